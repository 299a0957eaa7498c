"""The online fused-softmax forward, in Gluon for Hopper, with the score GEMM of the next key tile
overlapping the softmax and the PV GEMM of the current one.

Why a second kernel: Triton 3.6 waits for every wgmma right after issuing it unless the result is
a loop-carried accumulator, and its Hopper warp specialisation (``tl.range(warp_specialize=True)``)
made this loop 2x slower (``benchmarks/NOTES.md``, v4). Gluon states the schedule (FlashAttention-3's
intra-warpgroup overlap):

    iteration j:   wait K_j, V_j landed (TMA ring, issued STAGES tiles ahead by this warpgroup)
                   S_j   = Q K_j^T          wgmma, async   (INT8, accumulator starts at 1.5*2^23)
                   O    += P_{j-1} V_{j-1}   wgmma, async   (FP8, P from registers)
                   l_16  = P_{j-1} W_{j-1}   wgmma, async   (row sum on the tensor cores)
                   wait until only the last two are in flight: S_j is ready
                   softmax of S_j  -> P_j (FP8)             runs while the PV wgmma runs
                   wait for all; rescale O and l by exp2(m_{j-1} - m_j); refill the freed stage

Same numerics as ``fsattn_fwd._online_pass`` with per-key K scales and FP8 V (the default
configuration): the emulation in ``fsattn_diffusers.reference`` describes both. Additive float
biases, per-block K scales, 16-bit V and the frozen-max variants stay on the Triton kernel.
Gluon does not run in Triton's interpreter, so this kernel is exercised by the GPU tests only.

Status: opt-in (``FSAttnConfig(kernel="gluon")``). Correct (same accuracy as the Triton kernel),
but 8-25 % slower on the H200: with two CTAs per SM the Triton kernel's CTAs already overlap each
other's softmax and GEMMs, and this schedule adds per-iteration barriers and layout shuffles
(``benchmarks/NOTES.md``, v4, says what to try next).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_compat import tma_async_load
from .quantize import quantize_q

LN2 = gl.constexpr(0.6931471805599453)
ROWSUM_COLS = 16
ROWSUM_N = gl.constexpr(ROWSUM_COLS)


@gluon.jit
def _issue_tile_loads(k_desc, vt_desc, w_desc, k_smem, vt_smem, w_smem, bars, tile, kv_row, vt_row, w_row,
                      STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    stage = tile % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma_async_load(k_desc, [kv_row + tile * BLOCK_N, 0], bar, k_smem.index(stage))
    tma_async_load(vt_desc, [vt_row, tile * BLOCK_N], bar, vt_smem.index(stage))
    tma_async_load(w_desc, [w_row, tile * BLOCK_N], bar, w_smem.index(stage))


@gluon.jit
def _softmax_tile(s_bits, ks, qs, m):
    """P = 2**(s - m_new + 8) from the INT32 scores; returns (P fp32, m_new, alpha)."""
    # A plain conversion, as in the Triton kernel (the magic accumulator start measured slower there).
    return _softmax_scaled(s_bits.to(gl.float32) * gl.expand_dims(ks, 0), qs, m, 8.0)


@gluon.jit
def _softmax_scaled(pre, qs, m, P_OFFSET: gl.constexpr):
    """P = 2**(s - m_new + P_OFFSET) from the scores times their key's scale, `pre`."""
    # The row max of the undequantised scores (qs > 0), so the subtraction rides in the next FMA.
    m_new = gl.maximum(m, gl.max(pre, 1) * qs)
    p = gl.exp2(gl.fma(pre, gl.expand_dims(qs, 1), gl.expand_dims(P_OFFSET - m_new, 1)))
    alpha = gl.exp2(m - m_new)
    return p, m_new, alpha


@gluon.jit
def _program_rows(q_pad, n_q_heads, group, s_pad, w_rows_per_batch, BLOCK_M: gl.constexpr, D_PAD: gl.constexpr):
    """This program's (batch, head) and the first rows of its Q, K/V, V^T and row-sum weights in
    the quantised buffers; both Gluon kernels' grids are (query blocks, heads, batch)."""
    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    bh_q = b * n_q_heads + h
    bh_kv = b * (n_q_heads // group) + h // group
    q_row = bh_q * q_pad + pid_m * BLOCK_M
    return pid_m, h, b, bh_q, bh_kv, q_row, bh_kv * s_pad, bh_kv * D_PAD, b * w_rows_per_batch


@gluon.jit
def _epilogue(acc, l_acc, m, qkm_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, q_row, first_row, bh_q, bh_kv,
              b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh, P_OFFSET: gl.constexpr = 8.0):
    """Normalise, undo V's scale and mean, write O and the natural-log LSE of the rows from
    `first_row` (of the sequence; `q_row` in the quantised Q buffers) on; P was 2^(x - m + P_OFFSET)."""
    ROWS: gl.constexpr = acc.shape[0]
    D_PAD: gl.constexpr = acc.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_layout: gl.constexpr = l_acc.type.layout
    o_cols_layout: gl.constexpr = gl.SliceLayout(0, o_layout)
    l_o = gl.convert_layout(l_acc, o_row_layout)
    attended = l_o > 0.0
    inv_l = gl.where(attended, 1.0 / gl.where(attended, l_o, 1.0), 0.0)
    rd = gl.arange(0, D_PAD, layout=o_cols_layout)
    v_scale = gl.load(v_scale_ptr + bh_kv * D_PAD + rd)
    v_mean = gl.load(v_mean_ptr + bh_kv * D_PAD + rd)
    o = (acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(v_scale, 0)
         + gl.expand_dims(gl.where(attended, 1.0, 0.0), 1) * gl.expand_dims(v_mean, 0))
    rows = first_row + gl.arange(0, ROWS, layout=o_row_layout)
    io_mask = gl.expand_dims(rows < seq_q, 1) & gl.expand_dims(rd < head_dim, 0)
    offs = (b.to(gl.int64) * stride_ob + gl.expand_dims(rows.to(gl.int64), 1) * stride_os
            + h.to(gl.int64) * stride_oh + gl.expand_dims(rd, 0))
    gl.store(out_ptr + offs, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    att_r = l_acc > 0.0
    lse = gl.where(att_r, (m - P_OFFSET + gl.log2(gl.where(att_r, l_acc, 1.0))) * LN2
                   + gl.load(qkm_ptr + q_row + gl.arange(0, ROWS, layout=row_layout)), float("-inf"))
    lse_rows = first_row + gl.arange(0, ROWS, layout=row_layout)
    gl.store(lse_ptr + bh_q.to(gl.int64) * seq_q + lse_rows, lse, mask=lse_rows < seq_q)


@gluon.jit
def _fsattn_fwd_gluon_kernel(
    q_desc, k_desc, vt_desc, w_desc,
    qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
    seq_q, q_pad, head_dim, n_q_heads, group, n_tiles, s_pad, w_rows_per_batch,
    stride_ob, stride_os, stride_oh,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_PAD: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    pid_m, h, b, bh_q, bh_kv, q_row, kv_row, vt_row, w_row = _program_rows(
        q_pad, n_q_heads, group, s_pad, w_rows_per_batch, BLOCK_M, D_PAD)

    # Register layouts of the three GEMMs' accumulators (one warpgroup: 64 rows, [4, 1] warps).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D_PAD, 32])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, 16, 32])
    p_o_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    p_l_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D_PAD], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, D_PAD, BLOCK_N], vt_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, ROWSUM_N, BLOCK_N], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_async_load(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        if i < n_tiles:
            _issue_tile_loads(k_desc, vt_desc, w_desc, k_smem, vt_smem, w_smem, bars, i, kv_row, vt_row, w_row,
                              STAGES, BLOCK_N)

    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    qs = gl.load(qs_ptr + q_row + gl.arange(0, BLOCK_M, layout=row_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, layout=s_layout)
    l_zero = gl.zeros([BLOCK_M, ROWSUM_N], gl.float32, layout=l_layout)
    ks = gl.load(ks_ptr + kv_row + cols)

    # Tile 0: scores, softmax; its PV is issued in the first iteration.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(bars.index(0), 0)
    s_bits = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    p, m, alpha = _softmax_tile(s_bits, ks, qs, m)
    p8 = gl.convert_layout(p.to(gl.float8e4nv), p_o_layout)
    acc = gl.zeros([BLOCK_M, D_PAD], gl.float32, layout=o_layout)
    l_acc = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)

    for tile in range(1, n_tiles):
        stage = tile % STAGES
        prev = (tile - 1) % STAGES
        # This tile's key scales, issued before the GEMMs so that they hide the load's latency.
        ks = gl.load(ks_ptr + kv_row + tile * BLOCK_N + cols)
        mbarrier.wait(bars.index(stage), (tile // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p8, vt_smem.index(prev).permute((1, 0)), acc, is_async=True)
        l_tok = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(prev).permute((1, 0)), l_zero,
                              use_acc=False, is_async=True)
        # wgmma groups retire in order: with two left in flight, the score GEMM is done.
        s_bits = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok,))
        p, m, alpha_new = _softmax_tile(s_bits, ks, qs, m)
        p8_next = gl.convert_layout(p.to(gl.float8e4nv), p_o_layout)
        acc, l_tile = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, l_tok))
        # l and O hold tile-(j-1) sums at max m_{j-1}; bring both to m_j.
        l_acc = (l_acc + gl.convert_layout(gl.sum(l_tile, 1), row_layout)) * alpha_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_new, gl.SliceLayout(1, o_layout)), 1)
        p8 = p8_next
        # Stage `prev` has been read by every GEMM that needs it: refill it STAGES tiles ahead.
        if tile - 1 + STAGES < n_tiles:
            _issue_tile_loads(k_desc, vt_desc, w_desc, k_smem, vt_smem, w_smem, bars, tile - 1 + STAGES, kv_row,
                              vt_row, w_row, STAGES, BLOCK_N)

    last = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(p8, vt_smem.index(last).permute((1, 0)), acc)
    l_tile = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(last).permute((1, 0)), l_zero,
                           use_acc=False)
    l_acc = l_acc + gl.convert_layout(gl.sum(l_tile, 1), row_layout)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(q_bar)

    _epilogue(acc, l_acc, m, qkm_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, q_row, pid_m * BLOCK_M, bh_q, bh_kv,
              b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh)


def supports(layout, bias, frozen, exp_mode, pv_fp32, rowsum_mma, block_m, num_warps, num_stages) -> bool:
    """Whether the Gluon kernel covers this call (else the Triton kernel runs it); `layout` is the
    :class:`~.quantize.KVLayout` of the quantised K/V (natural key order).

    Only the tiles it was tested with: 64 x 128, one warpgroup, 2 to 4 pipeline stages. With one
    stage the loop would wait for a tile it issues only later (a hang); more than four do not fit
    shared memory at head dim 128.
    """
    return (bias is None and frozen == 0 and exp_mode == 0 and not pv_fp32 and rowsum_mma
            and layout.k_per_token and layout.v_dtype == torch.float8_e4m3fn and block_m == 64
            and layout.block_n == 128 and layout.pv_key_order == "natural" and num_warps == 4
            and 2 <= num_stages <= 4)


def _descriptor(t2d: torch.Tensor, block_shape, dtype) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block_shape, dtype)
    return TensorDescriptor.from_tensor(t2d, block_shape, layout)


def launch_operands(q, kv, out, lse, *, sm_scale, block_m, q_tile_rows):
    """Quantise Q and build what both Gluon kernels take: (grid, positional arguments).

    `block_m` query rows per program (Q is padded to it); `q_tile_rows` rows per Q TMA tile.
    """
    if kv.key_weight.shape[1] != ROWSUM_COLS:
        raise ValueError(f"the row-sum weights must have {ROWSUM_COLS} rows, got {kv.key_weight.shape[1]}")
    bsz, seq_q, n_q_heads, head_dim = q.shape
    _, n_kv_heads, s_pad, d_pad = kv.k_q.shape
    block_n = kv.block_n
    # Programs of 3 x 64 rows pad Q to 192 rows, quantised 64 at a time (a Triton block is a power of two).
    pow2 = block_m & (block_m - 1) == 0
    qq = quantize_q(q, kv, sm_scale=sm_scale, block_m=block_m if pow2 else q_tile_rows, pad_multiple=block_m)
    descriptors = (
        _descriptor(qq.q_q.view(-1, d_pad), [q_tile_rows, d_pad], gl.int8),
        _descriptor(kv.k_q.view(-1, d_pad), [block_n, d_pad], gl.int8),
        _descriptor(kv.v_t.view(-1, s_pad), [d_pad, block_n], gl.float8e4nv),
        _descriptor(kv.key_weight.view(-1, s_pad), [ROWSUM_COLS, block_n], gl.float8e4nv),
    )
    args = (*descriptors,
            qq.q_scale, qq.q_dot_k_mean, kv.k_scale, kv.v_scale, kv.v_mean, out, lse,
            seq_q, qq.q_q.shape[2], head_dim, n_q_heads, n_q_heads // n_kv_heads, kv.n_tiles, s_pad,
            ROWSUM_COLS if kv.key_weight.shape[0] > 1 else 0,
            out.stride(0), out.stride(1), out.stride(2))
    return (triton.cdiv(seq_q, block_m), n_q_heads, bsz), args


def fsattn_fwd_gluon(q, kv, out, lse, *, sm_scale, block_m=64, num_warps=4, num_stages=3):
    """Quantise Q and launch the Gluon kernel; arguments as :func:`.fsattn_fwd.fsattn_fwd`.

    Callers check :func:`supports` first; a call outside it raises here rather than hang the GPU.
    """
    if not 2 <= num_stages <= 4 or block_m != 64 or num_warps != 4 or kv.block_n != 128:
        raise ValueError(f"the Gluon kernel takes 64 x 128 tiles, 4 warps and 2-4 stages; got block_m={block_m}, "
                         f"block_n={kv.block_n}, num_warps={num_warps}, num_stages={num_stages}")
    if kv.pv_key_order != "natural":
        raise ValueError(f"the Gluon kernel reads V in the natural key order, got {kv.pv_key_order!r}")
    grid, args = launch_operands(q, kv, out, lse, sm_scale=sm_scale, block_m=block_m, q_tile_rows=block_m)
    _fsattn_fwd_gluon_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=kv.block_n, D_PAD=kv.k_q.shape[3],
                                   STAGES=num_stages, num_warps=num_warps)
    return out, lse
