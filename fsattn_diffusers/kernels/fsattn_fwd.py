"""The fused-softmax 8-bit attention forward kernel (Triton), one kernel with constexpr variants.

It runs every call the warp-specialised Gluon kernel does not (fsattn_diffusers/plan.py decides):
head dims up to 32, calls with at most 1,024 keys at head dims 65-128 (cross-attention to text),
float masks, GPUs other than Hopper, and the non-default numerics. Per query
tile of BLOCK_M rows of one head, with Q, K and V already quantised by ``quantize.py`` beside it
(docs/design.md §2):

1. Q is INT8, one scale per token, with the softmax scale and log2(e) folded in, so the score
   GEMM yields log2-domain scores.
2. The row max (``FROZEN``). ``FROZEN_OFF`` (the default policy): a running max, rescaled per
   tile, P scaled by 2**8. ``FROZEN_RESCALE`` / ``FROZEN_RECOMPUTE`` (``max_policy="sampled"``):
   the max ``g`` of two sampled key tiles (the first, and the one level with the query tile), so
   ``g`` never exceeds the true row max; P is ``2**(s - g + C)`` with ``C = 8.75 - T``. Each tile's
   max is still taken, off the exponential's critical path, to detect a violation (a score above
   ``g + T``, where P would pass FP8's 448): the offending rows take that tile's max, rescale and
   recompute the tile's P (RESCALE), or the query tile is redone online after the pass
   (RECOMPUTE). Query tiles that needed either are counted with an atomic add.
3. The max subtraction rides in the dequantising FMA: the row max is taken on the undequantised
   scores (the per-row scale is positive), then one FMA per score gives ``s - m + offset``.
4. Exponential fused with the FP8 quantisation of P: the special-function unit (``exp2``, then
   a saturating conversion), or bit arithmetic on the FMA pipes that writes the e4m3 byte
   directly (Schraudolph's linear exponent with a quadratic correction of the mantissa, clamped
   so no input yields a NaN or sign bit), or half of the keys of each tile each way (``EXP_MODE``).
5. The row sum of P comes from the tensor cores: a GEMM of P with a (keys, 16) operand whose
   column 0 holds each key's weight (1 attended, 0 masked or padding), so it sums exactly the
   quantised P that multiplied V, and masked keys cost no per-element work.

References: SageAttention2 (arXiv 2411.10958) for the quantisation granularities;
FlashAttention-3 (arXiv 2407.08608) for the FP8 P scaling.
"""

from __future__ import annotations

import functools

import torch

import triton
import triton.language as tl

from . import configs
from .configs import (EXP_MODE_BITS, EXP_MODE_HALF, EXP_MODE_SFU, FP_FUSION, FROZEN_OFF,  # noqa: F401
                      FROZEN_RECOMPUTE, FROZEN_RESCALE)
from .launch import BoundLaunch, cdiv, launch_key
from .lowp import IN_INTERPRETER, LN2, LOG2E, dot_lowp, to_low_precision
from .quantize import PrepassBuffers, QPrepass

# 1.5 * 2**23: adding it to a float below 2**22 in magnitude rounds that float to an integer in
# the low mantissa bits (the bit-level exponential's floor and byte extraction).
MAGIC_FLOAT = tl.constexpr(12582912.0)
# log2 of the largest P a frozen max may produce: 2**8.75 < 448, FP8 e4m3's top
P_LOG2_CEILING = tl.constexpr(configs.P_LOG2_CEILING)
# Quadratic correction of the linear (Schraudolph) exponent: 2**f - 1 - f ~= -KAPPA f (1 - f)
# on [0, 1); the residual is below 0.004 of the mantissa, far under FP8's rounding step.
EXP_KAPPA = tl.constexpr(0.3431)



@triton.jit
def _prescores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off,
               K_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, KEYS: tl.constexpr, D_PAD: tl.constexpr):
    """Scores of KEYS keys from `key_off` as (pre, row_scale, row_offset), with the log2-domain score
    equal to ``pre * row_scale + row_offset`` and row_scale > 0: a row max of `pre` is a row max of
    the scores, and the final subtraction can ride in the same FMA as the dequantisation."""
    rk = key_off + tl.arange(0, KEYS)
    rd = tl.arange(0, D_PAD)
    k8 = tl.load(kq_ptr + kq_base + rk[:, None] * D_PAD + rd[None, :])
    # A plain INT32 -> FP32 conversion: a magic-number accumulator start with a bitcast instead
    # costs more to initialise than the conversion (NOTES v5b).
    acc_f = tl.dot(q8, tl.trans(k8), out_dtype=tl.int32).to(tl.float32)
    if K_PER_TOKEN:
        ks = tl.load(ks_ptr + ks_base + rk)
        return acc_f * ks[None, :], qs, tl.zeros_like(qs)
    c = qs * tl.load(ks_ptr + ks_base + tile)
    return acc_f, c, tl.zeros_like(c)


@triton.jit
def _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off, offset, bias_ptr, bias_base,
            MULT: tl.constexpr, HAS_BIAS: tl.constexpr, K_PER_TOKEN: tl.constexpr,
            BLOCK_M: tl.constexpr, KEYS: tl.constexpr, D_PAD: tl.constexpr):
    """`MULT * (log2-domain score) + offset` for KEYS keys from `key_off` (MULT is 1, or 8 for the bit exp)."""
    pre, row_scale, row_offset = _prescores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off,
                                            K_PER_TOKEN, BLOCK_M, KEYS, D_PAD)
    x = pre * (MULT * row_scale)[:, None] + (MULT * row_offset + offset)[:, None]
    if HAS_BIAS:
        x += MULT * tl.load(bias_ptr + bias_base + key_off + tl.arange(0, KEYS))[None, :]
    return x


@triton.jit
def _exp2_to_fp8_bits(u):
    """FP8 e4m3 of 2**(u/8 - 7), from u = 8 * (log2 value + 7), on the FMA pipes only."""
    u = tl.minimum(tl.maximum(u, 0.0), 126.0)  # byte 0 is +0, byte 126 is 448: never NaN, never negative
    # floor(u / 8) by the magic-number rounding of u/8 - 1/2 (exact integers land either side;
    # the correction below is 0 at both ends of an octave, so either is right).
    octave = ((u * 0.125 - 0.5) + MAGIC_FLOAT) - MAGIC_FLOAT
    frac8 = u - octave * 8.0  # the linear mantissa, in [0, 8]
    u = frac8 * (frac8 * (EXP_KAPPA / 8.0) - EXP_KAPPA) + u
    byte = (u + MAGIC_FLOAT).to(tl.int32, bitcast=True).to(tl.int8)  # low 8 bits = round(u)
    return byte.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _pv_and_rowsum(p_lo, p, vt_ptr, vt_base, w_ptr, w_base, key_off, s_pad, acc_o, l_acc,
                   PV_FP32: tl.constexpr, ROWSUM_MMA: tl.constexpr, BLOCK_M: tl.constexpr, KEYS: tl.constexpr,
                   D_PAD: tl.constexpr, ROWSUM_COLS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """acc_o += P V and l_acc += the row sum of P over attended keys; `p_lo` is P in V's format."""
    rk = key_off + tl.arange(0, KEYS)
    rd = tl.arange(0, D_PAD)
    v = tl.load(vt_ptr + vt_base + rd[:, None] * s_pad + rk[None, :])
    if PV_FP32:
        acc_o += dot_lowp(p_lo, tl.trans(v), tl.zeros_like(acc_o), SOFT_ROUND)
    else:
        acc_o = dot_lowp(p_lo, tl.trans(v), acc_o, SOFT_ROUND)
    if ROWSUM_MMA:
        # Always added in FP32: chained through Hopper's FP8 accumulator (about 14 bits) over
        # hundreds of tiles, the row sum loses half its value at S = 32760 (NOTES v1).
        # Only column 0 of the (rows, ROWSUM_COLS) product is non-zero; reducing it right away keeps
        # one register per row alive across the loop instead of the whole tile (NOTES v6).
        rc = tl.arange(0, ROWSUM_COLS)
        w = tl.load(w_ptr + w_base + rc[:, None] * s_pad + rk[None, :])
        l_tile = dot_lowp(p_lo, tl.trans(w), tl.zeros((BLOCK_M, ROWSUM_COLS), tl.float32), SOFT_ROUND)
        l_acc += tl.sum(l_tile, 1)
    else:
        w = tl.load(w_ptr + w_base + rk).to(tl.float32)
        l_acc += tl.sum(p * w[None, :], 1)
    return acc_o, l_acc


@triton.jit
def _frozen_block(q8, qs, g, acc_o, l_acc, x_max, rescaled, row_ok, tile, key_off, p_offset, max_threshold,
                  kq_ptr, kq_base, ks_ptr, ks_base, vt_ptr, vt_base, w_ptr, w_base, bias_ptr, bias_base, s_pad,
                  BITS: tl.constexpr, RESCALE: tl.constexpr, HAS_BIAS: tl.constexpr, K_PER_TOKEN: tl.constexpr,
                  PV_FP32: tl.constexpr, ROWSUM_MMA: tl.constexpr, BLOCK_M: tl.constexpr, KEYS: tl.constexpr,
                  D_PAD: tl.constexpr, ROWSUM_COLS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """One block of KEYS keys of the sampled-max pass, P = 2**(s - g + p_offset). RESCALE
    (FROZEN_RESCALE) repairs a violation in this block; otherwise (FROZEN_RECOMPUTE) the block's
    max is only recorded, for the whole query tile to be redone after the pass."""
    PV_DTYPE: tl.constexpr = vt_ptr.dtype.element_ty
    offset = p_offset - g
    if BITS:
        u = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off, 8.0 * offset + 56.0, bias_ptr,
                    bias_base, 8.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, KEYS, D_PAD)
        block_max = tl.max(u, 1) * 0.125 - 7.0
        p_lo = _exp2_to_fp8_bits(u)
        p = u  # never read: the bit exponential requires the tensor-core row sum
    else:
        x = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off, offset, bias_ptr, bias_base,
                    1.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, KEYS, D_PAD)
        block_max = tl.max(x, 1)
        p = tl.math.exp2(x)
        p_lo = to_low_precision(p, PV_DTYPE, SOFT_ROUND)
    if RESCALE:
        violated = row_ok & (block_max - p_offset > max_threshold)
        if tl.max(violated.to(tl.int32), 0) > 0:
            # Raise the offending rows' max to this block's max and rescale what they accumulated.
            # This block's P was computed against the old max: redo it, scores included (rare, and
            # keeping the scores alive for it would cost registers on every block).
            shift = tl.where(violated, block_max - p_offset, 0.0)
            alpha = tl.math.exp2(-shift)
            acc_o = acc_o * alpha[:, None]
            l_acc = l_acc * alpha
            g = g + shift
            offset = p_offset - g
            if BITS:
                u = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off, 8.0 * offset + 56.0, bias_ptr,
                            bias_base, 8.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, KEYS, D_PAD)
                p_lo = _exp2_to_fp8_bits(u)
            else:
                x = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, key_off, offset, bias_ptr, bias_base,
                            1.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, KEYS, D_PAD)
                p = tl.math.exp2(x)
                p_lo = to_low_precision(p, PV_DTYPE, SOFT_ROUND)
            rescaled += 1
    else:
        x_max = tl.maximum(x_max, block_max)
    acc_o, l_acc = _pv_and_rowsum(p_lo, p, vt_ptr, vt_base, w_ptr, w_base, key_off, s_pad, acc_o, l_acc,
                                  PV_FP32, ROWSUM_MMA, BLOCK_M, KEYS, D_PAD, ROWSUM_COLS, SOFT_ROUND)
    return g, acc_o, l_acc, x_max, rescaled


@triton.jit
def _online_pass(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, vt_ptr, vt_base, w_ptr, w_base,
                 bias_ptr, bias_base, n_tiles, s_pad,
                 HAS_BIAS: tl.constexpr, K_PER_TOKEN: tl.constexpr, PV_FP32: tl.constexpr,
                 ROWSUM_MMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                 ROWSUM_COLS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Exact running-max softmax; P = 2**(s - m + 8). Returns (acc, row-sum acc, log2 shift)."""
    PV_DTYPE: tl.constexpr = vt_ptr.dtype.element_ty
    acc_o = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    l_acc = tl.zeros((BLOCK_M,), tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    zero = tl.zeros((BLOCK_M,), tl.float32)
    for tile in range(0, n_tiles):
        if HAS_BIAS:
            x = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile, tile * BLOCK_N, zero, bias_ptr,
                        bias_base, 1.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, BLOCK_N, D_PAD)
            m_new = tl.maximum(m, tl.max(x, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exp2 away from NaN
            p = tl.math.exp2(x - m_use[:, None] + 8.0)
        else:
            # Max of the undequantised scores, then one FMA gives s - m + 8 (no separate subtraction).
            pre, row_scale, row_offset = _prescores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, tile,
                                                    tile * BLOCK_N, K_PER_TOKEN, BLOCK_M, BLOCK_N, D_PAD)
            m_new = tl.maximum(m, tl.max(pre, 1) * row_scale + row_offset)
            m_use = m_new
            p = tl.math.exp2(pre * row_scale[:, None] + (row_offset + 8.0 - m_use)[:, None])
        alpha = tl.math.exp2(m - m_use)
        acc_o = acc_o * alpha[:, None]
        l_acc = l_acc * alpha
        acc_o, l_acc = _pv_and_rowsum(to_low_precision(p, PV_DTYPE, SOFT_ROUND), p, vt_ptr, vt_base, w_ptr,
                                      w_base, tile * BLOCK_N, s_pad, acc_o, l_acc, PV_FP32, ROWSUM_MMA, BLOCK_M,
                                      BLOCK_N, D_PAD, ROWSUM_COLS, SOFT_ROUND)
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m) - 8.0
    return acc_o, l_acc, shift


@triton.jit
def _fsattn_fwd_kernel(
    q8_ptr, qs_ptr, qkm_ptr, out_ptr, lse_ptr,
    kq_ptr, ks_ptr, k_mean_ptr, vt_ptr, v_scale_ptr, v_mean_ptr, w_ptr, bias_ptr, fallback_ptr,
    seq_q, q_pad, head_dim, n_q_heads, group, n_tiles, s_pad, max_threshold,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_wb, stride_biasb,
    FROZEN: tl.constexpr, EXP_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, K_PER_TOKEN: tl.constexpr,
    PV_FP32: tl.constexpr, ROWSUM_MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, ROWSUM_COLS: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    bh_kv = b * (n_q_heads // group) + h // group
    # 64-bit bases: B*S*H*D passes 2**31 for long videos.
    kq_base = bh_kv * s_pad * D_PAD
    ks_base = bh_kv * (s_pad if K_PER_TOKEN else n_tiles)
    vt_base = bh_kv * D_PAD * s_pad
    stat_base = bh_kv * D_PAD
    w_base = b * stride_wb
    bias_base = b * stride_biasb

    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D_PAD)
    row_ok = rows < seq_q
    io_mask = row_ok[:, None] & (rd < head_dim)[None, :]
    # Q comes quantised from the pre-pass (padded to whole tiles): loaded from memory, Triton keeps
    # the score GEMM's A operand in shared memory rather than in 32-128 registers per thread.
    q_rows = (b * n_q_heads + h) * q_pad + rows
    q8 = tl.load(q8_ptr + q_rows[:, None] * D_PAD + rd[None, :])
    qs = tl.load(qs_ptr + q_rows)

    if FROZEN:
        # --- speculative pass: the frozen max is the max of two sampled key tiles ---------------
        p_offset = P_LOG2_CEILING - max_threshold
        zero = tl.zeros((BLOCK_M,), tl.float32)
        diag = (pid_m * n_tiles) // tl.cdiv(seq_q, BLOCK_M)
        x0 = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, 0, 0, zero, bias_ptr, bias_base,
                     1.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, BLOCK_N, D_PAD)
        xd = _scores(q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, diag, diag * BLOCK_N, zero, bias_ptr, bias_base,
                     1.0, HAS_BIAS, K_PER_TOKEN, BLOCK_M, BLOCK_N, D_PAD)
        g = tl.maximum(tl.max(x0, 1), tl.max(xd, 1))
        # A row with nothing attended in both samples has no safe guess: online pass below.
        unguessed = tl.max((row_ok & (g == float("-inf"))).to(tl.int32), 0)
        g = tl.where(g == float("-inf"), 0.0, g)

        acc_o = tl.zeros((BLOCK_M, D_PAD), tl.float32)
        l_acc = tl.zeros((BLOCK_M,), tl.float32)
        x_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        rescaled = tl.full((), 0, tl.int32)
        NSPLIT: tl.constexpr = 2 if EXP_MODE == 1 else 1
        KEYS: tl.constexpr = BLOCK_N // NSPLIT
        for tile in range(0, n_tiles):
            for part in tl.static_range(NSPLIT):
                g, acc_o, l_acc, x_max, rescaled = _frozen_block(
                    q8, qs, g, acc_o, l_acc, x_max, rescaled, row_ok, tile, tile * BLOCK_N + part * KEYS,
                    p_offset, max_threshold, kq_ptr, kq_base, ks_ptr, ks_base, vt_ptr, vt_base, w_ptr, w_base,
                    bias_ptr, bias_base, s_pad, EXP_MODE == 2 or (EXP_MODE == 1 and part == 1), FROZEN == 2,
                    HAS_BIAS, K_PER_TOKEN, PV_FP32, ROWSUM_MMA, BLOCK_M, KEYS, D_PAD, ROWSUM_COLS, SOFT_ROUND)
        shift = g - p_offset
        redo = unguessed
        if FROZEN == 1:
            redo += tl.max((row_ok & (x_max - p_offset > max_threshold)).to(tl.int32), 0)
        if redo > 0:
            acc_o, l_acc, shift = _online_pass(
                q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, vt_ptr, vt_base, w_ptr, w_base, bias_ptr, bias_base,
                n_tiles, s_pad, HAS_BIAS, K_PER_TOKEN, PV_FP32, ROWSUM_MMA, BLOCK_M, BLOCK_N, D_PAD,
                ROWSUM_COLS, SOFT_ROUND)
        if redo + rescaled > 0:
            tl.atomic_add(fallback_ptr, 1)
    else:
        acc_o, l_acc, shift = _online_pass(
            q8, qs, kq_ptr, kq_base, ks_ptr, ks_base, vt_ptr, vt_base, w_ptr, w_base, bias_ptr, bias_base,
            n_tiles, s_pad, HAS_BIAS, K_PER_TOKEN, PV_FP32, ROWSUM_MMA, BLOCK_M, BLOCK_N, D_PAD,
            ROWSUM_COLS, SOFT_ROUND)

    # --- epilogue: normalise, undo V's scale and mean, write O and the natural-log LSE ----------
    # A row whose Q scale is NaN (a non-finite input, Q's pass) gets a NaN l, whatever its P became
    # (an exponential by bits turns NaN into 0); l's bits are kept otherwise. A row with no attended
    # key has l = 0 and gives zeros; a NaN l passes `!= 0`.
    l = l_acc + 0.0 * qs
    attended = l != 0.0
    inv_l = tl.where(attended, 1.0 / tl.where(attended, l, 1.0), 0.0)
    v_scale = tl.load(v_scale_ptr + stat_base + rd)
    v_mean = tl.load(v_mean_ptr + stat_base + rd)
    o = acc_o * inv_l[:, None] * v_scale[None, :] + tl.where(attended, 1.0, 0.0)[:, None] * v_mean[None, :]
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_os + h * stride_oh + rd[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=io_mask)
    lse = tl.where(attended, (shift + tl.log2(tl.where(attended, l, 1.0))) * LN2 + tl.load(qkm_ptr + q_rows),
                   float("-inf"))
    tl.store(lse_ptr + (b * n_q_heads + h) * seq_q + rows, lse, mask=row_ok)




def fsattn_fwd(q, kv, out, lse, fallback_counter, *, sm_scale, bias=None, frozen=FROZEN_RESCALE,
               exp_mode=EXP_MODE_SFU, pv_fp32=True, rowsum_mma=True, max_threshold=3.0,
               block_m=128, num_warps=4, num_stages=3):
    """Quantise Q and launch the forward kernel.

    Parameters
    ----------
    q, out : Tensor (B, Sq, Hq, D), any strides (permuted views are fine)
    kv : QuantizedKV from :func:`~.quantize.quantize_kv`, with Hkv dividing Hq
    lse : Tensor (B, Hq, Sq) float32, contiguous
    fallback_counter : int32 Tensor (1,): query tiles whose frozen max was violated are added
    bias : Tensor (B or 1, S_pad) float32 or None
        Additive key bias in log2 units (-inf for masked keys and padding).
    frozen : FROZEN_OFF, FROZEN_RECOMPUTE or FROZEN_RESCALE
    """
    prepare_fsattn_fwd(q, kv, out, lse, fallback_counter, bias, frozen=frozen, exp_mode=exp_mode, pv_fp32=pv_fp32,
                       rowsum_mma=rowsum_mma, max_threshold=max_threshold, block_m=block_m, num_warps=num_warps,
                       num_stages=num_stages).run(q, kv, out, lse, fallback_counter, sm_scale, bias)
    return out, lse


def prepare_fsattn_fwd(q, kv, out, lse, fallback_counter, bias=None, *, frozen=FROZEN_RESCALE, exp_mode=EXP_MODE_SFU,
                       pv_fp32=True, rowsum_mma=True, max_threshold=3.0, block_m=128, num_warps=4,
                       num_stages=3) -> "TritonForward":
    """The checked, cached :class:`TritonForward` of :func:`fsattn_fwd`'s arguments: its
    ``run(q, kv, out, lse, fallback_counter, sm_scale, bias)`` launches on any tensors of the same
    shapes, strides, dtypes, alignment and device (`kv` from :func:`~.quantize.quantize_kv`)."""
    if exp_mode != EXP_MODE_SFU and kv.v_t.dtype != torch.float8_e4m3fn:
        raise ValueError("the bit-level exponential writes FP8 bits: it needs an FP8 V")
    if kv.pv_key_order != "natural":
        raise ValueError(f"the Triton kernel reads V in the natural key order, got {kv.pv_key_order!r}")
    options = (("frozen", frozen), ("exp_mode", exp_mode), ("pv_fp32", pv_fp32), ("rowsum_mma", rowsum_mma),
               ("max_threshold", float(max_threshold)), ("block_m", block_m), ("num_warps", num_warps),
               ("num_stages", num_stages))
    bias_stride = None if bias is None else (bias.stride(0) if bias.shape[0] > 1 else 0)
    return _triton_forward(tuple(q.shape), q.stride(), tuple(kv.k_q.shape), kv.block_n, kv.n_tiles, kv.n_split,
                           kv.k_per_token, tuple(kv.rowsum_weights.shape), kv.rowsum_weights.stride(0), out.stride(),
                           bias_stride, options,
                           launch_key(q, out, lse, fallback_counter, bias, kv.v_t, kv.rowsum_weights))


@functools.lru_cache(maxsize=256)
def _triton_forward(q_shape, q_stride, kq_shape, block_n, n_tiles, n_split, k_per_token, rowsum_shape,
                    rowsum_stride, out_stride, bias_stride, options, _launch_key) -> "TritonForward":
    return TritonForward(q_shape, q_stride, kq_shape, block_n, n_tiles, n_split, k_per_token, rowsum_shape,
                         rowsum_stride, out_stride, bias_stride, **dict(options))


class TritonForward:
    """Q's quantisation and the Triton kernel's launch for one shape of Q, of the quantised K/V
    and of the output (`bias_stride`: the bias's batch stride, None without a bias), everything
    that depends only on shapes computed once: ``run(q, kv, out, lse, fallback_counter, sm_scale,
    bias)`` launches as :func:`fsattn_fwd` does."""

    def __init__(self, q_shape, q_stride, kq_shape, block_n, n_tiles, n_split, k_per_token, rowsum_shape,
                 rowsum_stride, out_stride, bias_stride, *, frozen, exp_mode, pv_fp32, rowsum_mma, max_threshold,
                 block_m, num_warps, num_stages):
        bsz, seq_q, n_q_heads, head_dim = q_shape
        _, n_kv_heads, s_pad, d_pad = kq_shape
        self._q = QPrepass(q_shape, q_stride, n_kv_heads, d_pad, n_split, block_m, block_m)
        self.q_buffer_bytes = self._q.buffer_bytes
        self._ints = (seq_q, self._q.q_pad, head_dim, n_q_heads, n_q_heads // n_kv_heads, n_tiles, s_pad,
                      float(max_threshold), *out_stride, rowsum_stride if rowsum_shape[0] > 1 else 0,
                      bias_stride or 0)
        self._launch = BoundLaunch(
            _fsattn_fwd_kernel, (cdiv(seq_q, block_m), n_q_heads, bsz),
            FROZEN=frozen, EXP_MODE=exp_mode, HAS_BIAS=bias_stride is not None, K_PER_TOKEN=k_per_token,
            PV_FP32=pv_fp32, ROWSUM_MMA=rowsum_mma, BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad,
            ROWSUM_COLS=rowsum_shape[1], SOFT_ROUND=IN_INTERPRETER, num_warps=num_warps, num_stages=num_stages,
            enable_fp_fusion=FP_FUSION)

    @property
    def direct(self) -> bool:
        """Whether both launches go straight to their compiled kernels."""
        return self._q.direct and self._launch.direct

    def run(self, q, kv, out, lse, fallback_counter, sm_scale, bias=None, stream=None):
        buffers = PrepassBuffers.of(kv, self._q.run(q, kv, sm_scale, stream))
        self._launch_on(buffers, out, lse, fallback_counter, bias, stream)

    def run_into(self, q, buffers, out, lse, fallback_counter, sm_scale, bias=None, stream=None):
        """As :meth:`run`, with Q quantised into `buffers`: the :class:`~.quantize.PrepassBuffers`
        of one allocation (:class:`~.launch.Address` es)."""
        b = buffers
        self._q.launch(q, b.workspace, b.q_q, b.q_scale, b.q_dot_k_mean, sm_scale, stream)
        self._launch_on(b, out, lse, fallback_counter, bias, stream)

    def _launch_on(self, b, out, lse, fallback_counter, bias, stream):
        self._launch(b.q_q, b.q_scale, b.q_dot_k_mean, out, lse, b.k_q, b.k_scale, b.k_mean, b.v_t, b.v_scale,
                     b.v_mean, b.rowsum_weights, bias if bias is not None else b.k_scale, fallback_counter,
                     *self._ints, stream=stream)
