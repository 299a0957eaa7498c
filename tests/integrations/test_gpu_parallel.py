"""fsattn under diffusers' context parallelism on two GPUs (NCCL): Wan2.1-1.3B, and the ring's merge on the kernels.

Skipped without two CUDA GPUs. Each test spawns two ranks (tests/integrations/cp_worker.py);
the bounds are those of test_context_parallel.py, which explains them.
"""

from __future__ import annotations

import pytest
import torch

from fsattn_diffusers.metrics import cosine_similarity

from .cp_worker import launch
from .test_context_parallel import _error, max_abs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")]

# (built-in model, latent (frames, height, width), transformer blocks): 1.3B at 33 frames of 480x832
# (14,040 video tokens), 14B at 81 frames of 720x1280 (75,600 tokens, ~2 min on two GPUs).
WAN_CASES = {
    "wan21_1.3b_480p_33f": ("wan2.1-t2v-1.3b", (9, 60, 104), 30),
    "wan21_14b_720p_81f": ("wan2.1-t2v-14b", (21, 90, 160), 40),
}


@pytest.mark.parametrize("case", list(WAN_CASES))
def test_wan21_under_ulysses_and_ring_matches_one_gpu(tmp_path, case):
    # The real Wan2.1-T2V config, random weights, bf16, the real 512 text tokens.
    model, latent, layers = WAN_CASES[case]
    options = dict(model=model, dtype="bfloat16", latent=latent, text_tokens=512,
                   layouts={"ulysses": (2, 1), "ring": (1, 2)})
    result = launch({"wan_model": options}, 2, "cuda", tmp_path)["wan_model"]
    single, sdpa = result["single_fsattn"], result["single_native"]
    print(f"\n{case} one GPU: fsattn vs SDPA cosine {cosine_similarity(single, sdpa):.6f}")
    for name, ring_steps in (("ulysses", 1), ("ring", 2)):
        out = result[name]
        print(f"{case} {name}: cosine vs one-GPU fsattn {cosine_similarity(out, single):.6f}, vs SDPA "
              f"{cosine_similarity(out, sdpa):.6f}; max-abs vs fsattn {max_abs(out, single):.4g}, "
              f"one-GPU fsattn vs SDPA {max_abs(single, sdpa):.4g}")
        assert cosine_similarity(out, single) >= 0.9999
        assert cosine_similarity(out, sdpa) >= 0.999
        for rank_stats in result[name + "_stats"]:
            assert rank_stats["calls"] == {"kernel": layers * (ring_steps + 1)}
            assert rank_stats["sdpa_fallbacks"] == {}


def test_ring_merge_on_the_kernels_is_as_close_to_exact_as_one_gpu(tmp_path):
    run = launch({"ring_attention": dict(dtype="bfloat16", seq=8192, heads=4, head_dim=128)}, 2, "cuda",
                 tmp_path)["ring_attention"]
    for family in ("late_sink", "ramp"):
        ring, single, exact = run[family + "_ring"], run[family + "_single"], run[family + "_reference"]
        ring_cos_err, ring_abs = _error(ring, exact)
        single_cos_err, single_abs = _error(single, exact)
        print(f"\n{family}: ring vs exact 1-cos {ring_cos_err:.3g}, max-abs {ring_abs:.3g}; one GPU 1-cos "
              f"{single_cos_err:.3g}, max-abs {single_abs:.3g}")
        assert cosine_similarity(ring, exact) >= 0.999, family
        assert ring_cos_err <= 1.5 * single_cos_err and ring_abs <= 1.5 * single_abs, family
    assert all(s["fallback_q_tiles"] > 0 for s in run["late_sink_stats"])  # the speculation was tested
    wrong_cos_err, _ = _error(run["ramp_ring_log2_lse"], run["ramp_reference"])
    assert wrong_cos_err > 1.5 * _error(run["ramp_single"], run["ramp_reference"])[0]


def test_kernels_run_on_the_tensors_device_not_the_current_one():
    # A transformer on cuda:1 while cuda:0 is current (diffusers' device_map, multi-GPU pipelines).
    from fsattn_diffusers import fsattn
    from fsattn_diffusers.reference import attention_reference

    gen = torch.Generator(device="cuda:1").manual_seed(3)
    q, k, v = (torch.randn(1, 2048, 4, 128, device="cuda:1", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    with torch.cuda.device(0):
        out = fsattn(q, k, v)
        torch.cuda.synchronize(1)
    assert out.device == q.device
    ref, _ = attention_reference(q, k, v)
    assert cosine_similarity(out, ref) > 0.999
