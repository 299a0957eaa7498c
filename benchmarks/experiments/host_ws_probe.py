"""Where the host time of an fsattn() call goes, per piece, on the warp-specialised kernel and the
Triton kernel (tiny shape, GPU idle): a CPU clock around each piece of ``PreparedCall.run``,
replicated here, in bursts of 16 calls with the GPU drained between bursts; cProfile of many
calls; and the Triton launcher's per-descriptor conversion timed alone.

    python benchmarks/experiments/host_ws_probe.py --out host_ws.json     # a CUDA GPU
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from fsattn_diffusers import FSAttnConfig, fsattn
from fsattn_diffusers import ops
from fsattn_diffusers.attention import key_mask, refusal
from fsattn_diffusers.kernels.launch import Address, carve, current_stream

SHAPES = {"ws": ((1, 256, 2, 128), {"kernel": "gluon_ws"}), "ws_2k": ((1, 2048, 2, 128), {}),
          "triton": ((1, 256, 2, 128), {}), "d64": ((1, 256, 2, 64), {})}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def burst_us(fn, burst=16, rounds=100):
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append((time.perf_counter() - t) / burst)
    torch.cuda.synchronize()
    return median(times) * 1e6


def pieces(prepared, q, k, v, scale, burst=16, rounds=100):
    """PreparedCall.run's direct path, each piece timed (µs per call, medians over bursts)."""
    acc = {n: [] for n in ("empties", "kv_launch", "q_launch", "fwd_args", "fwd_launch", "total")}
    fwd = prepared.forward
    device = q.device.index
    for r in range(rounds + 5):
        torch.cuda.synchronize()
        sums = dict.fromkeys(acc, 0.0)
        for _ in range(burst):
            t0 = time.perf_counter()
            stream = current_stream(device)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(prepared.lse_shape, dtype=torch.float32, device=q.device)
            scratch = torch.empty(prepared._bytes, dtype=torch.uint8, device=q.device)
            ws, k_q, v_t, rowsum, q_q, q_scale, q_dot_k_mean = carve(scratch, prepared._sizes)
            t1 = time.perf_counter()
            prepared.kv_prepass.launch(k, v, None, ws, k_q, v_t, rowsum, stream)
            k_mean, v_mean, v_scale, k_scale = (Address(ws + o) for o in prepared.kv_prepass.stat_offsets)
            buffers = prepared._buffers(ws, k_q, k_scale, k_mean, v_t, v_scale, v_mean, rowsum, q_q, q_scale,
                                        q_dot_k_mean)
            t2 = time.perf_counter()
            if prepared.with_counter:
                from fsattn_diffusers import stats
                fwd.run_into(q, buffers, out, lse, stats.fallback_counter(q.device), scale, None, stream)
                t3 = t4 = t5 = time.perf_counter()
            else:
                fwd._operands.quantize_q_into(q, buffers, scale, stream)
                t3 = time.perf_counter()
                args = fwd._operands.args(buffers, out, lse)
                from fsattn_diffusers.kernels.gluon_common import _descriptor
                import triton.experimental.gluon.language as gl
                ks = (_descriptor(buffers.k_scale, (fwd._block_n,), gl.float32, (fwd._operands.k_scale_numel,), (1,))
                      if fwd._ks_in_ring else None)
                t4 = time.perf_counter()
                fwd._launch(*args[:4], ks, *args[4:], stream=stream)
                t5 = time.perf_counter()
            for n, dt in (("empties", t1 - t0), ("kv_launch", t2 - t1), ("q_launch", t3 - t2), ("fwd_args", t4 - t3),
                          ("fwd_launch", t5 - t4), ("total", t5 - t0)):
                sums[n] += dt
        if r >= 5:
            for n in acc:
                acc[n].append(sums[n] / burst)
    torch.cuda.synchronize()
    return {n: median(x) * 1e6 for n, x in acc.items()}


def tensordesc_cost(prepared):
    """The Triton launcher's per-launch conversion of one TMA descriptor (µs), and the raw encode."""
    import triton
    from triton.backends.nvidia import driver as nvdriver

    fast = prepared.forward._launch._fast
    if fast is None:
        return {"note": "forward not direct"}
    runner = fast[0]
    compiled = getattr(runner, "__self__", None)
    out = {"runner_type": type(runner).__name__}
    # find the CompiledKernel in the runner's closure (CompiledKernel[grid] returns a closure)
    cells = [c.cell_contents for c in (getattr(runner, "__closure__", None) or ())]
    ck = next((c for c in cells if hasattr(c, "metadata") and hasattr(c, "run")), None)
    if ck is None:
        return {**out, "note": "no CompiledKernel in the runner's closure", "cells": [type(c).__name__ for c in cells]}
    meta = getattr(ck.metadata, "tensordesc_meta", None)
    out["n_tensordesc"] = len(meta or [])
    out["launch_fn"] = type(ck.run.launch).__name__
    t = torch.empty(1 << 20, dtype=torch.int8, device="cuda")
    from fsattn_diffusers.kernels.gluon_common import _descriptor
    import triton.experimental.gluon.language as gl
    desc = _descriptor(t, (64, 128), gl.int8, (8192, 128), (128, 1))
    if meta:
        m = meta[0]
        n = 5000
        s = time.perf_counter()
        for _ in range(n):
            nvdriver.make_tensordesc_arg(desc, m) if triton.__version__.startswith("3.6") else None
        out["make_tensordesc_arg_us"] = (time.perf_counter() - s) / n * 1e6
        utils = triton.runtime.driver.active.utils
        fill = getattr(utils, "fill_tma_descriptor", None) or getattr(utils, "fill_tma_descriptor_tiled")
        s = time.perf_counter()
        for _ in range(n):
            triton.runtime.driver.active.utils
        out["driver_active_utils_us"] = (time.perf_counter() - s) / n * 1e6
        out["meta0"] = {k: (v if isinstance(v, (int, str, bool, list)) else str(v)) for k, v in m.items()}
    return out


def profile_calls(call, n=3000):
    pr = cProfile.Profile()
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    pr.enable()
    for i in range(n):
        call()
        if i % 16 == 15:
            torch.cuda.synchronize()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    return s.getvalue()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import triton
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for name, (shape, fields) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        cfg = FSAttnConfig(**fields)
        cj = cfg.to_json()
        scale = shape[-1] ** -0.5
        r = {}
        r["fsattn_us"] = burst_us(lambda: fsattn(q, k, v, config=cfg))
        r["attention_impl_us"] = burst_us(lambda: ops.attention_impl(q, k, v, None, None, scale, "NHD", cj))
        r["refusal_us"] = burst_us(lambda: refusal(q, k, v, None, None, layout="NHD", check_device=False), rounds=30)
        r["key_mask_us"] = burst_us(lambda: key_mask(None, q, k, "NHD"), rounds=30)
        r["to_json_us"] = burst_us(lambda: cfg.to_json(), rounds=30)
        dev = torch.cuda.current_device()
        r["call_key_us"] = burst_us(lambda: ops._call_key(q, k, v, None, None, "NHD", cj, dev), rounds=30)
        key = ops._call_key(q, k, v, None, None, "NHD", cj, dev)
        prepared = ops._prepared_calls[key]
        r["plan_kernel"] = type(prepared.forward).__name__
        r["direct"] = bool(prepared.kv_prepass.direct and prepared.forward.direct)
        stream = current_stream(dev)
        r["prepared_run_us"] = burst_us(lambda: prepared.run(q, k, v, None, None, scale, stream))
        if r["direct"]:
            r["pieces_us"] = pieces(prepared, q, k, v, scale)
            if not prepared.with_counter:
                r["tensordesc"] = tensordesc_cost(prepared)
        r["profile"] = profile_calls(lambda: fsattn(q, k, v, config=cfg))
        res[name] = r
        print(name, {k: v for k, v in r.items() if k != "profile"}, flush=True)
        print(r["profile"][:6000], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
