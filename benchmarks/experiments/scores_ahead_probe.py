"""Experiment: the warp-specialised kernel with each consumer's next score GEMM issued before its PV
(`fsattn_fwd_gluon_ws.SCORES_AHEAD`), against the default schedule, in one process.

Correctness: outputs and LSE of both schedules on the input families (bit-equality expected: the
same P from the same max), and each against float64. Speed: `fsattn()` at the Wan shapes, the two
schedules interleaved over rounds.

    python3 benchmarks/experiments/scores_ahead_probe.py --out $OUT/ahead.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from input_families import make_family  # noqa: E402

from fsattn_diffusers import fsattn, ops, reset_stats, stats  # noqa: E402
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as wk  # noqa: E402
from fsattn_diffusers.metrics import cosine_similarity, relative_l1  # noqa: E402
from fsattn_diffusers.reference import attention_reference  # noqa: E402


def set_ahead(on: bool):
    wk.SCORES_AHEAD = on
    wk.gluon_ws_forward.cache_clear()
    ops._prepared_calls.clear()


def check(results):
    families = ["randn", "peaky", "late_sink", "max_staircase", "masked_keys", "padded_keys", "fully_masked",
                "huge_magnitude"]
    shapes = [(1, 2000, 4, 2000), (2, 1500, 4, 2700), (1, 700, 2, 4100)]
    for fam in families:
        for bsz, sq, heads, sk in shapes:
            gen = torch.Generator().manual_seed(hash((fam, sq)) % 2**31)
            q, k, v, mask = make_family(fam, bsz, sq, sk, heads, 128, generator=gen)
            q, k, v = (t.cuda().to(torch.bfloat16) for t in (q, k, v))
            mask = mask.cuda() if mask is not None else None
            outs = {}
            for ahead in (False, True):
                set_ahead(ahead)
                reset_stats()
                out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True)
                torch.cuda.synchronize()
                outs[ahead] = (out.float(), lse, dict(stats()))
            ref, _ = attention_reference(q, k, v, mask)
            row = {"family": fam, "shape": [bsz, sq, heads, sk],
                   "out_equal": bool(torch.equal(outs[False][0], outs[True][0])),
                   "lse_equal": bool(torch.equal(outs[False][1], outs[True][1])),
                   "max_abs_diff": float((outs[False][0] - outs[True][0]).abs().nan_to_num(0).max()),
                   "finite": bool(torch.isfinite(outs[True][0]).all())}
            for ahead in (False, True):
                o = outs[ahead][0]
                row[f"cos_{int(ahead)}"] = cosine_similarity(o, ref)
                row[f"rel_l1_{int(ahead)}"] = relative_l1(o, ref)
            row["stats"] = {k_: v_ for k_, v_ in outs[True][2].items() if isinstance(v_, (int, float))}
            print(row, flush=True)
            results["check"].append(row)


def bench(results, rounds):
    shapes = [("wan14b_720p", 1, 75600, 40), ("wan13b_480p", 1, 32760, 12), ("seq_16384", 1, 16384, 12)]
    for name, bsz, seq, heads in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        flops = 4.0 * bsz * heads * seq * seq * 128
        times = {False: [], True: []}
        for _ in range(rounds):
            for ahead in (False, True):
                set_ahead(ahead)
                fsattn(q, k, v)
                ms = triton.testing.do_bench(lambda: fsattn(q, k, v), warmup=3, rep=1500, return_mode="median")
                times[ahead].append(ms)
        row = {"shape": name}
        for ahead in (False, True):
            med = sorted(times[ahead])[len(times[ahead]) // 2]
            row[f"ms_{int(ahead)}"] = times[ahead]
            row[f"tflops_{int(ahead)}"] = flops / med / 1e9
        row["speedup"] = row["tflops_1"] / row["tflops_0"]
        print(row, flush=True)
        results["bench"].append(row)
        del q, k, v
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    results = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
               "check": [], "bench": []}
    try:
        if not args.skip_check:
            check(results)
        bench(results, args.rounds)
    finally:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
