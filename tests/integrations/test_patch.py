"""apply_fsattn / remove_fsattn: idempotence, skip options, pipelines, LoRA and dtypes."""

from __future__ import annotations

import logging

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import FSAttnConfig, apply_fsattn, remove_fsattn
from fsattn_diffusers.families import attention_modules

from .conftest import (BUILDERS, build_mochi_pipeline, build_wan_pipeline, cosine, emulation_calls, make_peaky, run,
                       run_wan_pipeline)


def _processors(model):
    return {path: module.processor for path, module in attention_modules(model)}


def test_applying_twice_patches_once_and_removal_restores_the_same_objects():
    model, inputs = BUILDERS["wan_i2v"]()
    originals = _processors(model)
    reference = run(model, inputs)
    apply_fsattn(model)
    once = run(model, inputs)
    apply_fsattn(model)
    for path, processor in _processors(model).items():
        assert type(processor).fsattn_own_class is type(originals[path])  # a copy of the original, not of a copy
    assert torch.equal(run(model, inputs), once)
    remove_fsattn(model)
    remove_fsattn(model)  # harmless when nothing is patched
    assert all(processor is originals[path] for path, processor in _processors(model).items())
    assert torch.equal(run(model, inputs), reference)


def test_applying_again_with_other_options_replaces_the_patch():
    model, inputs = BUILDERS["wan_t2v"]()
    apply_fsattn(model, config=FSAttnConfig(pv_format="16bit"))
    apply_fsattn(model)
    default = run(model, inputs)
    remove_fsattn(model)
    apply_fsattn(model)
    assert torch.equal(run(model, inputs), default)


def test_skip_blocks_keeps_those_blocks_on_their_own_attention():
    model, inputs = BUILDERS["wan_t2v"]()
    originals = _processors(model)
    apply_fsattn(model, skip_blocks=[1])
    run(model, inputs)
    assert emulation_calls() == 2  # block 0's self- and cross-attention
    for path, processor in _processors(model).items():
        assert (processor is originals[path]) == path.startswith("blocks.1.")


def test_skip_blocks_counts_through_double_then_single_stream_blocks():
    model, inputs = BUILDERS["hunyuan_video"]()  # blocks: transformer_blocks[0], single_transformer_blocks[0]
    originals = _processors(model)
    apply_fsattn(model, skip_blocks=(1,))
    run(model, inputs)
    assert emulation_calls() == 1
    kept = {path for path, processor in _processors(model).items() if processor is originals[path]}
    assert kept == {"single_transformer_blocks.0.attn"}


def test_skip_blocks_counts_wan_vace_control_blocks_first():
    model, inputs = BUILDERS["wan_vace"]()  # blocks: vace_blocks[0] (runs first), blocks[0], blocks[1]
    originals = _processors(model)
    apply_fsattn(model, skip_blocks=(0, 2))
    run(model, inputs)
    assert emulation_calls() == 2  # blocks.0's self- and cross-attention
    kept = {path for path, processor in _processors(model).items() if processor is originals[path]}
    assert kept == {"vace_blocks.0.attn1", "vace_blocks.0.attn2", "blocks.1.attn1", "blocks.1.attn2"}


def test_skip_blocks_out_of_range_is_rejected_with_the_valid_range():
    model, _ = BUILDERS["wan_t2v"]()
    with pytest.raises(ValueError, match=r"indices \[2\] outside WanTransformer3DModel's 2 blocks \(0..1\)"):
        apply_fsattn(model, skip_blocks=(0, 2))
    with pytest.raises(TypeError, match="expected int block indices"):
        apply_fsattn(model, skip_blocks=("0",))


@pytest.mark.parametrize("family, fsattn_calls", [("wan_t2v", 2), ("wan_i2v", 2), ("ltx_video", 2)])
def test_self_attention_only_leaves_cross_attention_alone(family, fsattn_calls):
    model, inputs = BUILDERS[family]()
    originals = _processors(model)
    apply_fsattn(model, self_attention_only=True)
    run(model, inputs)
    assert emulation_calls() == fsattn_calls
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {}  # LTX's masked cross-attention was never offered
    for path, processor in _processors(model).items():
        assert (processor is originals[path]) == path.endswith("attn2")


def test_steps_count_denoising_steps_not_transformer_calls():
    pipe = build_wan_pipeline()
    per_call = 4  # attention calls per transformer forward
    run_wan_pipeline(pipe, steps=4)  # guidance_scale 5: two transformer calls per step
    assert emulation_calls() == 0

    apply_fsattn(pipe)
    run_wan_pipeline(pipe, steps=4)
    assert emulation_calls() == 4 * 2 * per_call
    fsattn_diffusers.reset_stats()

    apply_fsattn(pipe, skip_first_steps=1, skip_last_steps=1)
    run_wan_pipeline(pipe, steps=4)
    assert emulation_calls() == 2 * 2 * per_call  # steps 1 and 2 of 0..3
    run_wan_pipeline(pipe, steps=5)  # a new run counts from its own first step
    assert emulation_calls() == 2 * 2 * per_call + 3 * 2 * per_call


@pytest.mark.parametrize("begin_index", [False, True])
def test_a_run_that_starts_part_way_skips_its_own_last_steps(begin_index):
    # Video-to-video pipelines (strength < 1) loop over the end of the schedule that
    # set_timesteps made: Wan's slices it, others also tell the scheduler set_begin_index.
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    class PartWay(DiffusionPipeline):
        def __init__(self, transformer, scheduler):
            super().__init__()
            self.register_modules(transformer=transformer, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, inputs, steps, strength):
            self.scheduler.set_timesteps(steps)
            start = steps - int(steps * strength)
            if begin_index:
                self.scheduler.set_begin_index(start)
            latents, calls = inputs["hidden_states"], []
            for t in self.scheduler.timesteps[start:]:
                before = emulation_calls()
                out = self.transformer(**{**inputs, "hidden_states": latents}, return_dict=False)[0]
                calls.append(emulation_calls() - before)
                latents = self.scheduler.step(out, t, latents, return_dict=False)[0]
            return calls

    model, inputs = BUILDERS["wan_t2v"]()
    pipe = PartWay(model, FlowMatchEulerDiscreteScheduler())
    apply_fsattn(pipe, skip_first_steps=1, skip_last_steps=2)
    assert pipe(inputs, steps=8, strength=0.75) == [0, 4, 4, 4, 0, 0]  # 6 steps: the first and the last two skipped
    assert pipe(inputs, steps=6, strength=1.0) == [0, 4, 4, 4, 0, 0]  # a new run counts afresh


def test_skipped_steps_run_the_original_attention_bit_for_bit():
    pipe = build_wan_pipeline()
    reference = run_wan_pipeline(pipe, steps=3)
    apply_fsattn(pipe, skip_first_steps=2, skip_last_steps=1)
    assert torch.equal(run_wan_pipeline(pipe, steps=3), reference)
    assert emulation_calls() == 0
    apply_fsattn(pipe)
    assert not torch.equal(run_wan_pipeline(pipe, steps=3), reference)


def test_wan22_patches_both_transformers_and_counts_steps_across_them():
    pipe = build_wan_pipeline(second_transformer=True)
    reference = run_wan_pipeline(pipe, steps=4)
    apply_fsattn(pipe, skip_first_steps=1)
    for transformer in (pipe.transformer, pipe.transformer_2):
        assert all(hasattr(type(p), "fsattn_route") for p in _processors(transformer).values())
    out = run_wan_pipeline(pipe, steps=4)
    assert emulation_calls() == 3 * 2 * 4  # the steps after the first, whichever transformer ran them
    assert cosine(out, reference) > 0.999
    remove_fsattn(pipe)
    assert "step" not in vars(pipe.scheduler) and "set_timesteps" not in vars(pipe.scheduler)
    assert torch.equal(run_wan_pipeline(pipe, steps=4), reference)


def test_pipeline_patch_leaves_the_vae_alone_and_covers_mochi_without_set_attn_processor():
    pipe = build_mochi_pipeline()
    assert not hasattr(pipe.transformer, "set_attn_processor")
    vae_processors = _processors(pipe.vae)
    assert vae_processors  # the Mochi VAE has diffusers Attention modules that must stay as they are
    apply_fsattn(pipe)
    assert _processors(pipe.vae) == vae_processors
    assert all(hasattr(type(p), "fsattn_route") for p in _processors(pipe.transformer).values())


def test_step_options_need_a_pipeline():
    model, _ = BUILDERS["wan_t2v"]()
    with pytest.raises(ValueError, match="only a pipeline's scheduler knows"):
        apply_fsattn(model, skip_first_steps=1)
    with pytest.raises(ValueError, match=r"skip_last_steps=-1; expected an int >= 0"):
        apply_fsattn(model, skip_last_steps=-1)
    with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
        apply_fsattn("WanPipeline")


def _add_lora(model):
    pytest.importorskip("peft")
    from peft import LoraConfig

    torch.manual_seed(7)  # init_lora_weights=False draws both LoRA matrices at random: a visible change
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


def test_lora_loaded_before_or_after_apply_gives_the_same_output():
    model, inputs = BUILDERS["wan_t2v"]()
    make_peaky(model)
    plain = run(model, inputs)
    sdpa_lora = run(_add_lora(model), inputs)
    assert cosine(sdpa_lora, plain) < 0.999  # the adapter matters
    lora_first = run(apply_fsattn(model), inputs)

    model, inputs = BUILDERS["wan_t2v"]()
    make_peaky(model)
    apply_fsattn(model)
    lora_after = run(_add_lora(model), inputs)
    assert torch.equal(lora_after, lora_first)
    assert cosine(lora_first, sdpa_lora) >= 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    model, inputs = BUILDERS["wan_t2v"]()
    make_peaky(model)
    model.to(dtype)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    reference = run(model, inputs)
    apply_fsattn(model)
    out = run(model, inputs)
    assert out.dtype == dtype
    assert emulation_calls() == 4
    assert cosine(out, reference) >= 0.999


def test_logs_the_backend_of_each_kind_of_attention_and_what_was_kept(caplog):
    import logging

    model, inputs = BUILDERS["ltx_video"]()
    with caplog.at_level(logging.INFO, logger="fsattn_diffusers"):
        apply_fsattn(model, skip_blocks=(1,))
        run(model, inputs)
        run(model, inputs)
    lines = [r.getMessage() for r in caplog.records if r.name == "fsattn_diffusers"]
    assert lines[0] == ("fsattn: LTXVideoTransformer3DModel: 2 attention modules run on fsattn; kept original attention: "
                        "LTXAttention self-attention (skip_blocks), e.g. transformer_blocks.1.attn1; "
                        "LTXAttention cross-attention (skip_blocks), e.g. transformer_blocks.1.attn2")
    assert sorted(lines[1:]) == sorted([
        "fsattn: LTXAttention self-attention (LTXVideoAttnProcessor) runs on fsattn",
        "fsattn: LTXAttention cross-attention (LTXVideoAttnProcessor) runs on SDPA instead of fsattn (reason: "
        "general_mask): attn_mask of shape (2, 2, 1, 16) has a row per head or per query; fsattn takes "
        "key-padding masks broadcastable to (B, 1, 1, Sk) (it does not read a mask to find out whether its rows "
        "agree)",
    ])


def test_strict_apply_raises_on_a_call_fsattn_cannot_take():
    from fsattn_diffusers import UnsupportedInputError

    model, inputs = BUILDERS["ltx_video"]()  # its cross-attention mask is repeated per head
    apply_fsattn(model, strict=True)
    with pytest.raises(UnsupportedInputError, match="LTXAttention cross-attention.*strict=True") as err:
        run(model, inputs)
    assert err.value.reason == "general_mask"
    apply_fsattn(model, strict=True, self_attention_only=True)
    run(model, inputs)
    assert emulation_calls() == 2 + 1  # block 0's self-attention ran before the refusal, then both blocks'


def test_a_model_without_attention_modules_warns_and_strict_raises(caplog):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False])
    for target in (vae, torch.nn.Linear(4, 4)):
        with caplog.at_level(logging.WARNING, logger="fsattn_diffusers"):
            caplog.clear()
            assert apply_fsattn(target) is target
        assert "has no attention module that diffusers knows" in caplog.text
        with pytest.raises(ValueError, match="no attention module"):
            apply_fsattn(target, strict=True)


@pytest.mark.parametrize("family", ["cogvideox", "wan_t2v"])
def test_fused_qkv_projections_keep_fsattn_on(family):
    # CogVideoX's fuse_qkv_projections() installs diffusers' fused processors over whatever was set:
    # fsattn must stay on through it (and through unfusing), and removal must undo both.
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    reference = run(model, inputs)
    apply_fsattn(model)
    patched = run(model, inputs)
    model.fuse_qkv_projections()
    calls = emulation_calls()
    fused = run(model, inputs)
    n_calls = emulation_calls() - calls
    assert n_calls > 0 and n_calls == calls, "attention left fsattn after fuse_qkv_projections()"
    assert cosine(fused, patched) > 0.9999
    model.unfuse_qkv_projections()
    calls = emulation_calls()
    run(model, inputs)
    assert emulation_calls() - calls == n_calls
    remove_fsattn(model)
    assert all(not getattr(type(p), "fsattn_route", None) for p in _processors(model).values())
    assert "set_processor" not in vars(next(m for _, m in attention_modules(model)))
    assert torch.equal(run(model, inputs), reference)
