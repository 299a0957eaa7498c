"""Experiment (NOTES v36): bit-equality of the warp-specialised kernel's first tile from its own max
against the kernel before it (a module file given by path) where `fsattn()` would not send a call
to it: head dim 128 with one key tile, a partial last tile, and a few tiles (kernel="gluon_ws"
forced), under both speculative policies (the vote while the GEMMs run, and forced before them).

    python3 benchmarks/experiments/first_tile_short_check.py --before OLD.py --out $OUT/short.json
"""

import argparse
import json
import os
import shutil
import sys

import torch

import fsattn_diffusers.kernels as kernels_pkg
from fsattn_diffusers import FSAttnConfig, fsattn, ops, plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from input_families import make_family  # noqa: E402

FAMILIES = ("randn", "peaky", "late_sink", "max_staircase", "masked_keys", "padded_keys", "fully_masked")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-k", type=int, nargs="+", default=[100, 700, 1500])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--policies", nargs="+", default=["late", "early"], choices=["late", "early"])
    args = parser.parse_args()
    shutil.copy(args.before, os.path.join(os.path.dirname(kernels_pkg.__file__), "_ws_before.py"))
    from fsattn_diffusers.kernels import _ws_before as before
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as after

    real = plan.gluon_module
    cfg = FSAttnConfig(kernel="gluon_ws")
    rows = []
    for early in [p == "early" for p in args.policies]:
        for module in (before, after):
            module.gluon_ws_votes_early = lambda *a, e=early, **k: e
            module.gluon_ws_forward.cache_clear()
        for seq_k in args.seq_k:
            for family in args.families:
                q, k, v, mask = make_family(family, 2, 1000, seq_k, 4, 128, device="cuda",
                                            generator=torch.Generator().manual_seed(3))
                res = []
                for module in (before, after):
                    plan.gluon_module = lambda name, m=module: m if name == "fsattn_fwd_gluon_ws" else real(name)
                    ops._prepared_calls.clear()
                    res.append(fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg))
                (o0, l0), (o1, l1) = res
                ops._prepared_calls.clear()
                o2, l2 = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)  # `after` again
                row = {"vote_before_gemms": early, "seq_k": seq_k, "family": family,
                       "bit_equal": bool(torch.equal(o0, o1) and torch.equal(l0, l1)),
                       "after_repeatable": bool(torch.equal(o1, o2) and torch.equal(l1, l2)),
                       "out_values_differing": int((o0 != o1).sum()), "out_max_abs_diff": float((o0.float() - o1.float()).abs().max()),
                       "out_max_abs": float(o1.float().abs().max()),
                       "lse_values_differing": int((l0 != l1).sum()), "lse_max_abs_diff": float((l0 - l1).abs().max()),
                       "finite": bool(torch.isfinite(o1).all())}
                print(row, flush=True)
                rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("bit-equal", sum(r["bit_equal"] for r in rows), "of", len(rows))


if __name__ == "__main__":
    main()
