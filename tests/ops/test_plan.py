"""The launch plan: which kernel takes which call (on a pretended sm_90), the plan cache, and how
the op hands the chosen kernel its operands (with the real pre-pass in Triton's interpreter)."""

from types import SimpleNamespace

import pytest
import torch

from fsattn_diffusers import FSAttnConfig
from fsattn_diffusers import ops
from fsattn_diffusers import plan as planning
from interpreter_only import skip_without_interpreter

HOPPER = (9, 0)


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    monkeypatch.setattr(planning, "_DISABLED_GLUON", set())
    planning._plan.cache_clear()
    yield
    planning._plan.cache_clear()


@pytest.fixture
def gluon_importable(monkeypatch):
    """Both Gluon modules import, whatever this Triton is (the plan only asks whether they do)."""
    monkeypatch.setattr(planning, "gluon_module", lambda name: SimpleNamespace(name=name))


def _plan(config=FSAttnConfig(), head_dim=128, has_bias=False, dtype=torch.bfloat16, target=HOPPER):
    return planning.plan_for(config, target, head_dim, has_bias, dtype)


@pytest.mark.parametrize("head_dim,kernel", [(128, "gluon_ws"), (96, "gluon_ws"), (64, "gluon_ws"), (48, "gluon_ws"),
                                             (32, "triton")])
def test_auto_takes_the_warp_specialised_kernel_at_padded_head_dims_64_and_128(gluon_importable, head_dim, kernel):
    plan = _plan(head_dim=head_dim)
    assert plan.kernel == kernel
    assert plan.pv_key_order == ("wgmma" if kernel == "gluon_ws" else "natural")


@pytest.mark.parametrize("seq_k, head_dim, kernel", [
    (512, 128, "triton"), (1024, 128, "triton"), (1025, 128, "gluon_ws"), (None, 128, "gluon_ws"),
    (512, 64, "gluon_ws"),  # the few-key rule was measured at head dim 128 only
])
def test_auto_runs_calls_with_few_keys_on_the_triton_kernel_at_head_dim_128(gluon_importable, seq_k, head_dim, kernel):
    assert planning.TRITON_MAX_KEYS == 1024
    assert planning.plan_for(FSAttnConfig(), HOPPER, head_dim, False, torch.bfloat16, seq_k).kernel == kernel
    # Asked for by name, the warp-specialised kernel takes few keys too.
    asked = planning.plan_for(FSAttnConfig(kernel="gluon_ws"), HOPPER, head_dim, False, torch.bfloat16, seq_k)
    assert asked.kernel == "gluon_ws"


@pytest.mark.parametrize("seq_q, seq_k, kernel", [(1100, 64, "triton"), (64, 1100, "gluon_ws")])
def test_the_op_plans_by_the_number_of_keys_not_of_queries(monkeypatch, gluon_importable, seq_q, seq_k, kernel):
    monkeypatch.setattr(ops, "target_of", lambda device: HOPPER)
    monkeypatch.setattr(ops, "CPU_PATH", "emulation")  # the emulation runs whatever the plan says
    planned = []
    real = ops.plan_for
    monkeypatch.setattr(ops, "plan_for", lambda *args, **kwargs: planned.append(real(*args, **kwargs)) or planned[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_q, 1, 128, generator=gen)
    k, v = (torch.randn(1, seq_k, 1, 128, generator=gen) for _ in range(2))
    ops.attention_impl(q, k, v, None, None, 128 ** -0.5, "NHD", FSAttnConfig().to_json())
    assert [plan.kernel for plan in planned] == [kernel]


@pytest.mark.parametrize("config", [
    FSAttnConfig(k_granularity="block"),  # the Gluon kernels read one K scale per key
    FSAttnConfig(pv_format="16bit"),
    FSAttnConfig(max_policy="sampled"),
    FSAttnConfig(pv_accum="fp32"),
    FSAttnConfig(rowsum="fma"),
    FSAttnConfig(block_n=32),  # no consumer layout for 32-key tiles
    FSAttnConfig(num_stages=5),  # a fifth 128-key stage does not fit shared memory
    FSAttnConfig(num_stages=1),  # one stage would wait for a tile it issues only later: a hang
    FSAttnConfig(block_m=128),
    FSAttnConfig(num_warps=8),
    FSAttnConfig(kernel="triton"),
])
def test_what_the_gluon_kernels_do_not_implement_runs_on_the_triton_kernel(gluon_importable, config):
    for kernel in ("auto", "gluon_ws", "gluon"):
        config = config.replace(kernel=kernel) if config.kernel != "triton" else config
        assert _plan(config).kernel == "triton"


def test_sorted_block_scales_run_on_the_warp_specialised_kernel_with_the_keys_sorted(gluon_importable):
    # Its per-tile K scale path; the single-warpgroup Gluon kernel reads one scale per key.
    for head_dim in (128, 64):
        plan = _plan(FSAttnConfig(k_granularity="sorted_block"), head_dim=head_dim)
        assert (plan.kernel, plan.k_per_token, plan.sort_keys) == ("gluon_ws", False, True)
    assert _plan(FSAttnConfig(k_granularity="sorted_block", kernel="gluon")).kernel == "triton"
    # Unsorted per-block scales stay on the Triton kernel (test above); per-key ones are not sorted.
    for granularity in ("token", "block"):
        assert not _plan(FSAttnConfig(k_granularity=granularity)).sort_keys
    # A float mask's bias is one per key for every head: no per-head order, a scale per key.
    biased = _plan(FSAttnConfig(k_granularity="sorted_block"), has_bias=True)
    assert (biased.kernel, biased.k_per_token, biased.sort_keys) == ("triton", True, False)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_auto_granularity_sorts_the_keys_of_long_calls_on_the_warp_specialised_kernel_only(gluon_importable,
                                                                                          head_dim):
    def plan(seq_k, **fields):
        return planning.plan_for(FSAttnConfig(**fields), HOPPER, head_dim, False, torch.bfloat16, seq_k)

    for long in (plan(None), plan(planning.TRITON_MAX_KEYS + 1), plan(75600)):
        assert (long.kernel, long.k_per_token, long.sort_keys) == ("gluon_ws", False, True)
    # Few keys: a scale per key, on whichever kernel runs them (at head dim 64 the warp-specialised
    # one, asked for by name at 128).
    for few in (plan(planning.TRITON_MAX_KEYS), plan(planning.TRITON_MAX_KEYS, kernel="gluon_ws")):
        assert (few.k_per_token, few.sort_keys) == (True, False)
    # Other kernels, other targets, a float mask: a scale per key, keys in order.
    others = [plan(None, kernel="triton"), plan(None, kernel="gluon"), plan(None, pv_format="16bit"),
              planning.plan_for(FSAttnConfig(), (8, 9), head_dim, False, torch.bfloat16, None),
              planning.plan_for(FSAttnConfig(), planning.EMULATION, head_dim, False, torch.bfloat16, None),
              planning.plan_for(FSAttnConfig(), HOPPER, head_dim, True, torch.bfloat16, None)]
    for other in others:
        assert other.k_per_token and not other.sort_keys


def test_a_float_mask_never_reaches_a_gluon_kernel(gluon_importable):
    # They add no bias to the scores: a float mask there would be ignored, silently.
    for kernel in ("auto", "gluon_ws", "gluon"):
        assert _plan(FSAttnConfig(kernel=kernel), has_bias=True).kernel == "triton"


def test_tiles_and_stages_set_in_the_config_reach_the_warp_specialised_kernel(gluon_importable):
    n64_tiles = _plan(FSAttnConfig(block_n=64, num_stages=8))
    assert (n64_tiles.kernel, n64_tiles.block_n, n64_tiles.num_stages) == ("gluon_ws", 64, 8)
    assert _plan(FSAttnConfig(num_stages=3)).num_stages == 3
    # Its programs cover 64 query rows per consumer warpgroup (as many as this Triton builds
    # unserialised), so Q is padded to that many.
    from fsattn_diffusers.kernels.configs import gluon_ws_consumers

    assert n64_tiles.block_m == 64 * gluon_ws_consumers(64, n64_tiles.d_pad) and n64_tiles.block_m >= _plan().block_m


@pytest.mark.parametrize("release,n64_at_128", [((3, 6), 3), ((3, 7), 3), ((3, 8), 2), ((3, 9), 2), (None, 2)])
def test_the_warp_specialised_programs_hold_64_rows_per_consumer_three_where_the_release_builds_them(
        gluon_importable, monkeypatch, release, n64_at_128):
    # Q is padded to a program's rows (64 per consumer warpgroup) and q_tiles count programs: the
    # plan's block_m must be what the launcher runs (configs.gluon_ws_consumers decides both).
    # Three at head dim 64 under every release (voting early where they must); with 64-key tiles at
    # head dim 128 only under the releases that build them voting late without serialising their
    # GEMMs (None: a Triton whose version does not read).
    from fsattn_diffusers.kernels import configs

    # The autouse fresh_plans fixture empties the plan cache before and after.
    monkeypatch.setattr(configs, "triton_release", lambda version=None: release)
    for head_dim, block_n, block_m in ((128, 128, 128), (96, 128, 128), (64, 128, 192), (48, 128, 192),
                                       (128, 64, 64 * n64_at_128), (64, 64, 192)):
        plan = _plan(FSAttnConfig(block_n=None if block_n == 128 else block_n), head_dim=head_dim)
        assert (plan.kernel, plan.block_n, plan.block_m) == ("gluon_ws", block_n, block_m)
        assert configs.gluon_ws_consumers(plan.block_n, plan.d_pad) * 64 == block_m


def test_other_gpus_and_the_cpu_paths_run_the_triton_kernel(gluon_importable):
    for target in ((8, 9), (10, 0), planning.INTERPRETER, planning.EMULATION):
        assert _plan(target=target).kernel == "triton"
    # The emulation models the Triton kernel with the H200's tiles; the interpreter uses small ones.
    emulated, interpreted = _plan(target=planning.EMULATION), _plan(target=planning.INTERPRETER)
    assert (emulated.block_m, emulated.block_n) == (64, 128)
    assert interpreted.block_n < emulated.block_n


def test_a_triton_without_the_gluon_api_runs_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(planning, "gluon_module", lambda name: None)
    # The Triton kernel reads one K scale per key: "auto" keeps the keys in order there.
    for plan in (_plan(), _plan(head_dim=64)):
        assert (plan.kernel, plan.k_per_token, plan.sort_keys) == ("triton", True, False)


def test_plans_are_cached_per_config_head_dim_mask_and_dtype(gluon_importable):
    first = _plan()
    hits = planning._plan.cache_info().hits
    assert _plan(FSAttnConfig()) is first  # an equal config is the same key
    assert planning._plan.cache_info().hits == hits + 1
    others = [_plan(FSAttnConfig(num_stages=3)), _plan(head_dim=64), _plan(has_bias=True),
              _plan(dtype=torch.float16, config=FSAttnConfig(pv_format="16bit")), _plan(target=(8, 9))]
    assert all(other is not first for other in others)
    assert planning._plan.cache_info().hits == hits + 1


def test_a_gluon_kernel_that_fails_to_compile_is_dropped_from_every_plan(gluon_importable, caplog):
    from triton.compiler.errors import CompilationError

    assert _plan().kernel == "gluon_ws"
    with caplog.at_level("WARNING", logger="fsattn_diffusers"):
        planning.disable_gluon("fsattn_fwd_gluon_ws", CompilationError(None, None, "no such builtin"))
    assert "does not compile" in caplog.text
    assert (_plan().kernel, _plan().k_per_token, _plan().sort_keys) == ("triton", True, False)
    assert _plan(FSAttnConfig(kernel="gluon")).kernel == "gluon"  # the other kernel is unaffected


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_speculative_max_needs_enough_key_tiles(head_dim):
    plan = _plan(FSAttnConfig(max_policy="sampled"), head_dim=head_dim)
    assert plan.max_mode_for(4 * plan.block_n) == planning.FROZEN_OFF
    assert plan.max_mode_for(4 * plan.block_n + 1) == planning.FROZEN_RESCALE


# --- the op with a pretended Hopper: which launcher gets which operands ----------------------------


def _pretend_hopper(monkeypatch, gluon):
    """ops on CPU tensors as on an sm_90, with `gluon` standing for both Gluon modules; the real
    quantisation kernels run in Triton's interpreter."""
    from fsattn_diffusers.kernels import fsattn_fwd as fwd

    skip_without_interpreter()

    triton_calls = []
    monkeypatch.setattr(planning, "gluon_module", lambda name: gluon)
    monkeypatch.setattr(ops, "target_of", lambda device: HOPPER)
    monkeypatch.setattr(fwd, "prepare_fsattn_fwd",
                        lambda q, kv, *a, **kw: SimpleNamespace(run=lambda *a: triton_calls.append(kv),
                                                                    q_buffer_bytes=()))
    return triton_calls


def _gluon_ws(launch):
    """A stand-in for the warp-specialised Gluon module whose forward, once prepared, runs
    `launch(q, kv, out, lse, sm_scale=..., num_stages=...)`."""
    def prepare(q, kv, out, lse, *, num_stages, **kwargs):
        return SimpleNamespace(run=lambda q, kv, out, lse, sm_scale: launch(q, kv, out, lse, sm_scale=sm_scale,
                                                                            num_stages=num_stages),
                               q_buffer_bytes=())
    return SimpleNamespace(prepare_fsattn_fwd_gluon_ws=prepare)


def _run(config, head_dim=64, seq=100):
    skip_without_interpreter()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, seq, 2, head_dim, generator=gen) for _ in range(3))
    weight = (torch.rand(1, seq, generator=gen) > 0.2).float()
    plan = ops.call_plan(config, torch.device("cpu"), head_dim, seq_k=seq)
    ops._prepare_and_run(plan, config, q, k, v, weight, None, 0.125, "NHD")
    return k, v, weight


def test_the_warp_specialised_kernel_is_handed_v_in_its_key_order(monkeypatch):
    from fsattn_diffusers.kernels.quantize import quantize_kv, wgmma_key_of_column

    received = []
    triton_calls = _pretend_hopper(monkeypatch, _gluon_ws(
        lambda q, kv, *a, num_stages, **kw: received.append((kv, num_stages))))
    k, v, weight = _run(FSAttnConfig(kernel="gluon_ws"))  # head dim 64 keeps the interpreter quick
    ((kv, stages),) = received
    assert triton_calls == [] and stages == 4 and kv.block_n == 128 and kv.pv_key_order == "wgmma"
    natural = quantize_kv(k, v, weight, block_n=kv.block_n, d_pad=64)
    keys = wgmma_key_of_column(torch.arange(natural.v_t.shape[-1]))
    assert torch.equal(kv.v_t.view(torch.uint8), natural.v_t.view(torch.uint8)[..., keys])
    assert torch.equal(kv.rowsum_weights.view(torch.uint8), natural.rowsum_weights.view(torch.uint8)[..., keys])
    assert torch.equal(kv.k_q, natural.k_q) and torch.equal(kv.k_scale, natural.k_scale)


@pytest.mark.parametrize("head_dim,block_n,release,program_rows", [(64, 128, (3, 9), 192), (128, 64, (3, 6), 192),
                                                                    (128, 64, (3, 9), 128), (128, 128, (3, 6), 128)])
def test_the_warp_specialised_launcher_pads_q_to_the_plans_rows(monkeypatch, head_dim, block_n, release, program_rows):
    # Q is padded to the rows of a program and the op counts q_tiles by the plan's block_m: the
    # launcher's consumer warpgroups must cover exactly those rows, under a Triton release that
    # builds three consumers with 64-key tiles at head dim 128 and one that does not. The real
    # launcher runs on the real quantised K/V (interpreter) up to its operands, which are recorded
    # instead of launched.
    gluon_ws = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon_ws", reason="no Gluon warp specialisation")
    from fsattn_diffusers.kernels import configs

    monkeypatch.setattr(configs, "triton_release", lambda version=None: release)  # fresh_plans empties the cache

    class Recorded(Exception):
        pass

    rows = []

    def record(q, kv, out, lse, *, block_m, **kwargs):
        rows.append(block_m)
        raise Recorded

    monkeypatch.setattr(gluon_ws, "gluon_operands", record)
    _pretend_hopper(monkeypatch, gluon_ws)
    # by name: "auto" runs the Triton kernel on 100 keys at 128
    config = FSAttnConfig(kernel="gluon_ws", block_n=block_n)
    with pytest.raises(Recorded):
        _run(config, head_dim=head_dim)
    assert rows == [ops.call_plan(config, torch.device("cuda"), head_dim, seq_k=100).block_m]
    assert rows == [program_rows]


@pytest.fixture
def ws_builds(monkeypatch):
    """The real warp-specialised launcher up to the kernel's build, which is recorded (its
    constexprs) instead; one stand-in for the operands of every call, so that its cache sees one
    shape. Yields (the launcher module, a quantised-K/V stand-in of a head dim, the builds)."""
    gluon_ws = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon_ws", reason="no Gluon warp specialisation")

    class Operands:
        grid = (1, 1, 1)
        q_buffer_bytes = 0

    operands, built = Operands(), []

    def record(kernel, grid, **constexprs):
        built.append(constexprs)
        return object()

    def kv(head_dim, k_per_token=True):
        return SimpleNamespace(block_n=128, pv_key_order="wgmma", k_q=torch.empty(2, 3, 256, head_dim, dtype=torch.int8),
                               k_per_token=k_per_token, n_tiles=2,
                               k_scale=torch.empty(2, 3, 256 if k_per_token else 2))

    monkeypatch.setattr(gluon_ws, "gluon_operands", lambda *args, **kwargs: operands)
    monkeypatch.setattr(gluon_ws, "BoundLaunch", record)
    gluon_ws.gluon_ws_forward.cache_clear()
    yield gluon_ws, kv, built
    gluon_ws.gluon_ws_forward.cache_clear()  # its entries hold this test's stand-ins


@pytest.mark.parametrize("head_dim,release,speculative,policy", [
    (64, (3, 6), True, "VOTE_WHILE_GEMMS_RUN"), (64, (3, 9), True, "VOTE_BEFORE_GEMMS"),
    (128, (3, 9), True, "VOTE_WHILE_GEMMS_RUN"), (64, (3, 9), False, "ONLINE_MAX")])
def test_the_warp_specialised_launcher_builds_the_max_policy_the_release_needs(monkeypatch, ws_builds, head_dim,
                                                                                release, speculative, policy):
    # configs.gluon_ws_votes_early decides where the speculative max's vote goes; the kernel must be
    # built with that policy and the consumers configs.gluon_ws_consumers counts.
    from fsattn_diffusers.kernels import configs

    gluon_ws, kv, built = ws_builds
    monkeypatch.setattr(configs, "triton_release", lambda version=None: release)
    gluon_ws.prepare_fsattn_fwd_gluon_ws(None, kv(head_dim), None, None, speculative=speculative)
    assert built[0]["SPECULATIVE"] == getattr(gluon_ws, policy).value
    assert built[0]["N_CONSUMERS"] == (3 if head_dim == 64 else 2)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_warp_specialised_launcher_reads_the_k_scales_where_the_prepass_put_them(ws_builds, head_dim):
    # Per key: from global memory at head dim 128, through the ring at 64; one per tile: a scalar.
    gluon_ws, kv, built = ws_builds
    gluon_ws.prepare_fsattn_fwd_gluon_ws(None, kv(head_dim), None, None)
    gluon_ws.prepare_fsattn_fwd_gluon_ws(None, kv(head_dim, k_per_token=False), None, None)
    per_key = gluon_ws.KS_RING if head_dim == 64 else gluon_ws.KS_GLOBAL
    assert [b["KS_SOURCE"] for b in built] == [per_key.value, gluon_ws.KS_TILE.value]
    wrong = kv(head_dim, k_per_token=False)
    wrong.k_scale = torch.empty(2, 3, 256)  # one per key, but the K/V pass said one per tile
    with pytest.raises(ValueError, match="one K scale per tile"):
        gluon_ws.prepare_fsattn_fwd_gluon_ws(None, wrong, None, None)


def test_the_single_warpgroup_gluon_launcher_refuses_per_tile_k_scales():
    # It reads one scale per key: a per-tile K/V pass would be read past its scales, silently.
    gluon = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon", reason="no Gluon")
    kv = SimpleNamespace(block_n=128, pv_key_order="natural", k_per_token=False)
    with pytest.raises(ValueError, match="one K scale per key"):
        gluon.prepare_fsattn_fwd_gluon(None, kv, None, None, num_stages=2)


def test_the_warp_specialised_launcher_builds_once_per_consumer_count_and_max_policy(monkeypatch, ws_builds):
    # One shape, asked for with each consumer count and vote place in turn: each pair is its own
    # build (a launch cached for one must not serve another), and asking again reuses it.
    gluon_ws, kv, built = ws_builds
    prepared = []
    for consumers, early in ((3, False), (3, True), (2, False), (2, True), (3, False)):
        monkeypatch.setattr(gluon_ws, "gluon_ws_consumers", lambda *args, n=consumers, **kwargs: n)
        monkeypatch.setattr(gluon_ws, "gluon_ws_votes_early", lambda *args, e=early, **kwargs: e)
        prepared.append(gluon_ws.prepare_fsattn_fwd_gluon_ws(None, kv(64), None, None))
    late, early = gluon_ws.VOTE_WHILE_GEMMS_RUN.value, gluon_ws.VOTE_BEFORE_GEMMS.value
    assert [(b["N_CONSUMERS"], b["SPECULATIVE"]) for b in built] == [(3, late), (3, early), (2, late), (2, early)]
    assert prepared[4] is prepared[0] and len({id(p) for p in prepared[:4]}) == 4


@pytest.mark.parametrize("failure", ["front end", "ptxas", "mlir pass"])
def test_a_gluon_compile_failure_costs_speed_not_the_call(monkeypatch, failure):
    # Gluon's API moves between Triton releases: the call is redone on the Triton kernel, with V
    # quantised again in that kernel's (natural) key order, and the Gluon kernel stays off.
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError

    errors = {"front end": CompilationError(None, None, "warp_specialize() got an unexpected keyword argument"),
              "ptxas": PTXASError("ptxas error: setmaxnreg"), "mlir pass": RuntimeError("PassManager::run failed")}
    gluon_orders = []

    def broken(q, kv, *args, **kwargs):
        gluon_orders.append(kv.pv_key_order)
        raise errors[failure]

    triton_calls = _pretend_hopper(monkeypatch, _gluon_ws(broken))
    _run(FSAttnConfig(kernel="gluon_ws"))
    assert gluon_orders == ["wgmma"] and [kv.pv_key_order for kv in triton_calls] == ["natural"]
    assert planning._DISABLED_GLUON == {"fsattn_fwd_gluon_ws"}


def test_a_long_call_whose_gluon_kernel_fails_to_compile_is_redone_with_a_scale_per_key(monkeypatch):
    # Under "auto" the warp-specialised kernel takes long calls with sorted keys and a K scale per
    # tile; the Triton kernel that redoes the call reads one per key, in the keys' own order.
    from triton.compiler.errors import CompilationError

    gluon_kvs = []

    def broken(q, kv, *args, **kwargs):
        gluon_kvs.append(kv)
        raise CompilationError(None, None, "no such builtin")

    triton_calls = _pretend_hopper(monkeypatch, _gluon_ws(broken))
    _run(FSAttnConfig(), seq=planning.TRITON_MAX_KEYS + 76)
    [sorted_kv], [per_key_kv] = gluon_kvs, triton_calls
    assert (sorted_kv.k_per_token, sorted_kv.key_order is None) == (False, False)
    assert sorted_kv.k_scale.shape[-1] == sorted_kv.n_tiles
    assert (per_key_kv.k_per_token, per_key_kv.key_order, per_key_kv.pv_key_order) == (True, None, "natural")
    assert per_key_kv.k_scale.shape[-1] >= planning.TRITON_MAX_KEYS + 76


def test_other_errors_in_a_gluon_kernel_are_raised(monkeypatch):
    # Only compile failures fall back: a launch error (bad memory access) must surface.
    def crashing(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _pretend_hopper(monkeypatch, _gluon_ws(crashing))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _run(FSAttnConfig(kernel="gluon_ws"))
    assert planning._DISABLED_GLUON == set()


def test_the_launchers_refuse_operands_the_plan_never_sends_them():
    # V in the wrong key order would give a wrong result, not an error; a stage count outside the
    # kernel's would hang or not fit: the launchers refuse both.
    gluon = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon", reason="no Gluon Hopper API here")
    gluon_ws = pytest.importorskip("fsattn_diffusers.kernels.fsattn_fwd_gluon_ws", reason="no Gluon warp specialisation")
    from fsattn_diffusers.kernels.fsattn_fwd import fsattn_fwd

    def kv(order="natural", block_n=128):
        return SimpleNamespace(k_per_token=True, v_dtype=torch.float8_e4m3fn, block_n=block_n, pv_key_order=order,
                               rowsum_weights=torch.empty(1, 16, 1))

    with pytest.raises(ValueError, match="2-4 stages"):
        gluon.fsattn_fwd_gluon(None, kv(), None, None, sm_scale=1.0, num_stages=1)
    for block_n, stages in ((128, 5), (64, 9), (32, 4)):
        with pytest.raises(ValueError, match=f"got block_n={block_n}, num_stages={stages}"):
            gluon_ws.fsattn_fwd_gluon_ws(None, kv("wgmma", block_n), None, None, sm_scale=1.0, num_stages=stages)
    with pytest.raises(ValueError, match="wgmma key order"):
        gluon_ws.fsattn_fwd_gluon_ws(None, kv("natural"), None, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="natural key order"):
        gluon.fsattn_fwd_gluon(None, kv("wgmma"), None, None, sm_scale=1.0)
    with pytest.raises(ValueError, match="natural key order"):
        fsattn_fwd(None, kv("wgmma"), None, None, None, sm_scale=1.0)
    # At head dim 64 the K scales go by TMA, one per key: block scales would be read as per-key
    # ones (a wrong result), a misaligned or strided buffer would fault.
    d64 = kv("wgmma")
    d64.k_q = torch.empty(2, 3, 256, 64, dtype=torch.int8)
    for bad in (torch.empty(2, 3, 2), torch.empty(2, 3, 256, dtype=torch.float16), torch.empty(2, 3, 512)[..., ::2],
                torch.empty(2 * 3 * 256 + 1)[1:].view(2, 3, 256)):
        d64.k_scale = bad
        with pytest.raises(ValueError, match=r"kv.k_scale must be contiguous float32 of shape \(2, 3, 256\)"):
            gluon_ws.fsattn_fwd_gluon_ws(None, d64, None, None, sm_scale=1.0)


@pytest.mark.parametrize("version,votes_early", [("3.6.0", False), ("3.7.1", False), ("3.8.0", True),
                                                 ("3.9.0", True), ("3.10.0+git1234", True), ("4.0.0", True)])
def test_three_consumers_at_head_dim_64_voting_where_the_release_builds_them(version, votes_early):
    # Triton 3.8 on builds three consumers voting late past their registers and ptxas serialises
    # their GEMMs; voting early they build cleanly at head dim 64, so three run there under every
    # release, and the early vote (slower where the late one builds) only where it must
    # (tests/kernels/test_compile_matrix.py checks every release's builds).
    from fsattn_diffusers.kernels.configs import gluon_ws_consumers, gluon_ws_votes_early

    for block_n in (128, 64):  # head dim 64
        assert gluon_ws_consumers(block_n, 64, triton_version=version) == 3
        assert gluon_ws_votes_early(block_n, 64, triton_version=version) == votes_early
    # 64-key tiles at head dim 128: three voting late where that builds, two voting late elsewhere.
    assert gluon_ws_consumers(64, 128, triton_version=version) == (2 if votes_early else 3)
    assert gluon_ws_consumers(128, 128, triton_version=version) == 2
    for block_n in (128, 64):
        assert not gluon_ws_votes_early(block_n, 128, triton_version=version)
    for decide in (gluon_ws_consumers, gluon_ws_votes_early):  # a given version must read, wherever asked
        with pytest.raises(ValueError, match="not a Triton version"):
            decide(128, 128, triton_version="main")


def test_triton_release_reads_the_installed_version_or_gives_none(monkeypatch):
    # The consumer count and the vote's place follow it; an installed Triton whose version does not
    # read gets the choices that build cleanly under every release (None), a given one raises.
    import sys

    from fsattn_diffusers.kernels import configs

    assert configs.triton_release("3.10.0") == (3, 10)
    assert configs.triton_release("3.9.0+git1234") == (3, 9)
    with pytest.raises(ValueError, match="not a Triton version"):
        configs.triton_release("junk")
    for fake, expected in ((SimpleNamespace(__version__="junk"), None), (SimpleNamespace(), None),
                           (SimpleNamespace(__version__="3.7.1"), (3, 7))):
        with monkeypatch.context() as patched:
            patched.setitem(sys.modules, "triton", fake)
            configs.triton_release.cache_clear()
            try:
                found = configs.triton_release()
            finally:
                configs.triton_release.cache_clear()
        assert found == expected
