"""GPU time per kernel of fsattn() calls (torch.profiler), per config, at Wan's cross-attention shapes.

    python benchmarks/experiments/kernel_times.py --out $OUT/kt.json
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fsattn_diffusers import FSAttnConfig, fsattn, ops
from fsattn_diffusers.kernels import configs as kernel_configs

SHAPES = {"wan13b_cross": (1, 32760, 512, 12), "wan14b_cross": (1, 75600, 512, 40)}
# name -> (config, the persistent kernel's speculative max)
CONFIGS = {"triton": (FSAttnConfig(kernel="triton"), False), "gluon_ws": (FSAttnConfig(kernel="gluon_ws"), False),
           "persistent_online": (FSAttnConfig(kernel="gluon_persistent"), False),
           "persistent_speculative": (FSAttnConfig(kernel="gluon_persistent"), True)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    results = {}
    for shape_name, (b, sq, sk, h) in SHAPES.items():
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for _ in range(3):
            F.scaled_dot_product_attention(qt, kt, vt)
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record()
        for _ in range(args.calls):
            F.scaled_dot_product_attention(qt, kt, vt)
        events[1].record()
        torch.cuda.synchronize()
        results[f"{shape_name} sdpa"] = {"call_ms": round(events[0].elapsed_time(events[1]) / args.calls, 4)}
        print(shape_name, "sdpa", json.dumps(results[f"{shape_name} sdpa"]))
        for name, (cfg, speculative) in CONFIGS.items():
            kernel_configs.GLUON_PERSISTENT_SPECULATIVE = speculative
            ops._prepared_calls.clear()
            for _ in range(3):
                fsattn(q, k, v, config=cfg)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    fsattn(q, k, v, config=cfg)
                torch.cuda.synchronize()
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
            for _ in range(args.calls):
                fsattn(q, k, v, config=cfg)
            events[1].record()
            torch.cuda.synchronize()
            per_kernel = {"call_ms": round(events[0].elapsed_time(events[1]) / args.calls, 4)}
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
