"""The fixed cost of one fsattn() call: host time with the GPU idle, launches per call, and a CUDA graph.

    python benchmarks/bench_host.py --out host.json     # any CUDA GPU with FP8 tensor cores

* host: the host's time to issue one call, from a CPU clock around bursts of a few calls (16 by
  default: ~80 launches, far from filling the GPU's launch queue, so the host never waits on the
  GPU), the median over many bursts, the GPU drained between bursts. It includes whatever the
  first calls after a sync cost more (on the H200 the bursts read up to 1.6x the loop below).
* back to back: wall time per call over many calls in a row, one sync at the end: what a loop of
  calls sustains. Where the kernels' GPU time (below) is far smaller, both measures are the
  host's.
* launches: CUDA kernel launches (and memsets) per call, and the GPU time of their kernels, from
  torch.profiler.
* graph: the same call captured in a ``torch.cuda.CUDAGraph``: replay time, and whether the replay
  gives the eager output bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from fsattn_diffusers import FSAttnConfig, fsattn

# name -> (shape (B, S, H, D), mask kind, config fields)
# At 256 keys "auto" runs the Triton kernel at head dim 128 (plan.TRITON_MAX_KEYS): the
# warp-specialised kernel, which runs every longer call, is timed by name.
CASES = {
    "d128": ((1, 256, 2, 128), None, {}),
    "d128_gluon_ws": ((1, 256, 2, 128), None, {"kernel": "gluon_ws"}),
    # "auto" sorts only calls of more than 1,024 keys; asked for, the sort runs at 256.
    "d128_gluon_ws_sorted": ((1, 256, 2, 128), None, {"kernel": "gluon_ws", "k_granularity": "sorted_block"}),
    "d128_bool_mask": ((1, 256, 2, 128), "bool", {}),
    "d128_float_mask": ((1, 256, 2, 128), "float", {}),
    "d64": ((1, 256, 2, 64), None, {}),
    "d128_triton": ((1, 256, 2, 128), None, {"kernel": "triton"}),
}


def _inputs(shape, mask_kind, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    mask = None
    if mask_kind is not None:
        keep = torch.ones(shape[0], 1, 1, shape[1], dtype=torch.bool, device="cuda")
        keep[..., -shape[1] // 4:] = False
        mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, device="cuda").masked_fill(~keep, -1e4)
    return q, k, v, mask


def host_time(call, calls: int) -> float:
    """Seconds per call, host clock, one sync at the end."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def host_burst_time(call, burst: int = 16, rounds: int = 60) -> float:
    """Seconds per call to issue `burst` calls, host clock, GPU idle at each start (median of `rounds`)."""
    for _ in range(5):
        call()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(burst):
            call()
        times.append((time.perf_counter() - start) / burst)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def gpu_time(call) -> float:
    import triton.testing

    return triton.testing.do_bench(call, warmup=25, rep=200) * 1e-3


def launches_per_call(call) -> dict:
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    launch = [n for n in names if n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")]
    memset = [n for n in names if n.startswith("cudaMemset") or n.startswith("cuMemset")]
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted({e.name for e in device_events})
    return {"launches": len(launch), "memsets": len(memset), "device_kernels": kernels,
            "device_kernel_us": sum(e.device_time for e in device_events)}


def graph_check(call, refill) -> dict:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    refill()
    graph.replay()
    torch.cuda.synchronize()
    eager = call()
    torch.cuda.synchronize()
    replay_s = host_time(graph.replay, 500)
    return {"bit_equal": bool(torch.equal(captured, eager)), "replay_us": replay_s * 1e6}


def environment() -> dict:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--calls", type=int, default=2000, help="calls in the back-to-back loop (default 2000)")
    parser.add_argument("--burst", type=int, default=16, help="calls per burst of the host time (default 16)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for name in ("calls", "burst"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_host.py measures the cost of GPU calls: it needs a CUDA GPU")
    rows = []
    with torch.no_grad():
        for name in args.cases:
            shape, mask_kind, fields = CASES[name]
            q, k, v, mask = _inputs(shape, mask_kind)
            config = FSAttnConfig(**fields)

            def call():
                return fsattn(q, k, v, attn_mask=mask, config=config)

            def refill():
                for dst, src in zip((q, k, v), _inputs(shape, mask_kind, seed=1)[:3]):
                    dst.copy_(src)

            row = {"case": name, "shape": list(shape), "mask": mask_kind, "config": fields,
                   "host_us": host_burst_time(call, args.burst) * 1e6,
                   "back_to_back_us": host_time(call, args.calls) * 1e6, "gpu_us": gpu_time(call) * 1e6}
            row.update(launches_per_call(call))
            row["graph"] = graph_check(call, refill)
            rows.append(row)
            print(f"{name:16s} host {row['host_us']:7.1f} us/call   back to back {row['back_to_back_us']:7.1f} us   "
                  f"do_bench {row['gpu_us']:6.1f} us   kernels {row['device_kernel_us']:6.1f} us   "
                  f"launches {row['launches']} memsets {row['memsets']}   graph replay {row['graph']['replay_us']:6.1f} us "
                  f"bit-equal {row['graph']['bit_equal']}", flush=True)
    report = {"environment": environment(), "calls": args.calls, "burst": args.burst, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
