"""benchmarks/bench_attention.py's reading of profiler events (its timings need a GPU)."""

import os
import sys
import time
from types import SimpleNamespace

import pytest
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


def _timed(start, end, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name="k", device_time=end - start, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def test_gpu_span_counts_overlaps_once_and_gaps_as_idle():
    # Two calls over 0-100 us: kernels 0-30 and 20-40 overlap (busy 0-40), a 20 us gap, then 60-100;
    # a host event outside the span is not the GPU's.
    events = [_timed(60.0, 100.0), _timed(0.0, 30.0), _timed(20.0, 40.0),
              _timed(-50.0, 500.0, torch.autograd.DeviceType.CPU)]
    assert bench_attention.gpu_span(events, calls=2) == {"span_us_per_call": 50.0, "busy_share": 0.8}
    # A kernel inside another's range adds nothing; back-to-back kernels leave no idle time.
    assert bench_attention.gpu_span([_timed(0.0, 10.0), _timed(2.0, 5.0), _timed(10.0, 20.0)], calls=1) == \
        {"span_us_per_call": 20.0, "busy_share": 1.0}
    assert bench_attention.gpu_span([_event("forward", 100.0)], calls=1) is None  # no times: no span
    assert bench_attention.gpu_span([_timed(5.0, 5.0)], calls=1) is None  # no length: no share


def test_a_rows_timing_is_the_median_with_the_mean_and_count_of_the_calls_do_bench_timed(monkeypatch):
    import triton.testing

    asked = {}

    def do_bench(fn, warmup, rep, return_mode):
        asked.update(warmup=warmup, rep=rep, return_mode=return_mode)
        return [113.0, 130.0, 115.0, 136.0, 116.0]  # a sustained loop with two power-limit dips

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    row = bench_attention.timed(lambda: None, warmup_ms=1000.0, rep_ms=3000.0)
    assert row == {"ms": 116.0, "ms_mean": 122.0, "timed_calls": 5}
    assert asked == {"warmup": 1000.0, "rep": 3000.0, "return_mode": "all"}


def test_a_rows_clocks_are_sampled_after_a_first_untimed_call_has_finished(monkeypatch):
    # A first call may compile for seconds with the GPU idle: it must finish before the samples start.
    events = []

    class Sampler:
        summary = None

        def __enter__(self):
            events.append("samples start")
            return self

        def __exit__(self, *exc):
            events.append("samples end")
            self.summary = {"sm_mhz": 1515.0}
            return False

    def timed(fn, warmup_ms, rep_ms):
        events.append(("timed", warmup_ms, rep_ms))
        return {"ms": 1.0}

    monkeypatch.setattr(bench_attention, "ClockSampler", Sampler)
    monkeypatch.setattr(bench_attention, "timed", timed)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("synchronize"))
    times, clocks = bench_attention.timed_with_clocks(lambda: events.append("call"), 1000.0, 3000.0)
    assert events == ["call", "synchronize", "samples start", ("timed", 1000.0, 3000.0), "samples end"]
    assert times == {"ms": 1.0} and clocks == {"sm_mhz": 1515.0}


def test_clock_samples_give_medians_and_each_reasons_share_and_skip_unreadable_lines():
    lines = ["1515, 637.2, 0x0000000000000004\n", "[N/A], [N/A], [N/A]\n", "\n",
             "1980, 100.0, 0x0000000000000001\n", "1600, 640, 0x0\n", "1510, 650, 0x0000000000000024\n"]
    summary = bench_attention.summarise_clock_samples(lines)
    assert summary == {"sm_mhz": 1557.5, "power_w": 638.6,
                       "reasons": {"gpu_idle": 0.25, "sw_power_cap": 0.5, "sw_thermal": 0.25}, "samples": 4}
    # A reason in one sample of many is kept, not rounded away.
    rare = bench_attention.summarise_clock_samples(["1980, 100, 0x0\n"] * 999 + ["1980, 100, 0x10\n"])
    assert rare["reasons"] == {"sync_boost": 0.001}
    assert bench_attention.summarise_clock_samples(["No devices were found\n"]) is None


def _fake_nvidia_smi(tmp_path, monkeypatch, body):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_clock_sampler_opens_its_window_before_the_work_and_asks_for_the_current_gpu(tmp_path, monkeypatch):
    # A slow-starting nvidia-smi whose first sample reads idle, then samples under load every 10 ms:
    # the block must not begin before the first sample, and that sample is not the block's. The
    # GPU asked for is CUDA's current device, by UUID.
    _fake_nvidia_smi(tmp_path, monkeypatch, f'echo "$@" > {tmp_path}/args\nsleep 0.3\n'
                     'echo "1980, 80.0, 0x0000000000000001"\nsleep 0.05\n'
                     'while true; do echo "1515, 637.2, 0x0000000000000004"; sleep 0.01; done\n')
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(uuid=f"uuid-of-{index}"))
    with bench_attention.ClockSampler(period_ms=10) as clocks:
        seen_at_start = len(clocks._lines)
        time.sleep(0.2)
    assert seen_at_start >= 1
    assert clocks.summary["sm_mhz"] == 1515.0 and clocks.summary["reasons"] == {"sw_power_cap": 1.0}
    assert (tmp_path / "args").read_text().split()[:2] == ["-i", "GPU-uuid-of-1"]


@pytest.mark.parametrize("nvidia_smi", ["absent", "failing"])
def test_clock_sampler_without_a_working_nvidia_smi_gives_no_summary_at_once(tmp_path, monkeypatch, nvidia_smi):
    if nvidia_smi == "absent":
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        _fake_nvidia_smi(tmp_path, monkeypatch, 'echo "No devices were found"\nexit 6\n')
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="x"))
    started = time.monotonic()
    with bench_attention.ClockSampler() as clocks:
        pass
    assert clocks.summary is None and time.monotonic() - started < 2.0
