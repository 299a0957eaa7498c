"""Which calls the Gluon kernels take (runs on CPU: the decision only reads shapes and flags)."""

from types import SimpleNamespace

import pytest
import torch

from fsattn_diffusers import FSAttnConfig
from fsattn_diffusers.ops import preferred_kernel

gluon = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon",
                            reason="this Triton has no Gluon Hopper API (the Triton kernel then runs everything)")
gluon_ws = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon_ws",
                               reason="this Triton has no Gluon warp specialisation (the Triton kernel runs everything)")
KERNELS = {"gluon": gluon, "gluon_ws": gluon_ws}

COVERED = dict(bias=None, frozen=0, exp_mode=0, pv_fp32=False, rowsum_mma=True, block_m=64, num_warps=4,
               num_stages=3)


def _kv(**over):
    kv = dict(k_per_token=True, v_t=torch.empty(1, dtype=torch.float8_e4m3fn), block_n=128,
              key_weight=torch.empty(1, 16, 1))
    kv.update(over)
    return SimpleNamespace(**kv)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_the_tested_configuration_is_covered(kernel):
    assert KERNELS[kernel].supports(_kv(), **COVERED)


@pytest.mark.parametrize("change", [dict(num_stages=1), dict(num_stages=5), dict(block_m=128), dict(num_warps=8),
                                    dict(frozen=2), dict(exp_mode=1), dict(pv_fp32=True), dict(rowsum_mma=False),
                                    dict(bias=torch.zeros(1, 128))])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_calls_outside_it_go_to_the_triton_kernel(kernel, change):
    # num_stages=1 would hang: the loop waits on a tile it issues only afterwards.
    assert not KERNELS[kernel].supports(_kv(), **dict(COVERED, **change))


@pytest.mark.parametrize("kv_change", [dict(block_n=64), dict(k_per_token=False),
                                       dict(v_t=torch.empty(1, dtype=torch.bfloat16))])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_operands_outside_it_go_to_the_triton_kernel(kernel, kv_change):
    assert not KERNELS[kernel].supports(_kv(**kv_change), **COVERED)


def test_the_launchers_refuse_what_they_do_not_cover():
    with pytest.raises(ValueError, match="2-4 stages"):
        gluon.fsattn_fwd_gluon(None, _kv(), None, None, sm_scale=1.0, num_stages=1)
    with pytest.raises(ValueError, match="2-4 stages"):
        gluon_ws.fsattn_fwd_gluon_ws(None, _kv(), None, None, sm_scale=1.0, num_stages=5)
    with pytest.raises(ValueError, match="128-key tiles"):
        gluon_ws.fsattn_fwd_gluon_ws(None, _kv(block_n=64), None, None, sm_scale=1.0)


@pytest.mark.parametrize("head_dim,expected", [(128, "gluon_ws"), (96, "gluon_ws"), (80, "gluon_ws"),
                                               (64, "triton"), (32, "triton")])
def test_auto_picks_the_kernel_measured_fastest_for_the_head_dim(head_dim, expected):
    # NOTES v7: the warp-specialised kernel is 9-12 % faster at head dim 128, 4 % slower at 64.
    assert preferred_kernel(FSAttnConfig(), head_dim) == expected


@pytest.mark.parametrize("kernel", ["triton", "gluon", "gluon_ws"])
def test_an_explicit_kernel_is_kept(kernel):
    for head_dim in (64, 128):
        assert preferred_kernel(FSAttnConfig(kernel=kernel), head_dim) == kernel


@pytest.mark.parametrize("failure", ["front end", "ptxas", "mlir pass"])
def test_a_gluon_kernel_that_does_not_compile_hands_its_calls_to_triton(monkeypatch, caplog, failure):
    # Gluon's API moves between Triton releases: a compile failure must cost speed, not the call.
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError

    from fsattn_diffusers import ops

    errors = {"front end": CompilationError(None, None, "warp_specialize() got an unexpected keyword argument"),
              "ptxas": PTXASError("ptxas error: setmaxnreg"), "mlir pass": RuntimeError("PassManager::run failed")}

    def broken(*args, **kwargs):
        raise errors[failure]

    fake = SimpleNamespace(fsattn_fwd_gluon_ws=broken, supports=lambda kv, **kw: True)
    monkeypatch.setattr(ops, "_gluon_module", lambda name: fake)
    monkeypatch.setattr(ops, "_DISABLED_GLUON", set())
    with caplog.at_level("WARNING", logger="fsattn_diffusers"):
        assert ops._launch_gluon("fsattn_fwd_gluon_ws") is False
    assert "does not compile" in caplog.text
    q = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0))
    out = torch.empty(2, 3)
    assert not ops._gluon_covers("fsattn_fwd_gluon_ws", q, out, _kv(), COVERED)
    assert ops._gluon_covers("fsattn_fwd_gluon", q, out, _kv(), COVERED)  # the other kernel is unaffected


def test_other_errors_in_a_gluon_kernel_are_raised(monkeypatch):
    # Only compile failures fall back: a launch error (bad memory access, wrong argument) must surface.
    from fsattn_diffusers import ops

    def crashing(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ops, "_gluon_module", lambda name: SimpleNamespace(fsattn_fwd_gluon_ws=crashing))
    monkeypatch.setattr(ops, "_DISABLED_GLUON", set())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ops._launch_gluon("fsattn_fwd_gluon_ws")
    assert ops._DISABLED_GLUON == set()


def test_the_triton_kernel_runs_the_call_when_the_gluon_kernel_does_not_compile(monkeypatch):
    from triton.compiler.errors import CompilationError

    from fsattn_diffusers import ops
    from fsattn_diffusers.kernels import fsattn_fwd as fwd
    from fsattn_diffusers.kernels import quantize

    def broken(*args, **kwargs):
        raise CompilationError(None, None, "no such builtin")

    triton_calls = []
    monkeypatch.setattr(ops, "_gluon_module", lambda name: SimpleNamespace(fsattn_fwd_gluon_ws=broken,
                                                                           supports=lambda kv, **kw: True))
    monkeypatch.setattr(ops, "_DISABLED_GLUON", set())
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(quantize, "quantize_kv", lambda *a, **kw: SimpleNamespace(n_tiles=8))
    monkeypatch.setattr(ops.stats, "fallback_counter", lambda device: None)
    monkeypatch.setattr(fwd, "fsattn_fwd", lambda *a, **kw: triton_calls.append(kw))
    q = SimpleNamespace(shape=(1, 256, 2, 128), device=torch.device("cuda", 0), dtype=torch.bfloat16)
    out = torch.empty(2, 3)
    launch = ops.launch_config(FSAttnConfig(), torch.device("cpu"), 128)
    ops._run_kernels(q, None, None, None, None, 0.1, FSAttnConfig(), launch, out, None)
    assert len(triton_calls) == 1 and ops._DISABLED_GLUON == {"fsattn_fwd_gluon_ws"}
