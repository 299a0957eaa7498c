"""The K/V pre-pass and the forward launcher, element by element, against the emulation."""

import pytest
import torch

from fsattn_diffusers import FSAttnConfig
from fsattn_diffusers.kernels.fsattn_fwd import FROZEN_RESCALE, fsattn_fwd
from fsattn_diffusers.kernels.quantize import quantize_q
from fsattn_diffusers.kernels.quantize import quantize_kv
from fsattn_diffusers.reference import _pack_v, _quantize_k, emulate_fsattn, to_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("k_per_token", [True, False])
@pytest.mark.parametrize("v_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_quantize_kv_matches_emulation(k_per_token, v_dtype, masked):
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(2, 70, 3, 48, generator=gen) * 4 + 1).to(DEVICE)
    v = (torch.randn(2, 70, 3, 48, generator=gen) + 2).to(DEVICE)
    weight = None
    if masked:
        weight = (torch.rand(2, 70, generator=gen) > 0.4).float().to(DEVICE)
    kv = quantize_kv(k, v, weight, block_n=32, d_pad=64, k_per_token=k_per_token,
                     smooth_v=v_dtype == torch.float8_e4m3fn, v_dtype=v_dtype)
    cfg = FSAttnConfig(k_granularity="token" if k_per_token else "block",
                       pv_format="fp8_e4m3" if v_dtype == torch.float8_e4m3fn else "16bit")
    w = weight if masked else torch.ones(2, 70, device=DEVICE)
    k8, key_scale, k_mean = _quantize_k(k.float().transpose(1, 2), w, cfg, 32)
    low = to_fp8 if v_dtype == torch.float8_e4m3fn else (lambda t: t.bfloat16().float())
    v_lo, v_scale, v_mean = _pack_v(v.float().transpose(1, 2), w, cfg, low)
    assert kv.k_q.shape == (2, 3, 96, 64) and kv.v_t.shape == (2, 3, 64, 96)
    # Padding channels and keys are exact zeros; masked keys too.
    assert kv.k_q[..., 48:].abs().max() == 0 and kv.k_q[:, :, 70:].abs().max() == 0
    assert kv.v_t.float()[:, :, :, 70:].abs().max() == 0
    # Rounding at exact ties may differ by one step between Triton and torch; nothing else may.
    assert (kv.k_q[..., :48].float() - k8[..., :48]).abs().max() <= 1
    assert (kv.k_q[..., :48].float() != k8[..., :48]).float().mean() < 1e-3
    scales = kv.k_scale if k_per_token else kv.k_scale.repeat_interleave(32, -1)
    torch.testing.assert_close(scales, key_scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(kv.k_mean[..., :48], k_mean, rtol=1e-3, atol=1e-3)
    v_kernel = kv.v_t.float().transpose(-1, -2)[:, :, :70, :48]
    assert (v_kernel != v_lo).float().mean() < 1e-3
    torch.testing.assert_close(kv.v_scale[..., :48], v_scale, rtol=1e-3, atol=1e-6)
    assert torch.equal(kv.key_weight.float()[:, 0, :70].expand(2, 70), w) and kv.key_weight.float()[:, 1:].abs().max() == 0


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


def test_quantize_q_folds_scale_and_pads():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 50, 4, 48, generator=gen).to(DEVICE) * 3
    k_mean = torch.randn(2, 2, 64, generator=gen).to(DEVICE)  # GQA: 2 KV heads for 4 query heads
    k_mean[..., 48:] = 0
    qq = quantize_q(q, k_mean, sm_scale=0.2, block_m=32)
    assert qq.q_q.shape == (2, 4, 64, 64) and qq.q_q[:, :, 50:].abs().max() == 0
    q_log2 = q.float().transpose(1, 2) * 0.2 * 1.4426950408889634
    scale = q_log2.abs().amax(-1) / 127
    torch.testing.assert_close(qq.q_scale[:, :, :50], scale)
    dequant = qq.q_q[:, :, :50, :48].float() * qq.q_scale[:, :, :50, None]
    assert (dequant - q_log2).abs().max() <= 0.5 * scale.max() * 1.0001
    expected = (q.float().transpose(1, 2) * k_mean.repeat_interleave(2, 1)[:, :, None, :48]).sum(-1) * 0.2
    torch.testing.assert_close(qq.q_dot_k_mean[:, :, :50], expected, rtol=1e-5, atol=1e-4)


def test_the_wgmma_key_order_gives_each_thread_its_own_keys():
    # In the m64nNk32 score accumulator, thread q of a quad holds keys 8g + 2q + {0, 1} of every 32;
    # as the 8-bit register operand of the PV GEMM it holds k = 4q + {0..3} and 16 + 4q + {0..3}.
    from fsattn_diffusers.kernels.quantize import wgmma_key_of_column

    keys = wgmma_key_of_column(torch.arange(96))
    assert torch.equal(keys.sort().values, torch.arange(96))
    for chunk in range(3):
        for q in range(4):
            operand_cols = [32 * chunk + 16 * h + 4 * q + j for h in range(2) for j in range(4)]
            held = {32 * chunk + 8 * g + 2 * q + e for g in range(4) for e in range(2)}
            assert set(keys[operand_cols].tolist()) == held


@pytest.mark.parametrize("masked", [False, True])
def test_the_wgmma_key_order_permutes_only_v_and_the_row_sum_weights(masked):
    from fsattn_diffusers.kernels.quantize import wgmma_key_of_column

    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(2, 150, 2, 64, generator=gen) * 3).to(DEVICE)
    v = (torch.randn(2, 150, 2, 64, generator=gen) + 1).to(DEVICE)
    weight = (torch.rand(2, 150, generator=gen) > 0.3).float().to(DEVICE) if masked else None
    natural = quantize_kv(k, v, weight, block_n=64, d_pad=64)
    wgmma = quantize_kv(k, v, weight, block_n=64, d_pad=64, pv_key_order="wgmma")
    assert natural.pv_key_order == "natural" and wgmma.pv_key_order == "wgmma"
    keys = wgmma_key_of_column(torch.arange(natural.v_t.shape[-1], device=DEVICE))
    assert torch.equal(wgmma.v_t.view(torch.uint8), natural.v_t.view(torch.uint8)[..., keys])
    assert torch.equal(wgmma.key_weight.view(torch.uint8), natural.key_weight.view(torch.uint8)[..., keys])
    assert not torch.equal(wgmma.v_t.view(torch.uint8), natural.v_t.view(torch.uint8))
    for name in ("k_q", "k_scale", "k_mean", "v_scale"):
        assert torch.equal(getattr(wgmma, name), getattr(natural, name)), name
    # v_mean carries the rounding error summed by atomics, whose order a GPU does not fix.
    torch.testing.assert_close(wgmma.v_mean, natural.v_mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [64, 128])
def test_the_kernels_operand_order_is_the_quantisers_key_order(n):
    # The Gluon kernel reads P's registers as the PV operand through a reshape and permute; V is
    # stored by wgmma_key_of_column. Replayed in torch, operand column c must hold that key.
    ws = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon_ws",
                             reason="this Triton has no Gluon warp specialisation")
    from fsattn_diffusers.kernels.quantize import wgmma_key_of_column

    rows = 4
    p = torch.arange(rows * n).reshape(rows, n)
    split, axes = ws.WGMMA_KEY_SPLIT.value, ws.WGMMA_AXES.value  # the constexprs the kernel uses
    operand = p.reshape(rows, n // 32, *split).permute(*axes).reshape(rows, n)
    assert torch.equal(operand, p[:, wgmma_key_of_column(torch.arange(n))])


def test_an_unknown_key_order_is_refused():
    k = torch.randn(1, 40, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="pv_key_order"):
        quantize_kv(k, k, None, block_n=32, d_pad=64, pv_key_order="shuffled")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_kv(k, k, None, block_n=16, d_pad=64, pv_key_order="wgmma")
