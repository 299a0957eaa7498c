"""The Triton kernels against the float64 reference and the PyTorch emulation.

On CPU the kernels run in Triton's interpreter at tiny shapes and tiles (the interpreter's float
conversions are made exact by fsattn_diffusers/kernels/lowp.py, so kernel and emulation agree to rounding). On a
GPU the same checks run at real lengths, on every input family of docs/design.md §4.1; the checks of
shapes, layouts, lengths and masked keys that need no emulation at the CPU's tiles run on either device.
"""

import math

import pytest
import torch

from fsattn_diffusers.metrics import cosine_similarity as cosine
from fsattn_diffusers.metrics import relative_l1 as rel_l1
from fsattn_diffusers import FSAttnConfig, fsattn, reset_stats, stats
from fsattn_diffusers import ops as fsattn_ops
from input_families import ADDITIVE_MASKED_VALUES, INPUT_FAMILIES, as_additive_mask, make_family
from interpreter_only import skip_without_interpreter
from fsattn_diffusers.reference import attention_reference, emulate_fsattn

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@pytest.fixture
def kernel_path(monkeypatch):
    """Run fsattn's Triton kernels (the interpreter on CPU) instead of the CPU emulation."""
    skip_without_interpreter()
    monkeypatch.setattr(fsattn_ops, "CPU_PATH", "interpreter")
    reset_stats()


@pytest.fixture
def kernel_device(request):
    """The device whose kernels a test runs: the GPU's compiled ones where there is a GPU, else the
    interpreter's on CPU (``kernel_path``). For the checks that hold on either (no emulation at the
    CPU's tiny tiles)."""
    if GPU:
        available, reason = fsattn_ops.kernels_available(torch.device(DEVICE))
        if not available:
            pytest.skip(f"fsattn's kernels do not run on this GPU ({reason}); its calls go to SDPA")
        return DEVICE
    request.getfixturevalue("kernel_path")
    return "cpu"


def _emulate(q, k, v, mask, cfg, layout="NHD", scale=None):
    """The emulation with the tiles the kernel used (its output in (B, S, H, D))."""
    from fsattn_diffusers.attention import key_mask

    qb, kb, vb = (t if layout == "NHD" else t.transpose(1, 2) for t in (q, k, v))
    weight, bias = key_mask(mask, qb, kb)
    # The Triton kernel's tiles on this device (the emulation models that kernel), with the K scales
    # of the plan the call itself runs (k_granularity "auto" sorts long calls on Hopper's
    # warp-specialised kernel and nowhere else).
    launch = fsattn_ops.call_plan(cfg.replace(kernel="triton"), q.device, qb.shape[-1], bias is not None, q.dtype)
    own = fsattn_ops.call_plan(cfg, q.device, qb.shape[-1], bias is not None, q.dtype, kb.shape[1])
    scale = qb.shape[-1] ** -0.5 if scale is None else scale
    return emulate_fsattn(qb, kb, vb, scale=scale, config=cfg, block_m=launch.block_m, block_n=launch.block_n,
                          key_weight=weight, key_bias=bias, k_per_token=own.k_per_token, sort_keys=own.sort_keys)


# --- CPU: the interpreter at tiny shapes ---------------------------------------------------------

# (name, config): each variant of the kernel's constexpr flags that a config can reach.
VARIANTS = [
    ("default", FSAttnConfig()),
    ("sampled_rescale", FSAttnConfig(max_policy="sampled")),
    ("sampled_recompute", FSAttnConfig(max_policy="sampled", on_violation="recompute")),
    ("pv16", FSAttnConfig(pv_format="16bit")),
    ("exp_half", FSAttnConfig(max_policy="sampled", exp_offload=0.5)),
    ("exp_bits", FSAttnConfig(max_policy="sampled", exp_offload=1.0)),
    ("k_block", FSAttnConfig(k_granularity="block")),
    ("k_sorted", FSAttnConfig(k_granularity="sorted_block")),
    ("fma_rowsum_fp32_acc", FSAttnConfig(rowsum="fma", pv_accum="fp32")),
]


@pytest.mark.parametrize("name,cfg", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_kernel_matches_emulation_and_reference(kernel_path, name, cfg):
    # 200 keys = 7 tiles of 32: the frozen-max path runs; the late key forces a violation.
    gen = torch.Generator().manual_seed(1)
    q, k, v, mask = make_family("late_sink", 1, 150, 200, 2, 64, dtype=torch.float32, generator=gen)
    out, lse = fsattn(q, k, v, return_lse=True, config=cfg)
    ref, ref_lse = attention_reference(q, k, v)
    emu, emu_lse, emu_fallbacks = _emulate(q, k, v, mask, cfg)
    assert rel_l1(out, emu) < 1e-4, "kernel and emulation disagree"
    assert torch.allclose(lse, emu_lse, atol=1e-3)
    assert cosine(out, ref) > 0.995 and rel_l1(out, ref) < 0.06
    assert (lse - ref_lse).abs().max() < 0.5
    if cfg.max_policy == "sampled":
        assert stats()["fallback_q_tiles"] == emu_fallbacks > 0, "the late sink must violate the frozen max"


@pytest.mark.parametrize("family", ["peaky", "masked_keys"])
def test_sorted_keys_kernel_matches_emulation(kernel_path, family):
    # late_sink (above) leaves every key but the sink at P = 0: there the order cannot show. Here a
    # kernel that ignored the order (or sorted the other way) differs from the emulation by ~2e-2.
    gen = torch.Generator().manual_seed(2)
    q, k, v, mask = make_family(family, 2, 150, 200, 2, 64, dtype=torch.float32, generator=gen)
    cfg = FSAttnConfig(k_granularity="sorted_block")
    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)
    emu, emu_lse, _ = _emulate(q, k, v, mask, cfg)
    unsorted, _, _ = _emulate(q, k, v, mask, FSAttnConfig(k_granularity="block"))
    assert rel_l1(out, emu) < 1e-4 < rel_l1(out, unsorted), "kernel and emulation disagree"
    assert torch.allclose(lse, emu_lse, atol=1e-3)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_head_dims_and_layouts(kernel_device, head_dim, layout):
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v, _ = make_family("randn", 2, 37, 45, 2, head_dim, dtype=torch.bfloat16, device=kernel_device,
                             generator=gen)
    if layout == "HND":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out = fsattn(q, k, v, layout=layout)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    qb, kb, vb = (t if layout == "NHD" else t.transpose(1, 2) for t in (q, k, v))
    ref, _ = attention_reference(qb, kb, vb)
    outb = out if layout == "NHD" else out.transpose(1, 2)
    assert cosine(outb, ref) > 0.998 and rel_l1(outb, ref) < 0.06


def test_strided_views_need_no_copy(kernel_device):
    # q, k, v as diffusers gets them: slices of one fused projection, then a view to heads.
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, 50, 3 * 2 * 64, generator=gen).to(kernel_device)
    q, k, v = (t.unflatten(-1, (2, 64)) for t in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    out = fsattn(q, k, v)
    ref, _ = attention_reference(q, k, v)
    assert cosine(out, ref) > 0.998


@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (1, 77), (33, 1), (5, 123), (123, 5)])
def test_odd_lengths_and_cross_attention(kernel_device, seq_q, seq_k):
    gen = torch.Generator().manual_seed(seq_q * 1000 + seq_k)
    q, k, v, _ = make_family("randn", 1, seq_q, seq_k, 2, 64, dtype=torch.float16, device=kernel_device,
                             generator=gen)
    out = fsattn(q, k, v)
    ref, _ = attention_reference(q, k, v)
    assert torch.isfinite(out).all()
    assert cosine(out, ref) > 0.998


def test_grouped_query_attention(kernel_device):
    gen = torch.Generator().manual_seed(4)
    q, k, v, _ = make_family("randn", 1, 40, 70, 4, 64, dtype=torch.float32, device=kernel_device, generator=gen,
                             kv_heads=2)
    out = fsattn(q, k, v)
    ref, _ = attention_reference(q, k, v)
    assert cosine(out, ref) > 0.998
    # Each query head must read its own group's key/value head: swapping the KV heads must move outputs.
    swapped = fsattn(q, k.flip(2), v.flip(2))
    assert cosine(swapped, ref) < 0.9


@pytest.mark.parametrize("policy", ["online", "sampled"])
@pytest.mark.parametrize("family,mask_kind", [("masked_keys", "bool"), ("masked_keys", "additive"),
                                              ("fully_masked", "bool"), ("fully_masked", "additive"),
                                              ("underflow", "additive")])
def test_masks(kernel_path, family, mask_kind, policy):
    gen = torch.Generator().manual_seed(5)
    q, k, v, mask = make_family(family, 2, 40, 230, 2, 64, dtype=torch.float32, generator=gen)
    if mask.dtype == torch.bool and mask_kind == "additive":
        # A float mask takes the kernel's additive-bias path: -inf where masked, a finite tilt elsewhere.
        tilt = torch.linspace(-2.0, 2.0, mask.shape[-1])
        mask = torch.where(mask, tilt, float("-inf"))
    cfg = FSAttnConfig(max_policy=policy)
    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)
    ref, ref_lse = attention_reference(q, k, v, mask)
    emu, emu_lse, _ = _emulate(q, k, v, mask, cfg)
    assert torch.isfinite(out).all()
    # Scores 1000 below zero carry fp32 rounding of ~1e-4 in the order the kernel adds them.
    assert rel_l1(out, emu) < 1e-3
    assert cosine(out, ref) > 0.995
    attended = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), attended)
    assert (lse[attended] - ref_lse[attended]).abs().max() < 0.5
    if family == "fully_masked":
        assert out[0].abs().max() == 0, "rows with every key masked must be zeros"


@pytest.mark.parametrize("masked_value", ADDITIVE_MASKED_VALUES)
def test_additive_masks_mask_keys_as_bool_masks_do(kernel_device, masked_value):
    # Padded keys unlike the attended ones (V around 5): a float mask that left them in the K/V
    # statistics coarsened V's FP8 grid and shifted its mean (16 % relative L1 against 2.8 %).
    gen = torch.Generator().manual_seed(9)
    q, k, v, mask = make_family("padded_keys", 2, 40, 230, 2, 64, dtype=torch.float32, device=kernel_device,
                                generator=gen)
    additive = as_additive_mask(mask, masked_value)
    ref, _ = attention_reference(q, k, v, mask)
    out_bool = fsattn(q, k, v, attn_mask=mask)
    out_float = fsattn(q, k, v, attn_mask=additive)
    assert rel_l1(out_float, ref) <= 1.05 * rel_l1(out_bool, ref)
    assert rel_l1(out_float, ref) < 0.04


@pytest.mark.gpu
@pytest.mark.parametrize("masked_value", ADDITIVE_MASKED_VALUES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_additive_masks_within_bool_mask_error(masked_value, dtype):
    gen = torch.Generator().manual_seed(21)
    q, k, v, mask = make_family("padded_keys", 2, 4096, 4096, 4, 128, dtype=dtype, device="cuda", generator=gen)
    ref, _ = attention_reference(q, k, v, mask)
    err_bool = rel_l1(fsattn(q, k, v, attn_mask=mask), ref)
    out = fsattn(q, k, v, attn_mask=as_additive_mask(mask, masked_value, dtype))
    assert torch.isfinite(out).all()
    assert rel_l1(out, ref) <= 1.1 * err_bool + 1e-3, (rel_l1(out, ref), err_bool)


@pytest.mark.parametrize("path", ["kernels", "emulation"])
@pytest.mark.parametrize("garbage", ["large", "inf", "nan"])
def test_masked_key_values_change_nothing(request, monkeypatch, path, garbage):
    # Masked keys must not widen V's FP8 grid: a padding token of large value (HunyuanVideo pads
    # its prompt) would otherwise coarsen every attended key's V (found by the Gluon kernel's GPU
    # test). Nor may an inf or NaN there reach the K and V means (0 * inf is NaN).
    if path == "kernels":
        device = request.getfixturevalue("kernel_device")
    else:
        device = "cpu"
        monkeypatch.setattr(fsattn_ops, "CPU_PATH", path)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, s, 2, 64, generator=gen).to(device) for s in (40, 150, 150))
    mask = torch.ones(2, 1, 1, 150, dtype=torch.bool, device=device)
    mask[0, ..., 120:] = False
    out = fsattn(q, k, v, attn_mask=mask)
    k_bad, v_bad = k.clone(), v.clone()
    if garbage == "large":
        v_bad[0, 120:] += 100.0
        k_bad[0, 120:] *= 50.0
    else:
        v_bad[0, 120:] = k_bad[0, 120:] = float(garbage)
    out_bad = fsattn(q, k_bad, v_bad, attn_mask=mask)
    assert torch.isfinite(out_bad).all()
    assert rel_l1(out_bad, out) < 1e-6
    assert cosine(out, attention_reference(q, k, v, mask)[0]) > 0.999


# (head dim, keys): at the default on a GPU, the warp-specialised kernel (64), the Triton kernel
# (128, few keys) and the warp-specialised kernel on sorted keys (128, over 1,024 keys; "k_token"
# there: with a K scale per key); the interpreter runs the Triton kernel at both head dims.
NON_FINITE_SHAPES = [(64, 150), (128, 150)] + ([(128, 1100)] if GPU else [])
# Every variant of the Triton kernel, V without smoothing, a K scale per key, a float mask (the
# Triton kernel with a bias), and on a GPU the simple Gluon kernel; the emulation.
NON_FINITE_PATHS = ([("kernels", name, cfg) for name, cfg in VARIANTS]
                    + [("kernels", "no_smooth_v", FSAttnConfig(smooth_v=False)),
                       ("kernels", "k_token", FSAttnConfig(k_granularity="token")),
                       ("kernels", "float_mask", FSAttnConfig()),
                       ("kernels", "gluon", FSAttnConfig(kernel="gluon")),
                       ("emulation", "default", FSAttnConfig()),
                       ("emulation", "no_smooth_v", FSAttnConfig(smooth_v=False))])


@pytest.mark.parametrize("path,name,cfg", NON_FINITE_PATHS, ids=[f"{p}-{n}" for p, n, _ in NON_FINITE_PATHS])
@pytest.mark.parametrize("head_dim,seq_k", NON_FINITE_SHAPES)
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_input_gives_nan_where_it_reaches_never_a_finite_wrong_value(request, monkeypatch, path, name,
                                                                                   cfg, head_dim, seq_k, bad):
    # Without check_finite nothing is checked on the host; a NaN or Inf must still not come out as
    # a plausible number (the INT8 max and rounding would drop it): a query row's output is NaN, a
    # key makes every row of the query heads that read its KV head NaN, a V channel that channel.
    # Everything else is what the same call without the bad values gives: bit for bit, except the
    # other rows of the bad query's head, which share its tile's max decisions (a sampled max redone,
    # a tile corrected), decisions its clean values may have taken.
    if path == "kernels":
        device = request.getfixturevalue("kernel_device")
    else:
        device = "cpu"
        monkeypatch.setattr(fsattn_ops, "CPU_PATH", path)
    gen = torch.Generator().manual_seed(head_dim + seq_k)
    q, k, v, _ = make_family("randn", 2, 40, seq_k, 4, head_dim, dtype=torch.bfloat16, device=device,
                             generator=gen, kv_heads=2)
    mask = None
    if name == "float_mask":
        mask = torch.zeros(2, 1, 1, seq_k, device=device)
        mask[..., seq_k - 20:] = float("-inf")
    clean, clean_lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)
    q[0, 3, 1, :5] = k[1, 7, 0, 2] = v[0, 9, 1, 5] = float(bad)
    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=cfg)
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[0, 3, 1, :] = True  # batch 0, query row 3 of head 1
    expected[1, :, 0:2, :] = True  # batch 1, query heads 0 and 1 (KV head 0)
    expected[0, :, 2:4, 5] = True  # batch 0, query heads 2 and 3 (KV head 1), channel 5
    assert torch.equal(~torch.isfinite(out), expected), (~torch.isfinite(out)).nonzero()[:8]
    beside = torch.zeros_like(expected)
    beside[0, :, 1, :] = True
    assert torch.equal(out[~expected & ~beside], clean[~expected & ~beside])
    assert cosine(out[~expected & beside], clean[~expected & beside]) > 0.999
    rows = torch.zeros_like(lse, dtype=torch.bool)  # (B, H, Sq): V's channel leaves the LSE alone
    rows[0, 1, 3] = True
    rows[1, 0:2, :] = True
    beside_lse = torch.zeros_like(rows)
    beside_lse[0, 1, :] = True
    assert torch.equal(lse.isnan(), rows)
    assert torch.equal(lse[~rows & ~beside_lse], clean_lse[~rows & ~beside_lse])
    assert torch.allclose(lse[~rows & beside_lse], clean_lse[~rows & beside_lse], atol=0.02)


# --- GPU: real lengths, every family -------------------------------------------------------------

# (family, min cosine, max relative L1): the op issue's bounds; adversarial families need only be finite
# and cos >= 0.995. huge_magnitude (scores of ~1e5) is checked for finiteness only: no 8-bit score
# ranks keys whose scores differ by less than the quantisation step (tests/input_families.py).
GPU_BOUNDS = {
    "randn": (0.999, 0.04),
    "peaky": (0.999, 0.04),
    "late_sink": (0.995, 1.0),
    "max_staircase": (0.995, 1.0),
    "underflow": (0.995, 1.0),
    "masked_keys": (0.995, 1.0),
    "padded_keys": (0.995, 1.0),
    "fully_masked": (0.995, 1.0),
    "huge_magnitude": (-1.0, float("inf")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", INPUT_FAMILIES)
def test_gpu_families_against_float64_and_emulation(family, head_dim):
    # A seed of the family's index, not hash() of its name (that varies from process to process).
    gen = torch.Generator().manual_seed(1000 * INPUT_FAMILIES.index(family) + head_dim)
    q, k, v, mask = make_family(family, 2, 4096, 4096, 4, head_dim, device="cuda", generator=gen)
    reset_stats()
    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, mask)
    min_cos, max_l1 = GPU_BOUNDS[family]
    assert torch.isfinite(out).all()
    assert cosine(out, ref) >= min_cos and rel_l1(out, ref) <= max_l1
    # The Triton kernel with the default's K scales (here one per tile of sorted keys, but with a
    # float mask: plan.py). The emulation models it, except that it sums PV in FP32 where the
    # default (pv_accum="hw") chains the sums through Hopper's FP8 accumulator (~14 bits): 1e-2 of
    # slack.
    from fsattn_diffusers.attention import key_mask

    has_bias = key_mask(mask, q, k)[1] is not None
    default_plan = fsattn_ops.call_plan(FSAttnConfig(), q.device, head_dim, has_bias, q.dtype, k.shape[1])
    assert default_plan.sort_keys == (default_plan.kernel == "gluon_ws")
    triton = FSAttnConfig(kernel="triton", k_granularity="sorted_block" if default_plan.sort_keys else "token")
    out_t = fsattn(q, k, v, attn_mask=mask, config=triton)
    emu, emu_lse, emu_fallbacks = _emulate(q, k, v, mask, triton)
    assert rel_l1(out_t, emu) < 1e-2, "the GPU kernel and its emulation disagree"
    if family != "huge_magnitude":
        # Where the default is the warp-specialised kernel, its speculative max rounds P from
        # another max: not bit-close to the Triton kernel, but as close to float64.
        assert rel_l1(out, ref) <= 1.1 * rel_l1(out_t, ref) + 1e-3
    attended = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), attended)
    # The speculative (sampled) max, off by default, must catch every violation on the GPU too.
    sampled = FSAttnConfig(max_policy="sampled")
    reset_stats()
    out_sampled = fsattn(q, k, v, attn_mask=mask, config=sampled)
    assert torch.isfinite(out_sampled).all() and cosine(out_sampled, ref) >= min_cos
    emu_s, _, emu_s_fallbacks = _emulate(q, k, v, mask, sampled)
    assert rel_l1(out_sampled, emu_s) < 1e-2
    if family in ("late_sink", "max_staircase", "underflow"):
        assert stats()["fallback_q_tiles"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("family", INPUT_FAMILIES)
def test_gpu_sorted_block_scales_on_every_family(family, head_dim):
    # k_granularity="sorted_block" through the op (the warp-specialised kernel where it takes the
    # call, GQA, masks per batch element), within the bounds; the Triton kernel with the same sorted
    # pre-pass near the emulation of its numerics, and the op as close to float64 as it (the
    # speculative max rounds P from another max, so the two are not bit-close).
    gen = torch.Generator().manual_seed(1000 * INPUT_FAMILIES.index(family) + head_dim + 1)
    q, k, v, mask = make_family(family, 2, 4096, 4096, 4, head_dim, device="cuda", generator=gen, kv_heads=2)
    cfg = FSAttnConfig(k_granularity="sorted_block")
    out = fsattn(q, k, v, attn_mask=mask, config=cfg)
    again = fsattn(q, k, v, attn_mask=mask, config=cfg)  # the prepared call
    ref, _ = attention_reference(q, k, v, mask)
    min_cos, max_l1 = GPU_BOUNDS[family]
    assert torch.equal(out, again) and torch.isfinite(out).all()
    assert cosine(out, ref) >= min_cos and rel_l1(out, ref) <= max_l1
    if family != "huge_magnitude":
        out_t = fsattn(q, k, v, attn_mask=mask, config=FSAttnConfig(k_granularity="sorted_block", kernel="triton"))
        emu, _, _ = _emulate(q, k, v, mask, cfg)
        assert rel_l1(out_t, emu) < 1e-2, "the Triton kernel and its emulation disagree"
        assert rel_l1(out, ref) <= 1.1 * rel_l1(out_t, ref) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "auto"])
def test_gpu_long_rows_and_64bit_offsets(kernel):
    # B*S*H*D > 2**31 elements: offsets must be 64-bit. 1 x 140000 x 128 x 128 = 2.29e9. "auto" runs
    # the warp-specialised Gluon kernel at this head dim on Hopper, so the Triton kernel is asked for too.
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 140_000, 128, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 4096, 128, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    assert q.numel() > 2**31
    out = fsattn(q, k, v, config=FSAttnConfig(kernel=kernel))
    rows = torch.tensor([0, 70_000, 139_999], device="cuda")
    ref, _ = attention_reference(q[:, rows], k, v)
    assert cosine(out[:, rows], ref) > 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("name,cfg", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_gpu_variants_against_emulation(name, cfg):
    gen = torch.Generator().manual_seed(11)
    q, k, v, mask = make_family("late_sink", 2, 2000, 3000, 4, 128, device="cuda", generator=gen)
    out = fsattn(q, k, v, config=cfg)
    emu, _, _ = _emulate(q, k, v, mask, cfg)
    ref, _ = attention_reference(q, k, v)
    assert rel_l1(out, emu) < 1e-2
    assert math.isfinite(rel_l1(out, ref)) and cosine(out, ref) > 0.995
