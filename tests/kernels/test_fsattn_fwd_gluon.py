"""The Gluon kernels (Hopper only) against the Triton kernel and float64.

Gluon does not run in Triton's interpreter, so every test here needs an sm_90 GPU; on other
machines they skip. Two kernels: the warp-specialised one (``kernel="gluon_ws"``, what ``"auto"``
runs at head dims 33-128 on Hopper, except calls with at most 1,024 keys at 65-128, so the
families of docs/design.md §4.1 in ``tests/kernels/test_fsattn_fwd.py``'s GPU tests reach it
too) and the single-warpgroup one (``kernel="gluon"``, opt-in). Each is checked against the Triton kernel and against float64.
"""

import inspect

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
# kernel name -> (module, the function that prepares its forward for the op)
GLUON_KERNELS = {"gluon": ("fsattn_fwd_gluon", "prepare_fsattn_fwd_gluon"),
                 "gluon_ws": ("fsattn_fwd_gluon_ws", "prepare_fsattn_fwd_gluon_ws")}


def _count_runs(monkeypatch, module, prepare_name, record):
    """Make `module`'s prepared forwards call `record(q)` after each run that returned, and
    forget the op's prepared calls (made before the count)."""
    real = getattr(module, prepare_name)

    class Counted:
        def __init__(self, forward):
            self._forward = forward

        def __getattr__(self, name):  # what the op reads of a forward (its buffers' sizes)
            return getattr(self._forward, name)

        def run(self, q, *args, **kwargs):
            result = self._forward.run(q, *args, **kwargs)
            record(q)
            return result

        def run_into(self, q, *args, **kwargs):
            result = self._forward.run_into(q, *args, **kwargs)
            record(q)
            return result

    monkeypatch.setattr(module, prepare_name, lambda *args, **kwargs: Counted(real(*args, **kwargs)))
    monkeypatch.setattr(ops, "_prepared_calls", {})


@pytest.fixture(params=list(GLUON_KERNELS))
def kernel(request):
    return request.param


@pytest.fixture
def gluon_calls(monkeypatch, kernel):
    """Count launches of the Gluon kernel under test, so a test knows which kernel ran."""
    module_name, launcher = GLUON_KERNELS[kernel]
    module = planning.gluon_module(module_name)
    # A kernel that failed to compile would hand its calls to the Triton kernel (and stay off):
    # start clean, and count a launch only once it has returned.
    monkeypatch.setattr(planning, "_DISABLED_GLUON", set())
    planning._plan.cache_clear()
    calls = []
    _count_runs(monkeypatch, module, launcher, lambda q: calls.append(q.shape))
    yield calls
    assert planning._DISABLED_GLUON == set(), "a Gluon kernel failed to compile and was switched off"


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
    (1, 600, 700, 2, 2, 48),
    (2, 64, 100, 2, 2, 64),
    (1, 777, 4096, 8, 2, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}h{s[3]}/{s[4]}d{s[5]}" for s in SHAPES])
def test_gluon_matches_triton_kernel_and_float64(shape, kernel, gluon_calls):
    gluon_cfg = FSAttnConfig(kernel=kernel)
    bsz, sq, sk, hq, hkv, d = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q = torch.randn(bsz, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse = fsattn(q, k, v, return_lse=True, config=gluon_cfg)
    assert len(gluon_calls) == 1, f"kernel={kernel!r} should run its Gluon kernel on sm_90"
    out_t, lse_t = fsattn(q, k, v, return_lse=True, config=TRITON)
    assert len(gluon_calls) == 1, "kernel='triton' must not reach a Gluon kernel"
    ref, ref_lse = attention_reference(q, k, v)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04
    # The row sum adds the FP8-rounded P (it must match what multiplied V): each P is off by up to
    # 6 %, so l by about 3 %/sqrt(keys) -- 0.05 at 100 keys, 0.008 at 4096 (natural-log units).
    assert torch.allclose(lse, ref_lse.to(lse.dtype), atol=0.5 / sk ** 0.5, rtol=0)
    if kernel == "gluon":
        # Same arithmetic, different order of the rescale and the FP8 accumulator chain.
        assert rel_l1(out, out_t) < 5e-3
        assert torch.allclose(lse, lse_t, atol=2e-3, rtol=0)
    else:
        _assert_as_close_to_float64_as_the_triton_kernel(out, lse, out_t, lse_t, ref, ref_lse, sk)


def _assert_as_close_to_float64_as_the_triton_kernel(out, lse, out_t, lse_t, ref, ref_lse, sk):
    """The speculative max rounds P to FP8 from another max than the Triton kernel's (and 64-key
    tiles move the running max at other points), so the warp-specialised kernel's output is not
    bit-close to the Triton kernel's; it must be as close to float64."""
    attended = torch.isfinite(ref_lse)
    assert rel_l1(out, ref) <= 1.1 * rel_l1(out_t, ref) + 1e-3
    lse_err = (lse.double() - ref_lse)[attended].abs().max().item()
    lse_err_t = (lse_t.double() - ref_lse)[attended].abs().max().item()
    # The two kernels' LSEs differ by their FP8 rounding of the row sum (see the test above).
    assert lse_err <= lse_err_t + 0.5 / sk ** 0.5, (lse_err, lse_err_t)


# The max policies: the online max, and the speculative one with the saturation vote while the
# tile's GEMMs run or before they are issued (configs.gluon_ws_votes_early picks one per release;
# the tests force each, so that every release's GPU run checks both).
MAX_POLICIES = ["online", "vote while GEMMs run", "vote before GEMMs"]


def _use_max_policy(monkeypatch, ws, policy):
    """The `speculative` argument of policy `policy`, with the vote's place forced, and the list
    that records the kernel policy of each build the launcher is asked for."""
    if policy != "online":
        monkeypatch.setattr(ws, "gluon_ws_votes_early", lambda *args, early=policy == "vote before GEMMs", **kw: early)
    built = []
    real = ws.gluon_ws_forward

    def recorded(*args):
        built.append(inspect.signature(real).bind(*args).arguments["max_policy"])
        return real(*args)

    monkeypatch.setattr(ws, "gluon_ws_forward", recorded)
    return policy != "online", built


KERNEL_POLICY = {"online": "ONLINE_MAX", "vote while GEMMs run": "VOTE_WHILE_GEMMS_RUN",
                 "vote before GEMMs": "VOTE_BEFORE_GEMMS"}


# The kernel's builds: 64- and 128-key tiles; at head dim 128 two consumers on 128-key tiles and
# the K scales from global memory, at 64 three consumers and the K scales through the ring stage
# (configs.gluon_ws_consumers).
WS_BUILDS = [(64, 128), (128, 128), (128, 64), (64, 64)]


@pytest.mark.parametrize("k_scales", ["token", "sorted_block"])
@pytest.mark.parametrize("block_n,head_dim", WS_BUILDS)
@pytest.mark.parametrize("policy", MAX_POLICIES)
@pytest.mark.parametrize("family", ["randn", "peaky", "max_staircase", "late_sink", "masked_keys", "fully_masked",
                                    "huge_magnitude"])
def test_warp_specialised_tiles_and_max_policies(monkeypatch, block_n, head_dim, policy, family, k_scales):
    # Each of the kernel's builds against float64 and the Triton kernel with the same K/V pass, on
    # the input families of docs/design.md §4.1 it covers (per-key masks; the staircase and the sink
    # saturate the speculative P of many tiles: without their correction, or their P taken again
    # from the true max, the output would be far off), with one K scale per key or one per tile
    # over keys sorted by size (k_granularity="sorted_block", the KS_TILE path). Online at 128 keys
    # with per-key scales is the Triton kernel's arithmetic: bit-close to it. huge_magnitude only
    # has to stay finite (tests/input_families.py).
    from input_families import make_family
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws
    from fsattn_diffusers.kernels.quantize import quantize_kv

    speculative, built = _use_max_policy(monkeypatch, ws, policy)

    sk = 1500
    q, k, v, mask = make_family(family, 2, 700, sk, 4, head_dim, device="cuda",
                                generator=torch.Generator().manual_seed(11))
    weight = None if mask is None else mask[:, 0, 0, :].float()
    per_key = k_scales == "token"
    kv = quantize_kv(k, v, weight, block_n=block_n, d_pad=head_dim, k_per_token=per_key, sort_keys=not per_key,
                     pv_key_order="wgmma")
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 700, dtype=torch.float32, device="cuda")
    ws.fsattn_fwd_gluon_ws(q, kv, out, lse, sm_scale=head_dim ** -0.5, speculative=speculative)
    assert built == [getattr(ws, KERNEL_POLICY[policy]).value]
    out_t, lse_t = fsattn(q, k, v, attn_mask=mask, return_lse=True, config=TRITON.replace(k_granularity=k_scales))
    ref, ref_lse = attention_reference(q, k, v, mask)
    empty = ~torch.isfinite(ref_lse)
    assert torch.isneginf(lse[empty]).all() and (out.transpose(1, 2)[empty] == 0).all()
    assert torch.isfinite(out).all()
    if family == "huge_magnitude":
        return
    if block_n == 128 and not speculative and per_key:
        assert rel_l1(out, out_t) < 5e-3
        assert torch.allclose(lse, lse_t, atol=2e-3, rtol=0)
    else:
        _assert_as_close_to_float64_as_the_triton_kernel(out, lse, out_t, lse_t, ref, ref_lse, sk)
    # The op's bounds (tests/kernels/test_fsattn_fwd.py's GPU_BOUNDS): the adversarial families
    # only cos >= 0.995.
    min_cos, max_l1 = (0.999, 0.04) if family in ("randn", "peaky") else (0.995, 1.0)
    assert cosine(out, ref) >= min_cos and rel_l1(out, ref) <= max_l1


@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("policy", MAX_POLICIES)
@pytest.mark.parametrize("family", ["randn", "max_staircase", "masked_keys"])
def test_two_and_three_consumers_agree_bit_for_bit(monkeypatch, head_dim, block_n, policy, family):
    # configs.gluon_ws_consumers runs two consumer warpgroups where a Triton release would build
    # three with their GEMMs serialised (64-key tiles at head dim 128 from 3.8 on): each
    # warpgroup's 64 rows meet the same key tiles in the same order either way, so the outputs must
    # not move by a bit.
    from input_families import make_family
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws
    from fsattn_diffusers.kernels.quantize import quantize_kv

    speculative, built = _use_max_policy(monkeypatch, ws, policy)

    q, k, v, mask = make_family(family, 2, 700, 1500, 4, head_dim, device="cuda",
                                generator=torch.Generator().manual_seed(5))
    weight = None if mask is None else mask[:, 0, 0, :].float()
    kv = quantize_kv(k, v, weight, block_n=block_n, d_pad=head_dim, k_per_token=True, pv_key_order="wgmma")
    program_rows = []
    real_operands = ws.gluon_operands

    def recorded_operands(*args, block_m, **kwargs):
        program_rows.append(block_m)
        return real_operands(*args, block_m=block_m, **kwargs)

    monkeypatch.setattr(ws, "gluon_operands", recorded_operands)
    results = []
    for consumers in (3, 2):
        monkeypatch.setattr(ws, "gluon_ws_consumers", lambda *args, n=consumers, **kwargs: n)
        out = torch.empty_like(q)
        lse = torch.empty(2, 4, 700, dtype=torch.float32, device="cuda")
        ws.fsattn_fwd_gluon_ws(q, kv, out, lse, sm_scale=head_dim ** -0.5, speculative=speculative)
        results.append((out, lse))
    assert program_rows == [192, 128]  # each run padded Q and sized its grid for its consumers
    assert built == [getattr(ws, KERNEL_POLICY[policy]).value] * 2
    (out3, lse3), (out2, lse2) = results
    assert torch.isfinite(out3).all() and out3.abs().max() > 0
    assert torch.equal(out3, out2) and torch.equal(lse3, lse2)


# 900 keys keep a K scale per key; from 1,025 on, "auto" sorts them on the warp-specialised kernel.
@pytest.mark.parametrize("seq_k", [900, 1500])
def test_gluon_boolean_key_mask_per_batch(kernel, gluon_calls, seq_k):
    gluon_cfg = FSAttnConfig(kernel=kernel)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, seq_k, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, seq_k, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    padded = seq_k - 250
    mask = torch.ones(2, seq_k, dtype=torch.bool, device="cuda")
    mask[0, padded:] = False  # batch 0: padded text, as HunyuanVideo passes it
    mask[1, ::3] = False
    attn_mask = mask[:, None, None, :]
    out = fsattn(q, k, v, attn_mask=attn_mask, config=gluon_cfg)
    assert len(gluon_calls) == 1
    sorted_keys = ops.call_plan(gluon_cfg, q.device, 128, seq_k=seq_k).sort_keys
    assert sorted_keys == (kernel == "gluon_ws" and seq_k > planning.TRITON_MAX_KEYS)
    ref, _ = attention_reference(q, k, v, attn_mask)
    assert cosine(out, ref) >= 0.999 and rel_l1(out, ref) <= 0.04
    # Masked keys carry no weight: changing their values changes nothing (up to the order of the
    # atomic adds of V's rounding-bias correction, which may flip a last bf16 bit).
    v2 = v.clone()
    v2[0, padded:] += 100.0
    assert rel_l1(fsattn(q, k, v2, attn_mask=attn_mask, config=gluon_cfg)[0], out[0]) < 1e-3


def test_configs_the_gluon_kernel_does_not_cover_run_on_triton(kernel, gluon_calls):
    # 1024 keys = 8 tiles: enough for the sampled max to be used (it needs more than 4).
    q = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16)
    for cfg in (FSAttnConfig(kernel=kernel, k_granularity="block"), FSAttnConfig(kernel=kernel, pv_format="16bit"),
                FSAttnConfig(kernel=kernel, max_policy="sampled"),
                FSAttnConfig(kernel=kernel, block_m=128, block_n=64), TRITON):
        out = fsattn(q, q, q, config=cfg)
        assert torch.isfinite(out).all()
    float_mask = torch.zeros(1, 1, 1, 1024, device="cuda")
    fsattn(q, q, q, attn_mask=float_mask, config=FSAttnConfig(kernel=kernel))
    assert gluon_calls == []
    assert planning.gluon_module(GLUON_KERNELS[kernel][0]) is not None


def test_auto_runs_the_warp_specialised_kernel_at_head_dims_64_and_128_unless_few_keys(monkeypatch):
    monkeypatch.setattr(planning, "_DISABLED_GLUON", set())
    planning._plan.cache_clear()
    calls = {}
    from fsattn_diffusers.kernels import fsattn_fwd as fwd

    def counter(name):
        return lambda q: calls.__setitem__(name, calls.get(name, 0) + 1)

    for name, (module_name, launcher) in GLUON_KERNELS.items():
        _count_runs(monkeypatch, planning.gluon_module(module_name), launcher, counter(name))
    _count_runs(monkeypatch, fwd, "prepare_fsattn_fwd", counter("triton"))
    for head_dim in (128, 64, 32):
        q = torch.randn(1, 2048, 2, head_dim, device="cuda", dtype=torch.bfloat16)
        fsattn(q, q, q)
    assert calls == {"gluon_ws": 2, "triton": 1}
    # Cross-attention to 512 keys at head dim 128: the Triton kernel (plan.TRITON_MAX_KEYS).
    q = torch.randn(1, 2048, 2, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16)
    fsattn(q, kv, kv)
    assert calls == {"gluon_ws": 2, "triton": 2}
