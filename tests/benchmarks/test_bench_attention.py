"""benchmarks/bench_attention.py's reading of profiler events (its timings need a GPU)."""

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import bench_attention  # noqa: E402


def _event(name, us, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_time=us, device_type=device)


def test_kernel_times_are_per_call_summed_over_launches_and_skip_host_events():
    # Two calls: the forward once a call, a sort pass twice a call, and a host-side event.
    events = [_event("forward", 100.0), _event("sort_pass", 3.0), _event("sort_pass", 5.0),
              _event("forward", 110.0), _event("sort_pass", 4.0), _event("sort_pass", 6.0),
              _event("cudaLaunchKernel", 50.0, torch.autograd.DeviceType.CPU)]
    times = bench_attention.per_kernel_us(events, calls=2)
    assert times == {"forward": 105.0, "sort_pass": 9.0}
    assert list(times) == ["forward", "sort_pass"]  # largest first
