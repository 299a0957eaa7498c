"""Experiment: the warp-specialised kernel's dequantisation with one ks * qs product per key and
row pair (`configs.gluon_ws_row_pair_products()` True) against one multiply per score (False), in one
process; Q's pre-pass gives rows i and i ^ 8 one scale in both.

Correctness: both on the input families against float64 (not bit-equal: s * (ks * qs) and
(s * ks) * qs round differently). Speed: `fsattn()` at the Wan shapes and head dim 64,
interleaved over rounds.

    python3 benchmarks/experiments/q_pairs_probe.py --out $OUT/pairs.json
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

from fsattn_diffusers import fsattn, ops  # noqa: E402
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as wk  # noqa: E402
from fsattn_diffusers.metrics import cosine_similarity, relative_l1  # noqa: E402
from fsattn_diffusers.reference import attention_reference  # noqa: E402

SCHEDULES = (False, True)


def use(schedule: bool):
    wk.gluon_ws_row_pair_products = lambda: schedule
    wk.gluon_ws_forward.cache_clear()
    ops._prepared_calls.clear()


def check(results):
    families = ["randn", "peaky", "late_sink", "max_staircase", "masked_keys", "padded_keys", "fully_masked",
                "huge_magnitude"]
    shapes = [(1, 2000, 4, 2000), (2, 1500, 4, 2700), (1, 700, 2, 4100)]
    for head_dim in (128, 64):
        for fam in families:
            for bsz, sq, heads, sk in shapes:
                gen = torch.Generator().manual_seed(hash((fam, sq)) % 2**31)
                q, k, v, mask = make_family(fam, bsz, sq, sk, heads, head_dim, generator=gen)
                q, k, v = (t.cuda().to(torch.bfloat16) for t in (q, k, v))
                mask = mask.cuda() if mask is not None else None
                outs = {}
                for schedule in SCHEDULES:
                    use(schedule)
                    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True)
                    torch.cuda.synchronize()
                    outs[schedule] = (out.float(), lse)
                ref, _ = attention_reference(q, k, v, mask)
                row = {"family": fam, "head_dim": head_dim, "shape": [bsz, sq, heads, sk],
                       "out_rel_l1_between": relative_l1(outs[False][0], outs[True][0]),
                       "lse_max_diff": float((outs[False][1] - outs[True][1]).abs().nan_to_num(0.0).max()),
                       "finite": bool(torch.isfinite(outs[True][0]).all())}
                for schedule in SCHEDULES:
                    row[f"cos_{schedule}"] = cosine_similarity(outs[schedule][0], ref)
                    row[f"rel_l1_{schedule}"] = relative_l1(outs[schedule][0], ref)
                print(row, flush=True)
                results["check"].append(row)


def bench(results, rounds):
    shapes = [("wan14b_720p", 1, 75600, 40, 128), ("wan13b_480p", 1, 32760, 12, 128),
              ("cogvideox_d64", 2, 17776, 48, 64), ("seq_16384", 1, 16384, 12, 128)]
    for name, bsz, seq, heads, head_dim in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        flops = 4.0 * bsz * heads * seq * seq * head_dim
        times = {s: [] for s in SCHEDULES}
        for _ in range(rounds):
            for schedule in SCHEDULES:
                use(schedule)
                fsattn(q, k, v)
                ms = triton.testing.do_bench(lambda: fsattn(q, k, v), warmup=3, rep=1200, return_mode="median")
                times[schedule].append(ms)
        row = {"shape": name}
        for schedule in SCHEDULES:
            med = sorted(times[schedule])[len(times[schedule]) // 2]
            row[f"ms_{schedule}"] = times[schedule]
            row[f"tflops_{schedule}"] = flops / med / 1e9
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
