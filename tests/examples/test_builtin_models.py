"""fsattn_diffusers.builtin_models: the published architectures, the tiny pipeline, the tokenizer."""

import pytest
import torch

from fsattn_diffusers import builtin_models as bm


# Parameter counts of the transformers built (on the meta device) from the published configs:
# Wan2.1-T2V "1.3B" and "14B", HunyuanVideo "13B". A wrong config value moves these.
@pytest.mark.parametrize(
    "name,params,attention_modules,heads,head_dim",
    [
        ("wan2.1-t2v-1.3b", 1_418_996_800, 60, 12, 128),  # 30 blocks x (self, cross)
        ("wan2.1-t2v-14b", 14_288_491_584, 80, 40, 128),  # 40 blocks x (self, cross)
        ("hunyuanvideo", 12_821_012_544, 62, 24, 128),  # 20 dual + 40 single + 2 refiner blocks
    ],
)
def test_real_architectures_match_the_published_configs(name, params, attention_modules, heads, head_dim):
    model = bm.build_transformer(name, device="meta", dtype=torch.bfloat16)
    assert bm.count_parameters(model) == params
    attn = [m for _, m in model.named_modules() if hasattr(m, "processor")]
    assert len(attn) == attention_modules
    assert model.config.num_attention_heads == heads and model.config.attention_head_dim == head_dim


def test_cogvideox_5b_matches_its_published_config():
    # No exact published parameter count was found to assert; "5B" and the config's shape are.
    model = bm.build_transformer("cogvideox-5b", device="meta", dtype=torch.bfloat16)
    assert 5.0e9 < bm.count_parameters(model) < 6.0e9
    attn = [m for _, m in model.named_modules() if hasattr(m, "processor")]
    assert len(attn) == 42  # one joint (text + video) attention per block
    assert model.config.num_attention_heads == 48 and model.config.attention_head_dim == 64
    assert model.config.max_text_seq_length == 226 and model.config.use_rotary_positional_embeddings


def test_cogvideox_prompt_inputs_are_t5_shaped_prompt_and_negative_prompt():
    inputs = bm.random_prompt_inputs("cogvideox-5b", 1, "cpu", torch.bfloat16, torch.Generator().manual_seed(0))
    assert set(inputs) == {"prompt_embeds", "negative_prompt_embeds"}
    assert inputs["prompt_embeds"].shape == inputs["negative_prompt_embeds"].shape == (1, 226, 4096)
    assert not torch.equal(inputs["prompt_embeds"], inputs["negative_prompt_embeds"])


def test_tiny_cogvideox_pipeline_denoises_to_latents():
    pipe = bm.build_pipeline("tiny-cogvideox")
    inputs = bm.random_prompt_inputs("tiny-cogvideox", 1, "cpu", torch.float32, torch.Generator().manual_seed(0))
    spec = bm.get_builtin("tiny-cogvideox")
    out = pipe(**inputs, height=spec.height, width=spec.width, num_frames=spec.num_frames, num_inference_steps=2,
               guidance_scale=spec.guidance_scale, output_type="latent").frames
    # 9 frames -> 3 latent frames, frames before channels, 8x spatial compression.
    assert out.shape == (1, 3, 16, spec.height // 8, spec.width // 8) and torch.isfinite(out).all()


def test_wan_configs_differ_only_in_width_and_depth():
    small, large = bm.WAN21_T2V_1_3B_TRANSFORMER, bm.WAN21_T2V_14B_TRANSFORMER
    assert {k for k in small if small[k] != large[k]} == {"num_attention_heads", "ffn_dim", "num_layers"}
    assert (large["num_attention_heads"], large["ffn_dim"], large["num_layers"]) == (40, 13824, 40)
    assert (small["num_attention_heads"], small["ffn_dim"], small["num_layers"]) == (12, 8960, 30)


def test_16bit_build_keeps_diffusers_fp32_modules_in_fp32_like_from_pretrained():
    model = bm.build_transformer("tiny", dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["scale_shift_table"] == torch.float32
    assert dtypes["blocks.0.norm2.weight"] == torch.float32  # "norm2" is in _keep_in_fp32_modules
    assert any("time_embedder" in n and d == torch.float32 for n, d in dtypes.items())


def test_builds_are_seeded_and_leave_the_global_generator_alone():
    state = torch.get_rng_state()
    a = bm.build_transformer("tiny", seed=3)
    b = bm.build_transformer("tiny", seed=3)
    c = bm.build_transformer("tiny", seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    wa, wb, wc = (m.blocks[0].attn1.to_q.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_unknown_names_and_dtypes_are_refused_with_the_choices():
    with pytest.raises(KeyError, match="wan2.1-t2v-1.3b"):
        bm.build_transformer("wan-9000")
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        bm.build_transformer("tiny", dtype=torch.float64)


def test_tokenizer_is_byte_level_with_t5_conventions():
    tok = bm.build_tokenizer()
    prompt = "A cat surfing, 日本 🌊"
    enc = tok(prompt, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    ids, mask = enc.input_ids[0], enc.attention_mask[0]
    n = len(prompt.encode("utf-8"))
    assert int(mask.sum()) == n + 1  # one token per byte, then </s>
    assert ids[n] == tok.eos_token_id == 1 and (ids[n + 1:] == tok.pad_token_id).all() and tok.pad_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == prompt
    assert len(tok) == 259


def test_tiny_pipeline_is_a_real_wan_pipeline_with_consistent_parts():
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5EncoderModel

    pipe = bm.build_pipeline("tiny")
    assert isinstance(pipe, WanPipeline) and isinstance(pipe.vae, AutoencoderKLWan)
    assert isinstance(pipe.text_encoder, UMT5EncoderModel)
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler) and pipe.scheduler.config.flow_shift == 3.0
    assert pipe.text_encoder.config.d_model == pipe.transformer.config.text_dim
    assert (pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial) == (4, 8)  # Wan's real compression
    assert pipe.vae.dtype == torch.float32
    frames = pipe("a test", height=32, width=48, num_frames=5, num_inference_steps=1, output_type="np",
                  generator=torch.Generator().manual_seed(0)).frames[0]
    assert frames.shape == (5, 32, 48, 3) and 0.0 <= frames.min() and frames.max() <= 1.0


def test_hunyuanvideo_prompt_inputs_have_real_shapes_and_a_padding_mask():
    inputs = bm.random_prompt_inputs("hunyuanvideo", 2, "cpu", torch.bfloat16, torch.Generator().manual_seed(0))
    assert inputs["prompt_embeds"].shape == (2, 256, 4096) and inputs["prompt_embeds"].dtype == torch.bfloat16
    assert inputs["pooled_prompt_embeds"].shape == (2, 768)
    assert inputs["prompt_attention_mask"].sum(dim=1).tolist() == [bm.HUNYUAN_PROMPT_TOKENS] * 2
    with pytest.raises(ValueError, match="has a text encoder"):
        bm.random_prompt_inputs("tiny", 1, "cpu", torch.float32)


def test_every_builtin_says_it_has_random_weights():
    for name in bm.BUILTIN_MODELS:
        note = bm.RANDOM_WEIGHTS_NOTE.format(name=name)
        assert name in note and "RANDOM weights" in note and "noise-like" in note
