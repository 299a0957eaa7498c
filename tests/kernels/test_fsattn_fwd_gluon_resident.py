"""The resident-keys Gluon kernel (Hopper only, calls with at most 512 keys at head dim 128)
against the Triton kernel and float64.

Gluon does not run in Triton's interpreter: every test here needs an sm_90 GPU; elsewhere they
skip. The kernel computes what the Triton kernel's online pass computes (the same FP8 P, the same
hardware accumulator), in another order: its output stays within a few thousandths of the Triton
kernel's, as the single-warpgroup Gluon kernel's does.
"""

import pytest
import torch

from fsattn_diffusers import FSAttnConfig, fsattn, ops
from fsattn_diffusers import plan as planning
from fsattn_diffusers.metrics import cosine_similarity as cosine
from fsattn_diffusers.metrics import relative_l1 as rel_l1
from fsattn_diffusers.reference import attention_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for Hopper (sm_90) wgmma and TMA")]

TRITON = FSAttnConfig(kernel="triton")
MODULE = "fsattn_fwd_gluon_resident"


@pytest.fixture
def resident_calls(monkeypatch):
    """The query shapes of the resident-keys kernel's launches that returned, from a clean plan."""
    module = planning.gluon_module(MODULE)
    monkeypatch.setattr(planning, "_DISABLED_GLUON", set())
    planning._plan.cache_clear()
    monkeypatch.setattr(ops, "_prepared_calls", {})
    calls = []
    real = module.prepare_fsattn_fwd_gluon_resident

    class Counted:
        def __init__(self, forward):
            self._forward = forward

        def __getattr__(self, name):
            return getattr(self._forward, name)

        def run(self, q, *args, **kwargs):
            self._forward.run(q, *args, **kwargs)
            calls.append(tuple(q.shape))

        def run_into(self, q, *args, **kwargs):
            self._forward.run_into(q, *args, **kwargs)
            calls.append(tuple(q.shape))

    monkeypatch.setattr(module, "prepare_fsattn_fwd_gluon_resident", lambda *a, **k: Counted(real(*a, **k)))
    yield calls
    assert planning._DISABLED_GLUON == set(), "the resident-keys kernel failed to compile and was switched off"


# (batch, seq_q, seq_k, q heads, kv heads): partial query and key tiles, one key tile, fewer items
# than SMs, grouped-query heads, runs of items that cross heads, Wan2.1-1.3B's cross-attention.
SHAPES = [
    (1, 1000, 512, 4, 4),
    (2, 300, 100, 3, 3),
    (1, 64, 128, 1, 1),
    (1, 777, 512, 8, 2),
    (3, 5000, 384, 5, 5),
    (1, 32760, 512, 12, 12),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}h{s[3]}/{s[4]}" for s in SHAPES])
def test_resident_matches_triton_kernel_and_float64(shape, resident_calls):
    bsz, sq, sk, hq, hkv = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q = torch.randn(bsz, sq, hq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(bsz, sk, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(bsz, sk, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = fsattn(q, k, v, return_lse=True, config=FSAttnConfig(kernel="gluon_resident"))
    assert resident_calls == [tuple(q.shape)]
    out_t, lse_t = fsattn(q, k, v, return_lse=True, config=TRITON)
    ref, ref_lse = attention_reference(q, k, v)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04
    assert rel_l1(out, out_t) < 5e-3
    assert torch.allclose(lse, lse_t, atol=2e-3, rtol=0)


@pytest.mark.parametrize("family", ["randn", "peaky", "late_sink", "masked_keys", "fully_masked", "huge_magnitude"])
def test_resident_input_families(family, resident_calls):
    # docs/design.md §4.1's families at 512 keys (cross-attention's length), with per-batch key
    # masks; huge_magnitude only has to stay finite (tests/input_families.py).
    from input_families import make_family

    q, k, v, mask = make_family(family, 2, 700, 512, 4, 128, device="cuda",
                                generator=torch.Generator().manual_seed(17))
    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=FSAttnConfig(kernel="gluon_resident"))
    assert len(resident_calls) == 1
    out_t, lse_t = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=TRITON)
    ref, ref_lse = attention_reference(q, k, v, mask)
    empty = ~torch.isfinite(ref_lse)
    assert torch.isneginf(lse[empty]).all() and (out.transpose(1, 2)[empty] == 0).all()
    assert torch.isfinite(out).all()
    if family == "huge_magnitude":
        return
    assert rel_l1(out, out_t) < 5e-3
    assert torch.allclose(lse, lse_t, atol=2e-3, rtol=0)


def test_masked_keys_carry_no_weight(resident_calls):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    k, v = k[:, :500], v[:, :500]
    mask = torch.ones(2, 500, dtype=torch.bool, device="cuda")
    mask[0, 300:] = False  # batch 0: padded text
    mask[1, ::3] = False
    attn_mask = mask[:, None, None, :]
    cfg = FSAttnConfig(kernel="gluon_resident")
    out = fsattn(q, k, v, attn_mask=attn_mask, config=cfg)
    assert len(resident_calls) == 1
    ref, _ = attention_reference(q, k, v, attn_mask)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04
    v2 = v.clone()
    v2[0, 300:] += 100.0
    assert rel_l1(fsattn(q, k, v2, attn_mask=attn_mask, config=cfg)[0], out[0]) < 1e-3


def test_calls_it_does_not_cover_run_elsewhere(resident_calls):
    q = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 640, 2, 128, device="cuda", dtype=torch.bfloat16)
    cfg = FSAttnConfig(kernel="gluon_resident")
    for args, config in (((q, kv, kv), cfg),  # five key tiles
                         ((q[..., :64], kv[..., :64], kv[..., :64]), cfg),  # head dim 64
                         ((q, kv[:, :512], kv[:, :512]), FSAttnConfig(kernel="gluon_resident", pv_format="16bit")),
                         ((q, kv[:, :512], kv[:, :512]), FSAttnConfig(kernel="gluon_resident", block_n=64))):
        out = fsattn(*args, config=config)
        ref, _ = attention_reference(*args)
        assert cosine(out, ref) >= 0.999
    assert resident_calls == []
