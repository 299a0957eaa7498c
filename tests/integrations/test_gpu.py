"""The integration on the GPU kernels: families in bf16, model CPU offload (with fsattn, and with the
whole recipe), Wan2.1-1.3B at 480p.

Skipped without a CUDA GPU (tests/conftest.py). The Wan2.1-1.3B test prints the forward-time
ratio (run with ``-s`` to see it).
"""

from __future__ import annotations

import time

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import FSAttnConfig, apply_fsattn, remove_fsattn

from .conftest import BUILDERS, build_wan_pipeline, cosine, make_peaky, run, run_wan_pipeline
from .test_families import EXPECTED, amplify_attention

pytestmark = pytest.mark.gpu

# The tiny models' calls are far below the size at which the integration hands attention to SDPA
# (FSAttnConfig.sdpa_below_flops, sdpa_below_keys): turn both off so that every call reaches the kernel.
EVERY_CALL = FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=0)


def _to_cuda(model, inputs, dtype=torch.bfloat16):
    model.to("cuda", dtype)
    return {k: (v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda")) if isinstance(v, torch.Tensor)
            else tuple(t.to("cuda", dtype) for t in v) if isinstance(v, tuple) else v for k, v in inputs.items()}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_families_on_the_kernels_in_bf16(family):
    model, inputs = BUILDERS[family]()
    amplify_attention(make_peaky(model))
    inputs = _to_cuda(model, inputs)
    reference = run(model, inputs)
    apply_fsattn(model, config=EVERY_CALL)
    out = run(model, inputs)
    assert fsattn_diffusers.stats()["calls"] == {"kernel": EXPECTED[family][0]}
    for b in range(out.shape[0]):
        assert cosine(out[b], reference[b]) >= 0.999, f"batch element {b}"
    remove_fsattn(model)
    assert torch.equal(run(model, inputs), reference)


@pytest.mark.parametrize("apply_first", [True, False])
def test_model_cpu_offload(apply_first):
    pipe = build_wan_pipeline()
    apply_fsattn(pipe, config=EVERY_CALL)
    on_gpu = run_wan_pipeline(pipe.to("cuda"), steps=2).cpu()
    pipe = build_wan_pipeline()
    if apply_first:
        apply_fsattn(pipe, config=EVERY_CALL)
    pipe.enable_model_cpu_offload()
    if not apply_first:
        apply_fsattn(pipe, config=EVERY_CALL)
    fsattn_diffusers.reset_stats()
    offloaded = run_wan_pipeline(pipe, steps=2).cpu()
    assert fsattn_diffusers.stats()["calls"] == {"kernel": 2 * 2 * 4}
    torch.testing.assert_close(offloaded, on_gpu)


@pytest.mark.parametrize("recipe_first", [True, False])
def test_the_recipe_with_model_cpu_offload_matches_the_recipe_on_the_gpu(recipe_first):
    # FP8 linears, fused QKV, fsattn and compiled blocks, with the weights moving between CPU and
    # GPU around each forward. Two compilations need not agree bit for bit: compared by cosine.
    from fsattn_diffusers import apply_recipe

    options = dict(fsattn_options={"config": EVERY_CALL})
    pipe = build_wan_pipeline().to("cuda", torch.bfloat16)
    apply_recipe(pipe, **options)
    on_gpu = run_wan_pipeline(pipe, steps=2).float().cpu()
    torch._dynamo.reset()
    pipe = build_wan_pipeline().to(torch.bfloat16)
    if recipe_first:
        apply_recipe(pipe.to("cuda"), **options)
    pipe.enable_model_cpu_offload()
    if not recipe_first:
        apply_recipe(pipe, **options)
    fsattn_diffusers.reset_stats()
    offloaded = run_wan_pipeline(pipe, steps=2).float().cpu()
    assert fsattn_diffusers.stats()["calls"] == {"kernel": 2 * 2 * 4}
    assert fsattn_diffusers.recipe_summary(pipe)["transformer"]["fp8_linear"], "no layer in FP8"
    assert cosine(offloaded, on_gpu) > 0.9999


def test_the_recipe_after_a_fused_lora_runs_the_adapter_in_fp8():
    # The supported order: load and fuse the LoRA, then the recipe (FP8 quantizes the fused weights).
    from peft import LoraConfig

    from fsattn_diffusers import apply_recipe

    model, inputs = BUILDERS["wan_t2v"]()
    inputs = _to_cuda(model, inputs)
    plain = run(model, inputs)
    model.add_adapter(LoraConfig(r=4, lora_alpha=32, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"]))
    model.fuse_lora()
    model.unload_lora()
    with_lora = run(model, inputs)
    assert cosine(with_lora, plain) < 0.99  # the adapter matters far beyond FP8's rounding
    apply_recipe(model, fsattn_options={"config": EVERY_CALL})
    fsattn_diffusers.reset_stats()
    out = run(model, inputs)
    assert fsattn_diffusers.stats()["calls"] == {"kernel": EXPECTED["wan_t2v"][0]}
    assert "blocks.0.attn1.to_qkv" in fsattn_diffusers.recipe_summary(model)["model"]["fp8_linear"]
    assert cosine(out, with_lora) > max(0.99, cosine(out, plain))


@pytest.mark.slow
def test_wan21_1_3b_480p_81_frames_matches_sdpa():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device("cuda"):  # the real Wan2.1-T2V-1.3B config, random weights
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        ).to(torch.bfloat16).eval()
        g = torch.Generator("cuda").manual_seed(0)
        # 480x832, 81 frames: latents of 21 x 60 x 104 (32,760 video tokens); 512 text tokens
        inputs = dict(hidden_states=torch.randn(1, 16, 21, 60, 104, generator=g, dtype=torch.bfloat16),
                      timestep=torch.tensor([700]),
                      encoder_hidden_states=torch.randn(1, 512, 4096, generator=g, dtype=torch.bfloat16))

    def timed():
        run(model, inputs)  # warm-up (fsattn: kernel compilation and autotuning)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            out = run(model, inputs)
        torch.cuda.synchronize()
        return out, (time.perf_counter() - start) / 3

    reference, sdpa_s = timed()
    apply_fsattn(model)
    fsattn_diffusers.reset_stats()
    out, fsattn_s = timed()
    similarity = cosine(out, reference)
    print(f"\nWan2.1-1.3B 480p 81 frames bf16 forward: SDPA {sdpa_s * 1e3:.0f} ms, fsattn {fsattn_s * 1e3:.0f} ms, "
          f"ratio {sdpa_s / fsattn_s:.3f}x; output cosine {similarity:.6f}; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; stats {fsattn_diffusers.stats()}")
    assert similarity >= 0.999
    # 4 forwards x 30 blocks: self-attention (32760 tokens) on the kernel, cross-attention to 512 text
    # tokens (below FSAttnConfig.sdpa_below_flops and sdpa_below_keys) on SDPA.
    assert fsattn_diffusers.stats()["calls"] == {"kernel": 4 * 30}
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {"small_problem": 4 * 30}
