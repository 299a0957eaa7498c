"""Experiment: where fsattn()'s time goes, kernel by kernel (torch.profiler's CUDA times), under the
Triton release that runs this, at the CogVideoX-like shape (head dim 64, two and three consumer
warpgroups) and Wan2.1-1.3B's; to tell a slower attention kernel from slower pre-passes when one
release's fsattn() is slower than another's.

    python3 benchmarks/experiments/parts_probe.py --out $OUT/parts.json
"""

import argparse
import collections
import json

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from fsattn_diffusers import fsattn, ops, plan
from fsattn_diffusers.kernels import configs
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws

CALLS = 10


def use(consumers):
    # The plan and the launcher read the count separately: both must see the same one.
    ws.gluon_ws_consumers = configs.gluon_ws_consumers = lambda *args, **kwargs: consumers
    ws.gluon_ws_forward.cache_clear()
    plan._plan.cache_clear()
    ops._prepared_calls.clear()


def parts(q, k, v):
    for _ in range(3):
        fsattn(q, k, v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fsattn(q, k, v)
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:60]] += e.device_time_total / 1e3 / CALLS
    return dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=["cogvideox_d64", "wan13b_480p"])
    args = parser.parse_args()
    rows = []
    for name, (bsz, heads, seq, d, counts) in {"cogvideox_d64": (2, 48, 17776, 64, (2, 3)),
                                                "wan13b_480p": (1, 12, 32760, 128, (2,))}.items():
        if name not in args.shapes:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        for consumers in counts:
            use(consumers)
            ms = triton.testing.do_bench(lambda: fsattn(q, k, v), warmup=5, rep=300, return_mode="median")
            row = {"shape": name, "consumers": consumers, "fsattn_ms": ms,
                   "tflops": 4.0 * bsz * heads * seq * seq * d / ms / 1e9, "kernels_ms": parts(q, k, v)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
