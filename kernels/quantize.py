"""K/V pre-pass of fused-softmax attention: smoothing, scales and 8-bit packing.

K: the mean key (over the attended keys) is subtracted, then each key (``K_PER_TOKEN``) or each
block of ``block_n`` keys of one head gets one INT8 scale: ``k8 = round(127 * (k - mean) / amax)``.
Softmax is unchanged by the subtracted mean (a per-row constant of the scores).

V, for the FP8 PV product: the per-channel mean is subtracted, then each channel gets one FP8
e4m3 scale mapping its largest magnitude to 448. For the 16-bit PV product V is copied as it is
(scale 1, mean 0). V is stored transposed, ``(B, H, D, S)``, because Hopper's FP8 wgmma needs its
B operand K-major and K here is the key axis.

Masked keys and the padding up to a whole tile are written as exact zeros and carry weight 0
in ``key_weight``; the forward kernel then needs no mask in its loop: a zero key scores 0, which
never exceeds the row max of the attended keys (their mean score is 0 after smoothing), and its
weight 0 keeps it out of the output and the row sum.

Buffers are padded to a whole number of tiles so that the forward kernel's main loop runs
unmasked (ANCHORS.md: masking every load cost 4.5x at S = 32760).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .lowp import INTERPRETER, to_low_precision

# e4m3fn's largest finite value.
FP8_E4M3_MAX = 448.0
# Width of the tile that carries each key's weight into the row-sum GEMM: the smallest N of an
# FP8 wgmma that Triton accepts (only column 0 is non-zero).
ROWSUM_COLS = 16


PV_KEY_ORDERS = ("natural", "wgmma")


@dataclass(frozen=True)
class KVLayout:
    """What a forward kernel needs to know of the quantised K/V, known before they exist."""

    k_per_token: bool
    v_dtype: torch.dtype
    block_n: int
    pv_key_order: str = "natural"


@dataclass
class QuantizedKV:
    """The pre-pass's output, in the layouts the forward kernel reads."""

    k_q: torch.Tensor  # int8 (B, Hkv, S_pad, D_pad)
    k_scale: torch.Tensor  # fp32 (B, Hkv, S_pad) per key, or (B, Hkv, n_tiles) per block
    k_mean: torch.Tensor  # fp32 (B, Hkv, D_pad): subtracted from K (zeros when not smoothing)
    v_t: torch.Tensor  # fp8 e4m3, bf16 or fp16 (B, Hkv, D_pad, S_pad)
    v_scale: torch.Tensor  # fp32 (B, Hkv, D_pad)
    v_mean: torch.Tensor  # fp32 (B, Hkv, D_pad)
    key_weight: torch.Tensor  # v_t's dtype (B or 1, ROWSUM_COLS, S_pad): row 0 is 1 for attended keys
    k_per_token: bool
    block_n: int
    n_tiles: int
    seq_len: int
    # "natural": column j of v_t and key_weight is key j. "wgmma": within every 32 keys, column c
    # holds key wgmma_key_of_column(c), the order in which the warp-specialised Gluon kernel's P
    # sits in registers as the PV GEMM's operand (no shuffle between the two GEMMs).
    pv_key_order: str = "natural"


def wgmma_key_of_column(columns: torch.Tensor) -> torch.Tensor:
    """The key held in column c under the "wgmma" order: the bits (b4 b3 b2 b1 b0) of c within its
    32 keys become (b4 b1 b3 b2 b0). In the m64nNk32 score accumulator a thread holds keys
    8g + 2q + {0, 1}; as the PV GEMM's 8-bit register operand it holds k = 4q + {0..3} and
    16 + 4q + {0..3} of every 32: this order makes those the same keys."""
    c = columns
    return (c & ~31) | (c & 16) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1) | (c & 1)


@triton.jit
def _round_half_away(x):
    # float -> int conversion truncates toward zero; adding +-0.5 first rounds half away from zero.
    return tl.where(x >= 0, x + 0.5, x - 0.5)


@dataclass
class QuantizedQ:
    q_q: torch.Tensor  # int8 (B, Hq, Sq_pad, D_pad), softmax scale and log2(e) folded in
    q_scale: torch.Tensor  # fp32 (B, Hq, Sq_pad): one per token
    q_dot_k_mean: torch.Tensor  # fp32 (B, Hq, Sq_pad): sm_scale * q . k_mean, for the LSE


@triton.jit
def _quantize_q_kernel(
    q_ptr, k_mean_ptr, qq_ptr, qs_ptr, qkm_ptr,
    seq_len, head_dim, n_heads, group, q_pad, sm_scale,
    stride_qb, stride_qs, stride_qh, stride_qd,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, SOFT_ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D_PAD)
    in_bounds = (rows < seq_len)[:, None] & (cols < head_dim)[None, :]
    q = tl.load(q_ptr + b * stride_qb + rows[:, None] * stride_qs + h * stride_qh + cols[None, :] * stride_qd,
                mask=in_bounds, other=0.0).to(tl.float32)
    k_mean = tl.load(k_mean_ptr + (b * (n_heads // group) + h // group) * D_PAD + cols)
    q_log2 = q * (sm_scale * 1.4426950408889634)
    amax = tl.maximum(tl.max(tl.abs(q_log2), 1), 1e-20)
    out_rows = (b * n_heads + h) * q_pad + rows
    tl.store(qq_ptr + out_rows[:, None] * D_PAD + cols[None, :],
             _round_half_away(q_log2 * (127.0 / amax)[:, None]).to(tl.int8))
    tl.store(qs_ptr + out_rows, amax / 127.0)
    # Smoothing K shifts every score of a row by sm_scale * q . k_mean; the LSE adds it back.
    tl.store(qkm_ptr + out_rows, tl.sum(q * k_mean[None, :], 1) * sm_scale)


def quantize_q(q, k_mean, *, sm_scale, block_m, pad_multiple=None) -> QuantizedQ:
    """INT8 Q, one scale per token, padded to whole tiles of `block_m` rows (a power of two) or of
    `pad_multiple` rows (a multiple of `block_m`); `q` (B, Sq, Hq, D) any strides."""
    bsz, seq_len, heads, dim = q.shape
    d_pad = k_mean.shape[-1]
    pad_multiple = pad_multiple or block_m
    if pad_multiple % block_m:
        raise ValueError(f"pad_multiple={pad_multiple} is not a multiple of block_m={block_m}")
    q_pad = triton.cdiv(seq_len, pad_multiple) * pad_multiple
    q_q = torch.empty(bsz, heads, q_pad, d_pad, dtype=torch.int8, device=q.device)
    q_scale = torch.empty(bsz, heads, q_pad, dtype=torch.float32, device=q.device)
    q_dot_k_mean = torch.empty_like(q_scale)
    _quantize_q_kernel[(q_pad // block_m, heads, bsz)](
        q, k_mean, q_q, q_scale, q_dot_k_mean,
        seq_len, dim, heads, heads // k_mean.shape[1], q_pad, float(sm_scale),
        *q.stride(),
        BLOCK_M=block_m, D_PAD=d_pad, SOFT_ROUND=INTERPRETER, num_warps=4,
    )
    return QuantizedQ(q_q, q_scale, q_dot_k_mean)


@triton.jit
def _quantize_kv_kernel(
    k_ptr, v_ptr, w_ptr,
    k_mean_ptr, v_mean_ptr, v_inv_scale_ptr,
    kq_ptr, k_scale_ptr, vt_ptr, v_err_ptr,
    seq_len, head_dim, n_kv_heads,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_wb, stride_ws,
    s_pad, n_tiles,
    HAS_WEIGHT: tl.constexpr,
    K_PER_TOKEN: tl.constexpr,
    V_FP8: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)
    h = (bh % n_kv_heads).to(tl.int64)

    rows = tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D_PAD)
    row_in = rows < seq_len
    col_in = cols < head_dim
    in_bounds = row_in[:, None] & col_in[None, :]

    weight = row_in.to(tl.float32)
    if HAS_WEIGHT:
        weight = tl.load(w_ptr + b * stride_wb + rows * stride_ws, mask=row_in, other=0.0).to(tl.float32)
    keep = weight[:, None] != 0.0

    stats_off = bh.to(tl.int64) * D_PAD + cols
    k = tl.load(k_ptr + b * stride_kb + rows[:, None] * stride_ks + h * stride_kh + cols[None, :] * stride_kd,
                mask=in_bounds, other=0.0).to(tl.float32)
    k = tl.where(keep & in_bounds, k - tl.load(k_mean_ptr + stats_off)[None, :], 0.0)
    out_rows = bh.to(tl.int64) * s_pad + rows
    if K_PER_TOKEN:
        k_amax = tl.maximum(tl.max(tl.abs(k), axis=1), 1e-20)
        k_q = _round_half_away(k * (127.0 / k_amax)[:, None]).to(tl.int8)
        tl.store(k_scale_ptr + out_rows, k_amax / 127.0)
    else:
        k_amax = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0), 1e-20)
        k_q = _round_half_away(k * (127.0 / k_amax)).to(tl.int8)
        tl.store(k_scale_ptr + bh.to(tl.int64) * n_tiles + tile, k_amax / 127.0)
    tl.store(kq_ptr + out_rows[:, None] * D_PAD + cols[None, :], k_q)

    v = tl.load(v_ptr + b * stride_vb + rows[:, None] * stride_vs + h * stride_vh + cols[None, :] * stride_vd,
                mask=in_bounds, other=0.0).to(tl.float32)
    if V_FP8:
        v = tl.where(keep & in_bounds, v - tl.load(v_mean_ptr + stats_off)[None, :], 0.0)
        v = v * tl.load(v_inv_scale_ptr + stats_off)[None, :]
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)  # rounding may step past 448; e4m3fn has no Inf
    else:
        v = tl.where(keep & in_bounds, v, 0.0)
    vt_cols = rows
    if WGMMA_ORDER:  # the inverse of wgmma_key_of_column: key bits (k4 k3 k2 k1 k0) -> (k4 k2 k1 k3 k0)
        vt_cols = (rows & ~31) | (rows & 16) | (((rows >> 1) & 3) << 2) | (((rows >> 3) & 1) << 1) | (rows & 1)
    vt_offs = (bh.to(tl.int64) * D_PAD + cols[None, :]) * s_pad + vt_cols[:, None]
    v_low = to_low_precision(v, vt_ptr.dtype.element_ty, SOFT_ROUND)
    tl.store(vt_ptr + vt_offs, v_low)
    # The rounding error summed over this tile's keys, per channel (in scaled units). Rounding a
    # fixed set of values is biased by a tiny constant per channel; an attention output that
    # averages thousands of keys is as small as that bias (ANCHORS: cos 0.9988 at S = 32760),
    # so the pre-pass subtracts its mean from the V mean the epilogue adds back.
    tl.atomic_add(v_err_ptr + stats_off, tl.sum(v_low.to(tl.float32) - v, 0), sem="relaxed")


def kv_statistics(k, v, key_weight, smooth_v, v_fp8, d_pad):
    """Per-(batch, head, channel) K mean, V mean and V scale, fp32, padded to `d_pad` channels.

    `k`, `v`: (B, S, H, D) views; `key_weight`: (B, S) float of 0/1 or None. The means only
    need to be near the true ones (any per-channel constant leaves softmax unchanged), so
    they are reduced in the input dtype where that saves a copy.
    """
    bsz, _, heads, dim = k.shape
    dev = k.device

    keep = None if key_weight is None else (key_weight != 0)[:, :, None, None]

    def mean(x):
        if keep is None:
            return torch.mean(x, dim=1, dtype=torch.float32)
        count = key_weight.sum(dim=1).clamp_min(1.0)[:, None, None]  # all-masked rows get zeros
        # Masked entries are selected away, not multiplied by 0: an inf or NaN in a padding
        # token must not reach the mean (0 * inf is NaN).
        return torch.where(keep, x, 0).sum(dim=1, dtype=torch.float32) / count

    zeros = torch.zeros(bsz, heads, dim, dtype=torch.float32, device=dev)
    k_mean = mean(k)
    v_mean = mean(v) if (smooth_v and v_fp8) else zeros
    if v_fp8:
        if keep is None:
            v_min, v_max = torch.aminmax(v, dim=1)
        else:
            # The range of the attended keys only: masked keys are zeroed in the quantised V, and
            # a large padding value must not coarsen every attended key's FP8 grid. Masked entries
            # take the channel mean, which leaves the range as it is: one copy, one pass.
            v_min, v_max = torch.aminmax(torch.where(keep, v, v_mean[:, None].to(v.dtype)), dim=1)
        v_amax = torch.maximum(v_max.float() - v_mean, v_mean - v_min.float()).clamp_min(1e-20)
        v_scale = v_amax / FP8_E4M3_MAX
    else:
        v_scale = torch.ones_like(zeros)

    def pad(t, value=0.0):
        return torch.nn.functional.pad(t, (0, d_pad - dim), value=value).contiguous()

    # Padding channels get scale 1: their V is zero, and 1/scale must stay finite.
    return pad(k_mean), pad(v_mean), pad(v_scale, 1.0)


def quantize_kv(k, v, key_weight=None, *, block_n, d_pad, k_per_token=True, smooth_v=True,
                v_dtype=torch.float8_e4m3fn, pv_key_order="natural") -> QuantizedKV:
    """Quantise K to INT8 and pack V (FP8 with per-channel scales, or 16-bit) for the forward kernel.

    Parameters
    ----------
    k, v : Tensor (B, S, H, D), any strides
        Keys and values (a permuted view is fine: no copy is made).
    key_weight : Tensor (B, S) or None
        1.0 for keys to attend to, 0.0 for masked keys (boolean key-padding mask).
    k_per_token : bool
        One K scale per key, else one per block of `block_n` keys.
    v_dtype : torch.dtype
        ``torch.float8_e4m3fn`` (scaled per channel, optionally mean-centred by `smooth_v`),
        ``torch.bfloat16`` or ``torch.float16`` (copied as is).
    pv_key_order : str
        The order of the keys in ``v_t`` and ``key_weight`` (:class:`QuantizedKV`): ``"natural"``
        for the Triton kernel, ``"wgmma"`` for the warp-specialised Gluon kernel.
    """
    if pv_key_order not in PV_KEY_ORDERS:
        raise ValueError(f"pv_key_order must be one of {PV_KEY_ORDERS}, got {pv_key_order!r}")
    if pv_key_order == "wgmma" and block_n % 32:
        raise ValueError(f"the wgmma key order permutes within 32 keys: block_n must be a multiple of 32, got {block_n}")
    bsz, seq_len, heads, dim = k.shape
    n_tiles = triton.cdiv(seq_len, block_n)
    s_pad = n_tiles * block_n
    dev = k.device
    v_fp8 = v_dtype == torch.float8_e4m3fn
    k_mean, v_mean, v_scale = kv_statistics(k, v, key_weight, smooth_v, v_fp8, d_pad)
    v_inv_scale = 1.0 / v_scale

    k_q = torch.empty(bsz, heads, s_pad, d_pad, dtype=torch.int8, device=dev)
    k_scale = torch.empty(bsz, heads, s_pad if k_per_token else n_tiles, dtype=torch.float32, device=dev)
    v_t = torch.empty(bsz, heads, d_pad, s_pad, dtype=v_dtype, device=dev)
    v_err = torch.zeros(bsz, heads, d_pad, dtype=torch.float32, device=dev)
    w_arg = key_weight if key_weight is not None else k_scale  # unused pointer when no weight
    _quantize_kv_kernel[(n_tiles, bsz * heads)](
        k, v, w_arg,
        k_mean, v_mean, v_inv_scale,
        k_q, k_scale, v_t, v_err,
        seq_len, dim, heads,
        *k.stride(), *v.stride(),
        key_weight.stride(0) if key_weight is not None else 0,
        key_weight.stride(1) if key_weight is not None else 0,
        s_pad, n_tiles,
        HAS_WEIGHT=key_weight is not None,
        K_PER_TOKEN=k_per_token,
        V_FP8=v_fp8,
        WGMMA_ORDER=pv_key_order == "wgmma",
        SOFT_ROUND=INTERPRETER,
        BLOCK_N=block_n,
        D_PAD=d_pad,
        num_warps=4,
    )

    n_attended = key_weight.sum(1) if key_weight is not None else torch.full((bsz,), float(seq_len), device=dev)
    v_mean = v_mean - v_err / n_attended.clamp_min(1.0)[:, None, None] * v_scale

    # The row-sum GEMM's B operand, stored (ROWSUM_COLS, S_pad) so that it is K-major.
    w_rows = 1 if key_weight is None else bsz
    weight = torch.zeros(w_rows, ROWSUM_COLS, s_pad, dtype=torch.float32, device=dev)
    weight[:, 0, :seq_len] = 1.0 if key_weight is None else key_weight
    if pv_key_order == "wgmma":  # only row 0 is non-zero
        weight[:, 0] = weight[:, 0, wgmma_key_of_column(torch.arange(s_pad, device=dev))]
    return QuantizedKV(
        k_q=k_q, k_scale=k_scale, k_mean=k_mean, v_t=v_t, v_scale=v_scale, v_mean=v_mean,
        key_weight=weight.to(v_dtype), k_per_token=k_per_token, block_n=block_n, n_tiles=n_tiles,
        seq_len=seq_len, pv_key_order=pv_key_order,
    )
