"""The persistent warp-specialised kernel (Hopper only): bit-equal to the warp-specialised kernel it
is built from, and as close to float64 through ``fsattn()``.

Gluon does not run in Triton's interpreter: every test here needs an sm_90 GPU; elsewhere they
skip. A persistent program runs many query blocks through one K/V ring and turn sequence, so a
wrong ring slot, parity or Q buffer shows as a hang or as outputs that differ from the kernel that
runs one block per program.
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

PERSISTENT = FSAttnConfig(kernel="gluon_persistent")

# (batch, seq_q, seq_k, q heads, kv heads, head dim): partial query and key tiles, one key tile,
# fewer items than SMs, grouped-query heads, runs of items that cross heads, more key tiles than
# ring stages, three consumers (head dim 64), Wan2.1-1.3B's cross-attention.
SHAPES = [
    (1, 1000, 512, 4, 4, 128),
    (2, 300, 100, 3, 3, 128),
    (1, 64, 128, 1, 1, 128),
    (1, 777, 512, 8, 2, 128),
    (3, 5000, 384, 5, 5, 128),
    (1, 2000, 1500, 4, 4, 128),
    (2, 3000, 512, 4, 4, 64),
    (1, 32760, 512, 12, 12, 128),
]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}h{s[3]}/{s[4]}d{s[5]}" for s in SHAPES])
def test_persistent_is_bit_equal_to_the_warp_specialised_kernel(shape, speculative):
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_persistent as pk
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws
    from fsattn_diffusers.kernels.quantize import quantize_kv

    bsz, sq, sk, hq, hkv, d = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q = torch.randn(bsz, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = quantize_kv(k, v, block_n=128, d_pad=d, pv_key_order="wgmma")
    outs = []
    for launch in (ws.fsattn_fwd_gluon_ws, pk.fsattn_fwd_gluon_persistent):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((bsz, hq, sq), float("nan"), device="cuda")
        launch(q, kv, out, lse, sm_scale=d ** -0.5, speculative=speculative)
        outs.append((out, lse))
    (out_ws, lse_ws), (out, lse) = outs
    assert torch.equal(out, out_ws) and torch.equal(lse, lse_ws)
    ref, _ = attention_reference(q, k, v)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04


@pytest.fixture
def persistent_calls(monkeypatch):
    """The query shapes of the persistent kernel's launches through the op, from a clean plan."""
    module = planning.gluon_module("fsattn_fwd_gluon_persistent")
    monkeypatch.setattr(planning, "_DISABLED_GLUON", set())
    planning._plan.cache_clear()
    monkeypatch.setattr(ops, "_prepared_calls", {})
    calls = []
    real = module.prepare_fsattn_fwd_gluon_persistent

    def counted(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(module, "prepare_fsattn_fwd_gluon_persistent", counted)
    yield calls
    assert planning._DISABLED_GLUON == set(), "the persistent kernel failed to compile and was switched off"


@pytest.mark.parametrize("family", ["randn", "peaky", "late_sink", "masked_keys", "fully_masked", "huge_magnitude"])
def test_persistent_input_families_through_the_op(family, persistent_calls):
    # docs/design.md §4.1's families at 512 keys (cross-attention's length), with per-batch key
    # masks; huge_magnitude only has to stay finite (tests/input_families.py).
    from input_families import make_family

    q, k, v, mask = make_family(family, 2, 700, 512, 4, 128, device="cuda",
                                generator=torch.Generator().manual_seed(17))
    out, lse = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=PERSISTENT)
    assert persistent_calls == [tuple(q.shape)]
    out_t, lse_t = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=FSAttnConfig(kernel="triton"))
    ref, ref_lse = attention_reference(q, k, v, mask)
    empty = ~torch.isfinite(ref_lse)
    assert torch.isneginf(lse[empty]).all() and (out.transpose(1, 2)[empty] == 0).all()
    assert torch.isfinite(out).all()
    if family == "huge_magnitude":
        return
    attended = ~empty
    assert rel_l1(out, ref) <= 1.1 * rel_l1(out_t, ref) + 1e-3
    lse_err = (lse.double() - ref_lse)[attended].abs().max().item()
    lse_err_t = (lse_t.double() - ref_lse)[attended].abs().max().item()
    assert lse_err <= lse_err_t + 0.5 / 512 ** 0.5


def test_calls_it_does_not_cover_run_elsewhere(persistent_calls):
    q = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16)
    for config in (FSAttnConfig(kernel="gluon_persistent", pv_format="16bit"),
                   FSAttnConfig(kernel="gluon_persistent", k_granularity="block")):
        out = fsattn(q, kv, kv, config=config)
        ref, _ = attention_reference(q, kv, kv)
        assert cosine(out, ref) >= 0.999
    assert persistent_calls == []
