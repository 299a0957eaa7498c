"""benchmarks/bench_attention.py's reading of profiler events (its timings need a GPU)."""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks",
                     "bench_attention.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", os.path.abspath(BENCH))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(name, us, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_time=us, device_type=device)


def test_kernel_times_are_per_call_summed_over_launches_and_skip_host_events(bench):
    # Two calls: the forward once a call, a sort pass twice a call, and a host-side event.
    events = [_event("forward", 100.0), _event("sort_pass", 3.0), _event("sort_pass", 5.0),
              _event("forward", 110.0), _event("sort_pass", 4.0), _event("sort_pass", 6.0),
              _event("cudaLaunchKernel", 50.0, torch.autograd.DeviceType.CPU)]
    times = bench.per_kernel_us(events, calls=2)
    assert times == {"forward": 105.0, "sort_pass": 9.0}
    assert list(times) == ["forward", "sort_pass"]  # largest first
