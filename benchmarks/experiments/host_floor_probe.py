"""Experiment (NOTES v19, Next): the host time a per-shape launch plan could reach at best.

#17 asks for 0.15 ms of host time per ``fsattn()`` call; v18 (d) measured 0.23-0.45 ms and
attributed ~170 µs of 229 to pieces (K/V pre-pass, Q, descriptors, allocations). The open
question is the floor: what the launches alone cost through Triton's compiled-kernel runner and
the driver, with every argument already built. This records, from one warm call, each launch
``Relaunch`` makes (the compiled kernel's runner, its arguments, its constexpr tail), then times
replaying exactly those launches, nothing else, against the whole call; both as bursts of 16
with the GPU idle (bench_host.py's measure), same process.

    python benchmarks/experiments/host_floor_probe.py --out floor.json      # any Hopper GPU

If the replay alone is near 0.15 ms, a plan that only allocates and launches cannot meet the goal
without fewer launches (or CUDA graphs); if it is far below, the Python between launches is the
target.
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
import bench_host  # noqa: E402
from fsattn_diffusers import FSAttnConfig, fsattn  # noqa: E402
from fsattn_diffusers.kernels import launch  # noqa: E402

CASES = {"d128_gluon_ws": (128, {"kernel": "gluon_ws"}), "d128_triton": (128, {"kernel": "triton"}),
         "d64": (64, {})}


def recorded_launches(call):
    """Each launch of one call of `call` (warm): (runner, args, tail)."""
    record = []
    original = launch.Relaunch._launch

    def recording(self, grid, *args, **meta):
        result = original(self, grid, *args, **meta)
        key = (torch.cuda.current_device(), launch._args_key(args), tuple(meta.items()))
        entry = self._compiled.get(key)
        if entry is None:
            raise RuntimeError(f"{self.fn} was not relaunched: not warm, or not keyed")
        compiled, tail, runners = entry
        record.append((runners.get(grid) or compiled[grid + (1,) * (3 - len(grid))], args, tail))
        return result

    launch.Relaunch._launch = recording
    try:
        call()
    finally:
        launch.Relaunch._launch = original
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows = {}
    for name, (head_dim, fields) in CASES.items():
        q, k, v = (torch.randn(1, 256, 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        config = FSAttnConfig(**fields)

        def call():
            return fsattn(q, k, v, config=config)

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        record = recorded_launches(call)

        def replay():
            for runner, launch_args, tail in record:
                runner(*launch_args, *tail)

        def empties():
            for _ in range(8):
                torch.empty(4096, device="cuda")

        rows[name] = {"launches": len(record), "call_us": bench_host.host_burst_time(call) * 1e6,
                      "replay_us": bench_host.host_burst_time(replay) * 1e6,
                      "eight_allocations_us": bench_host.host_burst_time(empties) * 1e6}
        print(name, json.dumps(rows[name]), flush=True)
    report = {"environment": bench_host.environment(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
