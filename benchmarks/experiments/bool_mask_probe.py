"""Experiment (NOTES v26): a boolean key mask handed to the K/V pre-pass as a view, against the cast.

Until v26 ``attention.key_mask`` turned a boolean mask into float32 weights (``.float().contiguous()``):
one more launch and one allocation per masked call. The pre-pass now reads the booleans. Here both
in one process: the old ``key_mask`` is patched back in for the "cast" rounds.

    python benchmarks/experiments/bool_mask_probe.py --out bm.json      # any CUDA GPU with FP8 tensor cores

Per variant: host time of one call (bursts of 16, GPU idle; bench_host.host_burst_time), launches
per call and their kernels, five interleaved rounds; the outputs of the two must be bit-equal.
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir))
import bench_host  # noqa: E402
from fsattn_diffusers import attention, fsattn  # noqa: E402

VIEW = attention.key_mask


def cast_key_mask(attn_mask, query, key, layout="NHD"):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        weight, bias = VIEW(attn_mask, query, key, layout)
        return weight.float().contiguous(), bias
    return VIEW(attn_mask, query, key, layout)


SHAPES = {"tiny_d128": (1, 256, 2, 128), "tiny_d64": (1, 256, 2, 64), "hunyuan_like": (1, 119056, 24, 128)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"environment": bench_host.environment(), "rows": {}}
    for name, shape in SHAPES.items():
        q, k, v, mask = bench_host._inputs(shape, "bool")
        variants = {"cast": cast_key_mask, "view": VIEW}
        row = {"shape": list(shape), "host_us": {key: [] for key in variants}}
        outs = {}
        for key, fn in variants.items():
            attention.key_mask = fn
            outs[key] = fsattn(q, k, v, attn_mask=mask)
            row[f"launches_{key}"] = bench_host.launches_per_call(lambda: fsattn(q, k, v, attn_mask=mask))
        row["bit_equal"] = bool(torch.equal(outs["cast"], outs["view"]))
        if shape[1] <= 4096:
            for _ in range(args.rounds):
                for key, fn in variants.items():
                    attention.key_mask = fn
                    row["host_us"][key].append(
                        bench_host.host_burst_time(lambda: fsattn(q, k, v, attn_mask=mask)) * 1e6)
            row["host_us_median"] = {key: statistics.median(t) for key, t in row["host_us"].items()}
        else:
            for key, fn in variants.items():
                attention.key_mask = fn
                row[f"gpu_ms_{key}"] = bench_host.gpu_time(lambda: fsattn(q, k, v, attn_mask=mask)) * 1e3
        attention.key_mask = VIEW
        print(name, json.dumps({k2: v2 for k2, v2 in row.items() if k2 != "host_us"}), flush=True)
        report["rows"][name] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if not all(r["bit_equal"] for r in report["rows"].values()):
        raise SystemExit("the view and the cast gave different outputs")


if __name__ == "__main__":
    main()
