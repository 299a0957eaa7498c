"""The "fsattn" backend in diffusers' attention registry, and the per-call fallback policy."""

from __future__ import annotations

import copy
import enum
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F

import fsattn_diffusers
from fsattn_diffusers import FSAttnConfig, UnsupportedInputError, fsattn, register_fsattn_backend
from fsattn_diffusers import diffusers_backend, routing
from fsattn_diffusers.config import DEFAULT_CONFIG
from fsattn_diffusers.diffusers_backend import add_enum_member
from fsattn_diffusers.reference import attention_reference

from .conftest import BUILDERS, make_peaky, run


@pytest.fixture
def backend():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    # model.set_attention_backend() also sets diffusers' process-wide active backend, which
    # reset_attention_backend() leaves as it is: restore it for the tests that follow.
    active = _AttentionBackendRegistry._active_backend
    member = register_fsattn_backend()
    yield member
    _AttentionBackendRegistry._active_backend = active
    register_fsattn_backend()  # back to the default options


def test_registration_is_idempotent_and_visible_to_every_diffusers_lookup(backend):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    n_members = len(AttentionBackendName)
    again = register_fsattn_backend()
    assert again is backend
    assert len(AttentionBackendName) == n_members  # no second member
    assert AttentionBackendName("fsattn") is backend
    assert AttentionBackendName.FSATTN is backend
    assert backend == "fsattn" and backend.value == "fsattn"
    assert "fsattn" in {m.value for m in AttentionBackendName.__members__.values()}
    assert backend in list(AttentionBackendName)
    assert "fsattn" in _AttentionBackendRegistry._backends  # what `attention_backend("fsattn")` checks
    assert _AttentionBackendRegistry._backends[backend] is diffusers_backend._fsattn_attention
    # every argument dispatch_attention_fn passes, so none is dropped
    assert _AttentionBackendRegistry._supported_arg_names[backend] == {
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "_parallel_config"}
    assert _AttentionBackendRegistry._is_context_parallel_available(backend)
    assert pickle.loads(pickle.dumps(backend)) is backend
    assert copy.deepcopy(backend) is backend


def test_add_enum_member_on_a_closed_str_enum():
    class Colour(str, enum.Enum):
        RED = "red"

    green = add_enum_member(Colour, "green")
    assert add_enum_member(Colour, "green") is green
    assert Colour("green") is green and Colour.GREEN is green and Colour["GREEN"] is green
    assert list(Colour) == [Colour.RED, green] and len(Colour) == 2
    assert isinstance(green, Colour) and isinstance(green, str) and green == "green"
    assert green.name == "GREEN" and green.value == "green"
    assert {green: 1}["green"] == 1  # hashes as its value, as diffusers' dict lookups need


def test_registration_refuses_to_replace_another_backend_named_fsattn(backend):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    ours = _AttentionBackendRegistry._backends[backend]
    _AttentionBackendRegistry._backends[backend] = lambda query, key, value: query
    try:
        with pytest.raises(RuntimeError, match="not fsattn-diffusers'"):
            register_fsattn_backend()
    finally:
        _AttentionBackendRegistry._backends[backend] = ours


def test_set_attention_backend_and_context_manager_give_the_processor_output(backend):
    from diffusers.models.attention_dispatch import attention_backend

    from fsattn_diffusers import remove_fsattn

    model, inputs = BUILDERS["wan_t2v"]()
    make_peaky(model)
    reference = run(model, inputs)
    model.set_attn_processor(fsattn_diffusers.FSAttnProcessor())
    one_liner = run(model, inputs)
    remove_fsattn(model)

    model.set_attention_backend("fsattn")
    assert torch.equal(run(model, inputs), one_liner)
    model.set_attention_backend("native")
    assert torch.equal(run(model, inputs), reference)
    model.reset_attention_backend()
    with attention_backend("fsattn"):
        assert torch.equal(run(model, inputs), one_liner)
    assert torch.equal(run(model, inputs), reference)


@pytest.mark.parametrize("family", ["hunyuan_video", "ltx_video"])
def test_backend_name_matches_one_liner_on_masked_families(backend, family):
    from fsattn_diffusers import remove_fsattn

    model, inputs = BUILDERS[family]()
    make_peaky(model)
    model.set_attn_processor(fsattn_diffusers.FSAttnProcessor())
    one_liner = run(model, inputs)
    remove_fsattn(model)
    model.set_attention_backend("fsattn")
    assert torch.equal(run(model, inputs), one_liner)
    model.reset_attention_backend()


def _dispatch(*args, **kwargs):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(*args, backend=kwargs.pop("backend"), **kwargs)


def _qkv(heads=2, dim=32, seq=40, batch=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, seq, heads, dim, generator=g, dtype=dtype) for _ in range(3)]


def test_backend_runs_fsattn_with_a_key_padding_mask(backend):
    q, k, v = _qkv()
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 25:] = False
    out = _dispatch(q, k, v, attn_mask=mask, backend=backend)  # 2-D: (batch, keys), diffusers' convention
    expected = fsattn(q, k, v, attn_mask=mask[:, None, None, :])
    assert torch.equal(out, expected)
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {}


@pytest.mark.parametrize("case, reason", [
    (dict(is_causal=True), "is_causal"),
    (dict(dropout_p=0.25), "dropout"),
    (dict(attn_mask=torch.ones(40, 40, dtype=torch.bool).tril()), "general_mask"),
    (dict(head_dim=160), "head_dim"),
])
def test_backend_falls_back_to_native_sdpa_once_logged_and_counted(backend, caplog, case, reason):
    case = dict(case)
    q, k, v = _qkv(dim=case.pop("head_dim", 32))
    torch.manual_seed(1)
    native = _dispatch(q, k, v, backend="native", **case)
    with caplog.at_level(logging.WARNING, logger="fsattn_diffusers"):
        torch.manual_seed(1)  # dropout draws the same mask
        out = _dispatch(q, k, v, backend=backend, **case)
        _dispatch(q, k, v, backend=backend, **case)
    assert torch.equal(out, native)
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {reason: 2}
    lines = [r.getMessage() for r in caplog.records if f"reason: {reason}" in r.getMessage()]
    assert len(lines) == 1 and "attention backend 'fsattn'" in lines[0]


def test_strict_backend_raises_instead_of_falling_back():
    member = register_fsattn_backend(strict=True)
    try:
        q, k, v = _qkv()
        with pytest.raises(UnsupportedInputError, match="strict=True") as err:
            _dispatch(q, k, v, is_causal=True, backend=member)
        assert err.value.reason == "is_causal"
        assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {}
    finally:
        register_fsattn_backend()


def test_backend_runs_with_the_registered_config():
    q, k, v = _qkv()
    config = FSAttnConfig(pv_format="16bit")
    member = register_fsattn_backend(config=config)
    try:
        out = _dispatch(q, k, v, backend=member)
    finally:
        register_fsattn_backend()
    assert torch.equal(out, fsattn(q, k, v, config=config))
    assert not torch.equal(out, fsattn(q, k, v))


def test_registration_rejects_bad_arguments():
    with pytest.raises(TypeError, match="config must be an FSAttnConfig"):
        register_fsattn_backend(config={"pv_format": "16bit"})
    with pytest.raises(TypeError, match="strict must be a bool"):
        register_fsattn_backend(strict="yes")


def test_context_parallel_forward_op_returns_out_and_lse_in_ring_attention_layout():
    q, k, v = _qkv(seq=70)
    out, lse = diffusers_backend._fsattn_forward_op(None, q, k, v, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v)  # ref_lse: (B, H, S)
    assert out.shape == q.shape and lse.shape == (2, 70, 2) and lse.dtype == torch.float32
    assert torch.allclose(lse.double(), ref_lse.permute(0, 2, 1), atol=2e-2)
    assert F.cosine_similarity(out.double().flatten(), ref_out.flatten(), dim=0) > 0.999


def test_backend_passes_diffusers_own_checks_when_enabled(backend, monkeypatch):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    monkeypatch.setattr(_AttentionBackendRegistry, "_checks_enabled", True)
    q, k, v = _qkv()
    assert torch.equal(_dispatch(q, k, v, backend=backend), fsattn(q, k, v))
    with pytest.raises(ValueError, match="same device|same dtype"):
        _dispatch(q, k.double(), v, backend=backend)


# --- small problems go to SDPA (FSAttnConfig.sdpa_below_flops) -------------------------------------


def test_attention_flops_counts_both_gemms_in_either_layout():
    q = torch.empty(2, 300, 6, 64, device="meta")
    k = torch.empty(2, 77, 6, 64, device="meta")
    want = 4.0 * 2 * 6 * 300 * 77 * 64
    assert routing.attention_flops(q, k, "NHD") == want
    assert routing.attention_flops(q.transpose(1, 2), k.transpose(1, 2), "HND") == want


def test_size_routing_threshold_defaults_and_ulysses_work_factor(monkeypatch):
    # Shapes on the meta device, routed as CUDA would be: the real comparison, no GPU needed.
    monkeypatch.setattr(routing, "ROUTED_DEVICE_TYPES", ("meta",))
    too_small = routing.too_small_for_fsattn
    video = torch.empty(1, 32760, 12, 128, device="meta")
    text = torch.empty(1, 512, 12, 128, device="meta")
    assert too_small(video, text, "NHD", None)  # Wan cross-attention, 1.0e11 FLOPs < 3e11 (default)
    assert not too_small(video, video, "NHD", None)  # Wan self-attention, 6.6e12
    # The key count is read from each layout's sequence axis (HND's axis 1 holds the 12 heads).
    assert not too_small(video.transpose(1, 2), video.transpose(1, 2), "HND", FSAttnConfig(sdpa_below_flops=0))
    assert too_small(video.transpose(1, 2), text.transpose(1, 2), "HND", FSAttnConfig(sdpa_below_flops=0))
    # Under sdpa_below_flops=0 the same call is still too small by its 512 keys; with both rules off it runs.
    assert too_small(video, text, "NHD", FSAttnConfig(sdpa_below_flops=0))
    assert not too_small(video.transpose(1, 2), text.transpose(1, 2), "HND",
                         FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=0))
    # Wan2.1-14B 720p cross-attention: 7.9e11 FLOPs, over sdpa_below_flops, but 512 keys.
    video_14b, text_14b = torch.empty(1, 75600, 40, 128, device="meta"), torch.empty(1, 512, 40, 128, device="meta")
    assert routing.attention_flops(video_14b, text_14b, "NHD") > DEFAULT_CONFIG.sdpa_below_flops
    assert too_small(video_14b, text_14b, "NHD", None)
    assert not too_small(video_14b, text_14b, "NHD", FSAttnConfig(sdpa_below_keys=512))
    assert too_small(video_14b, text_14b, "NHD", FSAttnConfig(sdpa_below_keys=513))
    # 1.5e11 FLOPs of shards: small alone, not once Ulysses of degree 2 has made it 3.1e11 per rank.
    shard = torch.empty(1, 5000, 12, 128, device="meta")
    assert routing.attention_flops(shard, shard, "NHD") == 4.0 * 12 * 5000 ** 2 * 128  # 1.5e11
    assert too_small(shard, shard, "NHD", None, work_factor=1)
    assert not too_small(shard, shard, "NHD", None, work_factor=2)
    # Keys count after the gather too: 1,500 keys per rank are 3,000 once Ulysses of degree 2 has run.
    few_keys = torch.empty(1, 1500, 12, 128, device="meta")
    by_keys = FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=2048)
    assert too_small(video, few_keys, "NHD", by_keys, work_factor=1)
    assert not too_small(video, few_keys, "NHD", by_keys, work_factor=2)


def test_size_routing_applies_to_cuda_tensors_only():
    # On CPU the emulation stands in for the GPU kernel: every call must reach it, however small.
    q, k, _ = _qkv()
    assert not routing.too_small_for_fsattn(q, k, "NHD", FSAttnConfig(sdpa_below_flops=1e30, sdpa_below_keys=10**9))


def test_small_calls_run_the_original_attention_counted_not_warned_even_when_strict(caplog, monkeypatch):
    calls = []

    def pretend_cuda_threshold(query, key, layout, config, work_factor=1):
        calls.append(config.sdpa_below_flops)
        return routing.attention_flops(query, key, layout) * work_factor < config.sdpa_below_flops

    monkeypatch.setattr(routing, "too_small_for_fsattn", pretend_cuda_threshold)
    q, k, v = _qkv()
    flops = routing.attention_flops(q, k, "NHD")
    native = _dispatch(q, k, v, backend="native")
    member = register_fsattn_backend(config=FSAttnConfig(sdpa_below_flops=flops * 2), strict=True)
    try:
        with caplog.at_level(logging.WARNING, logger="fsattn_diffusers"):
            routed = _dispatch(q, k, v, backend=member)
        assert torch.equal(routed, native)  # the model's own SDPA call, bit for bit
        assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {"small_problem": 1}
        assert not caplog.records  # a speed choice, not a problem: nothing at warning level
        register_fsattn_backend(config=FSAttnConfig(sdpa_below_flops=flops / 2), strict=True)
        big_enough = _dispatch(q, k, v, backend=member)
    finally:
        register_fsattn_backend()
    assert torch.equal(big_enough, fsattn(q, k, v))
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {"small_problem": 1}
    assert calls == [flops * 2, flops / 2]


def test_remove_fsattn_leaves_the_process_as_it_found_it(backend):
    # diffusers' set_attention_backend also makes "fsattn" the process-wide backend, which its
    # reset_attention_backend leaves in place: every model without a backend of its own ran fsattn.
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from fsattn_diffusers import remove_fsattn

    from .conftest import emulation_calls

    model, inputs = BUILDERS["wan_t2v"]()
    reference = run(model, inputs)
    before = _AttentionBackendRegistry._active_backend
    model.set_attention_backend("fsattn")
    model.reset_attention_backend()
    remove_fsattn(model)
    assert _AttentionBackendRegistry._active_backend == before
    fresh, fresh_inputs = BUILDERS["wan_t2v"]()
    calls = emulation_calls()
    assert torch.equal(run(model, inputs), reference)
    run(fresh, fresh_inputs)
    assert emulation_calls() == calls, "a model fsattn was removed from, or a new one, still ran fsattn"


def test_remove_fsattn_undoes_a_model_backend_set_without_reset(backend):
    from fsattn_diffusers import remove_fsattn

    from .conftest import emulation_calls

    model, inputs = BUILDERS["wan_t2v"]()
    reference = run(model, inputs)
    model.set_attention_backend("fsattn")
    calls = emulation_calls()
    run(model, inputs)
    assert emulation_calls() > calls  # the backend was on
    remove_fsattn(model)
    calls = emulation_calls()
    assert torch.equal(run(model, inputs), reference)
    assert emulation_calls() == calls
