"""GPU time per kernel of fsattn() calls (torch.profiler), per config, at Wan's cross-attention shapes.

    python benchmarks/experiments/kernel_times.py --out $OUT/kt.json
"""
import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from fsattn_diffusers import FSAttnConfig, fsattn

SHAPES = {"wan13b_cross": (1, 32760, 512, 12), "wan14b_cross": (1, 75600, 512, 40)}
CONFIGS = {"triton": FSAttnConfig(kernel="triton"), "resident": FSAttnConfig(kernel="gluon_resident")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    results = {}
    for shape_name, (b, sq, sk, h) in SHAPES.items():
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name, cfg in CONFIGS.items():
            for _ in range(3):
                fsattn(q, k, v, config=cfg)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    fsattn(q, k, v, config=cfg)
                torch.cuda.synchronize()
            per_kernel = {}
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "device_time_total", 0) > 0:
                    t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                    if t > 0:
                        per_kernel[e.key[:80]] = round(t / args.calls, 2)
            results[f"{shape_name} {name}"] = per_kernel
            print(shape_name, name, json.dumps(per_kernel))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
