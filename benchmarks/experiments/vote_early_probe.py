"""Experiment (NOTES v34): the warp-specialised kernel's saturation vote before the tile's GEMMs
are issued (``fsattn_fwd_gluon_ws.VOTE_EARLY``) against the default (vote while they run, then
correction GEMMs), through `fsattn()` beside SDPA, one process, interleaved rounds; and at head
dim 64 with three consumers forced, the build that Triton 3.8 on serialises in the default form
and builds cleanly in this one. Accuracy of every variant against float64 on the input families.

    python3 benchmarks/experiments/vote_early_probe.py --out $OUT/vote_early.json
    python3 benchmarks/experiments/vote_early_probe.py --tests    # the WS kernel's GPU tests, vote early
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

from fsattn_diffusers import fsattn, ops, plan
from fsattn_diffusers.kernels import configs
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws
from fsattn_diffusers.metrics import cosine_similarity, relative_l1
from fsattn_diffusers.reference import attention_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from input_families import make_family  # noqa: E402

DEFAULT_CONSUMERS = configs.gluon_ws_consumers
SHAPES = {"cogvideox_d64": (2, 48, 17776, 64), "wan14b_720p": (1, 40, 75600, 128), "wan13b_480p": (1, 12, 32760, 128)}
FAMILIES = ("randn", "peaky", "late_sink", "max_staircase", "masked_keys", "huge_magnitude")


def use(early, three=False):
    ws.VOTE_EARLY = early
    count = (lambda *a, **k: 3) if three else DEFAULT_CONSUMERS
    ws.gluon_ws_consumers = configs.gluon_ws_consumers = count  # the plan and the launcher read it apart
    ws.gluon_ws_forward.cache_clear()
    plan._plan.cache_clear()
    ops._prepared_calls.clear()


def variants(head_dim):
    out = {"late": (False, False), "early": (True, False)}
    if head_dim == 64:
        out["early_three"] = (True, True)
    return out


def accuracy():
    rows = []
    for head_dim in (64, 128):
        for family in FAMILIES:
            gen = torch.Generator().manual_seed(11)
            q, k, v, mask = make_family(family, 2, 2048, 4096, 4, head_dim, device="cuda", generator=gen)
            ref = attention_reference(q, k, v, mask)[0]
            row = {"head_dim": head_dim, "family": family}
            for name, (early, three) in variants(head_dim).items():
                use(early, three)
                out = fsattn(q, k, v, attn_mask=mask)
                row[name] = {"finite": bool(torch.isfinite(out).all()), "cos": cosine_similarity(out, ref),
                             "rel_l1": relative_l1(out, ref)}
            print(row, flush=True)
            rows.append(row)
    return rows


def timing():
    rows = []
    for name, (bsz, heads, seq, head_dim) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        flops = 4.0 * bsz * heads * seq * seq * head_dim
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        row = {"shape": name, "sdpa_ms": triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qh, kh, vh), warmup=5, rep=300, return_mode="median")}
        times = {variant: [] for variant in variants(head_dim)}
        for _ in range(3):
            for variant, (early, three) in variants(head_dim).items():
                use(early, three)
                fsattn(q, k, v)
                times[variant].append(triton.testing.do_bench(lambda: fsattn(q, k, v), warmup=5, rep=300,
                                                              return_mode="median"))
        for variant, ms in times.items():
            row[f"ms_{variant}"] = ms
            row[f"tflops_{variant}"] = flops / sorted(ms)[1] / 1e9
        print(row, flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--tests", action="store_true")
    args = parser.parse_args()
    if args.tests:
        import pytest

        use(True)
        sys.exit(pytest.main([os.path.join(ROOT, "tests/kernels/test_fsattn_fwd_gluon.py"), "-m", "gpu", "-q", "-rs",
                              "-p", "no:cacheprovider"]))
    report = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "accuracy": accuracy(), "timing": timing()}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
