"""Experiment (NOTES v37): builds of the warp-specialised kernel module given by file against the
package's own, through `fsattn()` beside SDPA, one process, interleaved rounds (the order rotates).
Each should be bit-equal to the package's: outputs and LSE are compared on the input families (head
dims 64 and 128; one key tile, a partial last tile, many) and on the timed shapes.

    python3 benchmarks/experiments/ws_variant_probe.py --variant token=FILE [--variant NAME=FILE ...] \
        --out $OUT/variants.json [--rounds 5] [--shapes wan14b_720p ...] [--families 2] [--block-k NAME ...]

Each FILE is copied into the package as kernels/_ws_<NAME>.py so that its relative imports resolve.
A variant named by --block-k runs with one K scale per 128-key tile (FSAttnConfig(k_granularity=
"block"), the plan let through to the warp-specialised kernel): not bit-equal to the package's. Its
accuracy rows are also taken with each head's keys sorted by their centred amax, largest first, masked
keys last (what a sorting pre-pass would do; done here in torch), and the timing rows give that
sort's own time at each shape and the K/V pass's time with either K-scale granularity; such a
variant is also timed on the keys sorted so (the sort outside the time), as "<NAME>_sorted".
"""

import argparse
import importlib
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F
import triton

import fsattn_diffusers.kernels as kernels_pkg
from fsattn_diffusers import FSAttnConfig, fsattn, ops, plan
from fsattn_diffusers.kernels.quantize import quantize_kv
from fsattn_diffusers.metrics import cosine_similarity, relative_l1
from fsattn_diffusers.reference import attention_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from input_families import INPUT_FAMILIES, make_family  # noqa: E402

SHAPES = {"wan14b_720p": (1, 40, 75600, 128), "wan13b_480p": (1, 12, 32760, 128),
          "cogvideox_d64": (2, 48, 17776, 64), "seq_16384": (1, 12, 16384, 128), "seq_8192": (1, 12, 8192, 128)}
_real_gluon_module = plan.gluon_module
MODULES = {"package": None}  # variant name -> kernel module (None: the package's own)
BLOCK_K = set()  # variants run with one K scale per key tile
_real_default_numerics = plan._default_numerics
CONFIG = {"config": None}


def use(variant):
    module = MODULES[variant]
    plan.gluon_module = _real_gluon_module if module is None else (
        lambda name: module if name == "fsattn_fwd_gluon_ws" else _real_gluon_module(name))
    if variant in BLOCK_K:
        plan._default_numerics = lambda p, has_bias: _real_default_numerics(
            plan._dataclass_replace(p, k_per_token=True), has_bias)
        # The warp-specialised kernel forced: with at most 1,024 keys at head dim 128 the plan would
        # send the call to the Triton kernel's per-block path instead (a float mask still goes there).
        CONFIG["config"] = FSAttnConfig(k_granularity="block", kernel="gluon_ws")
    else:
        plan._default_numerics = _real_default_numerics
        CONFIG["config"] = None
    plan._plan.cache_clear()
    ops._prepared_calls.clear()


def call(q, k, v, mask=None, return_lse=False):
    return fsattn(q, k, v, attn_mask=mask, return_lse=return_lse, config=CONFIG["config"])


def sorted_keys(k, v, mask):
    """Each (batch, head)'s keys by their centred amax, largest first, masked keys last: the mask is
    then the same for every head. None for float masks (per-key biases would differ by head)."""
    if mask is not None and mask.dtype != torch.bool:
        return None
    bsz, seq_k, heads, _ = k.shape
    keep = torch.ones(bsz, seq_k, dtype=torch.bool, device=k.device) if mask is None else mask.reshape(bsz, seq_k)
    kf = k.float()
    mean = (kf * keep[:, :, None, None]).sum(1, keepdim=True) / keep.sum(1).clamp_min(1)[:, None, None, None]
    amax = torch.where(keep[:, :, None], (kf - mean).abs().amax(-1), -1.0)  # (B, S, H)
    order = torch.argsort(amax, dim=1, descending=True, stable=True)[..., None].expand_as(k)
    n_keep = keep.sum(1)
    new_mask = None if mask is None else (torch.arange(seq_k, device=k.device)[None] < n_keep[:, None])[:, None, None]
    return k.gather(1, order), v.gather(1, order), new_mask


def compare(q, k, v, mask):
    """Each module's output and LSE (the package's first), and each variant's bit-equality to the package's."""
    res = {}
    for variant in MODULES:
        use(variant)
        res[variant] = call(q, k, v, mask, return_lse=True)
    o0, l0 = res["package"]
    return res, {name: {"bit_equal": bool(torch.equal(o, o0) and torch.equal(lse, l0)),
                        "max_abs_diff": float((o.float() - o0.float()).abs().max())}
                 for name, (o, lse) in res.items() if name != "package"}


def accuracy(n_families):
    rows = []
    for head_dim in (64, 128):
        for seq_k in (100, 700, 4096):  # one tile (the peel is the last tile too), a partial last tile, many
            for family in INPUT_FAMILIES[:n_families]:
                gen = torch.Generator().manual_seed(7)
                q, k, v, mask = make_family(family, 2, 1000, seq_k, 4, head_dim, device="cuda", generator=gen)
                res, equal = compare(q, k, v, mask)
                ref = attention_reference(q, k, v, mask)[0]
                row = {"head_dim": head_dim, "seq_k": seq_k, "family": family, "against_first": equal,
                       "kernel": {}}
                has_bias = mask is not None and mask.dtype != torch.bool  # a float mask taken as biased
                for name in MODULES:
                    use(name)
                    row["kernel"][name] = ops.call_plan(CONFIG["config"] or FSAttnConfig(), q.device, head_dim,
                                                        has_bias, q.dtype, seq_k).kernel
                for name, (out, _) in res.items():
                    row[name] = {"finite": bool(torch.isfinite(out).all()), "cos": cosine_similarity(out, ref),
                                 "rel_l1": relative_l1(out, ref)}
                resorted = sorted_keys(k, v, mask)
                for name in BLOCK_K if resorted is not None else ():
                    use(name)
                    out = call(q, *resorted)
                    row[name + "_sorted"] = {"finite": bool(torch.isfinite(out).all()),
                                             "cos": cosine_similarity(out, ref), "rel_l1": relative_l1(out, ref)}
                print(row, flush=True)
                rows.append(row)
    return rows


def timing(shapes, rounds):
    rows = []
    for name in shapes:
        bsz, heads, seq, head_dim = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        flops = 4.0 * bsz * heads * seq * seq * head_dim
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        row = {"shape": name, "sdpa_ms": triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qh, kh, vh), warmup=5, rep=300, return_mode="median")}
        del qh, kh, vh
        _, row["against_first"] = compare(q, k, v, None)
        if BLOCK_K:  # what a sorting pre-pass adds: each head's keys ordered by a float32 key
            amax = torch.rand(bsz * heads, -(-seq // 128) * 128, device="cuda")
            row["argsort_ms"] = triton.testing.do_bench(
                lambda: torch.argsort(amax, dim=1, descending=True, stable=True), warmup=5, rep=100,
                return_mode="median")
            # The K/V pass alone per K-scale granularity, so that the forward's own difference can be
            # told from the packing's (per-tile scales pack a whole tile per step).
            for per_token in (True, False):
                row[f"kv_pass_ms_{'token' if per_token else 'tile'}"] = triton.testing.do_bench(
                    lambda: quantize_kv(k, v, None, block_n=128, d_pad=head_dim, k_per_token=per_token,
                                        pv_key_order="wgmma"), warmup=5, rep=100, return_mode="median")
        # Per-tile variants also on the keys sorted as the product's pre-pass would store them (the
        # sort itself outside the time): the sorted order changes the speculative max's corrections.
        inputs = {variant: (k, v) for variant in MODULES}
        if BLOCK_K:
            k_sorted, v_sorted, _ = sorted_keys(k, v, None)
            inputs.update({f"{name}_sorted": (k_sorted, v_sorted) for name in BLOCK_K})
        times = {variant: [] for variant in inputs}
        for r in range(rounds):  # the order rotates from round to round
            names = list(times)
            for variant in names[r % len(names):] + names[:r % len(names)]:
                use(variant.removesuffix("_sorted") if variant not in MODULES else variant)
                kk, vv = inputs[variant]
                call(q, kk, vv)
                times[variant].append(triton.testing.do_bench(lambda: call(q, kk, vv), warmup=5, rep=300,
                                                              return_mode="median"))
        for variant, ms in times.items():
            row[f"ms_{variant}"] = ms
            row[f"tflops_{variant}"] = flops / sorted(ms)[len(ms) // 2] / 1e9
        print(row, flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", action="append", default=[], help="NAME=FILE, a kernel module to time")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--families", type=int, default=len(INPUT_FAMILIES), help="the first N input families")
    parser.add_argument("--block-k", nargs="*", default=[], help="variants run with one K scale per key tile")
    args = parser.parse_args()
    unknown = set(args.block_k) - {spec.split("=", 1)[0] for spec in args.variant}
    if unknown:
        parser.error(f"--block-k names no --variant: {sorted(unknown)}")
    BLOCK_K.update(args.block_k)
    variants = {}
    for spec in args.variant:
        name, path = spec.split("=", 1)
        shutil.copy(path, os.path.join(os.path.dirname(kernels_pkg.__file__), f"_ws_{name}.py"))
        variants[name] = importlib.import_module(f"fsattn_diffusers.kernels._ws_{name}")
    MODULES.clear()
    MODULES["package"] = None
    MODULES.update(variants)
    report = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "accuracy": accuracy(args.families), "timing": timing(args.shapes, args.rounds)}
    # A Gluon module that failed to compile turns the kernel off for the process (every variant).
    report["gluon_disabled"] = sorted(plan._DISABLED_GLUON)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
