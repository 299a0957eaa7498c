"""Which calls the Gluon kernel takes (runs on CPU: the decision only reads shapes and flags)."""

from types import SimpleNamespace

import pytest
import torch

gluon = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon",
                            reason="this Triton has no Gluon Hopper API (the Triton kernel then runs everything)")

COVERED = dict(bias=None, frozen=0, exp_mode=0, pv_fp32=False, rowsum_mma=True, block_m=64, num_warps=4,
               num_stages=3)


def _kv(**over):
    kv = dict(k_per_token=True, v_t=torch.empty(1, dtype=torch.float8_e4m3fn), block_n=128,
              key_weight=torch.empty(1, 16, 1))
    kv.update(over)
    return SimpleNamespace(**kv)


def test_the_tested_configuration_is_covered():
    assert gluon.supports(_kv(), **COVERED)


@pytest.mark.parametrize("change", [dict(num_stages=1), dict(num_stages=5), dict(block_m=128), dict(num_warps=8),
                                    dict(frozen=2), dict(exp_mode=1), dict(pv_fp32=True), dict(rowsum_mma=False),
                                    dict(bias=torch.zeros(1, 128))])
def test_calls_outside_it_go_to_the_triton_kernel(change):
    # num_stages=1 would hang: the loop waits on a tile it issues only afterwards.
    assert not gluon.supports(_kv(), **dict(COVERED, **change))


@pytest.mark.parametrize("kv_change", [dict(block_n=64), dict(k_per_token=False),
                                       dict(v_t=torch.empty(1, dtype=torch.bfloat16))])
def test_operands_outside_it_go_to_the_triton_kernel(kv_change):
    assert not gluon.supports(_kv(**kv_change), **COVERED)


def test_the_launcher_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="2-4 stages"):
        gluon.fsattn_fwd_gluon(None, _kv(), None, None, sm_scale=1.0, num_stages=1)
