"""What both Gluon forward kernels share: the softmax of one score tile, a program's rows in the
quantised buffers, the epilogue, and the host side of a launch (Q's quantisation, TMA descriptors).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launch import Address, cdiv, launch_key
from .lowp import LN2
from .quantize import ROWSUM_COLS, PrepassBuffers, QPrepass

ROWSUM_N = gl.constexpr(ROWSUM_COLS)


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
    # A row with no attended key has l = 0 and gives zeros; a NaN l passes `!= 0`. A row whose Q scale
    # is NaN (a non-finite input, Q's pass) has NaN scores, P and l here: the FP8 conversion keeps
    # NaN. (Adding 0 * its scale to l, as the Triton kernel does, spills at head dim 64.)
    attended = l_o != 0.0
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
    att_r = l_acc != 0.0
    lse = gl.where(att_r, (m - P_OFFSET + gl.log2(gl.where(att_r, l_acc, 1.0))) * LN2
                   + gl.load(qkm_ptr + q_row + gl.arange(0, ROWS, layout=row_layout)), float("-inf"))
    lse_rows = first_row + gl.arange(0, ROWS, layout=row_layout)
    gl.store(lse_ptr + bh_q.to(gl.int64) * seq_q + lse_rows, lse, mask=lse_rows < seq_q)


_descriptor_fields: dict = {}


def _descriptor(t, block_shape: tuple, dtype, shape=None, strides=None) -> TensorDescriptor:
    """A TMA descriptor of `t`, one of the pre-passes' fresh contiguous buffers (a tensor, or the
    :class:`~.launch.Address` of one), as a 2-D tensor of `shape` and `strides` (default: `t`'s
    own, `t` then a 1-D or 2-D tensor).

    The shared-memory layout and TensorDescriptor's own checks (16-byte aligned base and rows,
    positive shape) cost about as much host time as the rest of the launch. The layout depends
    only on the tile and dtype, and the checks hold by construction for these buffers (torch
    allocations whose 2-D rows are a multiple of 16 bytes; a 1-D buffer's caller checks its base),
    so both are done for the first descriptor of each tile and dtype, which must be of a tensor;
    later ones take its other fields (never its tensor) with their own base. The launch reads only
    the base's address (``data_ptr()``)."""
    key = (block_shape, dtype)
    fields = _descriptor_fields.get(key)
    if isinstance(t, Address):
        if fields is None:
            raise RuntimeError(f"the first TMA descriptor of a {block_shape} {dtype} tile must be of a tensor")
    elif not t.is_contiguous():
        raise ValueError(f"TMA operands here are contiguous buffers, got strides {t.stride()}")
    elif fields is None:
        view = t if shape is None else t.view(shape)
        layout = gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)
        desc = TensorDescriptor.from_tensor(view, list(block_shape), layout)
        _descriptor_fields[key] = {k: v for k, v in vars(desc).items() if k not in ("base", "shape", "strides")}
        return desc
    desc = object.__new__(TensorDescriptor)
    vars(desc).update(fields)
    if shape is None:
        desc.base, desc.shape, desc.strides = t, t.shape, t.stride()
    else:
        desc.base, desc.shape, desc.strides = t, shape, strides
    return desc


def gluon_operands(q, kv, out, lse, *, block_m, q_tile_rows) -> "GluonOperands":
    """The :class:`GluonOperands` of these tensors (cached per shape, strides, alignment and device)."""
    if kv.rowsum_weights.shape[1] != ROWSUM_COLS:
        raise ValueError(f"the row-sum weights must have {ROWSUM_COLS} rows, got {kv.rowsum_weights.shape[1]}")
    return _gluon_operands(tuple(q.shape), q.stride(), tuple(kv.k_q.shape), kv.block_n, kv.n_tiles, kv.n_split,
                           kv.rowsum_weights.shape[0], out.stride(), block_m, q_tile_rows,
                           launch_key(q, out, lse, kv.v_t, kv.rowsum_weights))


@functools.lru_cache(maxsize=256)
def _gluon_operands(q_shape, q_stride, kq_shape, block_n, n_tiles, n_split, rowsum_batches, out_stride, block_m,
                    q_tile_rows, _launch_key) -> "GluonOperands":
    return GluonOperands(q_shape, q_stride, kq_shape, block_n, n_tiles, n_split, rowsum_batches, out_stride,
                         block_m, q_tile_rows)


class GluonOperands:
    """What both Gluon kernels take, for one shape of Q, of the quantised K/V and of the output,
    everything that depends only on shapes computed once: ``grid``, Q's quantisation
    (:meth:`q_buffers`, :meth:`quantize_q_into`) and the kernels' arguments (:meth:`args`).

    `block_m` query rows per program (Q is padded to it); `q_tile_rows` rows per Q TMA tile.
    """

    def __init__(self, q_shape, q_stride, kq_shape, block_n, n_tiles, n_split, rowsum_batches, out_stride,
                 block_m, q_tile_rows):
        bsz, seq_q, n_q_heads, head_dim = q_shape
        _, n_kv_heads, s_pad, d_pad = kq_shape
        # Programs of 3 x 64 rows pad Q to 192 rows; Q's pass takes at most 64 rows a program (a Triton
        # block is a power of two), fewer where quantize.q_tile says.
        pow2 = block_m & (block_m - 1) == 0
        self._q = QPrepass(q_shape, q_stride, n_kv_heads, d_pad, n_split, block_m if pow2 else q_tile_rows, block_m)
        q_pad = self._q.q_pad
        # (block shape, element type, 2-D shape, strides) of the Q, K, V and row-sum descriptors
        self._q_desc = ((q_tile_rows, d_pad), gl.int8, (bsz * n_q_heads * q_pad, d_pad), (d_pad, 1))
        self._kv_descs = (((block_n, d_pad), gl.int8, (bsz * n_kv_heads * s_pad, d_pad), (d_pad, 1)),
                          ((d_pad, block_n), gl.float8e4nv, (bsz * n_kv_heads * d_pad, s_pad), (s_pad, 1)),
                          ((ROWSUM_COLS, block_n), gl.float8e4nv, (rowsum_batches * ROWSUM_COLS, s_pad), (s_pad, 1)))
        self._ints = (seq_q, q_pad, head_dim, n_q_heads, n_q_heads // n_kv_heads, n_tiles, s_pad,
                      ROWSUM_COLS if rowsum_batches > 1 else 0, *out_stride[:3])
        self.grid = (cdiv(seq_q, block_m), n_q_heads, bsz)
        self.q_buffer_bytes = self._q.buffer_bytes
        self.k_scale_numel = bsz * n_kv_heads * s_pad  # one K scale per key where they go by TMA

    @property
    def direct(self) -> bool:
        """Whether Q's quantisation goes straight to its compiled kernel."""
        return self._q.direct

    def q_buffers(self, q, kv, sm_scale, stream=None) -> PrepassBuffers:
        """Quantise Q into fresh tensors; returns them with `kv`'s."""
        return PrepassBuffers.of(kv, self._q.run(q, kv, sm_scale, stream))

    def quantize_q_into(self, q, buffers: PrepassBuffers, sm_scale, stream=None):
        """Quantise Q into `buffers` (:class:`~.launch.Address` es of :attr:`q_buffer_bytes`)."""
        self._q.launch(q, buffers.workspace, buffers.q_q, buffers.q_scale, buffers.q_dot_k_mean, sm_scale, stream)

    def args(self, buffers: PrepassBuffers, out, lse) -> tuple:
        """The kernels' positional arguments (TMA descriptors of Q, K, V and the row-sum weights
        first) over quantised `buffers`."""
        b = buffers
        (qb, qt, qs, qst), (kb, kt, ks, kst), (vb, vt, vs, vst), (wb, wt, ws, wst) = self._q_desc, *self._kv_descs
        return (_descriptor(b.q_q, qb, qt, qs, qst), _descriptor(b.k_q, kb, kt, ks, kst),
                _descriptor(b.v_t, vb, vt, vs, vst), _descriptor(b.rowsum_weights, wb, wt, ws, wst),
                b.q_scale, b.q_dot_k_mean, b.k_scale, b.v_scale, b.v_mean, out, lse, *self._ints)


def launch_operands(q, kv, out, lse, *, sm_scale, block_m, q_tile_rows):
    """Quantise Q and build what both Gluon kernels take: (grid, positional arguments).

    `block_m` query rows per program (Q is padded to it); `q_tile_rows` rows per Q TMA tile.
    """
    operands = gluon_operands(q, kv, out, lse, block_m=block_m, q_tile_rows=q_tile_rows)
    return operands.grid, operands.args(operands.q_buffers(q, kv, sm_scale), out, lse)
