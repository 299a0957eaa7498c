"""Experiment (NOTES v44 (d)): how much of a warp-specialised forward is its tail, the stretch at the
end where SMs have run out of programs while others still finish theirs.

All programs of a call do the same work (every key tile for 128 or 192 query rows), one program per
SM at a time, so a call of P programs on N SMs runs in about ceil(P / N) "waves" when they keep in
step; at Wan2.1-1.3B 480p (3,072 programs, 23.3 waves on 132 SMs) the last wave is 27 % full, which in
lockstep leaves ~3 % of the call's SM time idle (Wan2.1-14B 0.5 %, HunyuanVideo 0.4 %, head dim 64
0.5 %, 16,384 tokens 3 %). Programs do not keep in step over many waves, so how much of that is real
decides whether splitting the last programs' keys over the idle SMs (and merging by LSE) is worth
building. This probe measures it.

A copy of the package's kernel module (kernels/_ws_tail_clocked.py, written by this script) records,
per program, its SM (%smid), its start (%globaltimer, before the partitions fork) and each consumer's
end (after its epilogue's stores) into a buffer the launch passes last. `fsattn()` runs with the copy
(plan.gluon_module patched, as commit b4fe700's benchmarks/experiments/ws_variant_probe.py did),
and with the package's kernel for the instrumentation's cost.

    python3 benchmarks/experiments/tail_wave_probe.py --out $OUT/tail.json [--shapes ...] [--calls 3]
    python3 benchmarks/experiments/tail_wave_probe.py --compile-check   # CPU: patches apply, sm_90a build

Per shape and call: SMs used, programs, programs per SM (min / max), program time (p10 / p50 / p90),
the call's span (first start to last end), and the tail: idle SM time after each SM's last program,
as a share of all SM time in the span, beside the lockstep model's figure.
"""

import argparse
import importlib
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import fsattn_diffusers.kernels as kernels_pkg  # noqa: E402
from fsattn_diffusers import fsattn, ops, plan  # noqa: E402
from bench_attention import make_inputs  # noqa: E402
from shapes import SHAPES, SWEEP  # noqa: E402

COPY = "_ws_tail_clocked"
SLOTS = 5  # per program: SM, start, each consumer's end (up to three; ns; -1 where not written)

# (anchor, replacement) pairs applied to the kernel module's text, each anchor found exactly once.
PATCHES = [
    # The kernel takes the buffer last among its runtime arguments ...
    ("    stride_ob, stride_os, stride_oh,\n    BLOCK_N: gl.constexpr,",
     "    stride_ob, stride_os, stride_oh, clock_ptr,\n    BLOCK_N: gl.constexpr,"),
    # ... records its SM and start before the partitions fork ...
    ("    row0 = pid_m * BLOCK_M\n",
     "    row0 = pid_m * BLOCK_M\n"
     "    prog = (b * n_q_heads + h) * gl.num_programs(0) + pid_m\n"
     "    gl.store(clock_ptr + prog * 5, _special_asm(_SMID_ASM, pid_m))\n"
     "    gl.store(clock_ptr + prog * 5 + 1, _special_asm(_TIMER_ASM, pid_m))\n"),
    # ... and hands each consumer the buffer and its program's index,
    ("q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os,\n"
     "                     stride_oh, N_CONSUMERS)",
     "q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os,\n"
     "                     stride_oh, clock_ptr, prog, N_CONSUMERS)"),
    ("q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os, stride_oh,\n"
     "              N_CONSUMERS: gl.constexpr):",
     "q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os, stride_oh,\n"
     "              clock_ptr, prog, N_CONSUMERS: gl.constexpr):"),
    # which records its end after the epilogue (the consumer's last call).
    ("              b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh, SPEC_OFFSET if SPECULATIVE else 8.0)\n",
     "              b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh, SPEC_OFFSET if SPECULATIVE else 8.0)\n"
     "    gl.store(clock_ptr + prog * 5 + 2 + c, _special_asm(_TIMER_ASM, my_row))\n"),
    # The launch passes the buffer the probe set.
    ("        self._launch(*args[:4], ks_desc, *args[4:], stream=stream)",
     "        self._launch(*args[:4], ks_desc, *args[4:], CLOCK_BUFFER[0], stream=stream)"),
    # The special registers, read once per thread (every thread stores the same value).
    ("CONSUMER_REGS = {2: 240, 3: 160}\n",
     "CONSUMER_REGS = {2: 240, 3: 160}\n"
     "CLOCK_BUFFER = [None]\n"
     "_SMID_ASM = gl.constexpr('mov.u32 $0, %smid;')\n"
     "_TIMER_ASM = gl.constexpr('mov.u64 $0, %globaltimer;')\n\n\n"
     "@gluon.jit\n"
     "def _special_asm(asm: gl.constexpr, any_scalar):\n"
     "    if asm == _SMID_ASM:\n"
     "        value = gl.inline_asm_elementwise(asm, '=r,r', [any_scalar], dtype=gl.int32, is_pure=False,\n"
     "                                          pack=1).to(gl.int64)\n"
     "    else:\n"
     "        value = gl.inline_asm_elementwise(asm, '=l,r', [any_scalar], dtype=gl.int64, is_pure=False, pack=1)\n"
     "    return value\n"),
]


def write_copy():
    """The clocked copy of the kernel module, imported as kernels._ws_tail_clocked."""
    folder = kernels_pkg.__path__[0]
    with open(os.path.join(folder, "fsattn_fwd_gluon_ws.py")) as f:
        text = f.read()
    for anchor, replacement in PATCHES:
        if text.count(anchor) != 1:
            raise SystemExit(f"the kernel module moved: anchor found {text.count(anchor)} times:\n{anchor}")
        text = text.replace(anchor, replacement)
    with open(os.path.join(folder, COPY + ".py"), "w") as f:
        f.write(text)
    module = importlib.import_module(f"fsattn_diffusers.kernels.{COPY}")
    return importlib.reload(module)


_real_gluon_module = plan.gluon_module


def use(module):
    """fsattn() with `module` as the warp-specialised kernel (None: the package's)."""
    plan.gluon_module = _real_gluon_module if module is None else (
        lambda name: module if name == "fsattn_fwd_gluon_ws" else _real_gluon_module(name))
    plan._plan.cache_clear()
    ops._prepared_calls.clear()


def tail_of(buffer, n_sms_device):
    """The figures of one call's clock buffer (rows of programs that ran)."""
    rows = buffer[buffer[:, 1] >= 0].cpu()
    sm, start = rows[:, 0], rows[:, 1]
    end = rows[:, 2:].amax(1)
    t0, t1 = int(start.min()), int(end.max())
    span = t1 - t0
    sms = sorted(set(sm.tolist()))
    last_end = torch.tensor([int(end[sm == s].max()) for s in sms])
    per_sm = torch.tensor([int((sm == s).sum()) for s in sms])
    duration = (end - start).double()
    programs = rows.shape[0]
    waves = programs / len(sms)
    lockstep = (math.ceil(waves) - waves) / math.ceil(waves)
    return {"sms": len(sms), "device_sms": n_sms_device, "programs": programs,
            "programs_per_sm": [int(per_sm.min()), int(per_sm.max())],
            "program_us_p10_p50_p90": [float(duration.quantile(p)) / 1e3 for p in (0.1, 0.5, 0.9)],
            "span_ms": span / 1e6,
            "tail_idle_share": float((t1 - last_end).double().sum() / (len(sms) * span)),
            "first_sm_done_before_end_ms": (t1 - int(last_end.min())) / 1e6,
            "lockstep_idle_share": lockstep}


def measure(shapes, calls, out):
    """Each shape's rows, the report written to `out` after each (a call cut short keeps what ran)."""
    from triton.testing import do_bench
    clocked = write_copy()
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": importlib.import_module("triton").__version__, "results": []}
    for name in shapes:
        shape = SHAPES.get(name) or SWEEP[name]
        q, k, v, mask = make_inputs(shape, seed=0)
        slots = shape.batch * shape.heads * math.ceil(shape.seq_q / 64) * SLOTS
        clocked.CLOCK_BUFFER[0] = torch.full((slots,), -1, dtype=torch.int64, device="cuda")
        row = {"shape": name, "calls": []}
        use(clocked)
        for _ in range(2):  # compile and warm up
            fsattn(q, k, v, attn_mask=mask)
        for _ in range(calls):
            clocked.CLOCK_BUFFER[0].fill_(-1)
            fsattn(q, k, v, attn_mask=mask)
            torch.cuda.synchronize()
            row["calls"].append(tail_of(clocked.CLOCK_BUFFER[0].view(-1, SLOTS), n_sms))
        row["clocked_ms"] = do_bench(lambda: fsattn(q, k, v, attn_mask=mask), warmup=200, rep=1000)
        use(None)
        row["package_ms"] = do_bench(lambda: fsattn(q, k, v, attn_mask=mask), warmup=200, rep=1000)
        print(json.dumps(row), flush=True)
        report["results"].append(row)
        if out:
            with open(out, "w") as f:
                json.dump(report, f, indent=1)


def compile_check():
    """CPU: the patches apply and the copy builds for sm_90a with sorted keys (the long-call path)."""
    import compile_check as cc
    from sass_loop import describe
    from fsattn_diffusers.kernels import quantize
    clocked = write_copy()
    for head_dim in (128, 64):
        q, k, v, out, lse = cc._attention_inputs(head_dim)
        clocked.CLOCK_BUFFER[0] = torch.full((8192,), -1, dtype=torch.int64)
        with cc.sm90_builds() as builds:
            kv = quantize.quantize_kv(k, v, None, block_n=128, d_pad=head_dim, pv_key_order="wgmma",
                                      k_per_token=head_dim < 128, sort_keys=head_dim == 128)
            clocked.fsattn_fwd_gluon_ws(q, kv, out, lse, sm_scale=head_dim ** -0.5)
        build = [b for b in builds if b.kernel == "_fsattn_fwd_gluon_ws_kernel"][0]
        print(f"head dim {head_dim}: regs {build.regs} spill {build.spill} serialised {build.wgmma_serialized}; "
              f"globaltimer reads {build.ptx.count('%globaltimer')}, smid reads {build.ptx.count('%smid')}")
        print(describe(build.compiled.asm["cubin"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+",
                        default=["wan13b_480p", "seq_16384", "cogvideox_d64", "wan14b_720p", "hunyuan_720p"])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile-check", action="store_true")
    args = parser.parse_args()
    try:
        if args.compile_check:
            compile_check()
            return
        measure(args.shapes, args.calls, args.out)
    finally:
        copy = os.path.join(kernels_pkg.__path__[0], COPY + ".py")
        if os.path.exists(copy):
            os.remove(copy)


if __name__ == "__main__":
    main()
