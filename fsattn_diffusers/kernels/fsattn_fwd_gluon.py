"""The online fused-softmax forward in Gluon for Hopper (opt-in: ``FSAttnConfig(kernel="gluon")``),
with the score GEMM of the next key tile overlapping the softmax and the PV GEMM of the current one
in one warpgroup (FlashAttention-3's intra-warpgroup overlap):

    iteration j:   wait K_j, V_j landed (TMA ring, issued STAGES tiles ahead by this warpgroup)
                   S_j   = Q K_j^T          wgmma, async   (INT8)
                   O    += P_{j-1} V_{j-1}   wgmma, async   (FP8, P from registers)
                   l_16  = P_{j-1} W_{j-1}   wgmma, async   (row sum on the tensor cores)
                   wait until only the last two are in flight: S_j is ready
                   softmax of S_j  -> P_j (FP8)             runs while the PV wgmma runs
                   wait for all; rescale O and l by exp2(m_{j-1} - m_j); refill the freed stage

Same numerics as the Triton kernel's online pass with per-key K scales and FP8 V (the emulation in
``fsattn_diffusers.reference`` describes both); the plan sends it nothing else. It is kept as the
simplest Gluon statement of the schedule, not for speed: on the H200 it measured 8-25 % slower
than the Triton kernel, whose two programs per SM already overlap each other's softmax and GEMMs
(benchmarks/NOTES.md v4). Gluon does not run in Triton's interpreter: the GPU tests exercise it.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .configs import FP_FUSION
from .gluon_common import ROWSUM_N, GluonOperands, _epilogue, _program_rows, _softmax_tile, gluon_operands
from .gluon_compat import tma_async_load
from .launch import BoundLaunch


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


def fsattn_fwd_gluon(q, kv, out, lse, *, sm_scale, block_m=64, num_warps=4, num_stages=3):
    """Quantise Q and launch the Gluon kernel; arguments as :func:`.fsattn_fwd.fsattn_fwd`.

    The plan (fsattn_diffusers/plan.py) sends it only what it covers; anything else raises here
    rather than hang the GPU.
    """
    prepare_fsattn_fwd_gluon(q, kv, out, lse, block_m=block_m, num_warps=num_warps,
                             num_stages=num_stages).run(q, kv, out, lse, sm_scale)
    return out, lse


def prepare_fsattn_fwd_gluon(q, kv, out, lse, *, block_m=64, num_warps=4, num_stages=3) -> "GluonForward":
    """The checked, cached :class:`GluonForward` of :func:`fsattn_fwd_gluon`'s arguments: its
    ``run(q, kv, out, lse, sm_scale)`` launches on any tensors of the same shapes, strides, dtypes,
    alignment and device (`kv` from :func:`~.quantize.quantize_kv`)."""
    if not 2 <= num_stages <= 4 or block_m != 64 or num_warps != 4 or kv.block_n != 128:
        raise ValueError(f"the Gluon kernel takes 64 x 128 tiles, 4 warps and 2-4 stages; got block_m={block_m}, "
                         f"block_n={kv.block_n}, num_warps={num_warps}, num_stages={num_stages}")
    if kv.pv_key_order != "natural":
        raise ValueError(f"the Gluon kernel reads V in the natural key order, got {kv.pv_key_order!r}")
    if not kv.k_per_token:
        raise ValueError("the Gluon kernel reads one K scale per key (quantize_kv(..., k_per_token=True))")
    operands = gluon_operands(q, kv, out, lse, block_m=block_m, q_tile_rows=block_m)
    return gluon_forward(operands, kv.block_n, kv.k_q.shape[3], num_stages)


@functools.lru_cache(maxsize=256)
def gluon_forward(operands: GluonOperands, block_n: int, d_pad: int, num_stages: int) -> "GluonForward":
    """The :class:`GluonForward` of these operands and stages (cached)."""
    return GluonForward(operands, block_n, d_pad, num_stages)


class GluonForward:
    """Q's quantisation and the Gluon kernel's launch for one shape (its
    :class:`~.gluon_common.GluonOperands`), computed once: ``run(q, kv, out, lse, sm_scale,
    stream=None)`` launches on operands :func:`fsattn_fwd_gluon` accepts."""

    def __init__(self, operands: GluonOperands, block_n: int, d_pad: int, num_stages: int):
        self._operands = operands
        self.q_buffer_bytes = operands.q_buffer_bytes
        self._launch = BoundLaunch(_fsattn_fwd_gluon_kernel, operands.grid, BLOCK_M=64, BLOCK_N=block_n, D_PAD=d_pad,
                                   STAGES=num_stages, num_warps=4, enable_fp_fusion=FP_FUSION)

    @property
    def direct(self) -> bool:
        """Whether both launches go straight to their compiled kernels."""
        return self._operands.direct and self._launch.direct

    def run(self, q, kv, out, lse, sm_scale, stream=None):
        self._launch(*self._operands.args(self._operands.q_buffers(q, kv, sm_scale, stream), out, lse),
                     stream=stream)

    def run_into(self, q, buffers, out, lse, sm_scale, stream=None):
        """As :meth:`run`, with Q quantised into `buffers`: the
        :class:`~.quantize.PrepassBuffers` of one allocation (:class:`~.launch.Address` es)."""
        self._operands.quantize_q_into(q, buffers, sm_scale, stream)
        self._launch(*self._operands.args(buffers, out, lse), stream=stream)
