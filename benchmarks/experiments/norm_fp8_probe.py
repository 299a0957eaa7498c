"""Experiment: Wan's LayerNorm + modulation + per-row FP8 scaling in one pass, against inductor's.

NOTES v29 (b) lists three inductor reductions at 1.22-1.55 ms a Wan2.1-14B block: the block's
``(norm(x.float()) * (1 + scale) + shift).type_as(x)`` followed by torchao's dynamic per-row
e4m3 scaling of the next FP8 linear layer's input, a loop that reads the row once per reduction
and once to write. This probe times, on the real widths and in one process:

* ``inductor``: that code and an FP8 linear layer of torchao (float8 dynamic activation, per-row
  weight) compiled together with the recipe's inductor options;
* ``one_pass``: a Triton kernel that reads each row once (the LayerNorm's statistics, the
  modulation, the bf16 rounding, the row's max and the e4m3 values from registers), then the
  ``torch._scaled_mm`` call torchao makes with the layer's FP8 weight;

and how often their outputs agree. ``--check`` runs the kernel in Triton's interpreter on small
rows against PyTorch (CPU).

    python benchmarks/experiments/norm_fp8_probe.py --out probe.json
    TRITON_INTERPRET=1 python benchmarks/experiments/norm_fp8_probe.py --check
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from fsattn_diffusers.kernels.gelu_fp8 import row_parts  # noqa: E402
from fsattn_diffusers.kernels.lowp import IN_INTERPRETER, to_low_precision  # noqa: E402

SHAPES = {  # rows, width, output features of the QKV and feed-forward up projections
    "wan14b": (75600, 5120, (15360, 13824)),
    "wan13b": (32760, 1536, (4608, 8960)),
}


@triton.jit
def _load(x_ptr, row, stride, start, n, SIZE: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    return tl.load(x_ptr + row * stride + cols, mask=cols < n, other=0.0).to(tl.float32)


@triton.jit
def _modulated(x, mean, rstd, s_ptr, t_ptr, batch, start, n, SIZE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    scale = tl.load(s_ptr + batch * n + cols, mask=cols < n, other=0.0)
    shift = tl.load(t_ptr + batch * n + cols, mask=cols < n, other=0.0)
    y = (x - mean) * rstd * (1.0 + scale) + shift
    y = tl.where(cols < n, y, 0.0)
    return to_low_precision(y, tl.bfloat16, SOFT_ROUND).to(tl.float32)


@triton.jit
def _store(q_ptr, row, n, y, inv, start, SIZE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    q = tl.minimum(tl.maximum(y * inv, -448.0), 448.0)
    tl.store(q_ptr + row * n + cols, to_low_precision(q, tl.float8e4nv, SOFT_ROUND), mask=cols < n)


@triton.jit
def _norm_modulate_fp8_kernel(x_ptr, s_ptr, t_ptr, q_ptr, qs_ptr, n, x_stride, rows_per_batch, eps,
                              PART_A: tl.constexpr, PART_B: tl.constexpr, SOFT_ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    batch = row // rows_per_batch
    x_a = _load(x_ptr, row, x_stride, 0, n, PART_A)
    total = tl.sum(x_a, axis=0)
    if PART_B > 0:
        x_b = _load(x_ptr, row, x_stride, PART_A, n, PART_B)
        total += tl.sum(x_b, axis=0)
    mean = total / n
    cols_a = tl.arange(0, PART_A)
    d_a = tl.where(cols_a < n, x_a - mean, 0.0)
    var = tl.sum(d_a * d_a, axis=0)
    if PART_B > 0:
        cols_b = PART_A + tl.arange(0, PART_B)
        d_b = tl.where(cols_b < n, x_b - mean, 0.0)
        var += tl.sum(d_b * d_b, axis=0)
    rstd = 1.0 / tl.sqrt(var / n + eps)
    y_a = _modulated(x_a, mean, rstd, s_ptr, t_ptr, batch, 0, n, PART_A, SOFT_ROUND)
    amax = tl.max(tl.abs(y_a), axis=0)
    if PART_B > 0:
        y_b = _modulated(x_b, mean, rstd, s_ptr, t_ptr, batch, PART_A, n, PART_B, SOFT_ROUND)
        amax = tl.maximum(amax, tl.max(tl.abs(y_b), axis=0))
    inv = tl.where(amax > 0, 448.0 / tl.maximum(amax, 1e-30), 0.0)
    _store(q_ptr, row, n, y_a, inv, 0, PART_A, SOFT_ROUND)
    if PART_B > 0:
        _store(q_ptr, row, n, y_b, inv, PART_A, PART_B, SOFT_ROUND)
    tl.store(qs_ptr + row, amax / 448.0)


def one_pass(x, scale, shift, eps, num_warps):
    """x (B, S, C) bf16; scale, shift (B, 1, C) fp32 -> q (B*S, C) e4m3, per-row scales (B*S, 1)."""
    b, s, c = x.shape
    rows = x.reshape(b * s, c)
    part_a, part_b, part_c = row_parts(c)
    assert part_c == 0, "two parts at most in this probe"
    q = torch.empty((b * s, c), dtype=torch.float8_e4m3fn, device=x.device)
    qs = torch.empty((b * s, 1), dtype=torch.float32, device=x.device)
    _norm_modulate_fp8_kernel[(b * s,)](rows, scale.contiguous(), shift.contiguous(), q, qs, c, rows.stride(0), s,
                                        eps, PART_A=part_a, PART_B=part_b, SOFT_ROUND=IN_INTERPRETER,
                                        num_warps=num_warps)
    return q, qs


def torch_rows(x, scale, shift, eps):
    """What the model and torchao compute, in PyTorch (the scale as inductor keeps it, fp32)."""
    c = x.shape[-1]
    y = (torch.nn.functional.layer_norm(x.float(), (c,), eps=eps) * (1 + scale) + shift).to(x.dtype)
    y = y.reshape(-1, c).float()
    amax = y.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 448.0 / amax, torch.zeros_like(amax))
    return (y * inv).clamp(-448, 448).to(torch.float8_e4m3fn), amax / 448.0


def check() -> None:
    torch.manual_seed(0)
    worst = 0.0
    for b, s, c in ((1, 7, 1536), (2, 5, 640), (1, 3, 5120), (1, 4, 300)):
        x = (torch.randn(b, s, c) * 3 + 0.5).to(torch.bfloat16)
        scale, shift = torch.randn(b, 1, c) * 0.1, torch.randn(b, 1, c) * 0.1
        q, qs = one_pass(x, scale, shift, 1e-6, 4)
        rq, rqs = torch_rows(x, scale, shift, 1e-6)
        rel = float(((qs - rqs).abs() / rqs).max())
        codes, ref_codes = q.view(torch.uint8).int(), rq.view(torch.uint8).int()
        steps = int((codes - ref_codes).abs().max())  # same sign: neighbouring codes are one e4m3 step apart
        same = float((codes == ref_codes).float().mean())
        worst = max(worst, rel)
        print(f"B={b} S={s} C={c}: scales rel {rel:.2e}, e4m3 equal {same:.4f}, largest difference {steps} step(s)")
        assert rel < 1e-2 and same > 0.95 and steps <= 1
    print("check passed")


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernel_times(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.name[:90]] = rows.get(e.name[:90], 0.0) + e.device_time / 5e3
    return {k: round(v, 4) for k, v in sorted(rows.items(), key=lambda kv: -kv[1])}


def bench(out_path) -> None:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    from fsattn_diffusers import recipe

    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shapes": []}
    for name, (rows, c, outs) in SHAPES.items():
        torch.manual_seed(0)
        x = (torch.randn(1, rows, c, device=device) * 2).to(torch.bfloat16)
        scale = torch.randn(1, 1, c, device=device) * 0.1
        shift = torch.randn(1, 1, c, device=device) * 0.1
        for n_out in outs:
            layer = torch.nn.Linear(c, n_out, device=device, dtype=torch.bfloat16)
            quantize_(layer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))
            w = layer.weight

            def model_code(x, scale, shift):
                return layer((torch.nn.functional.layer_norm(x.float(), (c,), eps=1e-6) * (1 + scale) + shift).type_as(x))

            compiled = torch.compile(model_code, fullgraph=True, options=dict(recipe.INDUCTOR_OPTIONS))
            entry = {"shape": name, "rows": rows, "width": c, "out_features": n_out}
            with torch.no_grad():
                ref = compiled(x, scale, shift)
                entry["inductor_ms"] = timed(lambda: compiled(x, scale, shift))
                entry["inductor_kernels_ms"] = kernel_times(lambda: compiled(x, scale, shift))
                for warps in (4, 8, 16):
                    def ours(warps=warps):
                        q, qs = one_pass(x, scale, shift, 1e-6, warps)
                        return torch._scaled_mm(q, w.qdata.t(), scale_a=qs, scale_b=w.scale.t(), bias=layer.bias,
                                                out_dtype=torch.bfloat16,
                                                use_fast_accum=bool(w.mm_config.use_fast_accum)).view(1, rows, n_out)
                    got = ours()
                    entry[f"one_pass_{warps}w_ms"] = timed(ours)
                    entry[f"one_pass_{warps}w_pass_only_ms"] = timed(lambda: one_pass(x, scale, shift, 1e-6, warps))
                    entry[f"one_pass_{warps}w_equal_outputs"] = float((got == ref).float().mean())
                    entry[f"one_pass_{warps}w_cos"] = float(torch.nn.functional.cosine_similarity(
                        got.float().flatten(), ref.float().flatten(), dim=0))
                entry["one_pass_kernels_ms"] = kernel_times(ours)
            print(json.dumps(entry))
            result["shapes"].append(entry)
            if out_path:
                Path(out_path).write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="interpreter against PyTorch on small rows (CPU)")
    parser.add_argument("--out")
    args = parser.parse_args()
    check() if args.check else bench(args.out)


if __name__ == "__main__":
    main()
