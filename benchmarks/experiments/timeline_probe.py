"""Per-call times of 24 back-to-back fsattn calls at Wan2.1-14B 720p, with 20 ms samples of the SM
clock and the instantaneous board power beside them, then the GPU's busy share inside six profiled
calls: is a timed loop slower than its kernels because the GPU idles inside a call, or because the
power limiter slows a sustained loop? Writes $OUT/timeline.json (NOTES v51)."""
import json
import os
import subprocess
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fsattn_diffusers import FSAttnConfig, fsattn

CALLS, PROFILED = 24, 6


def start_sampler():
    lines = []
    proc = subprocess.Popen(["nvidia-smi", "--format=csv,noheader,nounits", "-lms", "20",
                             "--query-gpu=clocks.sm,power.draw.instant,clocks_event_reasons.active"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    threading.Thread(target=lambda: [lines.append((time.perf_counter(), line.strip())) for line in proc.stdout],
                     daemon=True).start()
    time.sleep(0.5)
    return proc, lines


def busy_union(kernels):
    """Total time some kernel ran, over (start, end) pairs sorted by start."""
    busy, cur_s, cur_e = 0.0, None, None
    for s0, e0 in kernels:
        if cur_e is None or s0 > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    return busy + cur_e - cur_s


q, k, v = (torch.randn(1, 75600, 40, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * 40 * 75600**2 * 128
out = {}
for label, cfg in (("default", FSAttnConfig()), ("k_token", FSAttnConfig(k_granularity="token"))):
    fn = lambda: fsattn(q, k, v, config=cfg)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    time.sleep(3)  # the card cools a little, as before a benchmark row
    proc, lines = start_sampler()
    t0 = time.perf_counter()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    calls = [s.elapsed_time(e) for s, e in events]
    gaps = [events[i][1].elapsed_time(events[i + 1][0]) for i in range(CALLS - 1)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # straight after, still hot
        for _ in range(PROFILED):
            fn()
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    proc.terminate()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    span = (kernels[-1][1] - kernels[0][0]) / PROFILED / 1e3
    busy = busy_union([(s0, e0) for s0, e0, _ in kernels]) / PROFILED / 1e3
    forward = [(e0 - s0) / 1e3 for s0, e0, name in kernels if "fwd" in name]
    smi = [(round(ts - t0, 3), line) for ts, line in lines]
    out[label] = {"call_ms": calls, "gap_ms": gaps, "loop_s": t1 - t0, "profile_span_ms_per_call": span,
                  "profile_busy_ms_per_call": busy, "profile_fwd_ms": forward, "smi": smi,
                  "profile_window_s": [t1 - t0, t2 - t0]}
    print(label, "calls ms", [round(c, 1) for c in calls])
    print(label, "gaps ms", [round(g, 2) for g in gaps][:8], "max", round(max(gaps), 2))
    print(label, "profile span/call", round(span, 1), "busy/call", round(busy, 1), "fwd", [round(m, 1) for m in forward])
    print(label, "TFLOP/s median loop", round(flops / sorted(calls)[CALLS // 2] / 1e9))
    for ts, line in smi[::10]:
        print("   ", ts, line)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "timeline.json"), "w"))
