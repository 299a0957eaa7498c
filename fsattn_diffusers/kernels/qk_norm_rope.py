"""Query/key RMSNorm over all heads and the interleaved rotary embedding, in one pass.

Video DiTs such as Wan normalise each token's query (and key) row of all heads together, scale it
by a learned weight, then rotate each head's consecutive channel pairs (2i, 2i + 1) by per-token
angles. Compiled, that is a looped reduction that reads the row again for the rotation (3.1 ms a
Wan2.1-14B block inside the recipe, ~1 TB/s, benchmarks/NOTES.md v17 (e); 2.9 ms standalone). Here
one program takes a token's row (its heads as at most two power-of-two chunks): it loads the row
for the sum of squares and again for the rotation, the second load from cache (a 10 KB row), and
writes it once: 0.87 ms at that shape, ~3.5 TB/s of DRAM traffic (NOTES v28 (d)). The rounding
follows eager PyTorch: the normalised, weighted row is rounded to the input's dtype (``rms_norm``'s
output); with float32 angles the rotation runs in float32 and is rounded once, with angles in the
input's dtype each product and sum is rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Relaunch
from .lowp import IN_INTERPRETER, to_low_precision


@triton.jit
def _row_chunk(h0: tl.constexpr, HC: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    heads = h0 + tl.arange(0, HC)
    offs = heads[:, None] * D + tl.arange(0, D)[None, :]
    return offs, heads[:, None] < H


@triton.jit
def _sum_of_squares(x_ptr, h0: tl.constexpr, HC: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    offs, mask = _row_chunk(h0, HC, H, D)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return tl.sum(tl.sum(x * x, 1), 0)


@triton.jit
def _normed_rotated(x_ptr, w_ptr, out_ptr, cos, sin, rstd, h0: tl.constexpr, HC: tl.constexpr, H: tl.constexpr,
                    D: tl.constexpr, ROUND_PRODUCTS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    offs, mask = _row_chunk(h0, HC, H, D)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # rms_norm's output, rounded to the model's dtype before the rotation reads it.
    y = to_low_precision(x * rstd * w, out_ptr.dtype.element_ty, SOFT_ROUND).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(y, (HC, D // 2, 2)))
    if ROUND_PRODUCTS:  # angles in the model's dtype: eager rounds every product and sum to it
        DT: tl.constexpr = out_ptr.dtype.element_ty
        o1 = (to_low_precision(x1 * cos[None, :], DT, SOFT_ROUND).to(tl.float32)
              - to_low_precision(x2 * sin[None, :], DT, SOFT_ROUND).to(tl.float32))
        o2 = (to_low_precision(x1 * sin[None, :], DT, SOFT_ROUND).to(tl.float32)
              + to_low_precision(x2 * cos[None, :], DT, SOFT_ROUND).to(tl.float32))
    else:  # float32 angles: the products and sums in float32, rounded once
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x1 * sin[None, :] + x2 * cos[None, :]
    o = tl.reshape(tl.join(o1, o2), (HC, D))
    tl.store(out_ptr + offs, to_low_precision(o, out_ptr.dtype.element_ty, SOFT_ROUND), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, stride_qb, stride_qs, stride_kb, stride_ks, wq_ptr, wk_ptr, cos_ptr, sin_ptr,
                         stride_fs, qo_ptr, ko_ptr, seq, eps, H: tl.constexpr, D: tl.constexpr, H0: tl.constexpr,
                         H1: tl.constexpr, ROUND_PRODUCTS: tl.constexpr, SOFT_ROUND: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    out_row = (batch * seq + token) * (H * D)
    if tl.program_id(2) == 0:
        x_ptr, w_ptr, out_ptr = q_ptr + batch * stride_qb + token * stride_qs, wq_ptr, qo_ptr + out_row
    else:
        x_ptr, w_ptr, out_ptr = k_ptr + batch * stride_kb + token * stride_ks, wk_ptr, ko_ptr + out_row
    ss = _sum_of_squares(x_ptr, 0, H0, H, D)
    if H1 > 0:
        ss += _sum_of_squares(x_ptr, H0, H1, H, D)
    rstd = tl.math.rsqrt(ss / (H * D) + eps)
    pairs = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + token * stride_fs + 2 * pairs).to(tl.float32)  # pair i's angle: channels 2i, 2i + 1
    sin = tl.load(sin_ptr + token * stride_fs + 2 * pairs + 1).to(tl.float32)
    _normed_rotated(x_ptr, w_ptr, out_ptr, cos, sin, rstd, 0, H0, H, D, ROUND_PRODUCTS, SOFT_ROUND)
    if H1 > 0:
        _normed_rotated(x_ptr, w_ptr, out_ptr, cos, sin, rstd, H0, H1, H, D, ROUND_PRODUCTS, SOFT_ROUND)


def head_chunks(heads: int) -> tuple[int, int]:
    """The two power-of-two chunks a row of `heads` heads is held in: the largest power of two not
    above `heads`, and the smallest covering the rest (0 if none): 40 -> (32, 8), 12 -> (8, 4)."""
    first = 1 << (heads.bit_length() - 1)
    rest = heads - first
    return first, (0 if rest == 0 else 1 << (rest - 1).bit_length())


def unsupported_reason(query, key, weight_q, weight_k, freqs_cos, freqs_sin, heads: int) -> str | None:
    """Why :func:`qk_norm_rope` cannot take these arguments, or None."""
    if query.dim() != 3 or key.shape != query.shape:
        return f"query and key must be (B, S, H*D) of one shape, got {tuple(query.shape)} and {tuple(key.shape)}"
    if heads <= 0 or query.shape[-1] % heads:
        return f"{query.shape[-1]} channels do not split into {heads} heads"
    d = query.shape[-1] // heads
    if d < 16 or d > 256 or d & (d - 1):
        return f"head dim {d} is not a power of two in [16, 256]"
    if query.dtype not in (torch.bfloat16, torch.float16) or key.dtype != query.dtype:
        return f"query/key dtype {query.dtype}/{key.dtype}; expected both bfloat16 or both float16"
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        return "query and key need unit stride along channels"
    for name, w in (("weight_q", weight_q), ("weight_k", weight_k)):
        if w.shape != (query.shape[-1],) or not w.is_contiguous():
            return f"{name} must be a contiguous ({query.shape[-1]},) tensor"
    seq = query.shape[1]
    for name, f in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if f.dim() != 4 or tuple(f.shape) != (1, seq, 1, d):
            return f"{name} must be (1, {seq}, 1, {d}) (one row of angles per token), got {tuple(f.shape)}"
        if f.dtype not in (torch.float32, query.dtype) or f.stride(-1) != 1:
            return (f"{name} must be float32 or {query.dtype} with one row of {d} per token, got {tuple(f.shape)} "
                    f"{f.dtype}")
    if freqs_cos.dtype != freqs_sin.dtype:
        return f"freqs_cos is {freqs_cos.dtype} and freqs_sin {freqs_sin.dtype}"
    if len({t.device for t in (query, key, weight_q, weight_k, freqs_cos, freqs_sin)}) != 1:
        return "all tensors must be on one device"
    return None


_LAUNCH = Relaunch(_qk_norm_rope_kernel)


def qk_norm_rope(query, key, weight_q, weight_k, eps: float, freqs_cos, freqs_sin, heads: int):
    """RMSNorm of each (B, S) row of `query` and `key` over all its channels, times the weights,
    then each head's channel pairs rotated by the token's angles. Returns the rotated (B, S, H, D)
    query and key (new contiguous tensors). `freqs_cos` / `freqs_sin` are Wan's ``(1, S, 1, D)``
    angles (each pair's cosine at channels 2i and 2i + 1), float32 or the query's dtype (a model
    cast with ``.to(dtype)`` casts its rotary buffers too), rounded as eager PyTorch rounds either.
    Raises ValueError naming what :func:`unsupported_reason` finds wrong."""
    reason = unsupported_reason(query, key, weight_q, weight_k, freqs_cos, freqs_sin, heads)
    if reason is not None:
        raise ValueError(f"qk_norm_rope: {reason}")
    return launch(query, key, weight_q, weight_k, eps, freqs_cos, freqs_sin, heads)


def launch(query, key, weight_q, weight_k, eps: float, freqs_cos, freqs_sin, heads: int):
    """:func:`qk_norm_rope` for arguments :func:`unsupported_reason` has accepted (not checked again)."""
    b, s, n = query.shape
    d = n // heads
    h0, h1 = head_chunks(heads)
    q_out = torch.empty(b, s, heads, d, dtype=query.dtype, device=query.device)
    k_out = torch.empty_like(q_out)
    cos, sin = freqs_cos.reshape(s, d), freqs_sin.reshape(s, d)
    if cos.stride(0) != sin.stride(0):  # the kernel takes one row stride for both
        sin = sin.contiguous()
        cos = cos.contiguous()
    # Two warps for rows of up to 16 heads of 128, four above (NOTES v28 (d): 0.148 against 0.206
    # ms at Wan2.1-1.3B's 12 heads, 0.873 against 0.919 at Wan2.1-14B's 40).
    num_warps = 2 if n <= 2048 else 4
    # With angles in the model's dtype eager rounds each product and each sum to it. Compiled with
    # FP fusion, LLVM folds one product's round trip through bf16 and the sum into one fma.rn.bf16
    # (two roundings where eager has three), and on an H100 a quarter of the outputs were a step
    # or more off eager's (NOTES v46): that build compiles without FP fusion.
    round_products = cos.dtype != torch.float32
    _LAUNCH[(s, b, 2)](query, key, query.stride(0), query.stride(1), key.stride(0), key.stride(1), weight_q, weight_k,
                       cos, sin, cos.stride(0), q_out, k_out, s, float(eps), H=heads, D=d, H0=h0, H1=h1,
                       ROUND_PRODUCTS=round_products, SOFT_ROUND=IN_INTERPRETER, num_warps=num_warps,
                       enable_fp_fusion=not round_products)
    return q_out, k_out
