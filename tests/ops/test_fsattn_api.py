"""The public fsattn(): argument checks, masks, dtypes, stats, and the custom op under torch.compile."""

import pytest
import torch

from fsattn_diffusers.metrics import cosine_similarity as cosine
from fsattn_diffusers.metrics import relative_l1 as rel_l1
from fsattn_diffusers import FSAttnConfig, UnsupportedInputError, fsattn, reset_stats, stats
from fsattn_diffusers.ops import attention_op
from fsattn_diffusers.reference import attention_reference


def _qkv(b=1, s=40, h=2, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "query must be 4-D"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share a dtype"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "bfloat16, float16 or float32"),
        (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 2, -1)[..., :32], v), ValueError, "same shape"),
        (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32].contiguous()[:, :, :1]), ValueError, "same shape"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "empty"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "head dims differ"),
    ],
)
def test_bad_tensors_raise_clear_errors(change, error, match):
    q, k, v = change(*_qkv())
    with pytest.raises(error, match=match):
        fsattn(q, k, v)


@pytest.mark.parametrize("scale, match", [("0.125", r"scale must be a real number or None, got '0.125'"),
                                          (True, "scale must be a real number"), (float("nan"), "scale must be finite")])
def test_a_bad_scale_is_named(scale, match):
    with pytest.raises(ValueError, match=match):
        fsattn(*_qkv(), scale=scale)


def test_head_count_and_batch_checks():
    q, k, v = _qkv(h=3)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fsattn(q, k[:, :, :2], v[:, :, :2])
    q2, k2, v2 = _qkv(b=2)
    with pytest.raises(ValueError, match="batch sizes differ"):
        fsattn(q2, k, v)
    with pytest.raises(ValueError, match="layout must be"):
        fsattn(q, k, v, layout="BSHD")


def test_head_dim_over_128_is_unsupported():
    q, k, v = _qkv(d=160)
    with pytest.raises(UnsupportedInputError, match="head dim 160") as info:
        fsattn(q, k, v)
    assert info.value.reason == "head_dim"


@pytest.mark.parametrize(
    "mask_shape,error",
    [((1, 2, 1, 40), UnsupportedInputError), ((1, 1, 40, 40), UnsupportedInputError), ((1, 1, 1, 39), ValueError),
     ((3, 1, 1, 40), ValueError), ((1, 1, 1, 1, 40), ValueError)],
)
def test_masks_fsattn_cannot_take(mask_shape, error):
    q, k, v = _qkv()
    with pytest.raises(error):
        fsattn(q, k, v, attn_mask=torch.ones(mask_shape, dtype=torch.bool))


def test_integer_mask_and_config_type_are_rejected():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        fsattn(q, k, v, attn_mask=torch.ones(1, 1, 1, 40, dtype=torch.int64))
    with pytest.raises(TypeError, match="FSAttnConfig"):
        fsattn(q, k, v, config={"max_threshold": 3})


def test_check_finite_is_opt_in():
    q, k, v = _qkv()
    q[0, 3, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="query contains NaN"):
        fsattn(q, k, v, config=FSAttnConfig(check_finite=True))


def test_grad_is_refused_with_a_clear_message():
    q, k, v = _qkv()
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="forward-only"):
        fsattn(q, k, v)
    with torch.no_grad():
        assert fsattn(q, k, v).shape == q.shape
    q.requires_grad_(False)
    mask = torch.zeros(1, 1, 1, k.shape[1], requires_grad=True)  # a learned bias would get no gradient
    with pytest.raises(NotImplementedError, match="forward-only"):
        fsattn(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("bad", [dict(max_threshold=0.0), dict(max_threshold=9.0), dict(exp_offload=0.3),
                                 dict(pv_format="fp4"), dict(block_n=48), dict(block_n=16),
                                 dict(exp_offload=0.5, pv_format="16bit"), dict(exp_offload=1.0, rowsum="fma"),
                                 dict(smooth_v=True, pv_format="16bit"), dict(num_stages=0),
                                 dict(sdpa_below_flops=-1.0), dict(sdpa_below_flops=float("inf")),
                                 dict(sdpa_below_flops="1e12"), dict(sdpa_below_keys=-1), dict(kernel="cuda")])
def test_config_validation(bad):
    with pytest.raises((ValueError, TypeError)):
        FSAttnConfig(**bad)


@pytest.mark.parametrize("field,value", [("block_m", 64.0), ("block_n", "128"), ("max_threshold", "3"),
                                         ("max_threshold", None), ("exp_offload", "1"), ("exp_offload", True),
                                         ("num_stages", True), ("num_warps", 4.0), ("sdpa_below_flops", True),
                                         ("sdpa_below_keys", 2048.0), ("check_finite", 1), ("smooth_v", "yes"),
                                         ("kernel", 3)])
def test_config_rejects_wrong_types_at_construction(field, value):
    with pytest.raises(TypeError, match=rf"FSAttnConfig\.{field}="):
        FSAttnConfig(**{field: value})


def test_config_has_no_unsmoothed_k_option():
    # Without the K mean subtracted, masked and tile-padding keys (zeros) could set the row max and
    # zero every output; the option is gone rather than wrong.
    with pytest.raises(TypeError, match="smooth_k"):
        FSAttnConfig(smooth_k=False)


@pytest.mark.parametrize("masked_value", ["-inf", "finfo_min", "-1e4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_masks_mask_keys_as_bool_masks_do(masked_value, dtype):
    # In bfloat16, LTX-Video's -1e4 is -9984: a threshold of 1e4 below the row's largest value
    # left those keys in (2.93 relative L1 on the H200).
    from input_families import as_additive_mask, make_family

    q, k, v, mask = make_family("padded_keys", 2, 300, 700, 2, 64, dtype=dtype,
                                generator=torch.Generator().manual_seed(4))
    ref, _ = attention_reference(q, k, v, mask)
    err_bool = rel_l1(fsattn(q, k, v, attn_mask=mask), ref)
    out = fsattn(q, k, v, attn_mask=as_additive_mask(mask, masked_value, dtype))
    assert rel_l1(out, ref) <= 1.05 * err_bool, (rel_l1(out, ref), err_bool)


def test_finite_additive_biases_stay_biases():
    # A bias that is large but finite relative to its row (the underflow family's -1000 everywhere)
    # masks nothing; only keys 1,000 below the row's largest value are dropped.
    q, k, v = _qkv(s=64)
    bias = torch.linspace(-8.0, 8.0, 64).reshape(1, 1, 1, 64) - 1000.0
    ref, _ = attention_reference(q, k, v, bias)
    out = fsattn(q, k, v, attn_mask=bias)
    assert cosine(out, ref) > 0.999
    # Same values, all shifted by one constant: softmax does not move.
    assert rel_l1(fsattn(q, k, v, attn_mask=bias + 900.0), out) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_dtypes_and_layouts_round_trip(dtype, layout):
    q, k, v = _qkv(dtype=dtype, s=50)
    if layout == "HND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # strided views, not copies
    out = fsattn(q, k, v, layout=layout)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    qb, kb, vb, ob = (t if layout == "NHD" else t.transpose(1, 2) for t in (q, k, v, out))
    ref, _ = attention_reference(qb, kb, vb)
    assert cosine(ob, ref) > 0.998


def test_bool_and_additive_masks_agree():
    q, k, v = _qkv(b=2, s=60)
    keep = torch.rand(2, 60, generator=torch.Generator().manual_seed(1)) > 0.3
    bool_mask = keep[:, None, None, :]
    float_mask = torch.where(bool_mask, 0.0, float("-inf"))
    out_bool = fsattn(q, k, v, attn_mask=bool_mask)
    out_float = fsattn(q, k, v, attn_mask=float_mask)
    ref, _ = attention_reference(q, k, v, bool_mask)
    assert cosine(out_bool, ref) > 0.998 and cosine(out_float, ref) > 0.998
    # 2-D (Sk,) style broadcast: one mask for every batch element
    shared = fsattn(q, k, v, attn_mask=keep[0])
    ref_shared, _ = attention_reference(q, k, v, keep[0])
    assert cosine(shared, ref_shared) > 0.998


def test_lse_is_natural_log_and_corrected_for_smoothing():
    q, k, v = _qkv(s=300)
    k = k + 5.0  # a large mean key: smoothing removes it from the scores, the LSE must put it back
    out, lse = fsattn(q, k, v, return_lse=True)
    _, ref_lse = attention_reference(q, k, v)
    assert lse.shape == (1, 2, 300) and lse.dtype == torch.float32
    assert (lse - ref_lse).abs().max() < 0.05


def test_stats_count_calls_and_fallbacks():
    reset_stats()
    q, k, v = _qkv(s=700)  # 6 key tiles of 128 (the H200 tiles the emulation mirrors): the frozen max runs
    k[:, 650] = q[:, 0] * 20  # a late sink for query 0
    fsattn(q, k, v, config=FSAttnConfig(max_policy="sampled"))
    s = stats()
    assert s["calls"] == {"emulation": 1}
    assert s["q_tiles"] == 2 * 11  # 2 heads x ceil(700 / 64) query tiles
    assert 1 <= s["fallback_q_tiles"] <= s["q_tiles"]
    reset_stats()
    assert stats()["fallback_q_tiles"] == 0 and stats()["calls"] == {}


def test_custom_op_passes_opcheck():
    q, k, v = _qkv(s=30)
    mask = torch.ones(1, 30, dtype=torch.float32)
    cfg = FSAttnConfig().to_json()
    torch.library.opcheck(attention_op, (q, k, v, None, None, 0.125, "NHD", cfg))
    torch.library.opcheck(attention_op, (q, k, v, mask, None, 0.125, "NHD", cfg))
    torch.library.opcheck(attention_op, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, mask,
                                         0.125, "HND", cfg))


def test_torch_compile_fullgraph_runs_the_op_in_one_graph():
    # The compiled graph must contain the custom op (eager fsattn calls the implementation directly),
    # and give what float64 attention gives within fsattn's own error: compared with the reference,
    # not with eager fsattn, so a graph that skipped the op or dropped the mask would fail.
    from fsattn_diffusers.ops import attention_op

    q, k, v = _qkv(s=30)
    keep = torch.ones(1, 1, 1, 30, dtype=torch.bool)
    keep[..., 20:] = False

    def block(q, k, v, mask):
        return fsattn(q * 2, k, v, attn_mask=mask)

    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True, backend=backend)(q, k, v, keep)
    assert attention_op._opoverload in seen
    ref, _ = attention_reference(q * 2, k, v, keep)
    assert cosine(out, ref) > 0.998 and rel_l1(out, ref) < 0.05
    calls = stats()["calls"].get("emulation", 0)
    torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v, keep)
    assert stats()["calls"]["emulation"] == calls + 1


def test_reset_stats_after_a_counter_born_in_inference_mode(monkeypatch):
    import sys
    from collections import Counter

    stats_module = sys.modules["fsattn_diffusers.stats"]  # the package rebinds `stats` to the function

    # Counters of its own: an earlier test in this process may have left emulated fallbacks.
    monkeypatch.setattr(stats_module, "_device_counters", {})
    monkeypatch.setattr(stats_module, "_emulated_fallbacks", Counter())
    with torch.inference_mode():
        stats_module.fallback_counter(torch.device("cpu")).add_(3)
    assert stats()["fallback_q_tiles"] == 3
    reset_stats()  # raised "Inplace update to inference tensor" when the counter was an inference tensor
    assert stats()["fallback_q_tiles"] == 0
