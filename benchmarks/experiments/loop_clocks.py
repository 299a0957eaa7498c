"""Experiment (NOTES v37 (b)): where a consumer warpgroup's tile period goes, read with %clock64 in a
copy of the warp-specialised kernel module (FILE; clocks around the loop's phases, summed per
program and consumer into a buffer): the softmax (scores landed to P converted), the wait for the
ring stage and the turn (and the ring stage's alone), the turn (and in it: the row-sum and P.V issue, the vote) (GEMM issue, vote, next score GEMM issue, hand-on), the wait for
P.V, and from there to the next tile's scores. Beside: `fsattn()` times of the package's kernel and
of the clocked copy (the clocks cost instructions and registers), one process.

    python3 benchmarks/experiments/loop_clocks.py --clocked FILE --out $OUT/clocks.json
"""

import argparse
import json
import os
import shutil

import torch

import fsattn_diffusers.kernels as kernels_pkg
from fsattn_diffusers import fsattn, ops, plan

SHAPES = {"wan14b_720p": (1, 40, 75600, 128), "wan13b_480p": (1, 12, 32760, 128),
          "cogvideox_d64": (2, 48, 17776, 64), "seq_16384": (1, 12, 16384, 128)}
PHASES = ("softmax", "ready_and_turn_wait", "turn", "pv_wait", "to_next_scores", "loop", "trips", "ready_wait",
          "turn_row_sum_and_pv_issue", "turn_vote")
_real = plan.gluon_module


def use(module):
    plan.gluon_module = _real if module is None else (lambda name: module if name == "fsattn_fwd_gluon_ws" else _real(name))
    ops._prepared_calls.clear()


def time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--clocked", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    shutil.copy(args.clocked, os.path.join(os.path.dirname(kernels_pkg.__file__), "_ws_clocks.py"))
    from fsattn_diffusers.kernels import _ws_clocks as clocked

    rows = []
    for name in args.shapes:
        bsz, heads, seq, head_dim = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        flop = 4 * bsz * heads * seq * seq * head_dim
        row = {"shape": name}
        for label, module in (("package", None), ("clocked", clocked), ("package_again", None)):
            use(module)
            ms = time_ms(lambda: fsattn(q, k, v))
            row[label + "_ms"] = ms
            row[label + "_tflops"] = flop / ms / 1e9
        use(clocked)
        buf = clocked.clock_buffer()
        buf.zero_()
        fsattn(q, k, v)
        torch.cuda.synchronize()
        rec = buf.view(-1, 16)[:, :10].double()
        rec = rec[rec[:, 6] > 0]
        consumers = 3 if head_dim == 64 else 2
        per = {}
        for c in range(consumers):
            part = rec[c::consumers]
            trips = part[:, 6].sum()
            per[f"consumer_{c}"] = {p: float(part[:, i].sum() / trips) for i, p in enumerate(PHASES) if p != "trips"}
        trips = rec[:, 6].sum()
        row["cycles_per_tile"] = {p: float(rec[:, i].sum() / trips) for i, p in enumerate(PHASES) if p != "trips"}
        row["per_consumer"] = per
        row["programs_x_consumers"] = int(rec.shape[0])
        # The spread across programs of the softmax and the turn wait (cycles per tile).
        for i, p in ((0, "softmax"), (1, "ready_and_turn_wait")):
            per_prog = rec[:, i] / rec[:, 6]
            row[p + "_quantiles"] = [float(x) for x in torch.quantile(per_prog, torch.tensor(
                [0.05, 0.5, 0.95], dtype=torch.float64, device=per_prog.device))]
        print(json.dumps(row), flush=True)
        rows.append(row)
    use(None)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
