"""Experiment (NOTES v26): Q's quantisation pass with its programs ordered heads first.

Q arrives from diffusers as (B, S, H, D), each token's heads contiguous. ``_quantize_q_kernel``'s
grid runs row blocks first: the programs in flight at once read 256 bytes (one head's channels)
of each of thousands of tokens, 10 KB apart at Wan2.1-14B, and the pass streamed at ~3.2 TB/s
(NOTES v18 (e), v20 (a)). With ``quantize.Q_HEADS_FIRST`` the programs in flight read whole
tokens. Same arithmetic per program, so the outputs must be bit-equal.

    python benchmarks/experiments/q_order_probe.py --out qo.json        # H200: bits, then times, one process

Per shape: Q's pass alone (``quantize_q``, at the block sizes the kernels use), ``fsattn()`` and,
for the cross-attention shapes, ``fsattn()`` with 64-key tiles (NOTES v18 (e): 2-4 % at 512
keys); SDPA in the same process. Five interleaved rounds of both orders, medians.
"""
import argparse
import functools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir))
from fsattn_diffusers import FSAttnConfig, fsattn, ops  # noqa: E402
from fsattn_diffusers.kernels import fsattn_fwd, gluon_common, quantize  # noqa: E402

# name -> (B, H, Sq, Sk, D)
SHAPES = {"wan13b_cross": (1, 12, 32760, 512, 128), "wan14b_cross": (1, 40, 75600, 512, 128),
          "wan14b_self": (1, 40, 75600, 75600, 128), "wan13b_self": (1, 12, 32760, 32760, 128),
          "cogvideox_d64": (2, 48, 17776, 17776, 64)}
CROSS = {"wan13b_cross", "wan14b_cross"}


def set_order(heads_first: bool):
    """Every cached object that holds a QPrepass is rebuilt after this."""
    quantize.Q_HEADS_FIRST = heads_first
    mods = [quantize, fsattn_fwd, gluon_common]
    try:
        from fsattn_diffusers.kernels import fsattn_fwd_gluon, fsattn_fwd_gluon_ws
        mods += [fsattn_fwd_gluon, fsattn_fwd_gluon_ws]
    except ImportError:
        pass
    for mod in mods:
        for value in vars(mod).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
    ops._prepared_calls.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"environment": {"torch": torch.__version__, "triton": triton.__version__,
                              "gpu": torch.cuda.get_device_name()}, "rows": {}}
    for name in args.shapes:
        bsz, heads, seq_q, seq_k, dim = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, s, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
                   for s in (seq_q, seq_k, seq_k))
        kv = quantize.quantize_kv(k, v, None, block_n=128, d_pad=max(64, dim))
        block_ms = (64, 128) if dim == 128 else (64,)
        fns = {f"q_pass_m{bm}": (lambda bm=bm: quantize.quantize_q(q, kv, sm_scale=dim**-0.5, block_m=bm))
               for bm in block_ms}
        fns["fsattn"] = lambda: fsattn(q, k, v)
        if name in CROSS:
            n64 = FSAttnConfig(block_n=64)
            fns["fsattn_n64"] = lambda: fsattn(q, k, v, config=n64)
        row = {"shape": [bsz, heads, seq_q, seq_k, dim], "bit_equal": {}}
        outputs = {}
        for heads_first in (False, True):
            set_order(heads_first)
            for label, fn in fns.items():
                out = fn()
                got = [out.q_q, out.q_scale, out.q_dot_k_mean] if label.startswith("q_pass") else [out]
                if heads_first:
                    row["bit_equal"][label] = all(torch.equal(a, b) for a, b in zip(outputs[label], got))
                else:
                    outputs[label] = got
        del outputs
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        times = {"sdpa": []}
        times.update({f"{label}_{order}": [] for label in fns for order in ("rows_first", "heads_first")})
        reps = 100 if seq_k <= 1024 or seq_q <= 20000 else 10
        for _ in range(args.rounds):
            times["sdpa"].append(do_bench(lambda: F.scaled_dot_product_attention(qh, kh, vh), warmup=10, rep=reps))
            for heads_first, order in ((False, "rows_first"), (True, "heads_first")):
                set_order(heads_first)
                for label, fn in fns.items():
                    times[f"{label}_{order}"].append(do_bench(fn, warmup=10, rep=reps))
        del qh, kh, vh
        row["ms"] = {label: statistics.median(t) for label, t in times.items()}
        row["ms_rounds"] = times
        q_bytes = q.numel() * 2 + q.numel() + 8 * bsz * heads * seq_q
        row["q_pass_tb_s"] = {label: q_bytes / (t * 1e-3) / 1e12 for label, t in row["ms"].items()
                              if label.startswith("q_pass")}
        row["vs_sdpa"] = {label: row["ms"]["sdpa"] / t for label, t in row["ms"].items() if label.startswith("fsattn")}
        print(name, json.dumps({key: row[key] for key in ("bit_equal", "ms", "q_pass_tb_s", "vs_sdpa")}), flush=True)
        report["rows"][name] = row
        del q, k, v, kv
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    failed = [n for n, r in report["rows"].items() if not all(r["bit_equal"].values())]
    if failed:
        raise SystemExit(f"heads-first output differs at {failed}")


if __name__ == "__main__":
    main()
