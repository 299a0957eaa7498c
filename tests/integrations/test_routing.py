"""One answer to "can fsattn take this call?": fsattn() and every route decide alike, and the exact
attention that serves refused calls."""

from __future__ import annotations

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import UnsupportedInputError, fsattn, register_fsattn_backend
from fsattn_diffusers import attention
from fsattn_diffusers.attention import exact_attention, refusal
from fsattn_diffusers.processor import AttentionRoute
from fsattn_diffusers.routing import attention_or_fallback


def _qkv(b=2, s=24, h=2, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(3)]


# name -> (query, key, value, SDPA keyword arguments), all (B, S, H, D)
def _cases():
    q, k, v = _qkv()
    keep = torch.ones(2, 24, dtype=torch.bool)
    keep[1, 20:] = False
    return {
        "plain": (q, k, v, {}),
        "bool_key_mask": (q, k, v, dict(attn_mask=keep[:, None, None, :])),
        "float_key_mask": (q, k, v, dict(attn_mask=torch.zeros(2, 1, 1, 24).masked_fill(~keep[:, None, None], -1e4))),
        "general_mask": (q, k, v, dict(attn_mask=torch.ones(2, 1, 24, 24, dtype=torch.bool))),
        "causal": (q, k, v, dict(is_causal=True)),
        "dropout": (q, k, v, dict(dropout_p=0.1)),
        "head_dim_160": (*_qkv(d=160), {}),
        "float64": (q.double(), k.double(), v.double(), {}),
        "gqa_without_enable_gqa": (q, k[:, :, :1], v[:, :, :1], {}),
        "gqa": (q, k[:, :, :1], v[:, :, :1], dict(enable_gqa=True)),
        "requires_grad": (q.clone().requires_grad_(), k, v, {}),
    }


ACCEPTED = {"plain", "bool_key_mask", "float_key_mask", "gqa"}


@pytest.mark.parametrize("name", list(_cases()))
def test_every_route_takes_the_decision_of_the_one_check(name):
    q, k, v, kwargs = _cases()[name]
    found = refusal(q, k, v, kwargs.get("attn_mask"), layout="NHD", dropout_p=kwargs.get("dropout_p", 0.0),
                    is_causal=kwargs.get("is_causal", False), enable_gqa=kwargs.get("enable_gqa", False))
    assert (found is None) == (name in ACCEPTED)
    decisions = {}

    # The policy the processors and the backend share.
    fell_back = []
    attention_or_fallback(q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                          kwargs.get("is_causal", False), None, kwargs.get("enable_gqa", False), layout="NHD",
                          config=None, strict=False, where="test", fallback=lambda: fell_back.append(1))
    decisions["policy"] = not fell_back
    # A processor's stand-in for F.scaled_dot_product_attention, (B, H, S, D) tensors.
    route = AttentionRoute("test", config=fsattn_diffusers.FSAttnConfig(), strict=False)
    fsattn_diffusers.reset_stats()
    try:
        route.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), **kwargs)
    except Exception:  # noqa: BLE001 - SDPA itself may refuse a malformed call: that is a fallback too
        pass
    decisions["sdpa_route"] = bool(fsattn_diffusers.stats()["calls"])
    # The "fsattn" backend through diffusers' dispatcher.
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    member = register_fsattn_backend()
    fsattn_diffusers.reset_stats()
    try:
        dispatch_attention_fn(q, k, v, backend=member, **kwargs)
    except Exception:  # noqa: BLE001
        pass
    decisions["backend"] = bool(fsattn_diffusers.stats()["calls"])
    # fsattn() itself raises exactly where it refuses (it has no dropout, causal or enable_gqa).
    if "dropout_p" not in kwargs and "is_causal" not in kwargs and name != "gqa_without_enable_gqa":
        try:
            fsattn(q, k, v, attn_mask=kwargs.get("attn_mask"))
            decisions["fsattn"] = True
        except (UnsupportedInputError, TypeError, ValueError, NotImplementedError):
            decisions["fsattn"] = False
    expected = name in ACCEPTED
    assert decisions == {route: expected for route in decisions}, decisions


def test_a_strict_route_raises_the_checks_reason():
    q, k, v, kwargs = _cases()["general_mask"]
    with pytest.raises(UnsupportedInputError, match="strict=True") as info:
        attention_or_fallback(q, k, v, kwargs["attn_mask"], 0.0, False, None, False, layout="NHD", config=None,
                              strict=True, where="test", fallback=lambda: None)
    assert info.value.reason == "general_mask"


@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "float64"])  # float64: not the query's dtype
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_exact_attention_lse_in_chunks_matches_float64(monkeypatch, mask_kind, layout):
    # Forced to many row blocks: the fallback never holds the whole score matrix.
    monkeypatch.setattr(attention, "EXACT_LSE_SCORES", 2 * 24 * 3)
    q, k, v = _qkv(s=24, h=4)
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query heads
    keep = torch.ones(2, 24, dtype=torch.bool)
    keep[0] = False  # a row whose keys are all masked: zeros and -inf, as the kernels give
    keep[1, 10:] = False
    float_mask = torch.zeros(2, 1, 1, 24).masked_fill(~keep[:, None, None], float("-inf"))
    mask = {None: None, "bool": keep[:, None, None, :], "float": float_mask, "float64": float_mask.double()}[mask_kind]
    args = [t if layout == "NHD" else t.transpose(1, 2) for t in (q, k, v)]
    out, lse = exact_attention(*args, mask, layout=layout, return_lse=True)
    qd, kd, vd = (t.double().transpose(1, 2).repeat_interleave(2 if t is not q else 1, 1) for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * 32**-0.5
    if mask is not None:
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    weights = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    ref = (weights @ vd).transpose(1, 2)
    out = out if layout == "NHD" else out.transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)
    if mask is not None:
        assert out[0].abs().max() == 0


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("masked_value", ["finfo_min", "-1e4", "-1e9"])
def test_exact_attention_reads_a_float_mask_as_the_kernels_do(masked_value, mask_dtype):
    # fsattn() masks a key whose value is MASKED_BIAS_GAP or more below the largest of its row. In
    # float32, finfo.min - 1000 is finfo.min: a row all at diffusers' padding value is fully
    # masked (zeros, -inf LSE), and the fallback must say the same, not attend evenly as SDPA
    # does. A row all at -1e4 or -1e9 is only shifted (in float32, as fsattn() compares, also
    # for a bfloat16 mask, where -1e9 - 1000 would round back to -1e9): both attend evenly.
    q, k, v = _qkv(s=24, h=4)
    value = torch.finfo(mask_dtype).min if masked_value == "finfo_min" else float(masked_value)
    mask = torch.zeros(2, 1, 1, 24, dtype=mask_dtype)
    mask[0] = value
    mask[1, ..., 10:] = value
    out, lse = exact_attention(q, k, v, mask, return_lse=True)
    kernel_out, kernel_lse = fsattn(q, k, v, attn_mask=mask, return_lse=True)
    if masked_value == "finfo_min":
        assert out[0].abs().max() == 0 and torch.isneginf(lse[0]).all()
    else:  # attended (at -1e9 the float32 scores keep no precision: only that it is attended)
        assert out[0].abs().max() > 0 and torch.isfinite(lse[0]).all()
    if masked_value == "-1e4":
        even = exact_attention(q[:1], k[:1], v[:1], return_lse=True)
        torch.testing.assert_close(out[:1], even[0], atol=2e-3, rtol=0)  # float32 scores shifted by 1e4
        torch.testing.assert_close(lse[:1], even[1] + mask[0, 0, 0, 0].float(), atol=1e-2, rtol=1e-6)
    assert torch.equal(torch.isneginf(kernel_lse), torch.isneginf(lse))
    ref = exact_attention(q[1:], k[1:, :10], v[1:, :10], return_lse=True)
    torch.testing.assert_close(out[1:], ref[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse[1:], ref[1], atol=1e-5, rtol=1e-5)
    rows = slice(1, 2) if masked_value == "-1e9" else slice(0, 2)
    torch.testing.assert_close(kernel_out[rows], out[rows], atol=0.05, rtol=0)


def test_exact_attention_keeps_a_nan_of_the_inputs_and_zeros_only_rows_with_every_key_masked():
    # The fallback's zeros are for rows SDPA gives NaN because nothing is attended; a NaN query row
    # must stay NaN, as it does on the kernels.
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 12, 2, 32, generator=gen) for _ in range(3))
    q[0, 3, 1, 0] = float("nan")
    for mask in (None, torch.ones(2, 1, 1, 12, dtype=torch.bool)):
        out, lse = exact_attention(q, k, v, mask, return_lse=True)
        bad = torch.zeros_like(out, dtype=torch.bool)
        bad[0, 3, 1] = True
        assert torch.equal(out.isnan(), bad) and torch.equal(lse.isnan(), bad[..., 0].transpose(1, 2))
    mask[1] = False
    out, lse = exact_attention(q, k, v, mask, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
    assert out[0, 3, 1].isnan().all() and torch.isfinite(out[0, :3]).all()


def test_exact_attention_keeps_a_per_key_mask_broadcast():
    # The gap rule runs on the mask's stored values: a (B, 1, 1, Sk) mask expanded over queries and
    # heads stays a view, not a B x H x Sq x Sk copy, and reads as the compact mask does.
    q, k, v = _qkv(s=24, h=4)
    compact = torch.zeros(2, 1, 1, 24)
    compact[1, ..., 10:] = torch.finfo(torch.float32).min
    expanded = compact.expand(2, 4, 24, 24)
    assert attention._gap_masked(expanded).stride()[1:3] == (0, 0)
    torch.testing.assert_close(exact_attention(q, k, v, expanded), exact_attention(q, k, v, compact))


@pytest.mark.parametrize("mask_dtype, q_dtype", [(torch.float32, torch.float32), (torch.bool, torch.float32),
                                              (torch.float32, torch.bfloat16)],
                         ids=["float_mask", "bool_mask", "float_mask_cast_to_bf16"])
def test_exact_attention_makes_no_full_size_copy_of_a_broadcast_mask(mask_dtype, q_dtype):
    # At video sizes a B x H x Sq x Sk copy of the mask is tens of GB. SDPA turns a boolean mask into
    # a float one, and a float mask in another dtype is cast, each the size of the tensor it is
    # handed: handed the broadcast view, full size. The bound is relative: the call's largest
    # allocation with the broadcast view may not exceed the compact mask's (SDPA's own scratch, which
    # grows with the CPU's threads) by a quarter of a one-byte-per-entry copy.
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _qkv(s=256, h=4, d=8, dtype=q_dtype)
    compact = torch.zeros(2, 1, 1, 256)
    compact[1, ..., 40:] = float("-inf")
    if mask_dtype == torch.bool:
        compact = compact == 0
    expanded = compact.expand(2, 4, 256, 256)

    def largest_allocation(mask):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = exact_attention(q, k, v, mask)
        return out, max(event.self_cpu_memory_usage for event in prof.events())

    out, largest = largest_allocation(expanded)
    _, largest_compact = largest_allocation(compact)
    assert 0 < largest <= largest_compact + expanded.numel() // 4, (largest, largest_compact, expanded.numel())
    reference = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=compact if mask_dtype == torch.bool else compact.to(q_dtype))
    torch.testing.assert_close(out, reference.transpose(1, 2), rtol=0, atol=0)
