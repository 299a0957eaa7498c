"""Probe (NOTES v16 (a), next): one pass for the FFN's tanh-GELU and its per-row FP8 scaling.

In the recipe, inductor fuses the GELU of the FFN hidden with torchao's dynamic per-row FP8
scaling of the down projection's input into one looped reduction (1.09 ms a block at Wan2.1-1.3B,
~5x a single read and write). This kernel reads each row once, keeps it in registers (GELU,
rounded to bf16 as the model's output is, row |max|, scale = |max| / 448, clamp, e4m3) and writes
the FP8 row and its scale. The probe checks it against the same ops in torch and times both, the
torch ops compiled by inductor as the recipe compiles them:

    TRITON_INTERPRET=1 python benchmarks/experiments/gelu_fp8_probe.py --check      # CPU, small rows
    python benchmarks/experiments/gelu_fp8_probe.py --out gelu_fp8.json               # GPU: Wan 1.3B / 14B shapes
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

E4M3_MAX = 448.0


@triton.jit
def _gelu_tanh_fp8_rows(x_ptr, q_ptr, scale_ptr, n_cols, x_stride, q_stride, BLOCK: tl.constexpr,
                        LIBDEVICE_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    if LIBDEVICE_TANH:  # what inductor calls
        tanh = libdevice.tanh(inner)
    else:  # the interpreter has no libdevice
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    y = (0.5 * x * (1.0 + tanh)).to(tl.bfloat16).to(tl.float32)
    scale = tl.max(tl.abs(y), axis=0) / 448.0
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(q_ptr + row * q_stride + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + row, scale)


def gelu_fp8_rows(x: torch.Tensor):
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    _gelu_tanh_fp8_rows[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block,
                                 LIBDEVICE_TANH=os.environ.get("TRITON_INTERPRET") != "1",
                                 num_warps=min(16, max(4, block // 1024)))
    return q, scale


def reference(x: torch.Tensor):
    """What the recipe runs: the model's bf16 GELU, then torchao's per-row scaling (fp32 scale)."""
    y = torch.nn.functional.gelu(x, approximate="tanh")
    scale = y.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX
    q = (y.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def compare(x):
    q, s = gelu_fp8_rows(x)
    rq, rs = reference(x)
    scale_rel = ((s - rs).abs() / rs).max().item()
    q_equal = (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
    q_rel = ((q.float() * s - rq.float() * rs).norm() / (rq.float() * rs).norm()).item()
    # One e4m3 step at the reference value (2^-9 below the normal range): the interpreter's FP8
    # conversion does not round to nearest even as the GPU's cvt.rn.satfinite does.
    step = torch.exp2(torch.floor(torch.log2(rq.float().abs().clamp_min(2.0 ** -6))) - 3)
    within = ((q.float() - rq.float()).abs() <= step).float().mean().item()
    return {"scale_max_rel_diff": scale_rel, "fp8_bytes_equal": q_equal, "within_one_e4m3_step": within,
            "dequantized_rel_l2": q_rel}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="small rows, compare only (runs under the interpreter)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.check:
        for rows, cols in ((4, 96), (3, 200)):
            x = (torch.randn(rows, cols, generator=gen) * 3).to(torch.bfloat16)
            print((rows, cols), compare(x))
        return
    from triton.testing import do_bench

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    compiled = torch.compile(reference, fullgraph=True)
    for name, (rows, cols) in {"wan13b_ffn": (32760, 8960), "wan14b_ffn": (75600, 13824)}.items():
        x = (torch.randn(rows, cols, generator=gen) * 2).to("cuda", torch.bfloat16)
        floor_bytes = rows * cols * 3 + rows * 4  # bf16 read, fp8 write, scales
        row = {"check": compare(x)}
        for label, fn in (("inductor", compiled), ("one_pass", gelu_fp8_rows)):
            ms = do_bench(lambda: fn(x), warmup=50, rep=300)
            row[label] = {"ms": ms, "tb_per_s_at_floor_bytes": floor_bytes / ms / 1e9}
        row["inductor_check"] = {"fp8_bytes_equal_to_eager":
                                 (compiled(x)[0].view(torch.uint8) == reference(x)[0].view(torch.uint8))
                                 .float().mean().item()}
        results[name] = row
        print(name, json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
