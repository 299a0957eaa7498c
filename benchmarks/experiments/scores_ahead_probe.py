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

from fsattn_diffusers import FSAttnConfig, fsattn, ops, plan, reset_stats, stats  # noqa: E402
from fsattn_diffusers.kernels import configs  # noqa: E402
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as wk  # noqa: E402

configs.GLUON_WS_MAX_STAGES[128] = 6  # 5 and 6 stages fit shared memory (225,704 bytes at 6)
VARIANTS = {"default4": (False, 4), "default5": (False, 5), "default6": (False, 6), "ahead4": (True, 4),
            "ahead6": (True, 6)}
from fsattn_diffusers.metrics import cosine_similarity, relative_l1  # noqa: E402
from fsattn_diffusers.reference import attention_reference  # noqa: E402


def set_variant(name):
    ahead, stages = VARIANTS[name]
    wk.SCORES_AHEAD = ahead
    wk.gluon_ws_forward.cache_clear()
    plan._plan.cache_clear()
    ops._prepared_calls.clear()
    return FSAttnConfig(num_stages=stages)


def check(results):
    families = ["randn", "late_sink", "max_staircase", "padded_keys"]
    shapes = [(2, 1500, 4, 2700), (1, 700, 2, 4100)]
    for fam in families:
        for bsz, sq, heads, sk in shapes:
            gen = torch.Generator().manual_seed(hash((fam, sq)) % 2**31)
            q, k, v, mask = make_family(fam, bsz, sq, sk, heads, 128, generator=gen)
            q, k, v = (t.cuda().to(torch.bfloat16) for t in (q, k, v))
            mask = mask.cuda() if mask is not None else None
            outs = {}
            for name in VARIANTS:
                cfg = set_variant(name)
                out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)
                torch.cuda.synchronize()
                outs[name] = (out.float(), lse)
            ref, _ = attention_reference(q, k, v, mask)
            base = outs["default4"]
            row = {"family": fam, "shape": [bsz, sq, heads, sk],
                   "equal_to_default4": {n: bool(torch.equal(base[0], o[0]) and torch.equal(base[1], o[1]))
                                         for n, o in outs.items()},
                   "finite": all(bool(torch.isfinite(o[0]).all()) for o in outs.values()),
                   "cos": cosine_similarity(base[0], ref), "rel_l1": relative_l1(base[0], ref)}
            print(row, flush=True)
            results["check"].append(row)


def bench(results, rounds):
    shapes = [("wan14b_720p", 1, 75600, 40), ("wan13b_480p", 1, 32760, 12), ("seq_16384", 1, 16384, 12)]
    for name, bsz, seq, heads in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        flops = 4.0 * bsz * heads * seq * seq * 128
        times = {n: [] for n in VARIANTS}
        for _ in range(rounds):
            for name in VARIANTS:
                cfg = set_variant(name)
                fsattn(q, k, v, config=cfg)
                ms = triton.testing.do_bench(lambda: fsattn(q, k, v, config=cfg), warmup=3, rep=1500,
                                             return_mode="median")
                times[name].append(ms)
        row = {"shape": name}
        for n in VARIANTS:
            med = sorted(times[n])[len(times[n]) // 2]
            row[f"ms_{n}"] = times[n]
            row[f"tflops_{n}"] = flops / med / 1e9
        print(row, flush=True)
        results["bench"].append(row)
        del q, k, v
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
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
