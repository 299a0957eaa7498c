"""K/V pre-pass of fused-softmax attention: smoothing, scales and 8-bit packing.

K: the mean key (over the attended keys) is subtracted, then each key (``K_PER_TOKEN``) or each
block of ``block_n`` keys of one head gets one INT8 scale: ``k8 = round(127 * (k - mean) / amax)``.
Softmax is unchanged by the subtracted mean (a per-row constant of the scores).

V, for the FP8 PV product: the per-channel mean is subtracted, then each channel gets one FP8
e4m3 scale mapping its largest magnitude to 448. For the 16-bit PV product V is copied as it is
(scale 1, mean 0). V is stored transposed, ``(B, H, D, S)``, because Hopper's FP8 wgmma needs its
B operand K-major and K here is the key axis.

Masked keys and the padding up to a whole tile are written as exact zeros and carry weight 0
in the row-sum operand (``rowsum_weights``); the forward kernel then needs no mask in its loop: a zero key scores 0, which
never exceeds the row max of the attended keys (their mean score is 0 after smoothing), and its
weight 0 keeps it out of the output and the row sum.

Buffers are padded to a whole number of tiles so that the forward kernel's main loop runs
unmasked (docs/design.md section 2.7: masking every load cost 4.5x at S = 32760).

Three launches per call, in this order on one stream, with no memset and no atomics (a CUDA-graph
replay writes the bytes an eager call writes):

1. ``_fsattn_kv_stats_kernel`` (:func:`quantize_kv`), grid ``(n_split, B * Hkv)``: each program sums
   K and V, takes V's per-channel min and max and counts the attended keys over its own run of
   key tiles (:func:`kv_split`), and writes them as one partial.
2. ``_quantize_kv_kernel`` (:func:`quantize_kv`), same grid: each program reduces its head's
   partials, in a fixed order so that every program of the head gets the same bits, to the K mean
   (with ``sort_keys``: reads the size pass's, below), V mean and V scale; packs its own key tiles
   and their row-sum weights; and writes V's rounding error summed over them as one partial.
3. ``_quantize_q_kernel`` (:func:`quantize_q`): besides quantising Q, one program per (batch, KV
   head) reduces those rounding-error partials into the V mean the forward kernel adds back
   (``QuantizedKV.v_mean``). Until then ``v_mean`` holds the mean subtracted from V, uncorrected.

With ``sort_keys`` (``k_granularity="sorted_block"``, or ``"auto"`` on long calls) a fourth launch
and a sort come between 1 and 2: ``_key_size_kernel`` writes each key's size (the largest magnitude
of the key less its head's mean; -1 for masked keys and padding), torch's stable sort orders each
head's keys by it, largest first, and the packing reads every key, value and weight through that
order, so that each tile of a per-tile K scale holds keys of nearly one size. A tile's K scale is
then its first key's size, read from the sorted sizes: the packing goes through K a sub-tile at a
time, as with per-key scales, instead of holding a whole tile to find its largest magnitude. The
size pass writes the head's K mean, and the packing subtracts that one rather than its own
reduction of the same partials, so that a tile's scale is the largest magnitude of the keys as
packed, bit for bit (a key past its scale would saturate at +-127, not wrap).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import BoundLaunch, cdiv, launch_key
from .lowp import IN_INTERPRETER, LOG2E, to_low_precision

# e4m3fn's largest finite value.
FP8_E4M3_MAX = 448.0
# Width of the tile that carries each key's weight into the row-sum GEMM: the smallest N of an
# FP8 wgmma that Triton accepts (only column 0 is non-zero, except in the "wgmma" order with one
# K scale per tile, where every column is the weights; see QuantizedKV).
ROWSUM_COLS = 16

PV_KEY_ORDERS = ("natural", "wgmma")

# SMs of an H200: the pre-pass sizes its launches for it (prepass_programs_target).
H200_SMS = 132
# Programs per (batch, KV head) at most: every program of a head re-reads all of the head's
# partials (5 rows of D_pad floats each, from L2) before packing, so the re-reading grows with the
# square of the split; this bounds it where few heads would otherwise split into hundreds.
MAX_SPLIT = 64
# Partials reduced per step (rows of one [SPLIT_BLOCK, D_pad] load).
SPLIT_BLOCK = 16
# Depth of the loops' software pipelining (tl.range's num_stages): LOOP_STAGES - 1 key tiles of
# loads in flight, waiting in shared memory. On an H200 (Triton 3.6) at the Wan, HunyuanVideo and
# head-dim-64 shapes three measured 1.3-1.4x faster than two for the statistics and 0-16 % faster
# for the packing; four and six were slower for the packing.
LOOP_STAGES = 3
# Warps per K/V pre-pass program; eight measured slower than four (fewer programs per SM).
PREPASS_WARPS = 4
# Rows of the packing loop's partial sum of V's rounding error (at most the keys per step).
V_ERR_ROWS = 16


def prepass_max_registers(d_pad: int) -> int:
    """Register ceiling (ptxas's .maxnreg) of the two K/V pre-pass kernels at padded head dim `d_pad`.

    The ceiling sets how many programs share an SM, and the loops wait on memory, so more
    programs pay. Left to itself ptxas took 128-168 registers, three programs per SM. 128 at head
    dim 128 (four per SM; on Triton 3.6 no spills, on 3.7.1 and 3.9.0 a few bytes in some builds)
    took the packing kernel from 936 to 832 us at Wan2.1-14B 720p on an H200; at 64 it spilled, so
    168 stays there.
    """
    return 128 if d_pad >= 128 else 168


def _pack_max_registers(d_pad: int, k_per_token: bool, sort_keys: bool) -> int:
    """Register ceiling of the packing kernel. Per-block K scales over keys in their own order
    hold a whole tile in the K loop, which spills under the pre-pass ceiling: none there. Over
    sorted keys the V loop reads keys and weights through the order (and, in the "wgmma" order,
    in permuted runs): at 128 registers its build for the warp-specialised kernel spilled 52 bytes
    under Triton 3.6, at 168 none (at head dim 64, 16 bytes under 3.6 only: two local loads a
    V step)."""
    if k_per_token:
        return prepass_max_registers(d_pad)
    return 168 if sort_keys else 255


def prepass_programs_target(d_pad: int) -> int:
    """Programs per K/V pre-pass launch to aim for: as many as fit on an H200 at once.

    A constant per head dim, not the device's SM count: the split fixes the order of the fp32 sums,
    so the statistics' bits depend on the shapes alone, and choosing it costs no device query.
    """
    return (4 if prepass_max_registers(d_pad) <= 128 else 3) * H200_SMS


def q_tile(block_m: int, d_pad: int) -> tuple[int, int]:
    """(rows, warps) of a Q quantisation program for a forward that takes `block_m` rows a program.

    Rows are quantised independently, so the tile changes no output bit, only how many programs
    share an SM: each loads its tile, reduces, then stores, with nothing overlapping inside it. At
    padded head dim 128 on an H200, at Wan2.1-14B / 1.3B (NOTES v26 (b)): 32 rows in 4 warps 0.330
    / 0.050 ms, against 0.364 / 0.055 for 128 rows in 8 warps and 0.366 / 0.056 for 64 in 4; 16
    rows or fewer warps were slower. At head dim 64, as measured before: 4 warps, the forward's
    rows.
    """
    if d_pad >= 128:
        return min(block_m, 32), 4
    return block_m, 8 if block_m * d_pad >= 128 * 128 else 4


_POS_INF = tl.constexpr(float("inf"))
_NEG_INF = tl.constexpr(float("-inf"))
_SUM = tl.constexpr(0)
_MIN = tl.constexpr(1)
_MAX = tl.constexpr(2)


@dataclass(frozen=True)
class KVLayout:
    """What a forward kernel needs to know of the quantised K/V, known before they exist."""

    k_per_token: bool
    v_dtype: torch.dtype
    block_n: int
    pv_key_order: str = "natural"


@dataclass
class QuantizedKV:
    """The pre-pass's output, in the layouts the forward kernel reads.

    ``v_mean`` is final only once :func:`quantize_q` has run on this object (it subtracts V's mean
    rounding error, which the K/V launch leaves in ``workspace`` as per-program partials); before
    that it holds the mean subtracted from V. Forward launchers call :func:`quantize_q` before
    their kernel, on the same stream. ``k_mean``, ``k_scale``, ``v_scale`` and ``v_mean`` are views
    of ``workspace``.
    """

    k_q: torch.Tensor  # int8 (B, Hkv, S_pad, D_pad)
    k_scale: torch.Tensor  # fp32 (B, Hkv, S_pad) per key, or (B, Hkv, n_tiles) per block
    k_mean: torch.Tensor  # fp32 (B, Hkv, D_pad): subtracted from K
    v_t: torch.Tensor  # fp8 e4m3, bf16 or fp16 (B, Hkv, D_pad, S_pad)
    v_scale: torch.Tensor  # fp32 (B, Hkv, D_pad)
    v_mean: torch.Tensor  # fp32 (B, Hkv, D_pad): added back by the epilogue (final after quantize_q)
    # The row-sum GEMM's operand, v_t's dtype (B or 1, ROWSUM_COLS, S_pad): row 0 is each key's
    # weight (1 attended, 0 masked or padding), the other rows zero; in the "wgmma" order with one
    # K scale per tile every row is the weights, so that every column of the GEMM's tile is the row sum.
    rowsum_weights: torch.Tensor
    k_per_token: bool
    block_n: int
    n_tiles: int
    seq_len: int
    # "natural": column j of v_t and rowsum_weights is key j. "wgmma": within every 32 keys, column c
    # holds key wgmma_key_of_column(c), the order in which the warp-specialised Gluon kernel's P
    # sits in registers as the PV GEMM's operand (no shuffle between the two GEMMs).
    pv_key_order: str = "natural"
    # fp32, laid out by `_workspace` (kernel) and `_workspace_views` (host); `n_split` programs
    # per (batch, KV head) wrote its partials.
    workspace: torch.Tensor | None = None
    n_split: int = 1
    # int64 (B, Hkv, S_pad) with quantize_kv(sort_keys=True): position p of each head's buffers
    # holds key key_order[p] (masked keys and padding last); None where the keys keep their order.
    key_order: torch.Tensor | None = None


def wgmma_key_of_column(columns: torch.Tensor) -> torch.Tensor:
    """The key held in column c under the "wgmma" order: the bits (b4 b3 b2 b1 b0) of c within its
    32 keys become (b4 b1 b3 b2 b0). In the m64nNk32 score accumulator a thread holds keys
    8g + 2q + {0, 1}; as the PV GEMM's 8-bit register operand it holds k = 4q + {0..3} and
    16 + 4q + {0..3} of every 32: this order makes those the same keys."""
    c = columns
    return (c & ~31) | (c & 16) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1) | (c & 1)


def kv_split(n_tiles: int, n_heads: int, n_programs_target: int) -> tuple[int, int]:
    """How the K/V pre-pass splits the key tiles of each of `n_heads` (batch, KV head) pairs.

    Returns ``(n_split, tiles_per_program)``: ``n_split`` programs per head, about
    ``n_programs_target`` in all, at most :data:`MAX_SPLIT` and never more than `n_tiles`. Program
    p owns tiles ``[p * tiles_per_program, (p + 1) * tiles_per_program)`` clipped to `n_tiles`;
    ``n_split`` is then trimmed so that none owns no tile.
    """
    n_split = max(1, min(n_programs_target // max(n_heads, 1), n_tiles, MAX_SPLIT))
    per_program = max(1, -(-n_tiles // n_split))
    return max(1, -(-n_tiles // per_program)), per_program


@triton.jit
def _round_half_away(x):
    # float -> int conversion truncates toward zero; adding +-0.5 first rounds half away from zero.
    return tl.where(x >= 0, x + 0.5, x - 0.5)


@triton.jit
def _workspace(ws_ptr, n_bh, n_split, D_PAD: tl.constexpr):
    """The pre-pass workspace's regions, fp32 (`_workspace_views` is the host's side):

    * ``stats``: 5 rows of ``n_bh * D_PAD``, per (batch, KV head) and channel: K mean, V mean
      (final after quantize_q), V scale, V shift (the mean subtracted from V) and the number of
      attended keys (the same in every channel);
    * ``partials`` (n_bh, n_split, 5, D_PAD): per program, K sum, V sum, V min, V max and the
      attended count over its keys;
    * ``v_err`` (n_bh, n_split, D_PAD): per program, V's rounding error summed over its keys;
    * ``k_scale``: QuantizedKV.k_scale.
    """
    partials = ws_ptr + 5 * n_bh * D_PAD
    v_err = partials + n_bh * n_split * 5 * D_PAD
    k_scale = v_err + n_bh * n_split * D_PAD
    return ws_ptr, partials, v_err, k_scale


def _workspace_views(bsz, heads, d_pad, n_split, k_scale_len, device):
    """The workspace (see `_workspace`) and its views k_mean, v_mean, v_scale, k_scale."""
    row = bsz * heads * d_pad
    ws = torch.empty((5 + 6 * n_split) * row + bsz * heads * k_scale_len, dtype=torch.float32, device=device)
    per_head = (heads * d_pad, d_pad, 1)
    views = [ws.as_strided((bsz, heads, d_pad), per_head, i * row) for i in range(3)]
    k_scale = ws.as_strided((bsz, heads, k_scale_len), (heads * k_scale_len, k_scale_len, 1), (5 + 6 * n_split) * row)
    return ws, (*views, k_scale)


@triton.jit
def _reduce_partials(ptrs, n_split, row_stride, OP: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Sum (or min, or max: `OP`) of the `n_split` rows ``ptrs + s * row_stride``, `ptrs` a
    [D_PAD] block of pointers. The order is fixed, so every program gets the same bits."""
    if OP == _SUM:
        neutral: tl.constexpr = 0.0
    elif OP == _MIN:
        neutral: tl.constexpr = _POS_INF
    else:
        neutral: tl.constexpr = _NEG_INF
    acc = tl.full([SPLIT_BLOCK, ptrs.shape[0]], neutral, tl.float32)
    for s0 in range(0, n_split, SPLIT_BLOCK):
        s = s0 + tl.arange(0, SPLIT_BLOCK)
        x = tl.load(ptrs[None, :] + s[:, None] * row_stride, mask=(s < n_split)[:, None], other=neutral)
        if OP == _SUM:
            acc += x
        elif OP == _MIN:
            acc = tl.minimum(acc, x)
        else:
            acc = tl.maximum(acc, x)
    if OP == _SUM:
        return tl.sum(acc, 0)
    elif OP == _MIN:
        return tl.min(acc, 0)
    else:
        return tl.max(acc, 0)


@dataclass
class QuantizedQ:
    q_q: torch.Tensor  # int8 (B, Hq, Sq_pad, D_pad), softmax scale and log2(e) folded in
    q_scale: torch.Tensor  # fp32 (B, Hq, Sq_pad): one per token
    q_dot_k_mean: torch.Tensor  # fp32 (B, Hq, Sq_pad): sm_scale * q . k_mean, for the LSE


class PrepassBuffers(NamedTuple):
    """Every pre-pass buffer a forward kernel reads, as tensors (:meth:`of`) or as
    :class:`~.launch.Address` es in one allocation: the forward launchers take either."""

    workspace: object
    k_q: object
    k_scale: object
    k_mean: object
    v_t: object
    v_scale: object
    v_mean: object
    rowsum_weights: object
    q_q: object
    q_scale: object
    q_dot_k_mean: object

    @classmethod
    def of(cls, kv: QuantizedKV, qq: QuantizedQ) -> "PrepassBuffers":
        return cls(kv.workspace, kv.k_q, kv.k_scale, kv.k_mean, kv.v_t, kv.v_scale, kv.v_mean, kv.rowsum_weights,
                   qq.q_q, qq.q_scale, qq.q_dot_k_mean)


@triton.jit
def _quantize_q_kernel(
    q_ptr, ws_ptr, qq_ptr, qs_ptr, qkm_ptr,
    seq_len, head_dim, n_heads, group, q_pad, sm_scale, n_split,
    stride_qb, stride_qs, stride_qh, stride_qd,
    BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n_kv_heads = n_heads // group
    bh_kv = b * n_kv_heads + h // group
    n_bh = tl.num_programs(2) * n_kv_heads
    stats, _, v_err, _ = _workspace(ws_ptr, n_bh, n_split, D_PAD)
    cols = tl.arange(0, D_PAD)
    stat = stats + bh_kv * D_PAD + cols
    if (pid == 0) & (h % group == 0):  # one program per (batch, KV head): V's mean correction
        # Rounding a fixed set of values is biased by a tiny constant per channel; an output that
        # averages thousands of keys shrinks towards that bias, so the mean the epilogue adds back
        # loses V's mean rounding error (docs/design.md section 2.3).
        row = n_bh * D_PAD
        err = _reduce_partials(v_err + bh_kv * n_split * D_PAD + cols, n_split, D_PAD, _SUM, SPLIT_BLOCK)
        n_attended = tl.maximum(tl.load(stat + 4 * row), 1.0)
        v_scale = tl.load(stat + 2 * row)
        tl.store(stat + row, tl.load(stat + 3 * row) - tl.math.div_rn(err, n_attended) * v_scale)

    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_bounds = (rows < seq_len)[:, None] & (cols < head_dim)[None, :]
    q = tl.load(q_ptr + b * stride_qb + rows[:, None] * stride_qs + h * stride_qh + cols[None, :] * stride_qd,
                mask=in_bounds, other=0.0).to(tl.float32)
    k_mean = tl.load(stat)
    out_rows = (b * n_heads + h) * q_pad + rows
    # Smoothing K shifts every score of a row by sm_scale * q . k_mean; the LSE adds it back.
    q_dot_k_mean = tl.sum(q * k_mean[None, :], 1) * sm_scale
    tl.store(qkm_ptr + out_rows, q_dot_k_mean)
    q_log2 = q * (sm_scale * LOG2E)
    amax = tl.maximum(tl.max(tl.abs(q_log2), 1), 1e-20)
    # q . k_mean is not finite wherever the row of Q or an attended key of its head is not (NaN or
    # Inf; also where finite values overflow float32 in it, far past any real score). That row's
    # scale is then NaN, and so are its scores, P, l and output, where the max and the INT8
    # rounding would otherwise turn the bad values into a finite row (the Triton kernel's epilogue
    # adds 0 times the scale to l too: its exponentials by bits drop NaN).
    finite = tl.abs(q_dot_k_mean) < float("inf")
    tl.store(qs_ptr + out_rows, tl.where(finite, amax / 127.0, float("nan")))
    tl.store(qq_ptr + out_rows[:, None] * D_PAD + cols[None, :],
             _round_half_away(q_log2 * (127.0 / amax)[:, None]).to(tl.int8))



def quantize_q(q, kv: QuantizedKV, *, sm_scale, block_m, pad_multiple=None) -> QuantizedQ:
    """INT8 Q, one scale per token, padded to whole tiles of `block_m` rows (a power of two) or of
    `pad_multiple` rows (a multiple of `block_m`); and the final ``kv.v_mean``.

    Parameters
    ----------
    q : Tensor (B, Sq, Hq, D), any strides
    kv : QuantizedKV from :func:`quantize_kv` of the same batch, Hkv dividing Hq
        Its K mean gives ``q_dot_k_mean``. Its ``v_mean`` is written here (the V mean less V's mean
        rounding error): run this after :func:`quantize_kv` and before the forward kernel, on one
        stream. Running it again on the same `kv` writes the same ``v_mean``.
    """
    pad_multiple = pad_multiple or block_m
    if pad_multiple % block_m:
        raise ValueError(f"pad_multiple={pad_multiple} is not a multiple of block_m={block_m}")
    return q_prepass(q, kv, block_m, pad_multiple).run(q, kv, sm_scale)


def q_prepass(q, kv: QuantizedKV, block_m: int, pad_multiple: int) -> "QPrepass":
    """The :class:`QPrepass` of these tensors (cached per shape, strides, alignment and device)."""
    return _q_prepass(tuple(q.shape), q.stride(), kv.k_q.shape[1], kv.k_q.shape[-1], kv.n_split, block_m,
                      pad_multiple, launch_key(q))


@functools.lru_cache(maxsize=256)
def _q_prepass(q_shape, q_stride, kv_heads, d_pad, n_split, block_m, pad_multiple, _launch_key) -> "QPrepass":
    return QPrepass(q_shape, q_stride, kv_heads, d_pad, n_split, block_m, pad_multiple)


class QPrepass:
    """:func:`quantize_q`'s launch for one shape of Q and of the K/V workspace, everything that
    depends only on shapes computed once: ``run(q, kv, sm_scale)`` allocates and launches;
    ``launch`` takes the buffers (tensors, or :class:`~.launch.Address` es of buffers laid out as
    :attr:`buffer_bytes` says)."""

    def __init__(self, q_shape, q_stride, kv_heads, d_pad, n_split, block_m, pad_multiple):
        bsz, seq_len, heads, dim = q_shape
        self.q_pad = cdiv(seq_len, pad_multiple) * pad_multiple
        self._shape = (bsz, heads, self.q_pad)
        self._d_pad = d_pad
        self._head = (seq_len, dim, heads, heads // kv_heads, self.q_pad)
        self._tail = (n_split, *q_stride)
        rows = bsz * heads * self.q_pad
        # Bytes of q_q, q_scale and q_dot_k_mean.
        self.buffer_bytes = (rows * d_pad, rows * 4, rows * 4)
        tile_rows, warps = q_tile(block_m, d_pad)
        self._launch = BoundLaunch(_quantize_q_kernel, (self.q_pad // tile_rows, heads, bsz), BLOCK_M=tile_rows,
                                   D_PAD=d_pad, SPLIT_BLOCK=SPLIT_BLOCK, SOFT_ROUND=IN_INTERPRETER,
                                   num_warps=warps)

    @property
    def direct(self) -> bool:
        """Whether the launch goes straight to the compiled kernel (:attr:`.launch.BoundLaunch.direct`)."""
        return self._launch.direct

    def run(self, q, kv: QuantizedKV, sm_scale, stream=None) -> QuantizedQ:
        dev = q.device
        q_q = torch.empty(*self._shape, self._d_pad, dtype=torch.int8, device=dev)
        q_scale = torch.empty(self._shape, dtype=torch.float32, device=dev)
        q_dot_k_mean = torch.empty(self._shape, dtype=torch.float32, device=dev)
        self.launch(q, kv.workspace, q_q, q_scale, q_dot_k_mean, sm_scale, stream)
        return QuantizedQ(q_q, q_scale, q_dot_k_mean)

    def launch(self, q, workspace, q_q, q_scale, q_dot_k_mean, sm_scale, stream=None):
        self._launch(q, workspace, q_q, q_scale, q_dot_k_mean, *self._head, float(sm_scale), *self._tail,
                     stream=stream)


@triton.jit
def _key_weights(w_ptr, b, keys, seq_len, stride_wb, stride_ws, HAS_WEIGHT: tl.constexpr):
    """Whether each of `keys` is a key (not padding), and its weight (0 for padding)."""
    is_key = keys < seq_len
    weight = is_key.to(tl.float32)
    if HAS_WEIGHT:
        weight = tl.load(w_ptr + b * stride_wb + keys * stride_ws, mask=is_key, other=0.0).to(tl.float32)
    return is_key, weight


@triton.jit
def _key_tile(w_ptr, b, tile, seq_len, stride_wb, stride_ws, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr):
    """Key tile `tile` of ROWS keys: its rows, whether each is a key, and its weight (0 for padding)."""
    rows = tl.arange(0, ROWS).to(tl.int64) + tile * ROWS  # `tile` is a loop index: a Python int when interpreted
    row_in, weight = _key_weights(w_ptr, b, rows, seq_len, stride_wb, stride_ws, HAS_WEIGHT)
    return rows, row_in, weight


@triton.jit
def _wgmma_key_of_column(c):
    """wgmma_key_of_column, in a kernel."""
    return (c & ~31) | (c & 16) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1) | (c & 1)


@triton.jit
def _fsattn_kv_stats_kernel(
    k_ptr, v_ptr, w_ptr, ws_ptr,
    seq_len, head_dim, n_kv_heads, n_split, tiles_per_program, n_tiles,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_wb, stride_ws,
    HAS_WEIGHT: tl.constexpr,
    V_MEAN: tl.constexpr,
    V_RANGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
    D_PAD: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)
    h = (bh % n_kv_heads).to(tl.int64)
    _, partials, _, _ = _workspace(ws_ptr, tl.num_programs(1), n_split, D_PAD)
    cols = tl.arange(0, D_PAD)
    col_in = cols < head_dim
    # This program's keys, SUB_N at a time (BLOCK_N // SUB_N steps per tile of the split).
    first = split * tiles_per_program * (BLOCK_N // SUB_N)
    last = tl.minimum(split * tiles_per_program + tiles_per_program, n_tiles) * (BLOCK_N // SUB_N)

    # Masked keys are selected away, never multiplied by 0: an inf or NaN in a padding token
    # must not reach the statistics (0 * inf is NaN). K, then V: one tile live at a time. Each
    # thread accumulates its own elements; the reduction over keys comes once, after the loop.
    k_acc = tl.zeros([SUB_N, D_PAD], tl.float32)
    n_acc = tl.zeros([SUB_N], tl.float32)
    for sub in tl.range(first, last, num_stages=LOOP_STAGES):
        rows, row_in, weight = _key_tile(w_ptr, b, sub, seq_len, stride_wb, stride_ws, HAS_WEIGHT, SUB_N)
        n_acc += weight
        k = tl.load(k_ptr + b * stride_kb + rows[:, None] * stride_ks + h * stride_kh + cols[None, :] * stride_kd,
                    mask=row_in[:, None] & col_in[None, :], other=0.0).to(tl.float32)
        k_acc += tl.where((weight[:, None] != 0.0) & col_in[None, :], k, 0.0)
    k_sum = tl.sum(k_acc, 0)
    n_attended = tl.zeros([D_PAD], tl.float32) + tl.sum(n_acc, 0)
    v_sum = tl.zeros([D_PAD], tl.float32)
    v_min = tl.full([D_PAD], _POS_INF, tl.float32)
    v_max = tl.full([D_PAD], _NEG_INF, tl.float32)
    if V_MEAN or V_RANGE:
        V_ROWS: tl.constexpr = SUB_N // 2  # three accumulators
        v_sum_acc = tl.zeros([V_ROWS, D_PAD], tl.float32)
        v_min_acc = tl.full([V_ROWS, D_PAD], _POS_INF, tl.float32)
        v_max_acc = tl.full([V_ROWS, D_PAD], _NEG_INF, tl.float32)
        for sub in tl.range(first * 2, last * 2, num_stages=LOOP_STAGES):
            rows, row_in, weight = _key_tile(w_ptr, b, sub, seq_len, stride_wb, stride_ws, HAS_WEIGHT, V_ROWS)
            attended = (weight[:, None] != 0.0) & col_in[None, :]
            v = tl.load(v_ptr + b * stride_vb + rows[:, None] * stride_vs + h * stride_vh + cols[None, :] * stride_vd,
                        mask=row_in[:, None] & col_in[None, :], other=0.0).to(tl.float32)
            if V_MEAN:
                v_sum_acc += tl.where(attended, v, 0.0)
            if V_RANGE:
                v_min_acc = tl.minimum(v_min_acc, tl.where(attended, v, _POS_INF))
                v_max_acc = tl.maximum(v_max_acc, tl.where(attended, v, _NEG_INF))
        v_sum = tl.sum(v_sum_acc, 0)
        v_min = tl.min(v_min_acc, 0)
        v_max = tl.max(v_max_acc, 0)
    # A program that owns no tile writes the neutral elements.
    mine = partials + (bh.to(tl.int64) * n_split + split) * 5 * D_PAD + cols
    tl.store(mine, k_sum)
    tl.store(mine + D_PAD, v_sum)
    tl.store(mine + 2 * D_PAD, v_min)
    tl.store(mine + 3 * D_PAD, v_max)
    tl.store(mine + 4 * D_PAD, n_attended)


@triton.jit
def _head_k_mean(partials, bh, n_split, SPLIT_BLOCK: tl.constexpr, D_PAD: tl.constexpr):
    """Head `bh`'s K mean over its attended keys and their count (both [D_PAD]) from the
    statistics' partials, in a fixed order (every program of the head gets the same bits)."""
    mine = partials + bh.to(tl.int64) * n_split * 5 * D_PAD + tl.arange(0, D_PAD)
    n_attended = _reduce_partials(mine + 4 * D_PAD, n_split, 5 * D_PAD, _SUM, SPLIT_BLOCK)
    count = tl.maximum(n_attended, 1.0)  # a head with every key masked: zero means
    return tl.math.div_rn(_reduce_partials(mine, n_split, 5 * D_PAD, _SUM, SPLIT_BLOCK), count), n_attended


@triton.jit
def _key_size_kernel(
    k_ptr, w_ptr, ws_ptr, size_ptr,
    seq_len, head_dim, n_kv_heads, n_split, tiles_per_program, n_tiles, s_pad,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_wb, stride_ws,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """Each key's size, the largest magnitude of the key less its head's mean, for the order of
    ``sort_keys``; -1 for masked keys and padding, so that they sort last (grid as the
    statistics'). Also writes that mean into the statistics, for the packing to subtract."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_kv_heads).to(tl.int64)
    h = (bh % n_kv_heads).to(tl.int64)
    stats, partials, _, _ = _workspace(ws_ptr, tl.num_programs(1), n_split, D_PAD)
    k_mean, _ = _head_k_mean(partials, bh, n_split, SPLIT_BLOCK, D_PAD)
    cols = tl.arange(0, D_PAD)
    col_in = cols < head_dim
    if split == 0:  # the mean the packing subtracts: one reduction's bits for the sizes and the keys
        tl.store(stats + bh.to(tl.int64) * D_PAD + cols, k_mean)
    first = split * tiles_per_program * (BLOCK_N // SUB_N)
    last = tl.minimum(split * tiles_per_program + tiles_per_program, n_tiles) * (BLOCK_N // SUB_N)
    for sub in tl.range(first, last, num_stages=LOOP_STAGES):
        rows, row_in, weight = _key_tile(w_ptr, b, sub, seq_len, stride_wb, stride_ws, HAS_WEIGHT, SUB_N)
        in_bounds = row_in[:, None] & col_in[None, :]
        k = tl.load(k_ptr + b * stride_kb + rows[:, None] * stride_ks + h * stride_kh + cols[None, :] * stride_kd,
                    mask=in_bounds, other=0.0).to(tl.float32)
        size = tl.max(tl.where(in_bounds, tl.abs(k - k_mean[None, :]), 0.0), axis=1)
        tl.store(size_ptr + bh.to(tl.int64) * s_pad + rows, tl.where(weight != 0.0, size, -1.0))


# seq_len is not specialised: with seq_len % 16 == 0 Triton proves `rows < seq_len` constant over
# each thread's columns and packs one converted FP8 pair twice into a 32-bit register
# (mov.b32 {%rs, %rs}); Triton 3.6's build of that wrote garbage into the upper half (the row-sum
# weights in the natural order, seen on an H200).
@triton.jit(do_not_specialize=["seq_len"])
def _quantize_kv_kernel(
    k_ptr, v_ptr, w_ptr, ws_ptr,
    kq_ptr, vt_ptr, rowsum_w_ptr, order_ptr, sorted_size_ptr,
    seq_len, head_dim, n_kv_heads, n_split, tiles_per_program, n_tiles, s_pad,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_wb, stride_ws,
    HAS_WEIGHT: tl.constexpr,
    K_PER_TOKEN: tl.constexpr,
    V_FP8: tl.constexpr,
    SMOOTH_V: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
    SORTED: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
    D_PAD: tl.constexpr,
    ROWSUM_COLS: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    V_ERR_ROWS: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    n_bh = tl.num_programs(1)
    b = (bh // n_kv_heads).to(tl.int64)
    h = (bh % n_kv_heads).to(tl.int64)
    stats, partials, v_err_ptr, k_scale_ptr = _workspace(ws_ptr, n_bh, n_split, D_PAD)
    cols = tl.arange(0, D_PAD)
    col_in = cols < head_dim

    # The head's statistics from its partials (fp32 throughout, divisions rounded as torch's).
    mine = partials + bh.to(tl.int64) * n_split * 5 * D_PAD + cols
    k_mean, n_attended = _head_k_mean(partials, bh, n_split, SPLIT_BLOCK, D_PAD)
    if SORTED:  # the size pass's K mean (written before this launch), from which the tiles' scales came
        k_mean = tl.load(stats + bh.to(tl.int64) * D_PAD + cols)
    count = tl.maximum(n_attended, 1.0)
    v_mean = tl.zeros([D_PAD], tl.float32)
    v_scale = tl.full([D_PAD], 1.0, tl.float32)
    if V_FP8:
        if SMOOTH_V:
            v_mean = tl.math.div_rn(_reduce_partials(mine + D_PAD, n_split, 5 * D_PAD, _SUM, SPLIT_BLOCK), count)
        v_min = _reduce_partials(mine + 2 * D_PAD, n_split, 5 * D_PAD, _MIN, SPLIT_BLOCK)
        v_max = _reduce_partials(mine + 3 * D_PAD, n_split, 5 * D_PAD, _MAX, SPLIT_BLOCK)
        v_amax = tl.maximum(tl.maximum(v_max - v_mean, v_mean - v_min), 1e-20)  # no attended key: the floor
        # Padding channels get scale 1: their V is zero, and 1/scale must stay finite.
        v_scale = tl.where(col_in, tl.math.div_rn(v_amax, 448.0), 1.0)
    v_inv_scale = tl.math.div_rn(tl.full([D_PAD], 1.0, tl.float32), v_scale)
    if split == 0:
        stat = stats + bh.to(tl.int64) * D_PAD + cols
        row = n_bh * D_PAD
        if not SORTED:
            tl.store(stat, k_mean)
        tl.store(stat + row, v_mean)  # quantize_q subtracts the rounding error
        tl.store(stat + 2 * row, v_scale)
        tl.store(stat + 3 * row, v_mean)
        tl.store(stat + 4 * row, n_attended)

    # K, then V, each over this program's keys: one tile live at a time (one loop doing both
    # kept twice the registers). K scales per block of keys in their own order need whole tiles
    # (the block's largest magnitude); the rest goes SUB_N keys at a time.
    first = split * tiles_per_program
    last = tl.minimum(first + tiles_per_program, n_tiles)
    K_ROWS: tl.constexpr = SUB_N if K_PER_TOKEN or SORTED else BLOCK_N
    # A whole tile per step for block scales over unsorted keys: one in flight (two spilled).
    K_STAGES: tl.constexpr = LOOP_STAGES if K_PER_TOKEN or SORTED else 1
    for sub in tl.range(first * (BLOCK_N // K_ROWS), last * (BLOCK_N // K_ROWS), num_stages=K_STAGES):
        rows = tl.arange(0, K_ROWS).to(tl.int64) + sub * K_ROWS
        keys = rows
        if SORTED:  # row r of the output holds key order[r]
            keys = tl.load(order_ptr + bh.to(tl.int64) * s_pad + rows)
        row_in, weight = _key_weights(w_ptr, b, keys, seq_len, stride_wb, stride_ws, HAS_WEIGHT)
        in_bounds = row_in[:, None] & col_in[None, :]
        k = tl.load(k_ptr + b * stride_kb + keys[:, None] * stride_ks + h * stride_kh + cols[None, :] * stride_kd,
                    mask=in_bounds, other=0.0).to(tl.float32)
        k = tl.where((weight[:, None] != 0.0) & in_bounds, k - k_mean[None, :], 0.0)
        out_rows = bh.to(tl.int64) * s_pad + rows
        if K_PER_TOKEN:
            k_amax = tl.maximum(tl.max(tl.abs(k), axis=1), 1e-20)
            k_q = _round_half_away(k * (127.0 / k_amax)[:, None]).to(tl.int8)
            tl.store(k_scale_ptr + out_rows, k_amax / 127.0)
        else:
            tile = sub // (BLOCK_N // K_ROWS)
            if SORTED:
                # Largest first: the tile's largest magnitude is its first key's size (-1 where the
                # whole tile is masked or padding), taken from the same K mean as these keys. The
                # clamp keeps the contract that no key wraps past +-127 whatever scale arrives: a
                # key past it saturates, where the int8 conversion would wrap.
                k_amax = tl.maximum(tl.load(sorted_size_ptr + bh.to(tl.int64) * s_pad + tile * BLOCK_N), 1e-20)
                k_scaled = tl.minimum(tl.maximum(k * (127.0 / k_amax), -127.0), 127.0)
            else:
                k_amax = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0), 1e-20)
                k_scaled = k * (127.0 / k_amax)
            k_q = _round_half_away(k_scaled).to(tl.int8)
            # Written by each of the tile's sub-tiles when sorted: the same value.
            tl.store(k_scale_ptr + bh.to(tl.int64) * n_tiles + tile, k_amax / 127.0)
        tl.store(kq_ptr + out_rows[:, None] * D_PAD + cols[None, :], k_q)

    # The row-sum weights: rows of batch b (one row block for the whole batch when unmasked),
    # written by the programs of its first head, every row of them, so that nothing is memset.
    # Sorted keys put masked keys and padding last in every head: the weights are still the same
    # for all heads of a batch.
    if HAS_WEIGHT:
        writes_weights = h == 0
    else:
        writes_weights = bh == 0
    w_row = tl.arange(0, ROWSUM_COLS)
    # V's rounding error, summed per step only over keys that the same thread holds (the leading
    # axis of the reshape is made of register repetitions in the tile's layout: no shared memory),
    # and over the rest once, after the loop. A full sum per step is a reduction across warps
    # through shared memory every step; an elementwise accumulator spilled under Triton 3.9.
    v_err = tl.zeros([V_ERR_ROWS, D_PAD], tl.float32)
    for sub in tl.range(first * (BLOCK_N // SUB_N), last * (BLOCK_N // SUB_N), num_stages=LOOP_STAGES):
        # Column c of v_t is loaded from its key: in the "wgmma" order the rows are read in a
        # permuted order (still whole rows), so the tile needs no permutation before its store.
        columns = tl.arange(0, SUB_N).to(tl.int64) + sub * SUB_N
        if WGMMA_ORDER:
            rows = _wgmma_key_of_column(columns)
        else:
            rows = columns
        if SORTED:
            rows = tl.load(order_ptr + bh.to(tl.int64) * s_pad + rows)
        row_in, weight = _key_weights(w_ptr, b, rows, seq_len, stride_wb, stride_ws, HAS_WEIGHT)
        in_bounds = row_in[:, None] & col_in[None, :]
        keep = (weight[:, None] != 0.0) & in_bounds
        v = tl.load(v_ptr + b * stride_vb + rows[:, None] * stride_vs + h * stride_vh + cols[None, :] * stride_vd,
                    mask=in_bounds, other=0.0).to(tl.float32)
        if V_FP8:
            v = tl.where(keep, v - v_mean[None, :], 0.0) * v_inv_scale[None, :]
            # Rounding may step past 448 and e4m3fn has no Inf. A NaN stays NaN, so that its channel's
            # output does (without smooth_v no NaN V mean would carry it).
            v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                           propagate_nan=tl.PropagateNan.ALL)
        else:
            v = tl.where(keep, v, 0.0)
        v_low = to_low_precision(v, vt_ptr.dtype.element_ty, SOFT_ROUND)
        v_err += tl.sum(tl.reshape(v_low.to(tl.float32) - v, [SUB_N // V_ERR_ROWS, V_ERR_ROWS, D_PAD]), 0)
        tl.store(vt_ptr + (bh.to(tl.int64) * D_PAD + cols[None, :]) * s_pad + columns[:, None], v_low)
        if writes_weights:
            if WGMMA_ORDER and not K_PER_TOKEN:  # every row: the warp-specialised kernel's per-tile path
                # reads each thread's first column
                w_tile = tl.broadcast_to(weight[None, :], [ROWSUM_COLS, SUB_N])
            else:
                w_tile = tl.where((w_row == 0)[:, None], weight[None, :], 0.0)
            tl.store(rowsum_w_ptr + (b * ROWSUM_COLS + w_row)[:, None] * s_pad + columns[None, :],
                     to_low_precision(w_tile, rowsum_w_ptr.dtype.element_ty, SOFT_ROUND))
    # V's rounding error over this program's keys, per channel in scaled units (quantize_q
    # reduces it; a program that owns no tile writes zeros).
    tl.store(v_err_ptr + (bh.to(tl.int64) * n_split + split) * D_PAD + cols, tl.sum(v_err, 0))


def _sub_tile(block_n, d_pad):
    """Keys per step of the pre-pass loops: 32 fp32 values per thread (more spilled at head dim
    128), at least 32 keys (the wgmma order's group). The tiles in flight wait in shared memory
    (LOOP_STAGES), not in registers."""
    return min(block_n, max(32, 32 * 32 * PREPASS_WARPS // d_pad))


def quantize_kv(k, v, key_weight=None, *, block_n, d_pad, k_per_token=True, smooth_v=True,
                v_dtype=torch.float8_e4m3fn, pv_key_order="natural", sort_keys=False,
                n_programs_target=None) -> QuantizedKV:
    """Quantise K to INT8 and pack V (FP8 with per-channel scales, or 16-bit) for the forward kernel.

    Two launches (statistics, then packing; with `sort_keys` a third and a sort between them:
    module docstring); ``v_mean`` of the result is final only after :func:`quantize_q` has run on it.

    Parameters
    ----------
    k, v : Tensor (B, S, H, D), any strides
        Keys and values (a permuted view is fine: no copy is made).
    key_weight : Tensor (B, S) or None, any strides
        1.0 (or True) for keys to attend to, 0.0 (False) for masked keys: float or boolean.
    block_n : int
        Keys per tile (a power of two): the padding granularity and the per-block K scale's block.
    d_pad : int
        Channels after padding (a power of two, at least D).
    k_per_token : bool
        One K scale per key, else one per block of `block_n` keys.
    v_dtype : torch.dtype
        ``torch.float8_e4m3fn`` (scaled per channel, optionally mean-centred by `smooth_v`),
        ``torch.bfloat16`` or ``torch.float16`` (copied as is).
    pv_key_order : str
        The order of the keys in ``v_t`` and ``rowsum_weights`` (:class:`QuantizedKV`): ``"natural"``
        for the Triton kernel, ``"wgmma"`` for the warp-specialised Gluon kernel.
    sort_keys : bool
        Store each head's keys (K, V and their weights alike) ordered by size, the largest
        magnitude of the key less the head's mean, largest first, masked keys and padding last
        (``QuantizedKV.key_order``), so that each block of a per-block K scale holds keys of
        nearly one size. One more launch, and a sort with torch.
    n_programs_target : int or None
        Programs per launch to aim for (:func:`kv_split`); the statistics' fp32 sums follow the
        split. Default :func:`prepass_programs_target` of `d_pad`.
    """
    if pv_key_order not in PV_KEY_ORDERS:
        raise ValueError(f"pv_key_order must be one of {PV_KEY_ORDERS}, got {pv_key_order!r}")
    if pv_key_order == "wgmma" and block_n % 32:
        raise ValueError(f"the wgmma key order permutes within 32 keys: block_n must be a multiple of 32, got {block_n}")
    bsz, seq_len, heads, dim = k.shape
    if d_pad < dim or d_pad & (d_pad - 1):
        raise ValueError(f"d_pad must be a power of two at least the head dim {dim}, got {d_pad}")
    return kv_prepass(k, v, key_weight, block_n=block_n, d_pad=d_pad, k_per_token=k_per_token, smooth_v=smooth_v,
                      v_dtype=v_dtype, pv_key_order=pv_key_order, sort_keys=sort_keys,
                      n_programs_target=n_programs_target).run(k, v, key_weight)


def kv_prepass(k, v, key_weight, *, block_n, d_pad, k_per_token, smooth_v, v_dtype, pv_key_order, sort_keys=False,
               n_programs_target=None, split=None) -> "KVPrepass":
    """The :class:`KVPrepass` of these tensors (cached per shape, strides, alignment and device);
    arguments as :func:`quantize_kv`, which checks them. `split`: ``(n_split, tiles_per_program)``
    instead of :func:`kv_split`'s (they must cover every tile; a program past the last owns none)."""
    bsz, seq_len, heads, _ = k.shape
    if split is None:
        if n_programs_target is None:
            n_programs_target = prepass_programs_target(d_pad)
        split = kv_split(cdiv(seq_len, block_n), bsz * heads, n_programs_target)
    return _kv_prepass(tuple(k.shape), k.stride(), v.stride(), None if key_weight is None else key_weight.stride(),
                       *split, block_n, d_pad, k_per_token, smooth_v, v_dtype, pv_key_order, sort_keys,
                       launch_key(k, v, key_weight))


def _launch_kv_prepass(k, v, key_weight, n_split, tiles_per_program, **layout) -> QuantizedKV:
    """quantize_kv's launches with `n_split` programs per head of `tiles_per_program` tiles
    each (`layout`: :func:`kv_prepass`'s keyword arguments)."""
    return kv_prepass(k, v, key_weight, split=(n_split, tiles_per_program), **layout).run(k, v, key_weight)


@functools.lru_cache(maxsize=256)
def _kv_prepass(k_shape, k_stride, v_stride, w_stride, n_split, tiles_per_program, block_n, d_pad, k_per_token,
                smooth_v, v_dtype, pv_key_order, sort_keys, _launch_key) -> "KVPrepass":
    return KVPrepass(k_shape, k_stride, v_stride, w_stride, n_split, tiles_per_program, block_n=block_n,
                     d_pad=d_pad, k_per_token=k_per_token, smooth_v=smooth_v, v_dtype=v_dtype,
                     pv_key_order=pv_key_order, sort_keys=sort_keys)


class KVPrepass:
    """:func:`quantize_kv`'s launches for one shape of K/V (`w_stride`: the key weights'
    strides, None without weights), everything that depends only on shapes computed once:
    ``run(k, v, key_weight)`` allocates and launches; ``launch`` takes the buffers (tensors, or
    :class:`~.launch.Address` es of buffers laid out as :attr:`buffer_bytes` says, and
    :attr:`stat_offsets` within the workspace)."""

    def __init__(self, k_shape, k_stride, v_stride, w_stride, n_split, tiles_per_program, *, block_n, d_pad,
                 k_per_token, smooth_v, v_dtype, pv_key_order, sort_keys=False):
        bsz, seq_len, heads, dim = k_shape
        self.n_tiles = n_tiles = cdiv(seq_len, block_n)
        self.s_pad = s_pad = n_tiles * block_n
        self.n_split = n_split
        self._bsz, self._heads, self._d_pad, self._seq_len = bsz, heads, d_pad, seq_len
        self._k_scale_len = s_pad if k_per_token else n_tiles
        self._v_dtype = v_dtype
        self._has_weight = w_stride is not None
        self._layout = dict(k_per_token=k_per_token, block_n=block_n, pv_key_order=pv_key_order)
        v_fp8 = v_dtype == torch.float8_e4m3fn
        row = bsz * heads * d_pad
        v_bytes = v_dtype.itemsize
        # Bytes of the workspace, k_q, v_t and the row-sum weights; offsets in bytes of k_mean,
        # v_mean, v_scale and k_scale in the workspace (`_workspace_views`).
        workspace_bytes = 4 * ((5 + 6 * n_split) * row + bsz * heads * self._k_scale_len)
        rowsum_rows = (bsz if w_stride is not None else 1) * ROWSUM_COLS
        self.buffer_bytes = (workspace_bytes, row * s_pad, row * s_pad * v_bytes, rowsum_rows * s_pad * v_bytes)
        self.stat_offsets = (0, 4 * row, 8 * row, 4 * (5 + 6 * n_split) * row)
        grid = (n_split, bsz * heads)
        shared = (seq_len, dim, heads, n_split, tiles_per_program, n_tiles)
        strides = (*k_stride, *v_stride, *(w_stride if w_stride is not None else (0, 0)))
        self._stats_args = (*shared, *strides)
        self._pack_args = (*shared, s_pad, *strides)
        self._sort_keys = sort_keys
        self._size_args = (*shared, s_pad, *k_stride, *(w_stride if w_stride is not None else (0, 0)))
        sub_n = _sub_tile(block_n, d_pad)
        self._sizes = BoundLaunch(
            _key_size_kernel, grid, HAS_WEIGHT=self._has_weight, BLOCK_N=block_n, SUB_N=sub_n, D_PAD=d_pad,
            SPLIT_BLOCK=SPLIT_BLOCK, LOOP_STAGES=LOOP_STAGES, num_warps=PREPASS_WARPS,
            maxnreg=prepass_max_registers(d_pad)) if sort_keys else None
        self._stats = BoundLaunch(
            _fsattn_kv_stats_kernel, grid, HAS_WEIGHT=self._has_weight, V_MEAN=smooth_v and v_fp8, V_RANGE=v_fp8,
            BLOCK_N=block_n, SUB_N=sub_n, D_PAD=d_pad, LOOP_STAGES=LOOP_STAGES, num_warps=PREPASS_WARPS,
            maxnreg=prepass_max_registers(d_pad))
        self._pack = BoundLaunch(
            _quantize_kv_kernel, grid, HAS_WEIGHT=self._has_weight, K_PER_TOKEN=k_per_token, V_FP8=v_fp8,
            SMOOTH_V=smooth_v, WGMMA_ORDER=pv_key_order == "wgmma", SORTED=sort_keys, SOFT_ROUND=IN_INTERPRETER,
            BLOCK_N=block_n,
            SUB_N=sub_n, D_PAD=d_pad, ROWSUM_COLS=ROWSUM_COLS, SPLIT_BLOCK=SPLIT_BLOCK, LOOP_STAGES=LOOP_STAGES,
            V_ERR_ROWS=min(V_ERR_ROWS, sub_n), num_warps=PREPASS_WARPS,
            maxnreg=_pack_max_registers(d_pad, k_per_token, sort_keys))

    @property
    def direct(self) -> bool:
        """Whether the launches go straight to their compiled kernels (:attr:`.launch.BoundLaunch.direct`);
        never with ``sort_keys`` (the sort is torch's, on tensors)."""
        return not self._sort_keys and self._stats.direct and self._pack.direct

    def run(self, k, v, key_weight, stream=None) -> QuantizedKV:
        bsz, heads, d_pad, s_pad, dev = self._bsz, self._heads, self._d_pad, self.s_pad, k.device
        ws, (k_mean, v_mean, v_scale, k_scale) = _workspace_views(bsz, heads, d_pad, self.n_split, self._k_scale_len,
                                                                   dev)
        k_q = torch.empty(bsz, heads, s_pad, d_pad, dtype=torch.int8, device=dev)
        v_t = torch.empty(bsz, heads, d_pad, s_pad, dtype=self._v_dtype, device=dev)
        # The row-sum GEMM's B operand, stored (ROWSUM_COLS, S_pad) so that it is K-major.
        rowsum_w = torch.empty(bsz if self._has_weight else 1, ROWSUM_COLS, s_pad, dtype=self._v_dtype, device=dev)
        order = self.launch(k, v, key_weight, ws, k_q, v_t, rowsum_w, stream)
        return QuantizedKV(k_q=k_q, k_scale=k_scale, k_mean=k_mean, v_t=v_t, v_scale=v_scale, v_mean=v_mean,
                           rowsum_weights=rowsum_w, n_tiles=self.n_tiles, seq_len=self._seq_len, workspace=ws,
                           n_split=self.n_split, key_order=order, **self._layout)

    def launch(self, k, v, key_weight, workspace, k_q, v_t, rowsum_weights, stream=None):
        """The launches into these buffers; returns the key order (``sort_keys``; else None),
        which the buffers must be tensors for."""
        w = key_weight if self._has_weight else workspace  # the workspace: an unused pointer
        self._stats(k, v, w, workspace, *self._stats_args, stream=stream)
        order = sorted_sizes = None
        if self._sort_keys:
            sizes = torch.empty(self._bsz * self._heads, self.s_pad, dtype=torch.float32, device=k_q.device)
            self._sizes(k, w, workspace, sizes, *self._size_args, stream=stream)
            # Stable, so that ties (masked keys, padding) keep their order and the result is deterministic.
            sorted_sizes, order = torch.sort(sizes, dim=1, descending=True, stable=True)
            order = order.view(self._bsz, self._heads, self.s_pad)
        self._pack(k, v, w, workspace, k_q, v_t, rowsum_weights, workspace if order is None else order,
                   workspace if sorted_sizes is None else sorted_sizes, *self._pack_args, stream=stream)
        return order
