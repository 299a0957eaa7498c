"""Which Hopper pipe each softmax instruction issues on, by throughput (benchmarks/NOTES.md v9 (a)).

    python benchmarks/pipe_probe.py --out benchmarks/results/x.json      # on the GPU
    python benchmarks/pipe_probe.py --sass [OP ...]                      # here: the SASS of each loop

Every thread runs independent dependency chains of one instruction (inline PTX, so the compiler
cannot fold them) long enough that latency hides; the rate per SM per clock takes FFMA as the
calibration (128 per clock per SM on sm_90). Pairs run both instructions in one loop: if the
pair's time is the sum of the two alone, they share a pipe; if it is the larger, they do not.
"""

import argparse
import collections
import json
import os

os.environ.pop("TRITON_INTERPRET", None)  # --sass compiles for sm_90a, which the interpreter cannot

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sass_loop import sass_of

# name -> (PTX with $0 = result, $1 = the previous value; operand type)
OPS = {
    "ffma": ("fma.rn.f32 $0, $1, 0f3F7FFFF0, 0f33800000;", "f32"),
    "fmul": ("mul.rn.f32 $0, $1, 0f3F7FFFF0;", "f32"),
    # x -> 2^-x stays in (0.5, 1): the chain never reaches inf or denormals, whose timing may differ.
    "ex2": ("{ .reg .f32 t; neg.f32 t, $1; ex2.approx.ftz.f32 $0, t; }", "f32"),
    "ex2_f16x2": ("ex2.approx.f16x2 $0, $1;", "i32"),
    "ex2_bf16x2": ("ex2.approx.ftz.bf16x2 $0, $1;", "i32"),
    "i2f": ("{ .reg .f32 t; cvt.rn.f32.s32 t, $1; mov.b32 $0, t; }", "i32"),
    "f2fp_e4m3": ("{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, $1, $1; mov.b32 $0, {h, h}; }", "f32"),
    "f2fp_bf16": ("cvt.rn.bf16x2.f32 $0, $1, $1;", "f32"),
    "fmnmx": ("max.f32 $0, $1, 0f3F000000;", "f32"),
}
PAIRS = [("ex2", "i2f"), ("ex2", "f2fp_e4m3"), ("ex2", "ffma"), ("i2f", "f2fp_e4m3"),
         ("ex2", "fmnmx")]
CHAINS = 8      # independent chains per thread and instruction
INNER = 8       # unrolled steps per loop iteration


@triton.jit
def _chains_kernel(x_ptr, y_ptr, n_iter, BLOCK: tl.constexpr, ASM_A: tl.constexpr, ASM_B: tl.constexpr,
                   INNER: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(x_ptr + offs)
    b = tl.load(y_ptr + offs)
    for _ in range(n_iter):
        for _u in tl.static_range(INNER):
            a = tl.inline_asm_elementwise(ASM_A, "=r,r", [a], dtype=a.dtype, is_pure=True, pack=1)
            if ASM_B != "":
                b = tl.inline_asm_elementwise(ASM_B, "=r,r", [b], dtype=b.dtype, is_pure=True, pack=1)
    tl.store(x_ptr + offs, a)
    tl.store(y_ptr + offs, b)


def _inputs(op, n):
    if op is None or OPS[op][1] == "f32":
        return torch.rand(n, device="cuda") * 0.5 + 0.25
    return torch.randint(-1000, 1000, (n,), device="cuda", dtype=torch.int32)


def measure(op_a, op_b, n_iter=4096, warps=16, ctas_per_sm=2):
    """Milliseconds, and thread-instructions of each kind per ns per SM. Two programs of 16 warps
    per SM (32 warps, 8 per scheduler) x 8 independent chains hide every latency, so the time is
    the pipe's throughput."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = warps * 32 * CHAINS
    n = block * sms * ctas_per_sm
    x, y = _inputs(op_a, n), _inputs(op_b, n)
    run = lambda: _chains_kernel[(sms * ctas_per_sm,)](x, y, n_iter, BLOCK=block, ASM_A=OPS[op_a][0],
                                                      ASM_B=OPS[op_b][0] if op_b else "", INNER=INNER,
                                                      num_warps=warps)
    ms = triton.testing.do_bench(run, warmup=5, rep=200, return_mode="median")
    per_op = n * n_iter * INNER  # instructions of each kind, all threads
    return ms, per_op / (ms * 1e6) / sms  # thread-ops per ns per SM


def sass_opcodes(op: str) -> collections.Counter:
    """SASS opcodes of the probe kernel for `op` ("a" or "a+b"), compiled for sm_90a here (no GPU)."""
    a, _, b = op.partition("+")
    sig = {"x_ptr": "*fp32" if OPS[a][1] == "f32" else "*i32",
           "y_ptr": "*fp32" if not b or OPS[b][1] == "f32" else "*i32", "n_iter": "i32", "BLOCK": "constexpr",
           "ASM_A": "constexpr", "ASM_B": "constexpr", "INNER": "constexpr"}
    consts = {"BLOCK": 16 * 32 * CHAINS, "ASM_A": OPS[a][0], "ASM_B": OPS[b][0] if b else "", "INNER": INNER}
    # FP fusion stated: the default is Triton's to change (3.9 warns it turns off in 3.10).
    kernel = triton.compile(ASTSource(_chains_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 16, "enable_fp_fusion": True})
    out = sass_of(kernel.asm["cubin"])
    # The whole kernel's opcodes (the loop dominates); predicated instructions (the loop's exit
    # branch, bounds checks) are left out.
    ops = [ln.split("*/")[1].strip().split()[0] for ln in out.splitlines() if "*/" in ln and ";" in ln]
    return collections.Counter(o for o in ops if not o.startswith("@"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--sass", nargs="*", metavar="OP",
                        help="print the SASS opcodes of these probes (all without names) instead of timing")
    args = parser.parse_args()
    if args.sass is not None:
        for op in args.sass or list(OPS) + [f"{a}+{b}" for a, b in PAIRS]:
            print(json.dumps({"op": op, "opcodes": dict(sass_opcodes(op).most_common(6))}))
        return
    rows = []
    calib = None
    for op in list(OPS) + [f"{a}+{b}" for a, b in PAIRS]:
        a, _, b = op.partition("+")
        ms, rate = measure(a, b or None)
        if op == "ffma":
            calib = rate / 128.0  # GHz: FFMA issues 128 per clock per SM
        rows.append({"op": op, "ms": ms, "per_ns_per_sm": rate, "per_clk_per_sm": rate / calib})
        print(f"{op:18s} {ms:8.3f} ms  {rate / calib:6.1f} per clock per SM (each kind)", flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "clock_ghz_from_ffma": calib}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
