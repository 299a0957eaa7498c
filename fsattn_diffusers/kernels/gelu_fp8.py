"""One pass for a feed-forward's tanh-GELU and the per-row FP8 scaling of its result.

A GELU feed-forward whose down projection runs in FP8 with dynamic per-row activation scales
(torchao's float8 dynamic-activation config) computes, per token row ``x`` of the up
projection's output::

    y = gelu_tanh(x)                      # rounded to bf16, as the model's own GELU returns it
    scale = max|y| / 448                  # fp32, one per row
    q = e4m3(clamp(y / scale, -448, 448))

Compiled by inductor these are a looped reduction that reads the row three times and writes the
GELU back in between (~0.8 TB/s on an H200). :func:`gelu_tanh_fp8_rows` reads each row once and
keeps it in registers: a row of ``n`` columns is held as up to three power-of-two parts
(``row_parts``: 8,960 = 8,192 + 512 + 512, 256 of the last used; 13,824 = 8,192 + 4,096 +
2,048, 1,536 used), so that at most part of the last one idles (a power-of-two padding of
8,960 would leave 45 % of 16,384 lanes idle).

``gelu_tanh(x) = x * sigmoid(2u)`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)`` is the same
function as ``0.5 x (1 + tanh(u))``; written with one exponential and one division it needs no
libdevice ``tanh`` (~20 instructions a value, which made the pass compute-bound) and runs under
Triton's interpreter as well. Far below zero (x < ~-10) torch's GELU is exactly 0 and this one a
value below 1e-18: a row lying entirely there gets a tiny scale instead of 0. An all-zero row
gets scale 0 and zeros (not 0/0); a row holding a NaN gets scale NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Relaunch
from .lowp import IN_INTERPRETER, to_low_precision

# gelu_tanh(x) = x / (1 + 2^(x (C1 + C3 x^2))): C1 = -2 log2(e) sqrt(2/pi), C3 = 0.044715 C1.
_C1 = tl.constexpr(-2.0 * 1.4426950408889634 * 0.7978845608028654)
_C3 = tl.constexpr(-2.0 * 1.4426950408889634 * 0.7978845608028654 * 0.044715)
# Smallest part of a row: below it the parts' own reductions and stores would cost more than
# idle lanes.
MIN_PART = 512
# Rows longer than this would need more registers than a program has: not taken.
MAX_COLS = 32768


@triton.jit
def _gelu_tanh_bf16(x, SOFT_ROUND: tl.constexpr):
    y = x / (1.0 + tl.exp2(x * (_C1 + _C3 * (x * x))))
    return to_low_precision(y, tl.bfloat16, SOFT_ROUND).to(tl.float32)


@triton.jit
def _load_part(x_ptr, row, x_stride, start, n_cols, SIZE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    return _gelu_tanh_bf16(x, SOFT_ROUND)


@triton.jit
def _store_part(q_ptr, row, q_stride, y, inv_scale, start, n_cols, SIZE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    q = tl.minimum(tl.maximum(y * inv_scale, -448.0), 448.0)
    tl.store(q_ptr + row * q_stride + cols, to_low_precision(q, tl.float8e4nv, SOFT_ROUND), mask=cols < n_cols)


@triton.jit
def _gelu_tanh_fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, x_stride, q_stride, PART_A: tl.constexpr,
                               PART_B: tl.constexpr, PART_C: tl.constexpr, SOFT_ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # max and min skip NaN: count them, so that a row holding one gets a NaN scale (its GEMM row
    # then comes out NaN, as torchao's does) instead of finite values.
    y_a = _load_part(x_ptr, row, x_stride, 0, n_cols, PART_A, SOFT_ROUND)
    amax = tl.max(tl.abs(y_a), axis=0)
    nans = tl.sum((y_a != y_a).to(tl.int32), axis=0)
    if PART_B > 0:
        y_b = _load_part(x_ptr, row, x_stride, PART_A, n_cols, PART_B, SOFT_ROUND)
        amax = tl.maximum(amax, tl.max(tl.abs(y_b), axis=0))
        nans += tl.sum((y_b != y_b).to(tl.int32), axis=0)
    if PART_C > 0:
        y_c = _load_part(x_ptr, row, x_stride, PART_A + PART_B, n_cols, PART_C, SOFT_ROUND)
        amax = tl.maximum(amax, tl.max(tl.abs(y_c), axis=0))
        nans += tl.sum((y_c != y_c).to(tl.int32), axis=0)
    amax = tl.where(nans > 0, float("nan"), amax)
    # Both divisions correctly rounded, as PyTorch's are: Triton's "/" compiles to an approximate
    # division (div.full.f32, up to 2 ulp), and a reciprocal a bit off moves a share of y / scale
    # that sits on a tie between two e4m3 values (y and amax are both bf16) to the other side:
    # 0.4-0.6 % of the values a step off the exact quotient's on an H100 (NOTES v46). Once a row.
    scale = tl.math.div_rn(amax, 448.0)
    inv_scale = tl.where(amax > 0, tl.math.div_rn(448.0, tl.maximum(amax, 1e-30)), 0.0)
    _store_part(q_ptr, row, q_stride, y_a, inv_scale, 0, n_cols, PART_A, SOFT_ROUND)
    if PART_B > 0:
        _store_part(q_ptr, row, q_stride, y_b, inv_scale, PART_A, n_cols, PART_B, SOFT_ROUND)
    if PART_C > 0:
        _store_part(q_ptr, row, q_stride, y_c, inv_scale, PART_A + PART_B, n_cols, PART_C, SOFT_ROUND)
    tl.store(scale_ptr + row, scale)


def row_parts(n_cols: int) -> tuple[int, int, int]:
    """Up to three power-of-two lengths (0 for an unused part) that cover `n_cols`: the largest
    power of two that fits, again for what is left, then the rest rounded up (at least
    ``MIN_PART`` each)."""
    if not 0 < n_cols <= MAX_COLS:
        raise ValueError(f"gelu_tanh_fp8_rows: rows of 1 to {MAX_COLS} columns, got {n_cols}")
    parts, left = [], n_cols
    while left > 0 and len(parts) < 2 and left >= MIN_PART:
        parts.append(1 << (left.bit_length() - 1))
        left -= parts[-1]
    if left > 0:
        parts.append(max(MIN_PART, triton.next_power_of_2(left)))
    return tuple(parts + [0] * (3 - len(parts)))


def num_warps_for(n_cols: int) -> int:
    """Warps per row program. Measured on an H200 (4 / 8 / 16 / 32 warps): 0.31 / 0.33 / 0.33 /
    0.56 ms at 32,760 x 8,960; 0.74 / 0.72 / 0.75 / 0.96 ms at 59,528 x 12,288; 1.42 / 1.23 /
    1.24 / 1.55 ms at 75,600 x 13,824."""
    return 4 if sum(row_parts(n_cols)) <= 9216 else 8


def gelu_tanh_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh-GELU of each row of `x` (2-D bf16, unit column stride), in FP8 e4m3 with per-row scales.

    Returns ``(q, scale)``: ``q`` float8_e4m3fn of `x`'s shape (contiguous), ``scale`` float32
    ``(rows, 1)`` with ``gelu(x) ~= q * scale`` (the GELU rounded to bf16 first).
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"gelu_tanh_fp8_rows: expected a 2-D bfloat16 tensor with unit column stride, got shape "
                         f"{tuple(x.shape)}, {x.dtype}, strides {x.stride()}")
    rows, cols = x.shape
    part_a, part_b, part_c = row_parts(cols)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        Relaunch.of(_gelu_tanh_fp8_rows_kernel)[(rows,)](
            x, q, scale, cols, x.stride(0), q.stride(0), PART_A=part_a, PART_B=part_b, PART_C=part_c,
            SOFT_ROUND=IN_INTERPRETER, num_warps=num_warps_for(cols))
    return q, scale
