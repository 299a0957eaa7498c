"""The warp-specialised forward as a persistent kernel, for calls with few keys (cross-attention to
text): one program per SM runs query block after query block, so the pipeline never drains.

With 512 keys a query block meets four key tiles: a program per block (``fsattn_fwd_gluon_ws.py``)
spends most of its life filling and draining its K/V ring and waiting for its first Q, and its
epilogue leaves the tensor cores idle. Here each program takes a contiguous run of (head, query
block) items: the producer streams every item's key tiles through one ring that runs on across
items, and loads each consumer's 64 rows of the next item's Q into a second buffer while the
current item computes; the consumers take turns at the tensor cores across item boundaries too,
so one warpgroup's epilogue runs beside the other's GEMMs. Per item the consumer's work is the
warp-specialised kernel's (:func:`~.fsattn_fwd_gluon_ws._consume_key_tiles`): same numerics, same
outputs bit for bit.
Gluon does not run in Triton's interpreter: the GPU tests exercise it.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .configs import GLUON_WS_STAGES
from .fsattn_fwd_gluon_ws import (SPEC_OFFSET, SPECULATIVE_MAX, GluonWSForward, _consume_key_tiles,
                                  _declare_vote, _produce_key_tiles, checked_operands)
from .gluon_common import ROWSUM_N, GluonOperands, _epilogue
from .gluon_compat import tma_async_load
from .quantize import H200_SMS


@gluon.jit
def _load_q(q_desc, q_smem, q_ready, q_empty, item, local, n_q_blocks, q_pad):
    """Each consumer's 64 rows of `item` (the program's `local`-th) into its buffer `local % 2`,
    once that buffer's previous item released it."""
    N_CONSUMERS: gl.constexpr = q_smem.shape[0] // 2
    q_row = (item // n_q_blocks) * q_pad + (item % n_q_blocks) * (64 * N_CONSUMERS)
    for c in gl.static_range(N_CONSUMERS):
        buf = 2 * c + local % 2
        # A fresh mbarrier counts as having completed the phase before its first (parity 1).
        mbarrier.wait(q_empty.index(buf), ((local // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(buf), q_desc.block_type.nbytes)
        tma_async_load(q_desc, [q_row + c * 64, 0], q_ready.index(buf), q_smem.index(buf))


@gluon.jit
def _producer(KS_IN_RING: gl.constexpr, q_desc, k_desc, vt_desc, w_desc, ks_desc, q_smem, k_smem, vt_smem, w_smem,
              ks_smem, q_ready, q_empty, ready, empty, first, last, n_q_blocks, q_pad, n_q_heads, group, s_pad,
              w_rows_per_batch, n_tiles):
    D_PAD: gl.constexpr = k_smem.shape[2]
    _load_q(q_desc, q_smem, q_ready, q_empty, first, 0, n_q_blocks, q_pad)
    for item in range(first, last):
        local = item - first
        bh_q = item // n_q_blocks
        b = bh_q // n_q_heads
        bh_kv = b * (n_q_heads // group) + (bh_q % n_q_heads) // group
        _produce_key_tiles(KS_IN_RING, k_desc, vt_desc, w_desc, ks_desc, k_smem, vt_smem, w_smem, ks_smem, ready, empty,
                           bh_kv * s_pad, bh_kv * D_PAD, b * w_rows_per_batch, n_tiles, local * n_tiles)
        # The next item's Q once this one's last key tile is issued: about when this item starts.
        if item + 1 < last:
            _load_q(q_desc, q_smem, q_ready, q_empty, item + 1, local + 1, n_q_blocks, q_pad)


@gluon.jit
def _consumer(c: gl.constexpr, SPECULATIVE: gl.constexpr, KS_IN_RING: gl.constexpr, q_smem, k_smem, vt_smem, w_smem,
              ks_smem, q_ready, q_empty, ready, empty, turn, qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr,
              lse_ptr, first, last, n_q_blocks, q_pad, n_q_heads, group, s_pad, seq_q, head_dim, n_tiles, stride_ob,
              stride_os, stride_oh, N_CONSUMERS: gl.constexpr):
    ROWS: gl.constexpr = 64
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    if SPECULATIVE:
        _declare_vote(c, n_tiles)
    for item in range(first, last):
        local = item - first
        bh_q = item // n_q_blocks
        pid_m = item % n_q_blocks
        b = bh_q // n_q_heads
        h = bh_q % n_q_heads
        bh_kv = b * (n_q_heads // group) + h // group
        first_row = pid_m * (ROWS * N_CONSUMERS) + c * ROWS
        my_row = bh_q * q_pad + first_row
        qs = gl.load(qs_ptr + my_row + rows)
        buf = 2 * c + local % 2
        mbarrier.wait(q_ready.index(buf), (local // 2) & 1)
        # Each item takes n_tiles ring slots and n_tiles + 1 turns of every warpgroup.
        acc, l_acc, m = _consume_key_tiles(c, SPECULATIVE, KS_IN_RING, q_smem.index(buf), k_smem, vt_smem, w_smem,
                                           ks_smem, ready, empty, turn, qs, ks_ptr, bh_kv * s_pad, n_tiles,
                                           local * n_tiles, local * (n_tiles + 1), N_CONSUMERS)
        mbarrier.arrive(q_empty.index(buf), count=1)
        _epilogue(acc, l_acc, m, qkm_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, my_row, first_row, bh_q, bh_kv,
                  b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh, SPEC_OFFSET if SPECULATIVE else 8.0)


@gluon.jit
def _fsattn_fwd_gluon_persistent_kernel(
    q_desc, k_desc, vt_desc, w_desc, ks_desc,
    qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
    seq_q, q_pad, head_dim, n_q_heads, group, n_tiles, s_pad, w_rows_per_batch,
    stride_ob, stride_os, stride_oh, n_q_blocks, n_items,
    BLOCK_N: gl.constexpr, D_PAD: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, SPECULATIVE: gl.constexpr, N_CONSUMERS: gl.constexpr,
    KS_IN_RING: gl.constexpr,
):
    # Items (head, query block) in head-major order; each program takes a contiguous run of them
    # (the launch gives every program at least one).
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    first = (pid * n_items) // n_programs
    last = ((pid + 1) * n_items) // n_programs

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * N_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D_PAD], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, D_PAD, BLOCK_N], vt_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, ROWSUM_N, BLOCK_N], w_desc.layout)
    if KS_IN_RING:
        ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [STAGES, BLOCK_N], ks_desc.layout)
        ks_src = ks_desc
    else:  # ks_desc is None (warp_specialize takes no None): stand-ins that no partition touches
        ks_smem = k_smem
        ks_src = k_desc
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=N_CONSUMERS)  # one arrive per consumer warpgroup
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * N_CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_CONSUMERS):
        mbarrier.init(turn.index(i), count=1)

    consumer_args = (q_smem, k_smem, vt_smem, w_smem, ks_smem, q_ready, q_empty, ready, empty, turn,
                     qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, first, last, n_q_blocks,
                     q_pad, n_q_heads, group, s_pad, seq_q, head_dim, n_tiles, stride_ob, stride_os, stride_oh,
                     N_CONSUMERS)
    producer_args = (q_desc, k_desc, vt_desc, w_desc, ks_src, q_smem, k_smem, vt_smem, w_smem, ks_smem, q_ready,
                     q_empty, ready, empty, first, last, n_q_blocks, q_pad, n_q_heads, group, s_pad, w_rows_per_batch,
                     n_tiles)
    # The flags go into each literal tuple (as in the warp-specialised kernel: a branch on them
    # must stay constexpr).
    if N_CONSUMERS == 3:
        gl.warp_specialize([(_consumer, (0, SPECULATIVE, KS_IN_RING) + consumer_args),
                            (_consumer, (1, SPECULATIVE, KS_IN_RING) + consumer_args),
                            (_consumer, (2, SPECULATIVE, KS_IN_RING) + consumer_args),
                            (_producer, (KS_IN_RING,) + producer_args)],
                           [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (0, SPECULATIVE, KS_IN_RING) + consumer_args),
                            (_consumer, (1, SPECULATIVE, KS_IN_RING) + consumer_args),
                            (_producer, (KS_IN_RING,) + producer_args)], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def fsattn_fwd_gluon_persistent(q, kv, out, lse, *, sm_scale, num_stages=GLUON_WS_STAGES, speculative=SPECULATIVE_MAX):
    """Quantise Q and launch the persistent kernel; arguments as
    :func:`.fsattn_fwd_gluon_ws.fsattn_fwd_gluon_ws` (`kv` in the wgmma key order)."""
    prepare_fsattn_fwd_gluon_persistent(q, kv, out, lse, num_stages=num_stages, speculative=speculative).run(
        q, kv, out, lse, sm_scale)
    return out, lse


def prepare_fsattn_fwd_gluon_persistent(q, kv, out, lse, *, num_stages=GLUON_WS_STAGES,
                                        speculative=SPECULATIVE_MAX) -> GluonWSForward:
    """The checked, cached forward of :func:`fsattn_fwd_gluon_persistent`'s arguments: its
    ``run(q, kv, out, lse, sm_scale)`` launches on any tensors of the same shapes, strides,
    dtypes, alignment and device."""
    operands = checked_operands(q, kv, out, lse, num_stages)
    return _persistent_forward(operands, kv.block_n, kv.k_q.shape[3], num_stages, bool(speculative),
                               _programs(q.device))


def _programs(device: torch.device) -> int:
    """Persistent programs: one per SM (a program's ring and Q buffers take most of its shared memory)."""
    if device.type != "cuda":
        return H200_SMS  # ahead-of-time builds for the H200
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=256)
def _persistent_forward(operands: GluonOperands, block_n: int, d_pad: int, num_stages: int, speculative: bool,
                        programs: int) -> GluonWSForward:
    q_blocks, heads, bsz = operands.grid
    items = q_blocks * heads * bsz
    return GluonWSForward(operands, block_n, d_pad, num_stages, speculative, kernel=_fsattn_fwd_gluon_persistent_kernel,
                          grid=(min(items, programs),), trailing_args=(q_blocks, items))
