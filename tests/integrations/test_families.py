"""Each video family: fsattn against SDPA on the whole transformer, and exact removal.

Random weights give flat attention whose errors hardly reach the output, so the models are made
peaky (q/k norm weights scaled: scores x6) and their attention outputs amplified (x4) so that
attention dominates the residual stream. A control shows the 0.999 threshold then catches a
real integration bug: losing the rotary embedding (what a processor wrapper whose signature does
not name ``image_rotary_emb`` does) or the text padding mask.
"""

from __future__ import annotations

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import FSAttnProcessor, apply_fsattn, remove_fsattn
from fsattn_diffusers.families import attention_modules

from .conftest import BUILDERS, cosine, emulation_calls, make_peaky, run

# Per family: fsattn calls per forward, and the SDPA fallbacks expected (reason -> calls).
EXPECTED = {
    "wan_t2v": (4, {}),  # 2 blocks x (self, cross)
    "wan_i2v": (6, {}),  # 2 blocks x (self, text cross, image cross)
    "wan_vace": (6, {}),  # (1 control block + 2 blocks) x (self, cross)
    # 1 double + 1 single joint block; the token refiner's pairwise text mask varies over queries.
    "hunyuan_video": (2, {"general_mask": 1}),
    "cogvideox": (2, {}),
    # Cross-attention: LTX repeats its text mask per head, (B, H, 1, S), which fsattn does not take.
    "ltx_video": (2, {"general_mask": 2}),
    "mochi": (4, {}),  # Mochi's processor runs SDPA once per batch element, on its valid text tokens
}


def amplify_attention(model, factor=4.0):
    with torch.no_grad():
        for _, module in attention_modules(model):
            for name in ("to_out", "to_add_out"):
                out = getattr(module, name, None)
                if out is not None:
                    (out[0] if isinstance(out, torch.nn.ModuleList) else out).weight.mul_(factor)
    return model


def peaky_model(family):
    model, inputs = BUILDERS[family]()
    return amplify_attention(make_peaky(model)), inputs


@pytest.mark.parametrize("family", list(BUILDERS))
def test_fsattn_matches_sdpa_per_batch_element_and_removal_is_exact(family):
    model, inputs = peaky_model(family)
    reference = run(model, inputs)

    apply_fsattn(model)
    out = run(model, inputs)
    fsattn_calls, expected_fallbacks = EXPECTED[family]
    assert emulation_calls() == fsattn_calls
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == expected_fallbacks
    for b in range(out.shape[0]):  # HunyuanVideo, LTX and Mochi pad the second prompt
        assert cosine(out[b], reference[b]) >= 0.999, f"batch element {b}"
    assert not torch.equal(out, reference)  # fsattn's 8-bit numerics did run

    remove_fsattn(model)
    assert torch.equal(run(model, inputs), reference)


class _LosesRotaryEmbedding(FSAttnProcessor):
    """The bug the threshold must catch: a processor that drops the rotary embedding."""

    def __call__(self, attn, *args, **kwargs):
        kwargs.pop("image_rotary_emb", None)
        kwargs.pop("rotary_emb", None)
        if len(args) >= 4:  # WanAttention passes rotary_emb positionally
            args = args[:3] + (None,) + args[4:]
        return super().__call__(attn, *args, **kwargs)


@pytest.mark.parametrize("family", ["wan_t2v", "hunyuan_video", "cogvideox", "ltx_video"])
def test_threshold_catches_a_lost_rotary_embedding(family):
    model, inputs = peaky_model(family)
    reference = run(model, inputs)
    model.set_attn_processor(_LosesRotaryEmbedding())
    assert cosine(run(model, inputs), reference) < 0.999


def test_threshold_catches_a_lost_padding_mask_in_hunyuan_video(monkeypatch):
    from fsattn_diffusers import processor

    model, inputs = peaky_model("hunyuan_video")
    reference = run(model, inputs)
    real = processor.attention_or_fallback

    def without_mask(query, key, value, attn_mask, *args, **kwargs):
        return real(query, key, value, None, *args, **kwargs)

    monkeypatch.setattr(processor, "attention_or_fallback", without_mask)
    apply_fsattn(model)
    out = run(model, inputs)
    assert cosine(out[0], reference[0]) >= 0.999  # the full-length prompt has no padding to lose
    assert cosine(out[1], reference[1]) < 0.999  # the short one attends to its padding
