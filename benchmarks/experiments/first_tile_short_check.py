"""Experiment (NOTES v36 (f), v37 (a)): the warp-specialised kernel's first tile from its own max
against the kernel before it (a module file given by path) where `fsattn()` would not send a call
to it: head dim 128 with one key tile, a partial last tile, and a few tiles (kernel="gluon_ws"
forced), under both speculative policies (the vote while the GEMMs run, and forced before them).
Per case: bit-equality, each kernel run twice (is either not repeatable?), and where they differ,
how many values, in which query rows and heads, by how much, and each kernel's distance to float64.

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
from fsattn_diffusers.metrics import cosine_similarity, relative_l1

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from input_families import make_family  # noqa: E402

FAMILIES = ("randn", "peaky", "late_sink", "max_staircase", "masked_keys", "padded_keys", "fully_masked")


def reference(q, k, v, mask):
    """Float64 attention, NHD in and out (fully masked rows give 0, as fsattn's do)."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2)


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

    def run(module, q, k, v, mask):
        plan.gluon_module = lambda name, m=module: m if name == "fsattn_fwd_gluon_ws" else real(name)
        ops._prepared_calls.clear()
        return fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)

    rows = []
    for early in [p == "early" for p in args.policies]:
        for module in (before, after):
            module.gluon_ws_votes_early = lambda *a, e=early, **k: e
            module.gluon_ws_forward.cache_clear()
        for seq_k in args.seq_k:
            for family in args.families:
                q, k, v, mask = make_family(family, 2, 1000, seq_k, 4, 128, device="cuda",
                                            generator=torch.Generator().manual_seed(3))
                o0, l0 = run(before, q, k, v, mask)
                o1, l1 = run(after, q, k, v, mask)
                o0b, l0b = run(before, q, k, v, mask)
                o1b, l1b = run(after, q, k, v, mask)
                ref = reference(q, k, v, mask)
                row = {"vote_before_gemms": early, "seq_k": seq_k, "family": family,
                       "bit_equal": bool(torch.equal(o0, o1) and torch.equal(l0, l1)),
                       "before_repeatable": bool(torch.equal(o0, o0b) and torch.equal(l0, l0b)),
                       "after_repeatable": bool(torch.equal(o1, o1b) and torch.equal(l1, l1b)),
                       "finite": bool(torch.isfinite(o1).all() and torch.isfinite(o0).all()),
                       "before_cos": cosine_similarity(o0, ref), "after_cos": cosine_similarity(o1, ref),
                       "before_rel_l1": relative_l1(o0, ref), "after_rel_l1": relative_l1(o1, ref)}
                diff = o0 != o1  # (B, Sq, H, D)
                if diff.any():
                    rows_differing = diff.any(-1)  # (B, Sq, H)
                    idx = rows_differing.nonzero().tolist()
                    d = (o0.float() - o1.float()).abs()
                    row.update({
                        "out_values_differing": int(diff.sum()), "out_rows_differing": len(idx),
                        "rows_differing_first": idx[:12],
                        "query_rows_differing": sorted({i[1] for i in idx})[:40],
                        "out_max_abs_diff": float(d.max()), "out_max_abs": float(o1.float().abs().max()),
                        "out_diff_in_bf16_ulps_max": float((d / o1.float().abs().clamp_min(1e-30)).max() * 128),
                        "per_row_rel_l1_max": float((d.sum(-1) / o1.float().abs().sum(-1).clamp_min(1e-30)).max()),
                    })
                ldiff = l0 != l1
                if ldiff.any():
                    row.update({"lse_values_differing": int(ldiff.sum()),
                                "lse_max_abs_diff": float((l0 - l1).abs().max()),
                                "lse_rows_differing_first": ldiff.nonzero().tolist()[:12]})
                print(row, flush=True)
                rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("bit-equal", sum(r["bit_equal"] for r in rows), "of", len(rows),
          "; before repeatable", sum(r["before_repeatable"] for r in rows),
          "; after repeatable", sum(r["after_repeatable"] for r in rows))


if __name__ == "__main__":
    main()
