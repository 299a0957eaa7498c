"""The online fused-softmax forward in Gluon for Hopper, for calls with few keys (cross-attention to
text): every key tile of a head stays in shared memory while a persistent program runs query tile
after query tile against it.

With 512 keys a query tile meets four key tiles: a kernel that loads its keys per query tile
spends most of each program filling and draining its pipeline, and reads every key tile from L2
once per query tile. Here each program takes a contiguous run of (head, query tile) items, loads
the run's K, V and row-sum weights once (again only where the run crosses into the next head),
and double-buffers Q by TMA, so the next tile's Q lands while this one computes. Per query tile
the schedule is the Gluon kernel's (``fsattn_fwd_gluon.py``): the score GEMM of key tile j
overlaps the PV GEMM of tile j-1 in the same warpgroup; with two warpgroups (64 rows
each) their GEMMs and softmaxes also overlap each other.

Same numerics as the other Gluon kernels (online max, per-key K scales, FP8 PV with the hardware
accumulator, the row sum on the tensor cores). Shared memory bounds the keys: K, V^T and the
row-sum weights take ~34 KB per 128-key tile at head dim 128 (:data:`RESIDENT_MAX_TILES`).
Gluon does not run in Triton's interpreter: the GPU tests exercise it.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .configs import FP_FUSION, GLUON_RESIDENT_MAX_TILES as RESIDENT_MAX_TILES
from .gluon_common import ROWSUM_N, GluonOperands, _softmax_tile, _store_outputs, gluon_operands
from .gluon_compat import tma_async_load
from .launch import BoundLaunch
from .quantize import H200_SMS

if not hasattr(gl, "warp_specialize"):  # the caller then runs the Triton kernel
    raise ImportError("this Triton's Gluon has no warp_specialize")

# Two consumer warpgroups of 64 query rows (a program's item is a block of 128 rows) and a TMA
# producer; registers per thread after setmaxnreg as in the warp-specialised kernel
# (2 x 128 x 240 + 128 x 24 fills the 64 K register file).
N_CONSUMERS = gl.constexpr(2)
BLOCK_M = 64 * 2
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@gluon.jit
def _producer(q_desc, k_desc, vt_desc, w_desc, q_smem, k_smem, vt_smem, w_smem, q_ready, q_empty, kv_ready, kv_empty,
              first, last, n_q_blocks, q_pad, n_q_heads, group, s_pad, w_rows_per_batch):
    """Per item: each consumer's 64 rows of Q into its free buffer; at each new head first, once
    both consumers released the last head's keys, every key tile of the new one."""
    N_TILES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D_PAD: gl.constexpr = k_smem.shape[2]
    N_CONSUMERS: gl.constexpr = q_smem.shape[0] // 2
    resident_kv = first * 0 - 1
    heads = first * 0
    for item in range(first, last):
        local = item - first
        bh_q = item // n_q_blocks
        b = bh_q // n_q_heads
        bh_kv = b * (n_q_heads // group) + (bh_q % n_q_heads) // group
        if bh_kv != resident_kv:
            # A fresh mbarrier counts as having completed the phase before its first (parity 1).
            mbarrier.wait(kv_empty, (heads & 1) ^ 1)
            mbarrier.expect(kv_ready, N_TILES * (k_desc.block_type.nbytes + vt_desc.block_type.nbytes
                                                 + w_desc.block_type.nbytes))
            for t in gl.static_range(N_TILES):
                tma_async_load(k_desc, [bh_kv * s_pad + t * BLOCK_N, 0], kv_ready, k_smem.index(t))
                tma_async_load(vt_desc, [bh_kv * D_PAD, t * BLOCK_N], kv_ready, vt_smem.index(t))
                tma_async_load(w_desc, [b * w_rows_per_batch, t * BLOCK_N], kv_ready, w_smem.index(t))
            heads += 1
            resident_kv = bh_kv
        q_row = bh_q * q_pad + (item % n_q_blocks) * (64 * N_CONSUMERS)
        for c in gl.static_range(N_CONSUMERS):
            buf = 2 * c + local % 2
            mbarrier.wait(q_empty.index(buf), ((local // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(buf), q_desc.block_type.nbytes)
            tma_async_load(q_desc, [q_row + c * 64, 0], q_ready.index(buf), q_smem.index(buf))


@gluon.jit
def _consumer(c: gl.constexpr, q_smem, k_smem, vt_smem, w_smem, q_ready, q_empty, kv_ready, kv_empty,
              qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, first, last, n_q_blocks, q_pad,
              n_q_heads, group, s_pad, seq_q, head_dim, stride_ob, stride_os, stride_oh):
    """Consumer warpgroup `c`: rows 64c to 64c + 63 of each item's query block, against the
    resident key tiles (the Gluon kernel's schedule per item: the score GEMM of tile t beside the
    PV GEMM of tile t - 1)."""
    ROWS: gl.constexpr = 64
    N_TILES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D_PAD: gl.constexpr = k_smem.shape[2]
    N_CONSUMERS: gl.constexpr = q_smem.shape[0] // 2
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
    o_cols_layout: gl.constexpr = gl.SliceLayout(0, o_layout)

    rows = gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    rd = gl.arange(0, D_PAD, layout=o_cols_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.int32, layout=s_layout)
    l_zero = gl.zeros([ROWS, ROWSUM_N], gl.float32, layout=l_layout)
    first_row = (first // n_q_blocks) * q_pad + (first % n_q_blocks) * (ROWS * N_CONSUMERS) + c * ROWS
    qs_next = gl.load(qs_ptr + first_row + rows)
    qkm_next = gl.load(qkm_ptr + first_row + rows)
    resident_kv = first * 0 - 1
    heads = first * 0
    for item in range(first, last):
        local = item - first
        bh_q = item // n_q_blocks
        pid_m = item % n_q_blocks
        b = bh_q // n_q_heads
        h = bh_q % n_q_heads
        bh_kv = b * (n_q_heads // group) + h // group
        kv_row = bh_kv * s_pad
        qs = qs_next
        qkm = qkm_next
        # The next item's row scales and q . k_mean, an item ahead of their use (the last item
        # loads its own again).
        ahead = gl.minimum(item + 1, last - 1)
        ahead_row = (ahead // n_q_blocks) * q_pad + (ahead % n_q_blocks) * (ROWS * N_CONSUMERS) + c * ROWS
        qs_next = gl.load(qs_ptr + ahead_row + rows)
        qkm_next = gl.load(qkm_ptr + ahead_row + rows)
        ks = gl.load(ks_ptr + kv_row + cols)
        if bh_kv != resident_kv:
            mbarrier.wait(kv_ready, heads & 1)
            heads += 1
            resident_kv = bh_kv
        buf = 2 * c + local % 2
        q_tile = q_smem.index(buf)
        mbarrier.wait(q_ready.index(buf), (local // 2) & 1)

        s_bits = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        if N_TILES == 1:
            mbarrier.arrive(q_empty.index(buf), count=1)
        m = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        p, m, alpha = _softmax_tile(s_bits, ks, qs, m)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_o_layout)
        acc = gl.zeros([ROWS, D_PAD], gl.float32, layout=o_layout)
        l_acc = gl.zeros([ROWS], gl.float32, layout=row_layout)
        for t in range(1, N_TILES):
            ks = gl.load(ks_ptr + kv_row + t * BLOCK_N + cols)
            s_tok = warpgroup_mma(q_tile, k_smem.index(t).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p8, vt_smem.index(t - 1).permute((1, 0)), acc, is_async=True)
            l_tok = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(t - 1).permute((1, 0)), l_zero,
                                  use_acc=False, is_async=True)
            # wgmma groups retire in order: with two left in flight, the score GEMM is done.
            s_bits = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok,))
            if t == N_TILES - 1:  # the last read of this Q buffer
                mbarrier.arrive(q_empty.index(buf), count=1)
            p, m, alpha_new = _softmax_tile(s_bits, ks, qs, m)
            p8_next = gl.convert_layout(p.to(gl.float8e4nv), p_o_layout)
            acc, l_tile = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, l_tok))
            # l and O hold the sums up to tile t-1 at max m_{t-1}; bring both to m_t.
            l_acc = (l_acc + gl.convert_layout(gl.sum(l_tile, 1), row_layout)) * alpha_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha_new, gl.SliceLayout(1, o_layout)), 1)
            p8 = p8_next
        acc = warpgroup_mma(p8, vt_smem.index(N_TILES - 1).permute((1, 0)), acc)
        l_tile = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(N_TILES - 1).permute((1, 0)), l_zero,
                               use_acc=False)
        l_acc = l_acc + gl.convert_layout(gl.sum(l_tile, 1), row_layout)
        # This head's keys are no longer read by this warpgroup once its last item is done.
        nxt_bh_q = (item + 1) // n_q_blocks
        nxt_kv = (nxt_bh_q // n_q_heads) * (n_q_heads // group) + (nxt_bh_q % n_q_heads) // group
        if (item + 1 == last) | (nxt_kv != bh_kv):
            mbarrier.arrive(kv_empty, count=1)
        v_scale = gl.load(v_scale_ptr + bh_kv * D_PAD + rd)
        v_mean = gl.load(v_mean_ptr + bh_kv * D_PAD + rd)
        _store_outputs(acc, l_acc, m, qkm, v_scale, v_mean, out_ptr, lse_ptr, pid_m * (ROWS * N_CONSUMERS) + c * ROWS,
                       bh_q, b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh, 8.0)


@gluon.jit
def _fsattn_fwd_gluon_resident_kernel(
    q_desc, k_desc, vt_desc, w_desc,
    qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
    seq_q, q_pad, head_dim, n_q_heads, group, n_tiles, s_pad, w_rows_per_batch,
    stride_ob, stride_os, stride_oh, n_q_blocks, n_items,
    BLOCK_N: gl.constexpr, D_PAD: gl.constexpr, N_TILES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    # Items (head, block of 128 query rows) in head-major order; each program takes a contiguous
    # run of them (the launch gives every program at least one).
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    first = (pid * n_items) // n_programs
    last = ((pid + 1) * n_items) // n_programs

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * N_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [N_TILES, BLOCK_N, D_PAD], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [N_TILES, D_PAD, BLOCK_N], vt_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [N_TILES, ROWSUM_N, BLOCK_N], w_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * N_CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_empty, count=N_CONSUMERS)  # one arrive per consumer warpgroup

    consumer_args = (q_smem, k_smem, vt_smem, w_smem, q_ready, q_empty, kv_ready, kv_empty,
                     qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, first, last, n_q_blocks,
                     q_pad, n_q_heads, group, s_pad, seq_q, head_dim, stride_ob, stride_os, stride_oh)
    producer_args = (q_desc, k_desc, vt_desc, w_desc, q_smem, k_smem, vt_smem, w_smem, q_ready, q_empty, kv_ready,
                     kv_empty, first, last, n_q_blocks, q_pad, n_q_heads, group, s_pad, w_rows_per_batch)
    gl.warp_specialize([(_consumer, (0,) + consumer_args), (_consumer, (1,) + consumer_args),
                        (_producer, producer_args)], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def resident_covers(seq_k: int, block_n: int, d_pad: int) -> bool:
    """Whether every key tile of a call fits this kernel's shared memory."""
    return block_n == 128 and d_pad == 128 and 0 < -(-seq_k // block_n) <= RESIDENT_MAX_TILES


def fsattn_fwd_gluon_resident(q, kv, out, lse, *, sm_scale):
    """Quantise Q and launch the kernel; arguments as :func:`.fsattn_fwd.fsattn_fwd`.

    The plan (fsattn_diffusers/plan.py) sends it only what it covers; anything else raises here
    rather than overflow shared memory or hang the GPU.
    """
    prepare_fsattn_fwd_gluon_resident(q, kv, out, lse).run(q, kv, out, lse, sm_scale)
    return out, lse


def prepare_fsattn_fwd_gluon_resident(q, kv, out, lse) -> "ResidentForward":
    """The checked, cached :class:`ResidentForward` of the arguments: its ``run(q, kv, out, lse,
    sm_scale)`` launches on any tensors of the same shapes, strides, dtypes, alignment and device
    (`kv` from :func:`~.quantize.quantize_kv`)."""
    if not resident_covers(kv.n_tiles * kv.block_n, kv.block_n, kv.k_q.shape[3]):
        raise ValueError(f"the resident-keys kernel takes head dim 128, 128-key tiles and at most "
                         f"{RESIDENT_MAX_TILES} of them; got d_pad={kv.k_q.shape[3]}, block_n={kv.block_n}, "
                         f"{kv.n_tiles} tiles")
    if kv.pv_key_order != "natural" or not kv.k_per_token:
        raise ValueError("the resident-keys kernel reads per-key K scales and V in the natural key order")
    operands = gluon_operands(q, kv, out, lse, block_m=BLOCK_M, q_tile_rows=64)
    return _resident_forward(operands, kv.n_tiles, kv.k_q.shape[3], _programs(q.device))


def _programs(device: torch.device) -> int:
    """Persistent programs: one per SM (a program's keys and Q buffers take most of its shared memory)."""
    if device.type != "cuda":
        return H200_SMS  # ahead-of-time builds for the H200
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=256)
def _resident_forward(operands: GluonOperands, n_tiles: int, d_pad: int, programs: int) -> "ResidentForward":
    return ResidentForward(operands, n_tiles, d_pad, programs)


class ResidentForward:
    """Q's quantisation and the kernel's launch for one shape (its
    :class:`~.gluon_common.GluonOperands`), computed once: ``run(q, kv, out, lse, sm_scale,
    stream=None)`` launches on operands :func:`fsattn_fwd_gluon_resident` accepts."""

    def __init__(self, operands: GluonOperands, n_tiles: int, d_pad: int, programs: int):
        self._operands = operands
        self.q_buffer_bytes = operands.q_buffer_bytes
        q_blocks, heads, bsz = operands.grid
        items = q_blocks * heads * bsz
        self._items = (q_blocks, items)
        self._launch = BoundLaunch(_fsattn_fwd_gluon_resident_kernel, (min(items, programs),), BLOCK_N=128,
                                   D_PAD=d_pad, N_TILES=n_tiles, CONSUMER_REGS=CONSUMER_REGS,
                                   PRODUCER_REGS=PRODUCER_REGS, num_warps=4, enable_fp_fusion=FP_FUSION)

    @property
    def direct(self) -> bool:
        """Whether both launches go straight to their compiled kernels."""
        return self._operands.direct and self._launch.direct

    def run(self, q, kv, out, lse, sm_scale, stream=None):
        self._launch(*self._operands.args(self._operands.q_buffers(q, kv, sm_scale, stream), out, lse),
                     *self._items, stream=stream)

    def run_into(self, q, buffers, out, lse, sm_scale, stream=None):
        """As :meth:`run`, with Q quantised into `buffers`: the
        :class:`~.quantize.PrepassBuffers` of one allocation (:class:`~.launch.Address` es)."""
        self._operands.quantize_q_into(q, buffers, sm_scale, stream)
        self._launch(*self._operands.args(buffers, out, lse), *self._items, stream=stream)
