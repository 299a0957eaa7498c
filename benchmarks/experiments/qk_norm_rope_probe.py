"""Experiment: Wan's query/key RMSNorm (across heads) and RoPE in one pass, against inductor's kernel.

In a Wan2.1-14B recipe forward inductor's fused RMSNorm + RoPE of Q and K took 3.1 ms a block
(0.125 s a forward, ~1 TB/s; NOTES v17 (e)). This probe times, at the Wan shapes, what the recipe
compiles today (diffusers' WanAttnProcessor code from the fused QKV projection's output to the
rotated Q and K, under torch.compile with the recipe's inductor options) against a hand-written
Triton kernel that reads each token's Q (or K) row once, takes the RMS over every head, applies
the weight and the rotation, and writes the (S, H, D) result; and reports how many output values
differ from the compiled code's, and by how much.

    python benchmarks/experiments/qk_norm_rope_probe.py --out qk.json          # GPU
    TRITON_INTERPRET=1 python benchmarks/experiments/qk_norm_rope_probe.py --check   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

SHAPES = {"wan14b_720p": (75600, 40), "wan13b_480p": (32760, 12)}  # tokens, heads (head dim 128)


@triton.jit
def _chunk_sumsq(x_ptr, h0: tl.constexpr, HC: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    heads = h0 + tl.arange(0, HC)
    offs = heads[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs, mask=heads[:, None] < H, other=0.0).to(tl.float32)
    return tl.sum(tl.sum(x * x, 1), 0)


@triton.jit
def _chunk_out(x_ptr, w_ptr, out_ptr, cos, sin, rstd, h0: tl.constexpr, HC: tl.constexpr, H: tl.constexpr,
               D: tl.constexpr):
    heads = h0 + tl.arange(0, HC)
    offs = heads[:, None] * D + tl.arange(0, D)[None, :]
    mask = heads[:, None] < H
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * w).to(tl.bfloat16).to(tl.float32)  # RMSNorm's bf16 output
    x1, x2 = tl.split(tl.reshape(y, (HC, D // 2, 2)))
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x1 * sin[None, :] + x2 * cos[None, :]
    o = tl.reshape(tl.join(o1, o2), (HC, D))
    tl.store(out_ptr + offs, o.to(tl.bfloat16), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, stride_q, stride_k, wq_ptr, wk_ptr, cos_ptr, sin_ptr, stride_f, qo_ptr, ko_ptr,
                         eps, H: tl.constexpr, D: tl.constexpr, H0: tl.constexpr, H1: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        x_ptr, w_ptr, out_ptr = q_ptr + row * stride_q, wq_ptr, qo_ptr + row * (H * D)
    else:
        x_ptr, w_ptr, out_ptr = k_ptr + row * stride_k, wk_ptr, ko_ptr + row * (H * D)
    ss = _chunk_sumsq(x_ptr, 0, H0, H, D)
    if H1 > 0:
        ss += _chunk_sumsq(x_ptr, H0, H1, H, D)
    rstd = tl.math.rsqrt(ss / (H * D) + eps)
    pairs = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + row * stride_f + 2 * pairs)  # freqs_cos[..., 0::2]
    sin = tl.load(sin_ptr + row * stride_f + 2 * pairs + 1)  # freqs_sin[..., 1::2]
    _chunk_out(x_ptr, w_ptr, out_ptr, cos, sin, rstd, 0, H0, H, D)
    if H1 > 0:
        _chunk_out(x_ptr, w_ptr, out_ptr, cos, sin, rstd, H0, H1, H, D)


def qk_norm_rope(q, k, wq, wk, eps, freqs_cos, freqs_sin, heads, num_warps=4):
    """q, k: (1, S, H*D) bf16 with unit last stride (views of the fused projection); freqs: (1, S, 1, D)
    float32. Returns the rotated (1, S, H, D) Q and K."""
    b, s, n = q.shape
    d = n // heads
    h0 = 1 << (heads.bit_length() - 1)
    rest = heads - h0
    h1 = 0 if rest == 0 else 1 << (rest - 1).bit_length()
    qo = torch.empty(b, s, heads, d, dtype=q.dtype, device=q.device)
    ko = torch.empty_like(qo)
    fc, fs = freqs_cos.reshape(s, d), freqs_sin.reshape(s, d)
    _qk_norm_rope_kernel[(s, 2)](q, k, q.stride(1), k.stride(1), wq, wk, fc, fs, fc.stride(0), qo, ko, eps,
                                 H=heads, D=d, H0=h0, H1=h1, num_warps=num_warps)
    return qo, ko


def diffusers_norm_rope(q, k, norm_q, norm_k, freqs_cos, freqs_sin, heads):
    """WanAttnProcessor's code from the projections' output to the rotated Q and K (diffusers 0.42)."""
    query, key = norm_q(q), norm_k(k)
    query, key = query.unflatten(2, (heads, -1)), key.unflatten(2, (heads, -1))

    def apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):
        x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
        cos = freqs_cos[..., 0::2]
        sin = freqs_sin[..., 1::2]
        out = torch.empty_like(hidden_states)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out.type_as(hidden_states)

    return apply_rotary_emb(query, freqs_cos, freqs_sin), apply_rotary_emb(key, freqs_cos, freqs_sin)


def inputs(tokens, heads, device, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    n = heads * 128
    qkv = torch.randn(1, tokens, 3 * n, generator=g, device=device).to(torch.bfloat16)  # the fused GEMM's output
    q, k = qkv[..., :n], qkv[..., n:2 * n]
    norm_q = torch.nn.RMSNorm(n, eps=1e-6, device=device, dtype=torch.bfloat16)
    norm_k = torch.nn.RMSNorm(n, eps=1e-6, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm_q.weight.copy_(1 + 0.1 * torch.randn(n, generator=g, device=device))
        norm_k.weight.copy_(1 + 0.1 * torch.randn(n, generator=g, device=device))
    angles = torch.rand(tokens, 64, generator=g, device=device) * 6.28
    freqs_cos = angles.cos().repeat_interleave(2, -1).reshape(1, tokens, 1, 128)
    freqs_sin = angles.sin().repeat_interleave(2, -1).reshape(1, tokens, 1, 128)
    return q, k, norm_q, norm_k, freqs_cos, freqs_sin


def compare(a, b) -> dict:
    a, b = a.detach().float(), b.detach().float()
    diff = (a - b).abs()
    return {"equal_fraction": float((a == b).float().mean()), "max_abs_diff": float(diff.max()),
            "within_one_ulp": float((diff <= b.abs() * 2.0 ** -7 + 1e-30).float().mean()),
            "max_rel_diff": float((diff / b.abs().clamp_min(1e-3)).max())}


def check():
    """Interpreter check at a tiny shape against eager diffusers code. Triton's interpreter converts
    float32 to bfloat16 by truncation, not to nearest, so expect one-ulp differences here (0.0078
    relative); the GPU run compares rounded values."""
    for tokens, heads in ((5, 3), (4, 4), (3, 12)):
        q, k, nq, nk, fc, fs = inputs(tokens, heads, "cpu")
        ref_q, ref_k = diffusers_norm_rope(q, k, nq, nk, fc, fs, heads)
        out_q, out_k = qk_norm_rope(q, k, nq.weight, nk.weight, 1e-6, fc, fs, heads)
        print(tokens, heads, compare(out_q, ref_q), compare(out_k, ref_k))


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.check:
        return check()
    from fsattn_diffusers.recipe import INDUCTOR_OPTIONS

    report = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "inductor_options": INDUCTOR_OPTIONS, "shapes": {}}
    compiled = torch.compile(diffusers_norm_rope, fullgraph=True, options=dict(INDUCTOR_OPTIONS))
    with torch.no_grad():
        for name, (tokens, heads) in SHAPES.items():
            q, k, nq, nk, fc, fs = inputs(tokens, heads, "cuda")
            ref_q, ref_k = compiled(q, k, nq, nk, fc, fs, heads)
            eager_q, eager_k = diffusers_norm_rope(q, k, nq, nk, fc, fs, heads)
            row = {"bytes_min": 4 * tokens * heads * 128 * 2}
            for warps in (2, 4, 8):
                out_q, out_k = qk_norm_rope(q, k, nq.weight, nk.weight, nq.eps, fc, fs, heads, warps)
                row[f"kernel_w{warps}_ms"] = timed(lambda: qk_norm_rope(q, k, nq.weight, nk.weight, nq.eps, fc, fs,
                                                                       heads, warps))
                row[f"kernel_w{warps}_vs_compiled"] = [compare(out_q, ref_q), compare(out_k, ref_k)]
            row["kernel_vs_eager"] = [compare(out_q, eager_q), compare(out_k, eager_k)]
            row["compiled_vs_eager"] = [compare(ref_q, eager_q), compare(ref_k, eager_k)]
            row["compiled_ms"] = timed(lambda: compiled(q, k, nq, nk, fc, fs, heads))
            row["eager_ms"] = timed(lambda: diffusers_norm_rope(q, k, nq, nk, fc, fs, heads), 5)
            report["shapes"][name] = row
            print(name, json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
