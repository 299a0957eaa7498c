"""How often the warp-specialised kernel's speculative max takes a correction, with keys in their
own order and sorted by size (the order of k_granularity="sorted_block"), emulated on the CPU.

The kernel's policy (fsattn_fwd_gluon_ws): per consumer warpgroup of 64 query rows, the running max
m starts from key tile 0's own row max at head dim 128 (from -inf at 64, so tile 0 always
corrects there); each later tile's P = 2^(x - m + 4) becomes FP8's 448 (it rounds there from 432
up) when a score x rises log2(432) - 4 or more above m, and one such row makes the warpgroup correct
the tile, after which m is the row max over it. Scores exact (float64), in log2 units;
quantisation left out; masked keys left out (the kernel scores them at the attended keys' mean).
"""
import argparse
import json
import math
import sys
import time

import torch

sys.path.insert(0, "tests")
from input_families import make_family

LOG2E = 1.4426950408889634
LIMIT = math.log2(432.0) - 4.0


def key_order(k, keep):
    """(B, H, S): the product's order, largest centred amax first, masked keys last."""
    w = keep.float()[:, None, :, None]
    mean = (k * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp_min(1)
    size = (k - mean).abs().amax(-1)
    size = torch.where(keep[:, None, :], size, -1.0)
    return torch.argsort(size, dim=-1, descending=True, stable=True)


def corrections(q, k, keep, d, first_from_own_max, block_n=128, rows=64):
    """(corrected warpgroup-tiles, warpgroup-tiles) over the batch and heads."""
    scale = d ** -0.5 * LOG2E
    bsz, heads, sq, _ = q.shape
    sk = k.shape[2]
    n_tiles = math.ceil(sk / block_n)
    pad = n_tiles * block_n - sk
    corrected = total = 0
    for b in range(bsz):
        for h in range(heads):
            x = (q[b, h] @ k[b, h].T) * scale  # (Sq, Sk)
            x = torch.where(keep[b][None, :], x, -math.inf)
            x = torch.nn.functional.pad(x, (0, pad), value=-math.inf)
            tmax = x.view(sq, n_tiles, block_n).amax(-1)  # (Sq, n_tiles)
            for r0 in range(0, sq, rows):
                t = tmax[r0:r0 + rows]
                m = t[:, 0].clone() if first_from_own_max else torch.full_like(t[:, 0], -math.inf)
                if not first_from_own_max:
                    corrected += 1
                    m = t[:, 0].clone()
                for j in range(1, n_tiles):
                    if bool((t[:, j] - m >= LIMIT).any()):
                        corrected += 1
                        m = torch.maximum(m, t[:, j])
                total += n_tiles
    return corrected, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    rows = []
    families = ("randn", "peaky", "late_sink", "max_staircase", "masked_keys", "padded_keys", "fully_masked")
    for d in (128, 64):
        for sk in (4096, 16384):
            for fam in families:
                for seed in range(args.seeds):
                    g = torch.Generator().manual_seed(1000 + seed)
                    q, k, v, mask = make_family(fam, 2, 1024, sk, 2, d, dtype=torch.float32, generator=g)
                    q, k = q.double().transpose(1, 2), k.double().transpose(1, 2)
                    keep = torch.ones(2, sk, dtype=torch.bool) if mask is None else mask[:, 0, 0, :].bool()
                    order = key_order(k, keep)
                    ks = torch.gather(k, 2, order[..., None].expand_as(k))
                    keep_s = torch.gather(keep[:, None, :].expand(2, 2, sk), 2, order)
                    # keep_s is the same for both heads by construction (masked keys last)
                    assert bool((keep_s == keep_s[:, :1]).all())
                    row = dict(head_dim=d, keys=sk, family=fam, seed=seed)
                    own = d > 64
                    row["as_stored"] = corrections(q, k, keep, d, own)
                    row["sorted"] = corrections(q, ks, keep_s[:, 0], d, own)
                    rows.append(row)
                    print(row, flush=True)
    meta = dict(script="benchmarks/experiments/correction_rate_emulation.py", machine="CPU (no GPU)",
                queries=1024, heads=2, batch=2, block_n=128, rows_per_warpgroup=64, limit_log2=LIMIT,
                seeds=args.seeds, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                counts="(corrected warpgroup-tiles, warpgroup-tiles) over batch and heads")
    json.dump(dict(meta=meta, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
