"""Which calls the Gluon kernels take (runs on CPU: the decision only reads shapes and flags)."""

from dataclasses import replace
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
# The key order of V each kernel reads (the warp-specialised one: its PV operand's register order).
KEY_ORDER = {"gluon": "natural", "gluon_ws": "wgmma"}

COVERED = dict(bias=None, frozen=0, exp_mode=0, pv_fp32=False, rowsum_mma=True, block_m=64, num_warps=4,
               num_stages=3)


def _kv(pv_key_order="natural", **over):
    """Stands for a QuantizedKV in the launchers and for its KVLayout in `supports`."""
    kv = dict(k_per_token=True, v_dtype=torch.float8_e4m3fn, block_n=128, pv_key_order=pv_key_order,
              key_weight=torch.empty(1, 16, 1))
    kv.update(over)
    return SimpleNamespace(**kv)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_the_tested_configuration_is_covered(kernel):
    assert KERNELS[kernel].supports(_kv(KEY_ORDER[kernel]), **COVERED)


@pytest.mark.parametrize("change", [dict(num_stages=1), dict(num_stages=5), dict(block_m=128), dict(num_warps=8),
                                    dict(frozen=2), dict(exp_mode=1), dict(pv_fp32=True), dict(rowsum_mma=False),
                                    dict(bias=torch.zeros(1, 128))])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_calls_outside_it_go_to_the_triton_kernel(kernel, change):
    # num_stages=1 would hang: the loop waits on a tile it issues only afterwards.
    assert not KERNELS[kernel].supports(_kv(KEY_ORDER[kernel]), **dict(COVERED, **change))


@pytest.mark.parametrize("kv_change", [dict(block_n=32), dict(k_per_token=False), dict(v_dtype=torch.bfloat16)])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_operands_outside_it_go_to_the_triton_kernel(kernel, kv_change):
    assert not KERNELS[kernel].supports(_kv(KEY_ORDER[kernel], **kv_change), **COVERED)


def test_the_single_warpgroup_kernel_takes_128_key_tiles_only():
    assert not gluon.supports(_kv(block_n=64), **COVERED)


@pytest.mark.parametrize("block_n,stages,covered", [(64, 8, True), (64, 9, False), (128, 4, True), (128, 5, False),
                                                    (64, 1, False)])
def test_the_warp_specialised_kernel_takes_64_or_128_key_tiles_and_the_stages_that_fit(block_n, stages, covered):
    # 64-key tiles run three consumer warpgroups (~17 KB of ring per stage), 128-key tiles two (~34 KB).
    assert gluon_ws.supports(_kv("wgmma", block_n=block_n), **dict(COVERED, num_stages=stages)) is covered


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_kernel_does_not_take_v_in_the_other_kernels_key_order(kernel):
    other = "natural" if KEY_ORDER[kernel] == "wgmma" else "wgmma"
    assert not KERNELS[kernel].supports(_kv(other), **COVERED)


def test_the_launchers_refuse_what_they_do_not_cover():
    with pytest.raises(ValueError, match="2-4 stages"):
        gluon.fsattn_fwd_gluon(None, _kv(), None, None, sm_scale=1.0, num_stages=1)
    for block_n, stages in ((128, 5), (64, 9), (32, 4)):
        with pytest.raises(ValueError, match=f"got block_n={block_n}, num_stages={stages}"):
            gluon_ws.fsattn_fwd_gluon_ws(None, _kv("wgmma", block_n=block_n), None, None, sm_scale=1.0,
                                         num_stages=stages)
    # V in the wrong key order would give a wrong result, not an error: the launchers refuse it.
    with pytest.raises(ValueError, match="wgmma key order"):
        gluon_ws.fsattn_fwd_gluon_ws(None, _kv("natural"), None, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="natural key order"):
        gluon.fsattn_fwd_gluon(None, _kv("wgmma"), None, None, sm_scale=1.0)
    from fsattn_diffusers.kernels.fsattn_fwd import fsattn_fwd

    with pytest.raises(ValueError, match="natural key order"):
        fsattn_fwd(None, _kv("wgmma"), None, None, None, sm_scale=1.0)


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
    assert not ops._gluon_covers("fsattn_fwd_gluon_ws", q, out, _kv("wgmma"), COVERED)
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


def _run_on_a_fake_hopper(monkeypatch, config, gluon):
    """ops._run_kernels for a (1, 256, 2, 128) bf16 call on an sm_90 that is not there, with
    `gluon` standing for both Gluon modules. Returns the key orders quantize_kv was asked for and
    those of the K/V the Triton kernel received."""
    from fsattn_diffusers import ops
    from fsattn_diffusers.kernels import fsattn_fwd as fwd
    from fsattn_diffusers.kernels import quantize

    quantised, triton_calls = [], []
    monkeypatch.setattr(ops, "_gluon_module", lambda name: gluon)
    monkeypatch.setattr(ops, "_DISABLED_GLUON", set())
    monkeypatch.setattr(ops, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(quantize, "quantize_kv", lambda *a, pv_key_order, **kw: quantised.append(pv_key_order)
                        or SimpleNamespace(n_tiles=8, pv_key_order=pv_key_order, block_n=kw["block_n"]))
    monkeypatch.setattr(ops.stats, "fallback_counter", lambda device: None)
    monkeypatch.setattr(fwd, "fsattn_fwd", lambda q, kv, *a, **kw: triton_calls.append(kv.pv_key_order))
    q = SimpleNamespace(shape=(1, 256, 2, 128), device=torch.device("cuda", 0), dtype=torch.bfloat16)
    k = SimpleNamespace(shape=(1, 1024, 2, 128))
    launch = ops.launch_config(config, torch.device("cpu"), 128)
    ops._run_kernels(q, k, None, None, None, 0.1, config, launch, torch.empty(2, 3), None)
    return quantised, triton_calls


def test_the_triton_kernel_runs_the_call_when_the_gluon_kernel_does_not_compile(monkeypatch):
    from triton.compiler.errors import CompilationError

    from fsattn_diffusers import ops

    gluon_calls = []

    def broken(q, kv, *args, **kwargs):
        gluon_calls.append(kv.pv_key_order)
        raise CompilationError(None, None, "no such builtin")

    gluon = SimpleNamespace(fsattn_fwd_gluon_ws=broken, supports=lambda layout, **kw: layout.pv_key_order == "wgmma")
    _, triton_calls = _run_on_a_fake_hopper(monkeypatch, FSAttnConfig(), gluon)
    # The Gluon kernel got V in its key order; the Triton kernel gets it re-quantised in the natural one.
    assert gluon_calls == ["wgmma"] and triton_calls == ["natural"]
    assert ops._DISABLED_GLUON == {"fsattn_fwd_gluon_ws"}


@pytest.mark.parametrize("config,orders", [(FSAttnConfig(), ["wgmma"]), (FSAttnConfig(kernel="triton"), ["natural"]),
                                           (FSAttnConfig(k_granularity="block"), ["natural"]),
                                           (FSAttnConfig(kernel="gluon"), ["natural"])])
def test_k_and_v_are_quantised_once_in_the_order_of_the_kernel_that_runs(monkeypatch, config, orders):
    launched = []
    gluon = SimpleNamespace(fsattn_fwd_gluon_ws=lambda q, kv, *a, **kw: launched.append(kv.pv_key_order),
                            fsattn_fwd_gluon=lambda q, kv, *a, **kw: launched.append(kv.pv_key_order),
                            supports=lambda layout, **kw: layout.k_per_token)
    quantised, triton_calls = _run_on_a_fake_hopper(monkeypatch, config, gluon)
    assert quantised == orders and launched + triton_calls == orders


@pytest.mark.parametrize("config,stages", [(FSAttnConfig(), 4), (FSAttnConfig(num_stages=3), 3)])
def test_the_warp_specialised_kernel_runs_four_stages_unless_the_config_says(monkeypatch, config, stages):
    # NOTES v8: four stages measured 0.5-2.6 % faster than three for this kernel; an explicit setting wins.
    launched = []
    gluon = SimpleNamespace(fsattn_fwd_gluon_ws=lambda *a, num_stages, **kw: launched.append(num_stages),
                            supports=lambda layout, **kw: True)
    _run_on_a_fake_hopper(monkeypatch, config, gluon)
    assert launched == [stages]


@pytest.mark.parametrize("config,block_n", [(FSAttnConfig(), 128), (FSAttnConfig(block_n=64), 64)])
def test_the_warp_specialised_kernel_gets_its_own_key_tile_unless_the_config_sets_one(monkeypatch, config, block_n):
    # NOTES v11 (d): two consumer warpgroups on 128-key tiles, whatever the Triton kernel's tile
    # (here the interpreter's 32); FSAttnConfig(block_n=64) runs three on 64.
    tiles = []
    gluon = SimpleNamespace(fsattn_fwd_gluon_ws=lambda q, kv, *a, **kw: tiles.append(kv.block_n),
                            supports=lambda layout, **kw: layout.block_n in (64, 128))
    _run_on_a_fake_hopper(monkeypatch, config, gluon)
    assert tiles == [block_n]


def test_a_key_tile_the_warp_specialised_kernel_does_not_take_goes_to_the_triton_kernel(monkeypatch):
    # Through the real coverage check: FSAttnConfig(block_n=32) is valid for the Triton kernel only.
    launched = []
    gluon = SimpleNamespace(fsattn_fwd_gluon_ws=lambda *a, **kw: launched.append(1), supports=gluon_ws.supports)
    quantised, triton_calls = _run_on_a_fake_hopper(monkeypatch, FSAttnConfig(block_n=32), gluon)
    assert launched == [] and quantised == ["natural"] and triton_calls == ["natural"]


def test_the_warp_specialised_kernel_is_handed_v_in_its_key_order(monkeypatch):
    # Through ops with the real pre-pass (Triton's interpreter on CPU): what reaches the Gluon
    # launcher is the natural quantisation with V and the row-sum weights permuted, nothing else.
    from fsattn_diffusers import ops
    from fsattn_diffusers.kernels.configs import GLUON_WS_BLOCK_N
    from fsattn_diffusers.kernels.quantize import quantize_kv, wgmma_key_of_column

    received = []
    fake = SimpleNamespace(fsattn_fwd_gluon_ws=lambda q, kv, *a, **kw: received.append(kv))
    monkeypatch.setattr(ops, "_gluon_module", lambda name: fake)
    monkeypatch.setattr(ops, "_gluon_covers", lambda module, *a: module == "fsattn_fwd_gluon_ws")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 100, 2, 64, generator=gen) for _ in range(3))
    weight = (torch.rand(1, 100, generator=gen) > 0.2).float()
    config = FSAttnConfig(kernel="gluon_ws")  # head dim 64 keeps the interpreter quick; "auto" runs Triton there
    # A Triton tile the warp-specialised kernel does not take, so that its own tile shows.
    launch = replace(ops.launch_config(config, torch.device("cpu"), 64), block_n=32)
    ops._run_kernels(q, k, v, weight, None, 0.125, config, launch, torch.empty_like(q), None)
    (kv,) = received
    assert kv.block_n == GLUON_WS_BLOCK_N != launch.block_n  # its own tile, not the Triton kernel's
    natural = quantize_kv(k, v, weight, block_n=kv.block_n, d_pad=64)
    keys = wgmma_key_of_column(torch.arange(natural.v_t.shape[-1]))
    assert kv.pv_key_order == "wgmma"
    assert torch.equal(kv.v_t.view(torch.uint8), natural.v_t.view(torch.uint8)[..., keys])
    assert torch.equal(kv.key_weight.view(torch.uint8), natural.key_weight.view(torch.uint8)[..., keys])
    assert torch.equal(kv.k_q, natural.k_q) and torch.equal(kv.k_scale, natural.k_scale)
