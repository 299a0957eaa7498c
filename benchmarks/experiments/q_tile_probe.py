"""Experiment (NOTES v26): Q's quantisation pass with smaller tiles, more programs in flight.

v26 (a) found the pass at ~3.2 TB/s whatever the programs' order. Each program loads its tile,
reduces each row, then stores: nothing overlaps within a program, and a 128 x 128 tile in 8 warps
leaves two programs per SM. Rows are quantised independently, so the tile's row count changes no
output bit; here it and the warps vary at the Wan2.1-14B and 1.3B shapes.

    python benchmarks/experiments/q_tile_probe.py --out qt.json      # H200
"""
import argparse
import json
import os
import statistics
import sys

import torch
import triton
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir))
from fsattn_diffusers.kernels import quantize  # noqa: E402

SHAPES = {"wan14b": (1, 75600, 40, 128), "wan13b": (1, 32760, 12, 128)}
TILES = [(128, 8), (64, 4), (64, 2), (32, 4), (32, 2), (32, 1), (16, 1), (16, 2)]
PRODUCT_Q_WARPS = quantize.q_warps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"environment": {"torch": torch.__version__, "triton": triton.__version__,
                              "gpu": torch.cuda.get_device_name()}, "rows": {}}
    for name, shape in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 512, shape[2], shape[3], generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = quantize.quantize_kv(k, k, None, block_n=128, d_pad=128)

        def run(block_m, warps):
            quantize.q_warps = lambda *_: warps
            quantize._q_prepass.cache_clear()
            return quantize.quantize_q(q, kv, sm_scale=shape[3] ** -0.5, block_m=block_m, pad_multiple=128)

        ref = run(64, 4)
        ref = [t.clone() for t in (ref.q_q, ref.q_scale, ref.q_dot_k_mean)]
        row = {"bit_equal": {}, "ms": {}}
        times = {f"m{m}_w{w}": [] for m, w in TILES}
        for m, w in TILES:
            out = run(m, w)
            row["bit_equal"][f"m{m}_w{w}"] = all(torch.equal(a, b) for a, b in
                                                 zip(ref, (out.q_q, out.q_scale, out.q_dot_k_mean)))
        for _ in range(args.rounds):
            for m, w in TILES:
                run(m, w)  # builds the launch for this tile
                times[f"m{m}_w{w}"].append(do_bench(lambda: quantize.quantize_q(
                    q, kv, sm_scale=shape[3] ** -0.5, block_m=m, pad_multiple=128), warmup=10, rep=100))
        q_bytes = q.numel() * 3 + 8 * shape[0] * shape[1] * shape[2]
        row["ms"] = {key: statistics.median(t) for key, t in times.items()}
        row["tb_s"] = {key: q_bytes / (t * 1e-3) / 1e12 for key, t in row["ms"].items()}
        row["ms_rounds"] = times
        print(name, json.dumps({k2: row[k2] for k2 in ("bit_equal", "ms", "tb_s")}), flush=True)
        report["rows"][name] = row
    quantize.q_warps = PRODUCT_Q_WARPS
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
