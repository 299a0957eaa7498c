"""Experiment (NOTES v21 (b)): where the host time of a prepared fsattn() call goes.

    python benchmarks/experiments/host_profile_probe.py --out host_profile.json   # a CUDA GPU

Times, in bursts of 16 calls with the GPU idle (bench_host.host_burst_time), the whole call, the
op (``attention_impl``), the prepared call's ``run`` alone, and nine ``torch.empty``; then
profiles 300 whole calls with cProfile (top functions by own time).
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
from bench_host import CASES, _inputs, host_burst_time  # noqa: E402

from fsattn_diffusers import FSAttnConfig, fsattn, ops  # noqa: E402
from fsattn_diffusers.attention import key_mask  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["d128", "d128_gluon_ws", "d64", "d128_bool_mask"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with torch.no_grad():
        for name in args.cases:
            shape, mask_kind, fields = CASES[name]
            q, k, v, mask = _inputs(shape, mask_kind)
            config = FSAttnConfig(**fields)
            cfg_json = config.to_json()
            weight, bias = key_mask(mask, q, k)
            fsattn(q, k, v, attn_mask=mask, config=config)
            prepared = ops._prepared_calls[ops._call_key(q, k, v, weight, bias, "NHD", cfg_json)]
            pieces = {
                "fsattn": lambda: fsattn(q, k, v, attn_mask=mask, config=config),
                "attention_impl": lambda: ops.attention_impl(q, k, v, weight, bias, 0.088, "NHD", cfg_json),
                "prepared_run": lambda: prepared.run(q, k, v, weight, bias, 0.088),
                "kv_prepass_run": lambda: prepared.kv_prepass.run(k, v, weight),
                "nine_empty": lambda: [torch.empty(4096, device="cuda") for _ in range(9)],
                "call_key": lambda: ops._call_key(q, k, v, weight, bias, "NHD", cfg_json),
            }
            row = {"case": name, "us": {n: host_burst_time(f) * 1e6 for n, f in pieces.items()}}
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fsattn(q, k, v, attn_mask=mask, config=config)
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            row["cprofile_top"] = text.getvalue()
            rows.append(row)
            print(name, json.dumps({n: round(t, 1) for n, t in row["us"].items()}), flush=True)
            print(row["cprofile_top"][:3500], flush=True)
    import triton
    report = {"environment": {"torch": torch.__version__, "triton": triton.__version__,
                              "gpu": torch.cuda.get_device_name()}, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
