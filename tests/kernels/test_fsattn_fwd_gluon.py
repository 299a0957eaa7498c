"""The Gluon kernel (Hopper only) against the Triton kernel, its emulation and float64.

Gluon does not run in Triton's interpreter, so every test here needs an sm_90 GPU; on other
machines they skip. The families of DESIGN.md section 4 reach this kernel through
``tests/kernels/test_fsattn_fwd.py``'s GPU tests through the Triton kernel; here the Gluon kernel
(``FSAttnConfig(kernel="gluon")``) is checked against that kernel and against float64.
"""

import pytest
import torch

from fsattn_diffusers import FSAttnConfig, fsattn
from fsattn_diffusers import ops as fsattn_ops
from fsattn_diffusers.metrics import cosine_similarity as cosine
from fsattn_diffusers.metrics import relative_l1 as rel_l1
from fsattn_diffusers.reference import attention_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for Hopper (sm_90) wgmma and TMA")]

TRITON = FSAttnConfig(kernel="triton")
GLUON = FSAttnConfig(kernel="gluon")


@pytest.fixture
def gluon_calls(monkeypatch):
    """Count launches of the Gluon kernel, so a test knows which kernel ran."""
    from fsattn_diffusers.kernels import fsattn_fwd_gluon as gk

    calls = []
    real = gk.fsattn_fwd_gluon

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gk, "fsattn_fwd_gluon", counted)
    return calls


# (batch, seq_q, seq_k, q heads, kv heads, head dim): partial last tiles, one key tile, fewer tiles
# than pipeline stages, grouped-query heads, every padded head dim.
SHAPES = [
    (1, 1000, 1500, 4, 4, 128),
    (2, 64, 100, 2, 2, 128),
    (1, 300, 200, 3, 3, 128),
    (1, 777, 4096, 8, 2, 128),
    (2, 2048, 2048, 4, 4, 64),
    (1, 1024, 1100, 2, 2, 96),
    (1, 513, 640, 2, 2, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}h{s[3]}/{s[4]}d{s[5]}" for s in SHAPES])
def test_gluon_matches_triton_kernel_and_float64(shape, gluon_calls):
    bsz, sq, sk, hq, hkv, d = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q = torch.randn(bsz, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = fsattn(q, k, v, return_lse=True, config=GLUON)
    assert len(gluon_calls) == 1, "kernel='gluon' should run the Gluon kernel on sm_90"
    out_t, lse_t = fsattn(q, k, v, return_lse=True, config=TRITON)
    assert len(gluon_calls) == 1, "kernel='triton' must not reach the Gluon kernel"
    # Same arithmetic, different order of the rescale and the FP8 accumulator chain.
    assert rel_l1(out, out_t) < 5e-3
    assert torch.allclose(lse, lse_t, atol=2e-3, rtol=0)
    ref, ref_lse = attention_reference(q, k, v)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04
    # The row sum adds the FP8-rounded P (it must match what multiplied V): each P is off by up to
    # 6 %, so l by about 3 %/sqrt(keys) -- 0.05 at 100 keys, 0.008 at 4096 (natural-log units).
    assert torch.allclose(lse, ref_lse.to(lse.dtype), atol=0.5 / sk ** 0.5, rtol=0)


def test_gluon_boolean_key_mask_per_batch(gluon_calls):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 900, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 900, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    mask = torch.ones(2, 900, dtype=torch.bool, device="cuda")
    mask[0, 650:] = False  # batch 0: padded text, as HunyuanVideo passes it
    mask[1, ::3] = False
    attn_mask = mask[:, None, None, :]
    out = fsattn(q, k, v, attn_mask=attn_mask, config=GLUON)
    assert len(gluon_calls) == 1
    ref, _ = attention_reference(q, k, v, attn_mask)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04
    # Masked keys carry no weight: changing their values changes nothing (up to the order of the
    # atomic adds of V's rounding-bias correction, which may flip a last bf16 bit).
    v2 = v.clone()
    v2[0, 650:] += 100.0
    assert rel_l1(fsattn(q, k, v2, attn_mask=attn_mask, config=GLUON)[0], out[0]) < 1e-3


def test_configs_the_gluon_kernel_does_not_cover_run_on_triton(gluon_calls):
    # 1024 keys = 8 tiles: enough for the sampled max to be used (it needs more than 4).
    q = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    for cfg in (FSAttnConfig(kernel="gluon", k_granularity="block"), FSAttnConfig(kernel="gluon", pv_format="16bit"),
                FSAttnConfig(kernel="gluon", max_policy="sampled"),
                FSAttnConfig(kernel="gluon", block_m=128, block_n=64), FSAttnConfig()):
        out = fsattn(q, q, q, config=cfg)
        assert torch.isfinite(out).all()
    float_mask = torch.zeros(1, 1, 1, 1024, device="cuda")
    fsattn(q, q, q, attn_mask=float_mask, config=GLUON)
    assert gluon_calls == []
    assert fsattn_ops._gluon_module() is not None
