"""The input families of docs/design.md §4.1, for the tests: fresh random inputs built to break the kernels.

Each family returns ``(q, k, v, attn_mask)`` in ``(B, S, H, D)`` layout. They are built to stress
the speculative max: a late sink (one key far above all others, late in the sequence), a max
staircase (the row max grows tile after tile), an underflow (every score pushed far below the
sampled guess by an additive mask), masks that empty whole rows, and peaky scores with biased keys.
``huge_magnitude`` (scores of ~1e5) only checks that nothing overflows: no 8-bit score can rank
keys whose scores differ by less than their quantisation step, so its output may pick another key.
"""

from __future__ import annotations

import torch

INPUT_FAMILIES = (
    "randn",
    "peaky",
    "late_sink",
    "max_staircase",
    "underflow",
    "masked_keys",
    "padded_keys",
    "fully_masked",
    "huge_magnitude",
)


def make_family(name, batch, seq_q, seq_k, heads, head_dim, *, dtype=torch.bfloat16, device="cpu",
                generator=None, kv_heads=None):
    """Inputs of family `name` (one of :data:`INPUT_FAMILIES`), drawn fresh from `generator`."""
    if name not in INPUT_FAMILIES:
        raise ValueError(f"unknown family {name!r}; expected one of {INPUT_FAMILIES}")
    kv_heads = heads if kv_heads is None else kv_heads
    g = generator if generator is not None else torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    q = randn(batch, seq_q, heads, head_dim)
    k = randn(batch, seq_k, kv_heads, head_dim)
    v = randn(batch, seq_k, kv_heads, head_dim)
    mask = None
    # A direction shared by every query, so that keys along it score high for all rows.
    u = randn(head_dim)
    u = u / u.norm() * head_dim**0.5
    scale = head_dim**-0.5
    if name == "peaky":
        q, k = q * 3, k * 3 + randn(head_dim) * 8
    elif name == "late_sink":
        q = q + u
        sink = int(seq_k * 0.9)
        k[:, sink] = u * (30.0 / (head_dim * scale))  # ~30 natural-log units above the typical score
    elif name == "max_staircase":
        q = q + u
        ramp = torch.linspace(0.0, 40.0 / (head_dim * scale), seq_k)  # the max climbs ~40 units end to end
        k = k + ramp[None, :, None, None] * u
    elif name == "underflow":
        # Every score sits 1000 below zero, and the first key tile (sampled for the guess) 1000 more.
        mask = torch.full((batch, 1, 1, seq_k), -1000.0)
        mask[..., : min(128, seq_k)] = -2000.0
    elif name == "masked_keys":
        keep = torch.rand(batch, seq_k, generator=g) > 0.3
        keep[:, -seq_k // 4:] = False  # a padded suffix, as HunyuanVideo's text padding
        keep[:, 0] = True
        mask = keep[:, None, None, :]
    elif name == "padded_keys":
        # Masked keys whose K and V look nothing like the attended ones (V around 5, K biased), so that
        # any masked key that leaks into the K/V statistics or the output shows.
        keep = torch.ones(batch, seq_k, dtype=torch.bool)
        keep[:, -seq_k // 3:] = False
        k = torch.where(keep[:, :, None, None], k, 4 * k + 8)
        v = torch.where(keep[:, :, None, None], v, v + 5)
        mask = keep[:, None, None, :]
    elif name == "fully_masked":
        keep = torch.ones(batch, seq_k, dtype=torch.bool)
        keep[0] = False  # every key of batch element 0 is masked: its rows return zeros
        keep[-1, seq_k // 2:] = False  # and the last one attends only to its first half
        mask = keep[:, None, None, :]
    elif name == "huge_magnitude":
        q, k, v = q * 300, k * 300, v * 1000
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    if mask is not None:
        mask = mask.to(device)
    return q, k, v, mask


# How an additive (float) mask writes "masked": diffusers' own conversion of boolean masks, the
# dtype's most negative finite value, and LTX-Video's -10000.
ADDITIVE_MASKED_VALUES = ("-inf", "finfo_min", "-1e4")


def as_additive_mask(mask: torch.Tensor, masked_value: str, dtype=torch.float32) -> torch.Tensor:
    """Boolean key mask `mask` (True = attend) as an additive float mask of `dtype`: 0 where attended,
    `masked_value` (one of :data:`ADDITIVE_MASKED_VALUES`) where masked."""
    values = {"-inf": float("-inf"), "finfo_min": torch.finfo(dtype).min, "-1e4": -1e4}
    if masked_value not in values:
        raise ValueError(f"masked_value={masked_value!r}; expected one of {ADDITIVE_MASKED_VALUES}")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, values[masked_value])
