"""Error measures used by the tests (relative L1 and cosine as DESIGN.md section 4 defines them)."""

import torch


def cosine(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    return float(torch.nn.functional.cosine_similarity(o, r, dim=0))


def rel_l1(out, ref):
    o, r = out.double(), ref.double()
    return float((o - r).abs().sum() / r.abs().sum().clamp_min(1e-300))
