"""Tiny random-weight video transformers, built from config (no downloads), and helpers.

Each builder returns ``(model, inputs)``: the model in eval mode and keyword inputs for its
forward with a batch of two (as batched classifier-free guidance runs it).
"""

from __future__ import annotations

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import routing
from fp8_on_cpu import lift_fp8_hardware_checks


def _seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def build_wan(image=False, layers=2):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers, rope_max_seq_len=32,
        image_dim=24 if image else None, added_kv_proj_dim=64 if image else None,
    ).eval()
    g = _seeded()
    # WanAttnProcessor splits image tokens off the front of the text sequence, assuming 512 text tokens.
    text_len = 512 if image else 20
    inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 16, 16, generator=g),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, text_len, 32, generator=g),
    )
    if image:
        inputs["encoder_hidden_states_image"] = torch.randn(2, 9, 24, generator=g)
    return model, inputs


def build_hunyuan_video(layers=1, single_layers=1):
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=layers,
        num_single_layers=single_layers, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(8, 12, 12), guidance_embeds=True,
    ).eval()
    g = _seeded()
    text_mask = torch.zeros(2, 24, dtype=torch.int64)
    text_mask[0, :24] = 1  # a full prompt next to a short one: the padded text keys must be masked out
    text_mask[1, :7] = 1
    inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 16, 16, generator=g),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 24, 32, generator=g),
        encoder_attention_mask=text_mask,
        pooled_projections=torch.randn(2, 16, generator=g),
        guidance=torch.tensor([6000.0, 6000.0]),
    )
    return model, inputs


def build_cogvideox(layers=2):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=32, num_layers=layers, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16, use_rotary_positional_embeddings=True,
    ).eval()
    g = _seeded()
    height = width = 16
    inputs = dict(
        hidden_states=torch.randn(2, 3, 4, height, width, generator=g),
        encoder_hidden_states=torch.randn(2, 16, 32, generator=g),
        timestep=torch.tensor([500, 500]),
        image_rotary_emb=_cogvideox_rope(model, frames=3, height=height, width=width),
    )
    return model, inputs


def _cogvideox_rope(model, frames, height, width):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    grid_h, grid_w = height // model.config.patch_size, width // model.config.patch_size
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=model.config.attention_head_dim, crops_coords=((0, 0), (grid_h, grid_w)),
        grid_size=(grid_h, grid_w), temporal_size=frames, device=torch.device("cpu"))
    return cos, sin


def build_ltx_video(layers=2):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=32,
        cross_attention_dim=64, num_layers=layers, caption_channels=32,
    ).eval()
    g = _seeded()
    frames, height, width = 3, 8, 8
    text_mask = torch.ones(2, 16, dtype=torch.int64)
    text_mask[1, 10:] = 0
    inputs = dict(
        hidden_states=torch.randn(2, frames * height * width, 8, generator=g),
        encoder_hidden_states=torch.randn(2, 16, 32, generator=g),
        timestep=torch.tensor([500, 500]),
        encoder_attention_mask=text_mask,
        num_frames=frames, height=height, width=width,
    )
    return model, inputs


def build_mochi(layers=2):
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(0)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=32, num_layers=layers, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=32, time_embed_dim=4,
    ).eval()
    g = _seeded()
    text_mask = torch.ones(2, 12, dtype=torch.int64)
    text_mask[1, 5:] = 0
    inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 12, 32, generator=g),
        timestep=torch.tensor([500, 500]),
        encoder_attention_mask=text_mask,
    )
    return model, inputs


def build_wan_vace(layers=2):
    """Wan VACE: one control block (vace_layers=[0]) before the main blocks."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=layers, rope_max_seq_len=32, vace_layers=[0],
        vace_in_channels=8,
    ).eval()
    g = _seeded()
    inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 16, 16, generator=g),
        timestep=torch.tensor([500, 500]),
        encoder_hidden_states=torch.randn(2, 20, 32, generator=g),
        control_hidden_states=torch.randn(2, 8, 3, 16, 16, generator=g),
    )
    return model, inputs


BUILDERS = {
    "wan_t2v": build_wan,
    "wan_i2v": lambda: build_wan(image=True),
    "wan_vace": build_wan_vace,
    "hunyuan_video": build_hunyuan_video,
    "cogvideox": build_cogvideox,
    "ltx_video": build_ltx_video,
    "mochi": build_mochi,
}


def make_peaky(model, factor=2.5):
    """Scale the q/k norm weights (or, without them, the q/k projections) so that scores are peaky.

    Random weights give scores of standard deviation about 1, where any attention looks right;
    scaling q and k by `factor` scales the scores by factor**2.
    """
    from fsattn_diffusers.families import attention_modules

    with torch.no_grad():
        for _, module in attention_modules(model):
            for q_name, k_name in (("norm_q", "norm_k"), ("norm_added_q", "norm_added_k")):
                for name in (q_name, k_name):
                    norm = getattr(module, name, None)
                    if getattr(norm, "weight", None) is not None:
                        norm.weight.mul_(factor)
                    elif name in ("norm_q", "norm_k"):
                        getattr(module, "to_" + name[-1]).weight.mul_(factor)
    return model


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    return out


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.fixture(autouse=True)
def fresh_counters():
    """Every test starts with zero counters and will see its one-time log lines."""
    fsattn_diffusers.reset_stats()
    routing.reset_logged()
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after the test (graphs, breaks, recompiles)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao's float8 linear layers and the recipe's FP8 path on the CPU, for tests that quantize
    and never multiply (tests/fp8_on_cpu.py)."""
    lift_fp8_hardware_checks(monkeypatch)


@pytest.fixture
def fp8_gemms_on_cpu(monkeypatch):
    """As ``fp8_on_cpu``, for tests that run the float8 GEMMs: they skip where torch's CPU
    ``_scaled_mm`` cannot stand in for them."""
    lift_fp8_hardware_checks(monkeypatch, runs_gemms=True)


def emulation_calls():
    return fsattn_diffusers.stats()["calls"].get("emulation", 0)


def build_wan_pipeline(second_transformer=False):
    """A tiny WanPipeline without text encoder (prompts come as embeddings); Wan 2.2 with two transformers."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    transformer, _ = build_wan()
    kwargs = {}
    if second_transformer:  # Wan 2.2: transformer for high noise, transformer_2 below the boundary
        kwargs = dict(transformer_2=build_wan()[0], boundary_ratio=0.5)
    return WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **kwargs)


def run_wan_pipeline(pipe, steps=4, guidance_scale=5.0):
    """Latents after `steps` steps; guidance_scale > 1 runs the transformer twice per step (CFG)."""
    g = torch.Generator().manual_seed(0)
    device = pipe._execution_device  # the pipeline leaves prompt embeddings where they are given
    prompt, negative = (torch.randn(1, 20, 32, generator=g).to(device) for _ in range(2))
    extra = {"guidance_scale_2": guidance_scale} if pipe.config.boundary_ratio is not None else {}
    return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, height=16, width=16, num_frames=5,
                num_inference_steps=steps, guidance_scale=guidance_scale, output_type="latent",
                generator=torch.Generator().manual_seed(1), **extra).frames


def build_mochi_pipeline():
    """A tiny MochiPipeline whose VAE has diffusers Attention modules of its own."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline

    vae = AutoencoderKLMochi(latent_channels=4, out_channels=3, encoder_block_out_channels=(32,) * 4,
                             decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5).eval()
    return MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                         transformer=build_mochi()[0])
