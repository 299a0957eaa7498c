"""The K/V pre-pass and the forward launcher, element by element, against float64 statistics, torch
packing and the emulation.

On CPU the kernels run in Triton's interpreter (tests/conftest.py) at tiny shapes; on a GPU the same
checks run on the GPU. Outputs are allocated poisoned (every byte 0xFF: NaN in float formats) where
a test says so, so that an element the kernels leave unwritten shows.
"""

import pytest
import torch

from fsattn_diffusers import FSAttnConfig
from fsattn_diffusers.kernels import quantize
from fsattn_diffusers.kernels.fsattn_fwd import FROZEN_RESCALE, fsattn_fwd
from fsattn_diffusers.kernels.quantize import PV_KEY_ORDERS, kv_split, quantize_kv, quantize_q, wgmma_key_of_column
from fsattn_diffusers.reference import _pack_v, _quantize_k, emulate_fsattn, key_order, to_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like fill their memory with 0xFF bytes while the test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        t.view(torch.uint8).fill_(0xFF) if t.numel() else None
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


def _inputs(bsz=2, seq=150, heads=3, dim=48, masked=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(bsz, seq, heads, dim, generator=gen) * 4 + 1
    v = torch.randn(bsz, seq, heads, dim, generator=gen) + 2
    weight = (torch.rand(bsz, seq, generator=gen) > 0.4).float() if masked else None
    return k.to(DEVICE), v.to(DEVICE), None if weight is None else weight.to(DEVICE)


def _stats64(k, v, weight, smooth_v, v_fp8):
    """K mean, V shift (the mean subtracted from V) and V scale in float64, (B, H, D)."""
    kd, vd = (t.double().transpose(1, 2) for t in (k, v))
    keep = (weight != 0)[:, None, :, None]
    count = weight.double().sum(1).clamp_min(1.0)[:, None, None]
    k_mean = torch.where(keep, kd, 0.0).sum(2) / count
    v_shift = torch.where(keep, vd, 0.0).sum(2) / count if smooth_v and v_fp8 else torch.zeros_like(k_mean)
    if not v_fp8:
        return k_mean, v_shift, torch.ones_like(k_mean)
    v_max = torch.where(keep, vd, float("-inf")).amax(2)
    v_min = torch.where(keep, vd, float("inf")).amin(2)
    return k_mean, v_shift, torch.maximum(v_max - v_shift, v_shift - v_min).clamp_min(1e-20) / 448.0


def _check_prepass(k, v, weight, kv, v_shift, *, block_n, smooth_v, v_dtype):
    """Every output of quantize_kv (then quantize_q: `kv.v_mean`, with `v_shift` the V mean read
    before it) against float64 statistics and torch's packing of K and V with those statistics."""
    bsz, seq, heads, dim = k.shape
    d_pad = kv.k_q.shape[-1]
    n_tiles = -(-seq // block_n)
    s_pad = n_tiles * block_n
    v_fp8 = v_dtype == FP8
    w = torch.ones(bsz, seq, device=k.device) if weight is None else weight
    keep = (w != 0)[:, None, :, None]

    # Statistics: as float64 up to fp32 sums in another order; padding channels 0 (scale 1).
    k_mean, v_shift64, v_scale = _stats64(k, v, w, smooth_v, v_fp8)
    torch.testing.assert_close(kv.k_mean[..., :dim].double(), k_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_shift[..., :dim].double(), v_shift64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.v_scale[..., :dim].double(), v_scale, rtol=1e-5, atol=0)
    assert (kv.k_mean[..., dim:] == 0).all() and (v_shift[..., dim:] == 0).all()
    assert (kv.v_mean[..., dim:] == 0).all() and (kv.v_scale[..., dim:] == 1).all()

    # K: INT8 of (k - mean) over its scale, zero at masked keys, padding keys and channels.
    kc = torch.where(keep, k.float().transpose(1, 2) - kv.k_mean[:, :, None, :dim], 0.0)
    kc = torch.nn.functional.pad(kc, (0, d_pad - dim, 0, s_pad - seq))
    if kv.k_per_token:
        amax = kc.abs().amax(-1).clamp_min(1e-20)
        assert kv.k_scale.shape == (bsz, heads, s_pad)
        torch.testing.assert_close(kv.k_scale, amax / 127, rtol=1e-6, atol=0)
        k8 = torch.trunc(kc * (127 / amax)[..., None] + torch.where(kc >= 0, 0.5, -0.5))
    else:
        amax = kc.view(bsz, heads, n_tiles, block_n * d_pad).abs().amax(-1).clamp_min(1e-20)
        assert kv.k_scale.shape == (bsz, heads, n_tiles)
        torch.testing.assert_close(kv.k_scale, amax / 127, rtol=1e-6, atol=0)
        scale = (127 / amax).repeat_interleave(block_n, -1)[..., None]
        k8 = torch.trunc(kc * scale + torch.where(kc >= 0, 0.5, -0.5))
    # A GPU divides 127 / amax to within an ulp: a key on a rounding tie may step by one.
    assert (kv.k_q.float() - k8).abs().max() <= 1 and (kv.k_q.float() != k8).float().mean() < 1e-3
    assert (kv.k_q[:, :, seq:] == 0).all() and (kv.k_q[..., dim:] == 0).all()
    assert (kv.k_q.float().abs().sum(-1)[:, :, :seq] == 0)[~keep[:, :, :, 0].expand(-1, heads, -1)].all()

    # V: (v - shift) / scale in the PV format, transposed, in the layout's key order; exact.
    scaled = torch.where(keep, v.float().transpose(1, 2) - v_shift[:, :, None, :dim], 0.0)
    scaled = scaled * (1.0 / kv.v_scale[:, :, None, :dim])
    if v_fp8:
        scaled = scaled.clamp(-448.0, 448.0)
    low = scaled.to(v_dtype)
    packed = torch.nn.functional.pad(low.float(), (0, d_pad - dim, 0, s_pad - seq)).transpose(-1, -2)
    columns = torch.arange(s_pad, device=k.device)
    keys = wgmma_key_of_column(columns) if kv.pv_key_order == "wgmma" else columns
    assert kv.v_t.dtype == v_dtype and kv.v_t.shape == (bsz, heads, d_pad, s_pad)
    assert torch.equal(kv.v_t.float(), packed[..., keys])

    # The final V mean: the shift less V's mean rounding error (scaled units times the scale).
    err = (low.double() - scaled.double()).sum(2) / w.double().sum(1).clamp_min(1.0)[:, None, None]
    expected = v_shift[..., :dim].double() - err * kv.v_scale[..., :dim].double()
    torch.testing.assert_close(kv.v_mean[..., :dim].double(), expected, rtol=1e-6, atol=1e-6)

    # Row-sum weights: row 0 the key weight, rows 1-15 zero (in the "wgmma" order with per-tile K
    # scales, the key weight too: the warp-specialised kernel then reads one column of the GEMM's
    # tile); one row block unless masked.
    weights = torch.nn.functional.pad(w, (0, s_pad - seq))[: 1 if weight is None else bsz]
    assert kv.rowsum_weights.dtype == v_dtype and kv.rowsum_weights.shape == (weights.shape[0], 16, s_pad)
    assert torch.equal(kv.rowsum_weights[:, 0].float(), weights[:, keys])
    others = weights[:, None, keys].expand(-1, 15, -1)
    if kv.pv_key_order != "wgmma" or kv.k_per_token:
        others = torch.zeros_like(others)
    assert torch.equal(kv.rowsum_weights[:, 1:].float(), others)


def _prepass(k, v, weight, q=None, **kwargs):
    """quantize_kv, the V mean before quantize_q, and the QuantizedKV after quantize_q."""
    kv = quantize_kv(k, v, weight, **kwargs)
    v_shift = kv.v_mean.clone()
    if q is None:
        q = torch.randn(k.shape[0], 5, *k.shape[2:], generator=torch.Generator().manual_seed(9)).to(k.device)
    quantize_q(q, kv, sm_scale=0.2, block_m=16)
    return kv, v_shift


@pytest.mark.parametrize("v_dtype, smooth_v", [(FP8, True), (FP8, False), (torch.bfloat16, False),
                                               (torch.float16, False)])
@pytest.mark.parametrize("k_per_token", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_prepass_matches_float64_statistics_and_torch_packing(poisoned, v_dtype, smooth_v, k_per_token, masked):
    # 150 keys: five 32-key tiles, the last short; 12 programs for 6 heads: 2 per head, owning 3 and 2 tiles.
    k, v, weight = _inputs(masked=masked)
    kv, v_shift = _prepass(k, v, weight, block_n=32, d_pad=64, k_per_token=k_per_token, smooth_v=smooth_v,
                           v_dtype=v_dtype, n_programs_target=12)
    assert kv.n_split == 2
    _check_prepass(k, v, weight, kv, v_shift, block_n=32, smooth_v=smooth_v, v_dtype=v_dtype)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("n_programs_target", [1, 18, 1000])
def test_wgmma_order_and_any_split(poisoned, masked, n_programs_target):
    # One program per head, three (2 + 2 + 1 tiles), and one per tile (five).
    k, v, weight = _inputs(masked=masked, seed=1)
    kv, v_shift = _prepass(k, v, weight, block_n=32, d_pad=64, pv_key_order="wgmma",
                           n_programs_target=n_programs_target)
    assert kv.n_split == {1: 1, 18: 3, 1000: 5}[n_programs_target]
    _check_prepass(k, v, weight, kv, v_shift, block_n=32, smooth_v=True, v_dtype=FP8)


# Tiles of one loop step (32 keys at padded head dim 64), and 128-key tiles packed in steps of
# 32 keys, where a per-tile K scale is the sorted tile's first size, read by every step. Masked,
# both have a last tile of masked keys and padding alone.
SORTED_SHAPES = {"32-key tiles": dict(block_n=32, d_pad=64, seq=150, dim=48),
                 "128-key tiles in 32-key steps": dict(block_n=128, d_pad=128, seq=300, dim=128)}


@pytest.mark.parametrize("pv_key_order", PV_KEY_ORDERS)
@pytest.mark.parametrize("k_per_token", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", SORTED_SHAPES.values(), ids=SORTED_SHAPES.keys())
def test_sorted_keys_are_the_packing_of_the_keys_in_order_of_size(poisoned, shape, masked, k_per_token,
                                                                  pv_key_order):
    # sort_keys stores each head's keys by size, largest first, masked keys and padding last: the
    # same buffers as packing those keys in that order, and their weights are the same for every
    # head (the first n_attended keys attended).
    block_n = shape["block_n"]
    k, v, weight = _inputs(seq=shape["seq"], heads=2, dim=shape["dim"], masked=masked, seed=4)
    bsz, seq, heads, dim = k.shape
    kv, v_shift = _prepass(k, v, weight, block_n=block_n, d_pad=shape["d_pad"], k_per_token=k_per_token,
                           pv_key_order=pv_key_order, sort_keys=True, n_programs_target=12)
    order = kv.key_order
    s_pad = kv.k_q.shape[2]
    assert order.shape == (bsz, heads, s_pad) and torch.equal(order.sort(-1).values,
                                                              torch.arange(s_pad, device=DEVICE).expand_as(order))
    # By size in float64 (near-ties may fall either way in float32).
    w = torch.ones(bsz, seq, device=DEVICE) if weight is None else weight
    keep = (w != 0)[:, None, :]
    kd = k.double().transpose(1, 2)
    mean = (kd * keep[..., None]).sum(2, keepdim=True) / keep.sum(-1).clamp_min(1)[..., None, None]
    size = torch.where(keep, (kd - mean).abs().amax(-1), -1.0)
    size = torch.nn.functional.pad(size, (0, s_pad - seq), value=-1.0).gather(-1, order)
    assert (size[..., 1:] <= size[..., :-1] + 1e-5).all()
    n_attended = keep.sum(-1)  # (B, 1)
    assert (size[..., : int(n_attended.min())] >= 0).all() and (size[..., int(n_attended.max()):] == -1).all()
    assert (order[:, :, seq:] >= seq).all(), "padding stays behind the keys, masked ones too"
    # The emulation's order (torch's float32 statistics) is the same on these inputs.
    assert torch.equal(order[:, :, :seq].cpu(), key_order(k.float().transpose(1, 2).cpu(), w.cpu()))

    # The real keys fill the first `seq` positions of every head: pack them in that order.
    head_order = order[:, :, :seq].transpose(1, 2)  # (B, S, H)
    k_sorted, v_sorted = (t.gather(1, head_order[..., None].expand_as(t)) for t in (k, v))
    w_sorted = (torch.arange(seq, device=DEVICE)[None] < n_attended).float()
    _check_prepass(k_sorted, v_sorted, w_sorted if masked else None, kv, v_shift, block_n=block_n, smooth_v=True,
                   v_dtype=FP8)


@pytest.mark.parametrize("pv_key_order", PV_KEY_ORDERS)
@pytest.mark.parametrize("masked", [False, True])
def test_a_sorted_tiles_k_scale_has_the_bits_of_the_largest_magnitude_in_it(masked, pv_key_order):
    # The packing of sorted keys reads each tile's K scale from the sorted sizes (its first key's)
    # instead of taking the tile's largest magnitude. With integer keys every sum is exact in fp32,
    # so the K mean has the same bits in any key order: the unsorted per-tile packing, which
    # takes each tile's largest magnitude from the tile, of the keys put in the sorted order
    # beforehand gives the same scales and INT8 keys, bit for bit.
    gen = torch.Generator().manual_seed(12)
    k = torch.randint(-60, 61, (2, 300, 2, 128), generator=gen).float().to(DEVICE)
    v = torch.randn(2, 300, 2, 128, generator=gen).to(DEVICE)
    weight = (torch.rand(2, 300, generator=gen) > 0.4).float().to(DEVICE) if masked else None
    layout = dict(block_n=128, d_pad=128, k_per_token=False, pv_key_order=pv_key_order, n_programs_target=8)
    sorted_kv = quantize_kv(k, v, weight, sort_keys=True, **layout)
    head_order = sorted_kv.key_order[:, :, :300].transpose(1, 2)  # (B, S, H): real keys first, masked ones last
    k_sorted = k.gather(1, head_order[..., None].expand_as(k))
    n_attended = None if weight is None else weight.sum(1, keepdim=True)
    w_sorted = None if weight is None else (torch.arange(300, device=DEVICE)[None] < n_attended).float()
    in_order = quantize_kv(k_sorted, v, w_sorted, sort_keys=False, **layout)
    assert torch.equal(sorted_kv.k_scale, in_order.k_scale)
    assert torch.equal(sorted_kv.k_q, in_order.k_q)
    if masked:  # the last tile holds masked keys and padding alone: the scale's floor
        assert (sorted_kv.k_scale[..., -1] < 1e-21).all() and (sorted_kv.k_scale[..., :-1] > 0.1).all()


def test_a_sorted_tiles_k_scale_below_its_largest_magnitude_saturates_the_int8_keys(monkeypatch):
    # The packing of sorted keys takes each tile's scale from the sorted sizes, which the size pass
    # computed from the same K mean as the keys it packs. Whatever scale arrives, no INT8 key may
    # wrap: a key past its scale saturates at +-127 (a K mean off by a last bit, where the mean is
    # large against the keys' spread, would put keys far past it). Simulated by scales 3 % below
    # the sizes: the largest key of each tile then rounds past 127.
    sort = torch.sort

    def sort_with_small_sizes(sizes, *args, **kwargs):
        values, order = sort(sizes, *args, **kwargs)
        return torch.where(values > 0, values * 0.97, values), order

    monkeypatch.setattr(torch, "sort", sort_with_small_sizes)
    gen = torch.Generator().manual_seed(5)
    k = torch.randint(-60, 61, (1, 300, 2, 128), generator=gen).float().to(DEVICE)  # exact fp32 sums
    v = torch.randn(1, 300, 2, 128, generator=gen).to(DEVICE)
    kv = quantize_kv(k, v, None, block_n=128, d_pad=128, k_per_token=False, pv_key_order="wgmma",
                     sort_keys=True, n_programs_target=8)
    mean = k.sum(1, keepdim=True) / 300.0  # fp32, as the kernels divide
    centred = (k - mean).transpose(1, 2)  # (B, H, S, D)
    centred = torch.nn.functional.pad(centred, (0, 0, 0, kv.k_q.shape[2] - 300))
    centred = centred.gather(2, kv.key_order[..., None].expand_as(centred))
    scale = kv.k_scale.repeat_interleave(128, -1)[..., None] * 127.0  # each key's tile amax
    scaled = centred * (127.0 / scale)
    expected = torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5).trunc().clamp(-127, 127)
    past = scaled.abs() >= 128.0  # past the scale by far more than a rounding
    assert past.sum() > 10, "some keys must lie past the scale for this test to mean anything"
    assert torch.equal(kv.k_q.float()[past], expected[past]), "+-127 with the key's sign, never wrapped"
    # Elsewhere the packing as usual (a GPU's division may round a last bit otherwise: a step at most).
    assert (kv.k_q.float() - expected).abs().max() <= 1


@pytest.mark.parametrize("seq", [256, 250])
@pytest.mark.parametrize("masked", [False, True])
def test_head_dim_128_tiles_of_128_keys(poisoned, seq, masked):
    # The loops step through each 128-key tile in sub-tiles of 32 keys; 256 keys is a multiple of
    # 16 (where a specialised seq_len once broke the row-sum weights on a GPU), 250 is not. One
    # batch, two heads, two programs per head.
    k, v, weight = _inputs(bsz=1, seq=seq, heads=2, dim=128, masked=masked, seed=10)
    for order in ("wgmma", "natural"):
        kv, v_shift = _prepass(k, v, weight, block_n=128, d_pad=128, pv_key_order=order, n_programs_target=4)
        assert kv.n_split == 2
        _check_prepass(k, v, weight, kv, v_shift, block_n=128, smooth_v=True, v_dtype=FP8)


def test_a_program_past_the_last_tile_writes_neutral_partials(poisoned):
    # Four programs of two tiles over five tiles: the fourth owns none. Its partials (and rounding
    # error) must leave the statistics as they are, over poisoned memory.
    k, v, weight = _inputs(seed=2)
    kv = quantize._launch_kv_prepass(k, v, weight, 4, 2, block_n=32, d_pad=64, k_per_token=True, smooth_v=True,
                                     v_dtype=FP8, pv_key_order="natural")
    v_shift = kv.v_mean.clone()
    quantize_q(k[:, :5], kv, sm_scale=0.2, block_m=16)
    assert kv.n_split == 4
    _check_prepass(k, v, weight, kv, v_shift, block_n=32, smooth_v=True, v_dtype=FP8)


@pytest.mark.parametrize("order", PV_KEY_ORDERS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 1e30])
def test_masked_keys_never_reach_the_outputs(bad, order):
    # Whatever a masked key holds (padding tokens may hold inf or NaN), every output byte is the same.
    k, v, weight = _inputs(seed=3)
    masked = (weight == 0)[:, :, None, None]
    clean = _prepass(k.masked_fill(masked, 0.0), v.masked_fill(masked, 0.0), weight, block_n=32, d_pad=64,
                     n_programs_target=12, pv_key_order=order)[0]
    dirty = _prepass(k.masked_fill(masked, bad), v.masked_fill(masked, bad), weight, block_n=32, d_pad=64,
                     n_programs_target=12, pv_key_order=order)[0]
    for name in ("k_q", "k_scale", "v_t", "rowsum_weights", "workspace"):
        assert torch.equal(getattr(clean, name).view(torch.uint8), getattr(dirty, name).view(torch.uint8)), name


def test_a_boolean_key_weight_broadcast_over_the_batch_quantises_as_its_float_copy():
    # key_mask hands a boolean mask on as a view (no cast launch): the pre-pass reads True/False
    # as 1/0, through the view's strides (batch stride 0 here).
    k, v, _ = _inputs(seed=11)
    keep = (torch.rand(1, k.shape[1], generator=torch.Generator().manual_seed(12)) > 0.4).to(DEVICE)
    as_bool = keep.expand(k.shape[0], -1)
    as_float = as_bool.float().contiguous()
    from_bool = _prepass(k, v, as_bool, block_n=32, d_pad=64, n_programs_target=12)[0]
    from_float = _prepass(k, v, as_float, block_n=32, d_pad=64, n_programs_target=12)[0]
    for name in ("k_q", "k_scale", "v_t", "rowsum_weights", "workspace"):
        assert torch.equal(getattr(from_bool, name).view(torch.uint8), getattr(from_float, name).view(torch.uint8)), name
    assert from_bool.rowsum_weights[:, 0, : k.shape[1]].float().sum() == as_float.sum()


def test_a_batch_row_with_every_key_masked_gives_zeros():
    k, v, weight = _inputs(seed=4)
    weight[1] = 0
    kv, _ = _prepass(k, v, weight, block_n=32, d_pad=64, n_programs_target=12)
    for name in ("k_q", "v_t", "k_mean", "v_mean"):
        assert getattr(kv, name)[1].float().abs().max() == 0, name
    assert (kv.v_scale > 0).all() and torch.isfinite(kv.v_scale).all()
    assert kv.rowsum_weights[1].float().abs().max() == 0 and kv.rowsum_weights[0, 0].float().sum() == weight[0].sum()


def test_grouped_query_heads_read_their_kv_head_and_correct_every_v_mean(poisoned):
    # 4 query heads over 2 KV heads, batch 2: q . k_mean pairs query head h with KV head h // 2, and
    # the V-mean correction (one program per batch and KV head) reaches every (batch, KV head).
    k, v, weight = _inputs(heads=2, seed=5)
    q = (torch.randn(2, 50, 4, 48, generator=torch.Generator().manual_seed(6)) * 3).to(DEVICE)
    kv = quantize_kv(k, v, weight, block_n=32, d_pad=64, n_programs_target=8)
    v_shift = kv.v_mean.clone()
    qq = quantize_q(q, kv, sm_scale=0.2, block_m=32)
    expected = (q.float().transpose(1, 2) * kv.k_mean.repeat_interleave(2, 1)[:, :, None, :48]).sum(-1) * 0.2
    torch.testing.assert_close(qq.q_dot_k_mean[:, :, :50], expected, rtol=1e-5, atol=1e-4)
    _check_prepass(k, v, weight, kv, v_shift, block_n=32, smooth_v=True, v_dtype=FP8)


def test_q_programs_of_fewer_rows_than_the_forward_write_every_padded_row_alike(poisoned, monkeypatch):
    # At head dim 128 Q's pass runs 32-row programs for a forward of 128-row tiles (q_tile): the
    # grid must still cover the whole padding, and a row's bytes must not depend on its program.
    gen = torch.Generator().manual_seed(13)
    k, v = (torch.randn(2, 90, 2, 128, generator=gen).to(DEVICE) for _ in range(2))
    q = (torch.randn(2, 200, 4, 128, generator=gen) * 2).to(DEVICE)
    assert quantize.q_tile(128, 128)[0] < 128
    small = quantize_q(q, quantize_kv(k, v, None, block_n=32, d_pad=128), sm_scale=0.2, block_m=128)
    monkeypatch.setattr(quantize, "q_tile", lambda block_m, d_pad: (block_m, 4))
    quantize._q_prepass.cache_clear()
    whole = quantize_q(q, quantize_kv(k, v, None, block_n=32, d_pad=128), sm_scale=0.2, block_m=128)
    quantize._q_prepass.cache_clear()
    assert small.q_q.shape[2] == 256  # padded to the forward's tiles, not the pass's
    for name in ("q_q", "q_scale", "q_dot_k_mean"):
        assert torch.equal(getattr(small, name).view(torch.uint8), getattr(whole, name).view(torch.uint8)), name


def test_the_prepass_is_deterministic_and_quantize_q_may_run_twice():
    k, v, weight = _inputs(seed=7)
    runs = []
    for _ in range(2):
        kv = quantize_kv(k, v, weight, block_n=32, d_pad=64, n_programs_target=12)
        qq = quantize_q(k[:, :40], kv, sm_scale=0.2, block_m=16)
        runs.append([kv.k_q, kv.k_scale, kv.v_t, kv.rowsum_weights, kv.workspace, qq.q_q, qq.q_scale, qq.q_dot_k_mean])
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    v_mean = kv.v_mean.clone()
    quantize_q(k[:, :40], kv, sm_scale=0.2, block_m=16)  # a launcher falling back to another kernel does this
    assert torch.equal(kv.v_mean, v_mean)


@pytest.mark.parametrize("n_tiles, n_heads, target, expected", [
    (256, 12, 528, (43, 6)),   # Wan 2.1 1.3B at 480p (head dim 128: four programs per SM): 516 programs
    (591, 40, 528, (13, 46)),  # Wan 2.1 14B at 720p
    (139, 96, 396, (4, 35)),   # CogVideoX-like head dim 64, batch 2 x 48 heads (three per SM)
    (5, 6, 12, (2, 3)),
    (5, 6, 18, (3, 2)),
    (9, 1, 4, (3, 3)),         # 4 programs of 3 tiles would leave the fourth with none
    (5, 400, 396, (1, 5)),     # more heads than the target: one program per head
    (10_000, 1, 396, (64, 157)),  # at most MAX_SPLIT per head
    (1, 1, 396, (1, 1)),
])
def test_kv_split(n_tiles, n_heads, target, expected):
    n_split, per_program = kv_split(n_tiles, n_heads, target)
    assert (n_split, per_program) == expected
    assert (n_split - 1) * per_program < n_tiles <= n_split * per_program  # every program owns a tile
    assert n_split <= min(n_tiles, quantize.MAX_SPLIT)


@pytest.mark.parametrize("k_per_token", [True, False])
@pytest.mark.parametrize("v_dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_quantize_kv_matches_emulation(k_per_token, v_dtype, masked):
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(2, 70, 3, 48, generator=gen) * 4 + 1).to(DEVICE)
    v = (torch.randn(2, 70, 3, 48, generator=gen) + 2).to(DEVICE)
    weight = None
    if masked:
        weight = (torch.rand(2, 70, generator=gen) > 0.4).float().to(DEVICE)
    kv, _ = _prepass(k, v, weight, block_n=32, d_pad=64, k_per_token=k_per_token,
                     smooth_v=v_dtype == FP8, v_dtype=v_dtype)
    cfg = FSAttnConfig(k_granularity="token" if k_per_token else "block",
                       pv_format="fp8_e4m3" if v_dtype == FP8 else "16bit")
    w = weight if masked else torch.ones(2, 70, device=DEVICE)
    k8, key_scale, k_mean = _quantize_k(k.float().transpose(1, 2), w, k_per_token, 32)
    low = to_fp8 if v_dtype == FP8 else (lambda t: t.bfloat16().float())
    v_lo, v_scale, v_mean = _pack_v(v.float().transpose(1, 2), w, cfg, low)
    assert kv.k_q.shape == (2, 3, 96, 64) and kv.v_t.shape == (2, 3, 64, 96)
    # Rounding at exact ties may differ by one step between Triton and torch; nothing else may.
    assert (kv.k_q[..., :48].float() - k8[..., :48]).abs().max() <= 1
    assert (kv.k_q[..., :48].float() != k8[..., :48]).float().mean() < 1e-3
    scales = kv.k_scale if k_per_token else kv.k_scale.repeat_interleave(32, -1)
    torch.testing.assert_close(scales, key_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(kv.k_mean[..., :48], k_mean, rtol=1e-3, atol=1e-3)
    v_kernel = kv.v_t.float().transpose(-1, -2)[:, :, :70, :48]
    assert (v_kernel != v_lo).float().mean() < 1e-3
    torch.testing.assert_close(kv.v_scale[..., :48], v_scale, rtol=1e-3, atol=1e-6)


def test_forward_writes_every_output_element():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 200, 2, 64, generator=gen).to(DEVICE) for _ in range(3))
    kv = quantize_kv(k, v, None, block_n=32, d_pad=64)
    out = torch.full_like(q, float("nan"))  # poison
    lse = torch.full((1, 2, 200), float("nan"), device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    fsattn_fwd(q, kv, out, lse, counter, sm_scale=0.125, frozen=FROZEN_RESCALE, block_m=16, num_warps=4,
               num_stages=1)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    emu, emu_lse, _ = emulate_fsattn(q, k, v, scale=0.125, config=FSAttnConfig(max_policy="sampled"), block_m=16,
                                     block_n=32)
    # FP8 roundings of P may flip where kernel and emulation round a score differently (1 ulp).
    assert (out - emu).abs().sum() / emu.abs().sum() < 2e-3
    torch.testing.assert_close(lse, emu_lse, rtol=1e-5, atol=5e-3)


def test_quantize_q_folds_scale_and_pads(poisoned):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 50, 4, 48, generator=gen).to(DEVICE) * 3
    k, v, _ = _inputs(heads=2, masked=False, seed=8)  # GQA: 2 KV heads for 4 query heads
    kv = quantize_kv(k, v, None, block_n=32, d_pad=64)
    qq = quantize_q(q, kv, sm_scale=0.2, block_m=32)
    assert qq.q_q.shape == (2, 4, 64, 64) and qq.q_q[:, :, 50:].abs().max() == 0 and qq.q_q[..., 48:].abs().max() == 0
    q_log2 = q.float().transpose(1, 2) * 0.2 * 1.4426950408889634
    scale = q_log2.abs().amax(-1) / 127
    torch.testing.assert_close(qq.q_scale[:, :, :50], scale)
    dequant = qq.q_q[:, :, :50, :48].float() * qq.q_scale[:, :, :50, None]
    assert (dequant - q_log2).abs().max() <= 0.5 * scale.max() * 1.0001
    k_mean = k.double().mean(1)  # (B, Hkv, D)
    expected = (q.double().transpose(1, 2) * k_mean.repeat_interleave(2, 1)[:, :, None]).sum(-1) * 0.2
    torch.testing.assert_close(qq.q_dot_k_mean[:, :, :50].double(), expected, rtol=1e-5, atol=1e-4)


def test_the_wgmma_key_order_gives_each_thread_its_own_keys():
    # In the m64nNk32 score accumulator, thread q of a quad holds keys 8g + 2q + {0, 1} of every 32;
    # as the 8-bit register operand of the PV GEMM it holds k = 4q + {0..3} and 16 + 4q + {0..3}.
    keys = wgmma_key_of_column(torch.arange(96))
    assert torch.equal(keys.sort().values, torch.arange(96))
    for chunk in range(3):
        for q in range(4):
            operand_cols = [32 * chunk + 16 * h + 4 * q + j for h in range(2) for j in range(4)]
            held = {32 * chunk + 8 * g + 2 * q + e for g in range(4) for e in range(2)}
            assert set(keys[operand_cols].tolist()) == held


@pytest.mark.parametrize("masked", [False, True])
def test_the_wgmma_key_order_permutes_only_v_and_the_row_sum_weights(masked):
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(2, 150, 2, 64, generator=gen) * 3).to(DEVICE)
    v = (torch.randn(2, 150, 2, 64, generator=gen) + 1).to(DEVICE)
    weight = (torch.rand(2, 150, generator=gen) > 0.3).float().to(DEVICE) if masked else None
    natural, natural_shift = _prepass(k, v, weight, block_n=64, d_pad=64)
    wgmma, wgmma_shift = _prepass(k, v, weight, block_n=64, d_pad=64, pv_key_order="wgmma")
    assert natural.pv_key_order == "natural" and wgmma.pv_key_order == "wgmma"
    keys = wgmma_key_of_column(torch.arange(natural.v_t.shape[-1], device=DEVICE))
    assert torch.equal(wgmma.v_t.view(torch.uint8), natural.v_t.view(torch.uint8)[..., keys])
    assert torch.equal(wgmma.rowsum_weights.view(torch.uint8)[:, :1],
                       natural.rowsum_weights.view(torch.uint8)[:, :1, keys])
    assert not torch.equal(wgmma.v_t.view(torch.uint8), natural.v_t.view(torch.uint8))
    # The statistics come from the same keys in the same order: the same bits.
    for name in ("k_q", "k_scale", "k_mean", "v_scale"):
        assert torch.equal(getattr(wgmma, name), getattr(natural, name)), name
    # V's rounding error is summed over each tile's keys in the order they are stored: the
    # correction of the V mean is the same up to the order of a float32 sum.
    assert torch.equal(wgmma_shift, natural_shift)
    correction = natural.v_mean - natural_shift
    assert correction.abs().max() > 0
    torch.testing.assert_close(wgmma.v_mean - wgmma_shift, correction, rtol=1e-4, atol=1e-4 * correction.abs().max())


@pytest.mark.parametrize("n", [64, 128])
def test_the_kernels_operand_order_is_the_quantisers_key_order(n):
    # The Gluon kernel reads P's registers as the PV operand through a reshape and permute; V is
    # stored by wgmma_key_of_column. Replayed in torch, operand column c must hold that key.
    ws = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon_ws",
                             reason="this Triton has no Gluon warp specialisation")

    rows = 4
    p = torch.arange(rows * n).reshape(rows, n)
    split, axes = ws.WGMMA_KEY_SPLIT.value, ws.WGMMA_AXES.value  # the constexprs the kernel uses
    operand = p.reshape(rows, n // 32, *split).permute(*axes).reshape(rows, n)
    assert torch.equal(operand, p[:, wgmma_key_of_column(torch.arange(n))])


def test_bad_arguments_are_refused():
    k = torch.randn(1, 40, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="pv_key_order"):
        quantize_kv(k, k, None, block_n=32, d_pad=64, pv_key_order="shuffled")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_kv(k, k, None, block_n=16, d_pad=64, pv_key_order="wgmma")
    with pytest.raises(ValueError, match="d_pad"):
        quantize_kv(k, k, None, block_n=32, d_pad=48)
    with pytest.raises(ValueError, match="d_pad"):
        quantize_kv(k, k, None, block_n=32, d_pad=32)
