"""fsattn against SDPA (default = cuDNN on Hopper, flash, cuDNN) and SageAttention, side by side.

    python benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p --out benchmarks/results/x.json

Times are medians of ``triton.testing.do_bench`` (CUDA events) on fresh random bf16 inputs; fsattn's
quantisation pre-pass is inside its time. Each row also keeps the mean and the number of timed calls.
The window is long by default (1 s of untimed calls, then 3 s timed): at the large shapes the card
runs at its power limit, whose control swings the clock over a cycle of about a second (on an H100
at Wan2.1-14B, calls of 113-119 ms with a dip to 124-136 ms every eight or so), and a short window
times one phase of it. ``--warmup-ms 25 --rep-ms 300`` is the short window of the figures in
``benchmarks/NOTES.md`` before v51: at Wan2.1-14B it timed only the eighth and ninth calls, where
that H100's first dip fell. Effective TFLOP/s = 4*B*H*Sq*Sk*D / time. Accuracy is
measured on a random sample of query rows of two heads against the float64 reference. With
``--kernel-times`` each fsattn row also lists the GPU time of each kernel of a call (torch.profiler
over a few calls): where the call's time goes (pre-passes, the key sort, the forward kernel). The
profiling runs after every timing, on fresh inputs of the same seed, so that no timing follows it;
its few calls are a short burst after an idle moment, in another phase of the power limit's cycle
than the row's window (``kernel_clocks`` beside ``clocks``): the kernels' shares compare, their sum
and the row's time need not. ``kernel_span`` says whether the GPU waited inside those calls: their
span per call, first kernel to last, and the share of it that some kernel ran.
Each timed row also carries the GPU's SM clock, board power and clock-event reasons sampled by
``nvidia-smi`` while it was timed: the 8-bit kernels are bound by the card's power limit at the large
shapes, so the same code runs at different clocks on cards of the same name, and a time is only
comparable with another taken at the same clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import KEYS_SWEEP, SHAPES, SWEEP  # noqa: E402

ALL_SHAPES = {**SHAPES, **SWEEP, **KEYS_SWEEP}
SWEEPS = {"sweep": SWEEP, "keys_sweep": KEYS_SWEEP}

from fsattn_diffusers import FSAttnConfig, fsattn, reset_stats, stats  # noqa: E402
from fsattn_diffusers.metrics import cosine_similarity, relative_l1  # noqa: E402
from fsattn_diffusers.reference import attention_reference  # noqa: E402

# Named fsattn variants: FSAttnConfig fields. Tile overrides: block_m, block_n, num_warps, num_stages.
VARIANTS = {
    "default": {},
    "online": {"max_policy": "online"},
    "sampled": {"max_policy": "sampled"},
    "recompute": {"on_violation": "recompute"},
    "pv16": {"pv_format": "16bit"},
    "fp8": {"pv_format": "fp8_e4m3"},
    "exp_half": {"exp_offload": 0.5},
    "exp_bits": {"exp_offload": 1.0},
    "k_token": {"k_granularity": "token"},
    "k_block": {"k_granularity": "block"},
    "k_sorted": {"k_granularity": "sorted_block"},
    "rowsum_fma": {"rowsum": "fma"},
    "pv_hw_acc": {"pv_accum": "hw"},
}


def parse_variant(spec: str):
    """'name' from VARIANTS, or 'label:key=value,key=value' (values parsed as int/float/str)."""
    if ":" not in spec:
        return spec, dict(VARIANTS[spec])
    label, body = spec.split(":", 1)
    fields = {}
    for item in filter(None, body.split(",")):
        key, value = item.split("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        fields[key] = value
    return label, fields


def environment():
    info = {"torch": torch.__version__, "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        try:
            done = subprocess.run(["nvidia-smi", "-i", gpu_for_nvidia_smi(), "--format=csv,noheader,nounits",
                                   "--query-gpu=driver_version,power.limit,clocks.max.sm"],
                                  capture_output=True, text=True, timeout=30)
            fields = [f.strip() for f in done.stdout.split(",")] if done.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired):
            fields = []
        if len(fields) != 3:  # an error message, not the three values
            fields = []
        info["driver"] = fields[0] if fields else None
        for i, (key, cast) in enumerate((("power_limit_w", float), ("max_sm_mhz", int)), start=1):
            try:
                info[key] = cast(float(fields[i]))
            except (IndexError, ValueError):  # absent, or "[N/A]"
                info[key] = None
    return info


# nvidia-smi's clock-event ("throttle") reason bits, by the names its documentation gives them.
CLOCK_EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                       0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                       0x100: "display_clocks"}


def gpu_for_nvidia_smi():
    """The current CUDA device as nvidia-smi's ``-i`` takes it: by UUID, since CUDA's device order
    (fastest first, and only those CUDA_VISIBLE_DEVICES lets through) need not be nvidia-smi's."""
    current = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(current), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else str(current)


def summarise_clock_samples(lines):
    """Median SM clock (MHz) and board power (W) of nvidia-smi lines "MHz, W, 0xREASONS"
    (``--format=csv,noheader,nounits``), and the share of them that carried each clock-event
    reason (those seen at all); None if no line parses. Shares, not a union: a reason in one
    sample says little about the row. nvidia-smi's power.draw is a one-second average."""
    mhz, watts, bits = [], [], []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            clock, power, reasons = float(fields[0]), float(fields[1]), int(fields[2], 16)
        except (IndexError, ValueError):  # a header, a blank or "[N/A]": not a sample
            continue
        mhz.append(clock)
        watts.append(power)
        bits.append(reasons)
    if not mhz:
        return None
    seen = {name: sum(1 for b in bits if b & bit) for bit, name in CLOCK_EVENT_REASONS.items()}
    return {"sm_mhz": statistics.median(mhz), "power_w": round(statistics.median(watts), 1),
            "reasons": {name: round(n / len(bits), 3) for name, n in seen.items() if n}, "samples": len(mhz)}


class ClockSampler:
    """``with ClockSampler() as clocks: ...`` samples the current GPU's clock, power and clock-event
    reasons every `period_ms` while the block runs; ``clocks.summary`` is then
    :func:`summarise_clock_samples` of them, or None where nvidia-smi is absent or gave nothing."""

    def __init__(self, period_ms=50):
        self.period_ms = period_ms
        self.summary = None
        self._lines = []
        self._proc = None

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", gpu_for_nvidia_smi(), "--format=csv,noheader,nounits", "-lms", str(self.period_ms),
                 "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        first = threading.Event()

        def read():
            for line in self._proc.stdout:
                self._lines.append(line)
                first.set()
            first.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        first.wait(timeout=5.0)  # nvidia-smi takes a moment to start: let the window open before the work
        self._start = len(self._lines)  # what came before the work is not the work's
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._reader.join(timeout=5.0)
            if not self._reader.is_alive():  # else closing would wait on the reader's lock
                self._proc.stdout.close()
            self.summary = summarise_clock_samples(self._lines[self._start:])
        return False


def kernel_report():
    """Registers, spills and wgmma count of the compiled forward kernels (Triton's cache)."""
    from fsattn_diffusers.kernels import fsattn_fwd as fwd

    rows = []
    try:
        for cache in fwd._fsattn_fwd_kernel.device_caches.values():
            for kernel in cache[0].values():
                ptx = kernel.asm.get("ptx", "")
                rows.append({"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                             "wgmma": ptx.count("wgmma.mma_async"), "name": kernel.name,
                             "constants": {k: str(v) for k, v in getattr(kernel, "constants", {}).items()
                                           if isinstance(k, str) and k.isupper()}})
    except Exception as exc:  # introspection differs between Triton releases: report, don't fail
        rows.append({"error": repr(exc)})
    return rows


def per_kernel_us(events, calls):
    """Microseconds per call of each CUDA kernel among profiler `events` recorded over `calls` calls
    (a kernel launched more than once a call, as a sort's passes are, is summed), largest first."""
    total = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] = total.get(e.name, 0.0) + e.device_time / calls
    return dict(sorted(total.items(), key=lambda item: -item[1]))


def gpu_span(events, calls):
    """The GPU's span per call over profiler `events` recorded over `calls` back-to-back calls (first
    kernel's start to last kernel's end, microseconds) and the share of it some kernel ran: below 1
    where the GPU waited inside or between the calls. None without CUDA events or their times."""
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA and getattr(e, "time_range", None))
    span = max((hi for _, hi in ranges), default=0.0) - (ranges[0][0] if ranges else 0.0)
    if span <= 0:
        return None
    busy, start, end = 0.0, *ranges[0]
    for lo, hi in ranges[1:]:
        if lo > end:
            busy, start, end = busy + end - start, lo, hi
        else:
            end = max(end, hi)
    busy += end - start
    return {"span_us_per_call": span / calls, "busy_share": busy / span}


def kernel_times(fn, calls=5):
    """:func:`per_kernel_us` and :func:`gpu_span` of `fn`'s calls, after one untimed call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    return per_kernel_us(events, calls), gpu_span(events, calls)


def timed(fn, warmup_ms, rep_ms):
    """``do_bench``'s per-call times of `fn` (ms) as the row's fields: the median as ``ms``, the mean
    and the number of timed calls beside it."""
    import triton.testing

    times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    return {"ms": statistics.median(times), "ms_mean": statistics.fmean(times), "timed_calls": len(times)}


def timed_with_clocks(fn, warmup_ms, rep_ms):
    """:func:`timed` of `fn` and the clock summary of its window. One call runs first, outside the
    samples: a first call may compile for seconds with the GPU idle, which would read as an idle
    card's clock and power (``--no-accuracy`` leaves the compile to the timing's first call)."""
    fn()
    torch.cuda.synchronize()
    with ClockSampler() as clocks:
        times = timed(fn, warmup_ms, rep_ms)
    return times, clocks.summary


def make_inputs(shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape.batch, s, shape.heads, shape.head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for s in (shape.seq_q, shape.seq_k, shape.seq_k))
    mask = None
    if shape.padded_keys:
        mask = torch.ones(shape.batch, 1, 1, shape.seq_k, dtype=torch.bool, device="cuda")
        mask[..., shape.seq_k - shape.padded_keys:] = False
    return q, k, v, mask


def sdpa_fn(q, k, v, mask, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def run():
        if backend == "default":
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        with sdpa_kernel(backends[backend]):
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)

    return run


def sage_fn(q, k, v, mask):
    import sageattention

    return lambda: sageattention.sageattn(q, k, v, tensor_layout="NHD", is_causal=False)


def accuracy(out_fn, q, k, v, mask, seed, rows=1024):
    """cos / rel-L1 of `out_fn()` (B, S, H, D) on sampled query rows of the first two heads, vs float64."""
    out = out_fn()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randperm(q.shape[1], device="cuda", generator=gen)[:rows]
    heads = slice(0, 2)
    ref, _ = attention_reference(q[:, idx, heads], k[:, :, heads], v[:, :, heads], mask)
    o = out[:, idx, heads]
    return {"cos": cosine_similarity(o, ref), "rel_l1": relative_l1(o, ref), "finite": bool(torch.isfinite(out).all())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(ALL_SHAPES) + list(SWEEPS),
                        help="shape names, 'sweep' for the sequence-length sweep, 'keys_sweep' for the key-count sweep")
    parser.add_argument("--variants", nargs="+", default=["default"],
                        help=f"fsattn variants: names from {list(VARIANTS)} or 'label:key=value,...'")
    parser.add_argument("--baselines", nargs="*", default=["default", "flash", "cudnn", "sage"])
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--warmup-ms", type=float, default=1000.0,
                        help="untimed calls before each row's timing, in ms (the card's power limit settles)")
    parser.add_argument("--rep-ms", type=float, default=3000.0,
                        help="each row's timed window, in ms (several of the power limit's cycles)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernel-times", action="store_true",
                        help="also the GPU time of each kernel of an fsattn call, from torch.profiler")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()

    env = environment()
    print(json.dumps(env))
    rows = []

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"environment": env, "rows": rows, "kernels": kernel_report()}, f, indent=1)

    def record(row):
        rows.append(row)
        acc = row.get("accuracy") or {}
        clk = row.get("clocks") or {}
        clk_text = (f"{clk['sm_mhz']:.0f} MHz {clk['power_w']:.0f} W "
                    + " ".join(f"{name} {share:.0%}" for name, share in clk["reasons"].items())) if clk else ""
        print(f"{row['shape']:16s} {row['method']:28s} {row.get('ms', float('nan')):9.3f} ms "
              f"(mean {row.get('ms_mean', float('nan')):.3f}, {row.get('timed_calls', 0)} calls) "
              f"{row.get('tflops', float('nan')):7.1f} TFLOP/s x{row.get('speedup', float('nan')):5.2f} "
              f"cos {acc.get('cos', float('nan')):.6f} l1 {acc.get('rel_l1', float('nan')):.4f} "
              f"fb {row.get('fallback_share', '')} {clk_text} {row.get('error', '')}", flush=True)
        save()

    names = [n for name in args.shapes for n in SWEEPS.get(name, [name])]
    for name in names:
        shape = ALL_SHAPES[name]
        q, k, v, mask = make_inputs(shape, args.seed)
        base_ms = None
        for backend in args.baselines:
            method = f"sdpa_{backend}" if backend != "sage" else "sageattention"
            try:
                fn = sage_fn(q, k, v, mask) if backend == "sage" else sdpa_fn(q, k, v, mask, backend)
                times, clocks = timed_with_clocks(fn, args.warmup_ms, args.rep_ms)
            except Exception as exc:  # a backend that cannot take the shape (or is absent)
                record({"shape": name, "method": method, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            ms = times["ms"]
            if backend == "default":
                base_ms = ms
            record({"shape": name, "method": method, **times, "tflops": shape.flops / ms / 1e9,
                    "speedup": (base_ms / ms) if base_ms else float("nan"), "clocks": clocks})
            torch.cuda.empty_cache()
        for spec in args.variants:
            label, fields = parse_variant(spec)
            try:
                cfg = FSAttnConfig(**fields)
                fn = lambda: fsattn(q, k, v, attn_mask=mask, config=cfg)  # noqa: E731
                reset_stats()
                acc = None if args.no_accuracy else accuracy(fn, q, k, v, mask, args.seed)
                s = stats()
                share = f"{s['fallback_q_tiles']}/{s['q_tiles']}" if s["q_tiles"] else ""
                times, clocks = timed_with_clocks(fn, args.warmup_ms, args.rep_ms)
            except Exception as exc:
                record({"shape": name, "method": f"fsattn[{label}]", "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            ms = times["ms"]
            record({"shape": name, "method": f"fsattn[{label}]", "config": fields, **times,
                    "tflops": shape.flops / ms / 1e9, "speedup": (base_ms / ms) if base_ms else float("nan"),
                    "accuracy": acc, "fallback_share": share, "clocks": clocks})
        del q, k, v, mask
        torch.cuda.empty_cache()

    for name in names if args.kernel_times else []:
        q, k, v, mask = make_inputs(ALL_SHAPES[name], args.seed)
        for row in rows:
            if row["shape"] != name or "config" not in row:
                continue
            cfg = FSAttnConfig(**row["config"])
            try:
                with ClockSampler() as clocks:
                    row["kernel_us"], row["kernel_span"] = kernel_times(
                        lambda: fsattn(q, k, v, attn_mask=mask, config=cfg))
                row["kernel_clocks"] = clocks.summary
            except Exception as exc:  # the row's timing stands; say why its split is missing
                row["kernel_us_error"] = f"{type(exc).__name__}: {exc}"[:300]
            span = row.get("kernel_span") or {}
            span_text = (f"(span {span['span_us_per_call'] / 1e3:.1f} ms a call, busy {span['busy_share']:.1%})"
                         if span else "")
            print(f"{name:16s} {row['method']:28s} GPU time per call by kernel:", row.get("kernel_us_error", ""),
                  span_text)
            for kernel, us in (row.get("kernel_us") or {}).items():
                print(f"{'':16s}   {us:10.1f} us  {kernel[:100]}", flush=True)
            save()
        del q, k, v, mask
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
