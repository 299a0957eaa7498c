"""The online fused-softmax forward in Gluon for Hopper, warp-specialised, with the two consumer
warpgroups taking turns at the tensor cores (FlashAttention-3's ping-pong); the default on sm_90
at head dims 65-128 (``FSAttnConfig(kernel="auto")``; benchmarks/NOTES.md v7, v8).

Why: the Triton kernel runs one warpgroup per program, two programs per SM, each issuing its own
loads (address arithmetic and ``cp.async`` in the softmax's instruction stream), meeting a
program-wide ``bar.sync`` every tile, and waiting for each GEMM right after issuing it; NOTES v6
found its loop bound by those waits, not by a unit. Here, per program of 2 x 64 query rows:

    producer (4 warps, 24 registers)   for each key tile: wait until both consumers released the
                                       ring stage, then TMA K, V^T and the row-sum weights into it
    consumer w (4 warps, w = 0, 1)     its 64 rows of Q (TMA), then per key tile j: wait for the
                                       score GEMM, online softmax (the Triton kernel's numerics),
                                       rescale; in its turn issue the row sum and PV of tile j and
                                       the score GEMM of tile j + 1, hand the turn over; wait for
                                       PV, release the stage

Only mbarriers synchronise (no program-wide barrier). P goes from the score accumulator to the PV
GEMM's register operand without moving between threads: V and the row-sum weights come in the
"wgmma" key order (``quantize_kv(..., pv_key_order="wgmma")``), which matches the keys each
thread already holds (:func:`_in_wgmma_order`). Measured on the H200 (NOTES v8): 776 and 811
TFLOP/s at the Wan-1.3B and 14B shapes against the Triton kernel's 672 and 668 (v7, with a
shuffle of P between the GEMMs: 733 and 759); without the ping-pong the same structure only
tied the Triton kernel; at head dim 64 it is slower (465 vs 482), so head dims up to 64 stay on
the Triton kernel. Coverage: per-key K scales, FP8 V, tensor-core row sum, no float bias, default
tiles; other configurations run the Triton kernel. Gluon does not run in Triton's interpreter:
the GPU tests exercise this kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .configs import GLUON_WS_STAGES
from .fsattn_fwd_gluon import ROWSUM_N, _epilogue, _program_rows, _softmax_tile, launch_operands

if not hasattr(gl, "warp_specialize"):  # the caller then runs the Triton kernel
    raise ImportError("this Triton's Gluon has no warp_specialize")

CONSUMER_ROWS = 64  # rows per consumer warpgroup (one m64 wgmma)
CONSUMERS = 2
# Registers per thread after setmaxnreg: 2 x 128 x 240 + 128 x 24 fills the 64 K register file.
# 232 for the consumers ran 11 % slower (NOTES v7); the producer needs few.
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@gluon.jit
def _producer(q_desc, k_desc, vt_desc, w_desc, q_smem, k_smem, vt_smem, w_smem, q_bars, ready, empty,
              q_row, kv_row, vt_row, w_row, n_tiles):
    # Sizes from the shared-memory shapes (constexpr; warp_specialize passes arguments as values).
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    for c in gl.static_range(2):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + c * 64, 0], q_bars.index(c), q_smem.index(c))
    for tile in range(n_tiles):
        stage = tile % STAGES
        # A fresh mbarrier counts as having completed the phase before its first (parity 1), so
        # the first lap over the ring does not wait.
        mbarrier.wait(empty.index(stage), ((tile // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + tile * BLOCK_N, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(vt_desc, [vt_row, tile * BLOCK_N], bar, vt_smem.index(stage))
        tma.async_copy_global_to_shared(w_desc, [w_row, tile * BLOCK_N], bar, w_smem.index(stage))


# _in_wgmma_order's split of each 32 keys into (b4, b3, b2 b1, b0) and the axis order that makes
# them operand columns; tests/kernels/test_quantize.py replays both in torch against
# quantize.wgmma_key_of_column, the order V is stored in.
WGMMA_KEY_SPLIT = gl.constexpr((2, 2, 4, 2))
WGMMA_AXES = gl.constexpr((0, 1, 2, 4, 3, 5))


@gluon.jit
def _in_wgmma_order(p, layout: gl.constexpr):
    """P as the PV GEMM's register operand without moving data between threads: column kA of the
    result is key pi(kA), where within each 32 keys pi takes the bits (b4 b3 b2 b1 b0) of kA to
    (b4 b1 b3 b2 b0) (``quantize.wgmma_key_of_column``), the keys each thread already holds in the
    score accumulator's layout; V^T and the row-sum weights are stored in that order, so the
    product is unchanged. The convert is register renaming: the SASS of the loop lost its 16
    SHFL, 16 SEL (604 -> 571 instructions per tile and warp, NOTES v8)."""
    ROWS: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    x = gl.reshape(p, [ROWS, N // 32, WGMMA_KEY_SPLIT[0], WGMMA_KEY_SPLIT[1], WGMMA_KEY_SPLIT[2],
                       WGMMA_KEY_SPLIT[3]])
    x = gl.permute(x, [WGMMA_AXES[0], WGMMA_AXES[1], WGMMA_AXES[2], WGMMA_AXES[3], WGMMA_AXES[4], WGMMA_AXES[5]])
    return gl.convert_layout(gl.reshape(x, [ROWS, N]), layout)


@gluon.jit
def _consumer(c: gl.constexpr, q_smem, k_smem, vt_smem, w_smem, q_bars, ready, empty, turn,
                       qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
                       q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os,
                       stride_oh):
    """One consumer warpgroup: 64 query rows against every key tile.

    The two warpgroups take turns at the tensor cores (FlashAttention-3's ping-pong): in its turn a
    warpgroup issues the row sum and PV of tile j and the score GEMM of tile j + 1, hands the turn
    over, and waits for PV (the score GEMM stays in flight); its softmax of tile j + 1 then runs
    while the other warpgroup's GEMMs do. Same numerics as the Triton kernel's online pass.
    """
    ROWS: gl.constexpr = 64
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D_PAD: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D_PAD, 32])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 16, 32])
    p_o_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    p_l_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    # Warpgroup 0 takes the first turn: its first wait is on the parity a fresh mbarrier has done.
    FIRST: gl.constexpr = 1 if c == 0 else 0

    my_row = q_row + c * ROWS
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    qs = gl.load(qs_ptr + my_row + gl.arange(0, ROWS, layout=row_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.int32, layout=s_layout)
    l_zero = gl.zeros([ROWS, ROWSUM_N], gl.float32, layout=l_layout)
    acc = gl.zeros([ROWS, D_PAD], gl.float32, layout=o_layout)
    l_acc = gl.zeros([ROWS], gl.float32, layout=row_layout)
    m = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    q_tile = q_smem.index(c)
    mbarrier.wait(q_bars.index(c), 0)

    ks = gl.load(ks_ptr + kv_row + cols)
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(turn.index(c), FIRST)
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - c), count=1)
    for tile in range(n_tiles - 1):
        stage = tile % STAGES
        nxt = tile + 1
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        p, m, alpha = _softmax_tile(s, ks, qs, m)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
        p8 = _in_wgmma_order(p.to(gl.float8e4nv), p_o_layout)
        ks = gl.load(ks_ptr + kv_row + nxt * BLOCK_N + cols)
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        mbarrier.wait(turn.index(c), (nxt & 1) ^ FIRST)
        l_tok = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(stage).permute((1, 0)), l_zero,
                              use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p8, vt_smem.index(stage).permute((1, 0)), acc, is_async=True)
        s_tok = warpgroup_mma(q_tile, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.arrive(turn.index(1 - c), count=1)
        # Groups retire in order: with one left in flight, the row sum and PV are done.
        acc, l_tile = warpgroup_mma_wait(num_outstanding=1, deps=(o_tok, l_tok))
        mbarrier.arrive(empty.index(stage), count=1)
        l_acc = l_acc * alpha + gl.convert_layout(gl.sum(l_tile, 1), row_layout)

    last = n_tiles - 1
    stage = last % STAGES
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    p, m, alpha = _softmax_tile(s, ks, qs, m)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
    p8 = _in_wgmma_order(p.to(gl.float8e4nv), p_o_layout)
    mbarrier.wait(turn.index(c), ((last + 1) & 1) ^ FIRST)
    l_tok = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(stage).permute((1, 0)), l_zero,
                          use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p8, vt_smem.index(stage).permute((1, 0)), acc, is_async=True)
    mbarrier.arrive(turn.index(1 - c), count=1)
    acc, l_tile = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, l_tok))
    mbarrier.arrive(empty.index(stage), count=1)
    l_acc = l_acc * alpha + gl.convert_layout(gl.sum(l_tile, 1), row_layout)
    _epilogue(acc, l_acc, m, qkm_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, my_row, row0 + c * ROWS, bh_q, bh_kv,
              b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh)


@gluon.jit
def _fsattn_fwd_gluon_ws_kernel(
    q_desc, k_desc, vt_desc, w_desc,
    qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
    seq_q, q_pad, head_dim, n_q_heads, group, n_tiles, s_pad, w_rows_per_batch,
    stride_ob, stride_os, stride_oh,
    BLOCK_N: gl.constexpr, D_PAD: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 128  # CONSUMERS x CONSUMER_ROWS
    pid_m, h, b, bh_q, bh_kv, q_row, kv_row, vt_row, w_row = _program_rows(
        q_pad, n_q_heads, group, s_pad, w_rows_per_batch, BLOCK_M, D_PAD)
    row0 = pid_m * BLOCK_M

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D_PAD], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, D_PAD, BLOCK_N], vt_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, ROWSUM_N, BLOCK_N], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)

    consumer_args = (q_smem, k_smem, vt_smem, w_smem, q_bars, ready, empty, turn,
                     qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
                     q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os,
                     stride_oh)
    gl.warp_specialize([
        (_consumer, (0,) + consumer_args),
        (_consumer, (1,) + consumer_args),
        (_producer, (q_desc, k_desc, vt_desc, w_desc, q_smem, k_smem, vt_smem, w_smem, q_bars, ready, empty,
                     q_row, kv_row, vt_row, w_row, n_tiles)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def supports(layout, bias, frozen, exp_mode, pv_fp32, rowsum_mma, block_m, num_warps, num_stages) -> bool:
    """Whether this kernel covers the call (else the Triton kernel runs it): the default numerics
    (online softmax, per-key K scales, FP8 V, tensor-core row sum, no float bias), the default
    tiles (64-row warpgroups, 128 keys, 4 warps each), 2-4 pipeline stages, and V and the row-sum
    weights in the "wgmma" key order (`layout`: the :class:`~.quantize.KVLayout` to quantise to)."""
    return (bias is None and frozen == 0 and exp_mode == 0 and not pv_fp32 and rowsum_mma
            and layout.k_per_token and layout.v_dtype == torch.float8_e4m3fn and block_m == CONSUMER_ROWS
            and layout.block_n == 128 and layout.pv_key_order == "wgmma" and num_warps == 4
            and 2 <= num_stages <= 4)


def fsattn_fwd_gluon_ws(q, kv, out, lse, *, sm_scale, num_stages=GLUON_WS_STAGES):
    """Quantise Q and launch the warp-specialised kernel; arguments as :func:`.fsattn_fwd.fsattn_fwd`,
    except that `kv` must be quantised with ``pv_key_order="wgmma"``.

    Callers check :func:`supports` first; a call outside it raises here rather than hang the GPU.
    """
    if not 2 <= num_stages <= 4 or kv.block_n != 128:
        raise ValueError(f"the warp-specialised Gluon kernel takes 128-key tiles and 2-4 stages; got "
                         f"block_n={kv.block_n}, num_stages={num_stages}")
    if kv.pv_key_order != "wgmma":
        raise ValueError("the warp-specialised Gluon kernel reads V in the wgmma key order "
                         f"(quantize_kv(..., pv_key_order='wgmma')), got {kv.pv_key_order!r}")
    grid, args = launch_operands(q, kv, out, lse, sm_scale=sm_scale, block_m=CONSUMERS * CONSUMER_ROWS,
                                 q_tile_rows=CONSUMER_ROWS)
    _fsattn_fwd_gluon_ws_kernel[grid](*args, BLOCK_N=kv.block_n, D_PAD=kv.k_q.shape[3], STAGES=num_stages,
                                      CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out, lse
