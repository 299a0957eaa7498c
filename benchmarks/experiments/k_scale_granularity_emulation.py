"""Experiment (NOTES v39), CPU only: how close to float64 the emulated kernel numerics stay with one K
scale per key (the default), one per 128-key tile, one per tile after sorting each head's keys by
their centred amax (largest first, masked keys last), and four per tile (the 32 keys each lane of a
quad holds in the score accumulator: keys 8i + 2t + j share lane t's scale), on the input families.

    python3 benchmarks/experiments/k_scale_granularity_emulation.py --out FILE [--seq-k 1024 4096 16384]
"""

import argparse
import json
import math
import os
import sys

import torch

import fsattn_diffusers.reference as reference
from fsattn_diffusers import FSAttnConfig, fsattn
from fsattn_diffusers.metrics import cosine_similarity, relative_l1

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from input_families import INPUT_FAMILIES, make_family  # noqa: E402

BLOCK = FSAttnConfig(k_granularity="block")
_per_block = reference._quantize_k


def _per_lane_of_quad(k, key_weight, config, block_n):
    """reference._quantize_k with four scales per tile: keys 8i + 2t + j (i < block_n / 8, j < 2) share one."""
    bsz, heads, seq_k, dim = k.shape
    s_pad = math.ceil(seq_k / block_n) * block_n
    k_mean = reference._masked_mean(k, key_weight)
    kc = torch.where(key_weight[:, None, :, None] != 0, k - k_mean[:, :, None], 0.0)
    kc = torch.nn.functional.pad(kc, (0, 0, 0, s_pad - seq_k))
    t = kc.view(bsz, heads, s_pad // block_n, block_n // 8, 4, 2, dim)
    amax = t.abs().amax(dim=(3, 5, 6), keepdim=True).clamp_min(1e-20)
    k8 = reference._round_half_away(t * (127.0 / amax)).view_as(kc)
    return k8, (amax / 127.0).expand_as(t[..., :1]).reshape(bsz, heads, s_pad), k_mean


def sorted_keys(k, v, mask):
    """Each (batch, head)'s keys by centred amax, largest first, masked keys last (so the mask is
    then the same for every head); None for a float mask."""
    if mask is not None and mask.dtype != torch.bool:
        return None
    bsz, seq_k, heads, _ = k.shape
    keep = torch.ones(bsz, seq_k, dtype=torch.bool) if mask is None else mask.reshape(bsz, seq_k)
    kf = k.float()
    mean = (kf * keep[:, :, None, None]).sum(1, keepdim=True) / keep.sum(1).clamp_min(1)[:, None, None, None]
    amax = torch.where(keep[:, :, None], (kf - mean).abs().amax(-1), -1.0)
    order = torch.argsort(amax, dim=1, descending=True, stable=True)[..., None].expand_as(k)
    new_mask = None if mask is None else (torch.arange(seq_k)[None] < keep.sum(1)[:, None])[:, None, None]
    return k.gather(1, order), v.gather(1, order), new_mask


def run(seq_ks):
    rows = []
    for seq_k in seq_ks:
        for head_dim in (128, 64):
            for family in INPUT_FAMILIES[:-1]:  # huge_magnitude only checks finiteness
                q, k, v, mask = make_family(family, 2, 1024, seq_k, 2, head_dim,
                                            generator=torch.Generator().manual_seed(77 + head_dim))
                ref = reference.attention_reference(q, k, v, mask)[0]
                outs = {"token": fsattn(q, k, v, attn_mask=mask), "tile": fsattn(q, k, v, attn_mask=mask, config=BLOCK)}
                resorted = sorted_keys(k, v, mask)
                if resorted is not None:
                    k2, v2, m2 = resorted
                    outs["sorted_tile"] = fsattn(q, k2, v2, attn_mask=m2, config=BLOCK)
                reference._quantize_k = _per_lane_of_quad
                try:
                    outs["lane_of_quad"] = fsattn(q, k, v, attn_mask=mask, config=BLOCK)
                finally:
                    reference._quantize_k = _per_block
                row = {"seq_k": seq_k, "head_dim": head_dim, "family": family}
                for name, out in outs.items():
                    row[name] = {"cos": round(cosine_similarity(out, ref), 6),
                                 "rel_l1_pct": round(100 * relative_l1(out, ref), 3)}
                print(row, flush=True)
                rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-k", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    report = {"torch": torch.__version__, "device": "cpu (emulation of the kernels' numerics)",
              "queries": 1024, "batch": 2, "heads": 2, "rows": run(args.seq_k)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
