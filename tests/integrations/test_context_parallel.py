"""fsattn under diffusers' context parallelism (Ulysses, ring, both), on the CPU with gloo.

The multi-rank tests spawn one process per rank (tests/integrations/cp_worker.py), each on the
CPU emulation of the kernels (FSATTN_CPU_PATH=emulation), and compare with single-process runs
made in the same worker from the same weights.

Bounds, and why:

* Ulysses moves heads between ranks and changes no attention arithmetic: every (batch, head) row
  still sees every key in one fsattn call, with the same quantisation. What remains is float32
  rounding in the rest of the model (GEMMs over half the tokens), hence max-abs <= 1e-5 of the
  output's magnitude.
* A ring computes each rank's key chunk with its own 8-bit quantisation (K smoothing mean, V
  scales, frozen max all per chunk) and merges the chunks by their LSE. It is another draw of
  fsattn's quantisation noise around the same exact attention, so it must be as close to exact
  (SDPA, float64) as the single-process fsattn is, up to noise: error <= 1.5x the single run's.
  The triangle inequality then bounds ring vs single-process fsattn by 2.5x the single run's
  own error. A wrong LSE (a log2 one, checked as a control) breaks these bounds.
"""

from __future__ import annotations

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import UnsupportedInputError, diffusers_backend, register_fsattn_backend
from fsattn_diffusers.metrics import cosine_similarity
from fsattn_diffusers.reference import attention_reference

from .cp_worker import launch

TINY_WAN = dict(model="tiny", dtype="float32", latent=(3, 16, 16), text_tokens=16, qk_gain=2.5)
# The tiny Wan has 2 blocks: self-attention (under context parallelism) and cross-attention
# (to the text, which stays whole on every rank: Wan's _cp_plan does not split it) in each.
TINY_BLOCKS = 2


def max_abs(a, b):
    return (a - b).abs().max().item()


def _check_model_run(result, name, ring_steps):
    single, sdpa, out = result["single_fsattn"], result["single_native"], result[name]
    own_error = max_abs(single, sdpa)
    assert own_error > 0  # the single-process run did go through fsattn's 8-bit arithmetic
    assert cosine_similarity(out, single) >= 0.9999
    assert cosine_similarity(out, sdpa) >= 0.999
    if ring_steps == 1:
        assert max_abs(out, single) <= 1e-5 * single.abs().max().item()
    else:
        assert max_abs(out, sdpa) <= 1.5 * own_error
        assert max_abs(out, single) <= 2.5 * own_error
    for rank_stats in result[name + "_stats"]:
        # every self-attention call ran fsattn once per ring step; nothing fell back
        assert rank_stats["calls"] == {"emulation": TINY_BLOCKS * (ring_steps + 1)}
        assert rank_stats["sdpa_fallbacks"] == {}


def test_tiny_wan_under_ulysses_and_ring_matches_one_process(tmp_path):
    result = launch({"wan_model": dict(TINY_WAN, layouts={"ulysses": (2, 1), "ring": (1, 2)})}, 2, "cpu",
                    tmp_path)["wan_model"]
    _check_model_run(result, "ulysses", ring_steps=1)
    _check_model_run(result, "ring", ring_steps=2)


def test_fsattn_processor_under_context_parallelism_set_before_or_after_matches_one_process(tmp_path):
    # diffusers' enable_parallelism() configures the processors it finds; FSAttnProcessor set after
    # it takes the model's configuration on its first call. Without either, each rank would attend
    # over its own tokens only (far outside these bounds).
    layouts = {"ulysses": (2, 1), "ring": (1, 2)}
    results = launch({route: dict(TINY_WAN, scenario="wan_model", layouts=layouts, route=route)
                      for route in ("processor_first", "processor_after")}, 2, "cpu", tmp_path)
    for result in results.values():
        _check_model_run(result, "ulysses", ring_steps=1)
        _check_model_run(result, "ring", ring_steps=2)


def test_tiny_wan_under_ulysses_and_ring_together_on_four_ranks(tmp_path):
    result = launch({"wan_model": dict(TINY_WAN, layouts={"unified": (2, 2)})}, 4, "cpu", tmp_path)["wan_model"]
    _check_model_run(result, "unified", ring_steps=2)


def test_tiny_ltx_video_under_ulysses_and_ring_matches_one_process(tmp_path):
    # diffusers' LTX plan splits the text as well: the cross-attention's keys are sharded too.
    result = launch({"ltx_model": dict(latent=(2, 4, 4), text_tokens=8, qk_gain=2.5,
                                       layouts={"ulysses": (2, 1), "ring": (1, 2)})}, 2, "cpu", tmp_path)["ltx_model"]
    for name, ring_steps in (("ulysses", 1), ("ring", 2)):
        single, sdpa, out = result["single_fsattn"], result["single_native"], result[name]
        own_error = max_abs(single, sdpa)
        assert own_error > 0
        assert cosine_similarity(out, single) >= 0.9999 and cosine_similarity(out, sdpa) >= 0.999
        if ring_steps == 1:
            assert max_abs(out, single) <= 1e-5 * single.abs().max().item()
        else:
            assert max_abs(out, sdpa) <= 1.5 * own_error and max_abs(out, single) <= 2.5 * own_error
        for rank_stats in result[name + "_stats"]:
            # self- and cross-attention both ran fsattn, once per ring step; nothing fell back
            assert rank_stats["calls"] == {"emulation": 2 * ring_steps}
            assert rank_stats["sdpa_fallbacks"] == {}


@pytest.fixture(scope="module")
def attention_runs(tmp_path_factory):
    """Attention-level runs on 2 ranks, in one spawn: the ring's merge and the fallbacks."""
    scenarios = {"ring_attention": dict(dtype="float32", seq=1536, heads=2, head_dim=64), "fallbacks": {}}
    return launch(scenarios, 2, "cpu", tmp_path_factory.mktemp("cp"))


def _error(out, reference):
    return 1.0 - cosine_similarity(out, reference), max_abs(out, reference)


@pytest.mark.parametrize("family", ["late_sink", "ramp"])
def test_ring_merge_is_as_close_to_exact_as_one_process(attention_runs, family):
    run = attention_runs["ring_attention"]
    ring, single, exact = run[family + "_ring"], run[family + "_single"], run[family + "_reference"]
    ring_cos_err, ring_abs = _error(ring, exact)
    single_cos_err, single_abs = _error(single, exact)
    assert cosine_similarity(ring, exact) >= 0.999
    assert ring_cos_err <= 1.5 * single_cos_err and ring_abs <= 1.5 * single_abs
    for rank_stats in run[family + "_stats"]:
        assert rank_stats["calls"] == {"emulation": 2} and rank_stats["sdpa_fallbacks"] == {}


def test_frozen_max_speculation_is_violated_and_repaired_per_rank(attention_runs):
    # Each rank guesses its row max from two tiles of the key chunk in hand (1536 keys: two
    # chunks of 6 tiles, enough for the speculative path). The late sink, in rank 1's chunk and
    # outside its sampled tiles, breaks most guesses on both ranks' queries; the rescale repairs them.
    run = attention_runs["ring_attention"]
    for rank_stats in run["late_sink_stats"]:
        assert 0 < rank_stats["fallback_q_tiles"] <= rank_stats["q_tiles"]
    assert all(s["fallback_q_tiles"] == 0 for s in run["ramp_stats"])  # the online default never speculates


def test_a_log2_lse_would_break_the_ring_bounds(attention_runs):
    run = attention_runs["ring_attention"]
    wrong_cos_err, wrong_abs = _error(run["ramp_ring_log2_lse"], run["ramp_reference"])
    single_cos_err, single_abs = _error(run["ramp_single"], run["ramp_reference"])
    assert wrong_cos_err > 1.5 * single_cos_err and wrong_abs > 1.5 * single_abs


def test_ulysses_takes_a_key_padding_mask_gathered_from_every_rank(attention_runs):
    case = attention_runs["fallbacks"]["ulysses_key_mask"]
    assert case["raised"] is None
    torch.testing.assert_close(case["out"], case["expected"], rtol=0, atol=1e-6)
    assert all(s["calls"] == {"emulation": 1} and s["sdpa_fallbacks"] == {} for s in case["stats"])


def test_unsupported_calls_fall_back_or_raise_under_context_parallelism(attention_runs):
    cases = attention_runs["fallbacks"]
    ulysses = cases["ulysses_head_dim"]  # head dim 160: the native backend's own Ulysses path
    assert ulysses["raised"] is None and torch.equal(ulysses["out"], ulysses["expected"])
    assert all(s["calls"] == {} and s["sdpa_fallbacks"] == {"head_dim": 1} for s in ulysses["stats"])
    ring = cases["ring_head_dim"]  # diffusers' native op cannot run a ring: exact attention with its LSE
    assert ring["raised"] is None
    torch.testing.assert_close(ring["out"], ring["expected"], rtol=0, atol=1e-5)
    assert all(s["calls"] == {} and s["sdpa_fallbacks"] == {"head_dim": 1} for s in ring["stats"])
    assert cases["ulysses_head_dim_strict"]["raised"] == "head_dim"
    assert "strict=True" in cases["ulysses_head_dim_strict"]["message"]
    assert cases["ulysses_causal"]["raised"] == "is_causal"
    assert cases["ring_key_mask"]["raised"] == "cp_ring_mask"
    assert "ulysses_degree" in cases["ring_key_mask"]["message"]


# ----------------------------------------------------------------------------- one process


def test_backend_reports_context_parallel_support():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    member = register_fsattn_backend()
    assert _AttentionBackendRegistry._is_context_parallel_available(member)
    assert "fsattn" in _AttentionBackendRegistry._supports_context_parallel


class _RingOfTwo:
    """Stands in for a ParallelConfig where no collective is reached (the call raises first)."""

    class context_parallel_config:  # noqa: N801 - the attribute name diffusers reads
        ring_degree, ulysses_degree = 2, 1


def _qkv(seq=64, dim=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seq, 2, dim, generator=g) for _ in range(3)]


def test_strict_backend_raises_before_any_collective_under_context_parallelism():
    register_fsattn_backend(strict=True)
    try:
        q, k, v = _qkv(dim=160)
        with pytest.raises(UnsupportedInputError, match="strict=True") as err:
            diffusers_backend._fsattn_attention(q, k, v, _parallel_config=_RingOfTwo())
        assert err.value.reason == "head_dim"
    finally:
        register_fsattn_backend()
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {}


def test_forward_op_lse_is_natural_log_in_bsh_layout_and_merges_exactly():
    # The ring's merge, written out as diffusers' TemplatedRingAttention does it, over two key
    # halves of fsattn's forward op, against one fsattn call over all keys and the exact result.
    q, k, v = _qkv(seq=96)
    exact, exact_lse = attention_reference(q, k, v)
    parts = [diffusers_backend._fsattn_forward_op(None, q, k[:, half], v[:, half], return_lse=True)
             for half in (slice(0, 48), slice(48, 96))]
    (out_a, lse_a), (out_b, lse_b) = [(o.float(), lse.unsqueeze(-1)) for o, lse in parts]
    assert lse_a.shape == (1, 96, 2, 1)  # (B, S, H) before the ring's unsqueeze
    # each half's LSE is its own exact log-sum-exp, key-mean correction included
    for (_, lse), half in zip(parts, (slice(0, 48), slice(48, 96))):
        torch.testing.assert_close(lse.double(), attention_reference(q, k[:, half], v[:, half])[1].permute(0, 2, 1),
                                   rtol=0, atol=2e-2)
    merged = out_a - torch.sigmoid(lse_b - lse_a) * (out_a - out_b)
    merged_lse = lse_a - torch.nn.functional.logsigmoid(lse_a - lse_b)
    whole = diffusers_backend._fsattn_forward_op(None, q, k, v)
    torch.testing.assert_close(merged_lse.squeeze(-1).double(), exact_lse.permute(0, 2, 1), rtol=0, atol=2e-2)
    assert cosine_similarity(merged, exact) >= 0.999
    assert _error(merged, exact)[1] <= 2.0 * _error(whole, exact)[1]


def test_sdpa_forward_op_gives_the_exact_lse():
    q, k, v = _qkv(seq=40)
    out, lse = diffusers_backend._sdpa_forward_op(None, q, k, v, return_lse=True)
    exact, exact_lse = attention_reference(q, k, v)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), exact_lse.permute(0, 2, 1), rtol=0, atol=1e-5)
