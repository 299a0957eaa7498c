"""Built-in model architectures, constructed in code with random weights: nothing is downloaded.

Seven names are built in (:data:`BUILTIN_MODELS`):

``tiny``
    A whole :class:`~diffusers.WanPipeline` from the real classes (``WanTransformer3DModel``,
    ``AutoencoderKLWan``, a transformers ``UMT5EncoderModel``, Wan's ``UniPCMultistepScheduler``)
    at tiny sizes, with a byte-level tokenizer built in code. It makes a few frames on a CPU in
    seconds: the examples' and tests' default.
``wan2.1-t2v-1.3b``, ``wan2.1-t2v-14b``
    The real Wan 2.1 text-to-video transformer architectures (the published ``config.json`` of
    ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` and ``-14B-Diffusers``) in a WanPipeline whose text
    encoder and VAE are tiny: the prompt still goes through a tokenizer and a UMT5 encoder (of the
    real width, 4096, and the real 512 text tokens, so cross-attention has its real shape), and the
    VAE has Wan's real compression (4x in time, 8x in space), so every attention call and every
    latent has the shape of a real run and decoding costs little.
``hunyuanvideo`` (and ``tiny-hunyuanvideo``, the same at tiny sizes, to try its code path on a CPU)
    The real HunyuanVideo transformer (``hunyuanvideo-community/HunyuanVideo``) in a
    :class:`~diffusers.HunyuanVideoPipeline` with no text encoders and no VAE: the examples feed
    it random prompt embeddings (with a key-padding mask, as real prompts have) and stop at the
    latents (``output_type="latent"``). It is there for timing.
``cogvideox-5b`` (and ``tiny-cogvideox``)
    The real CogVideoX-5B transformer (``THUDM/CogVideoX-5b``: 48 heads of 64, joint attention over
    226 text tokens and the video's) in a :class:`~diffusers.CogVideoXPipeline` with no text
    encoder and no VAE, fed random T5-shaped prompt embeddings, stopping at the latents: the
    head-dim-64 family, for timing.

All of them have random weights, so what they make is noise-like by construction: they measure
speed and the difference fsattn makes, never picture quality (:data:`RANDOM_WEIGHTS_NOTE`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

RANDOM_WEIGHTS_NOTE = (
    "built-in model {name!r} has RANDOM weights: its video is noise-like by construction (not a fault "
    "of fsattn). It measures speed and the A/B difference between attention backends, not picture quality."
)

# transformer/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (the same values as diffusers'
# scripts/convert_wan_to_diffusers.py, "Wan-T2V-1.3B").
WAN21_T2V_1_3B_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}
# transformer/config.json of Wan-AI/Wan2.1-T2V-14B-Diffusers: wider (40 heads of 128), deeper (40).
WAN21_T2V_14B_TRANSFORMER = {
    **WAN21_T2V_1_3B_TRANSFORMER,
    "num_attention_heads": 40,
    "ffn_dim": 13824,
    "num_layers": 40,
}
# transformer/config.json of hunyuanvideo-community/HunyuanVideo (diffusers'
# scripts/convert_hunyuan_video_to_diffusers.py, "HYVideo-T/2-cfgdistill").
HUNYUANVIDEO_TRANSFORMER = {
    "in_channels": 16,
    "out_channels": 16,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "num_layers": 20,
    "num_single_layers": 40,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 2,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "guidance_embeds": True,
    "text_embed_dim": 4096,
    "pooled_projection_dim": 768,
    "rope_theta": 256.0,
    "rope_axes_dim": [16, 56, 56],
}
# scheduler/scheduler_config.json of the Wan 2.1 T2V Diffusers repos (flow_shift 3.0 is the
# 480p setting; diffusers' WanPipeline docs suggest 5.0 at 720p).
WAN_SCHEDULER = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}
# scheduler/scheduler_config.json of hunyuanvideo-community/HunyuanVideo.
HUNYUANVIDEO_SCHEDULER = {"num_train_timesteps": 1000, "shift": 7.0}

# transformer/config.json of THUDM/CogVideoX-5b (CogVideoX 1.0: no temporal patching, rotary
# position embeddings, 49 frames at 480x720).
COGVIDEOX_5B_TRANSFORMER = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "dropout": 0.0,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 16,
    "max_text_seq_length": 226,
    "norm_elementwise_affine": True,
    "norm_eps": 1e-5,
    "num_attention_heads": 48,
    "num_layers": 42,
    "out_channels": 16,
    "patch_size": 2,
    "sample_frames": 49,
    "sample_height": 60,
    "sample_width": 90,
    "spatial_interpolation_scale": 1.875,
    "temporal_compression_ratio": 4,
    "temporal_interpolation_scale": 1.0,
    "text_embed_dim": 4096,
    "time_embed_dim": 512,
    "timestep_activation_fn": "silu",
    "use_rotary_positional_embeddings": True,
}
# scheduler/scheduler_config.json of THUDM/CogVideoX-5b (CogVideoXDDIMScheduler).
COGVIDEOX_SCHEDULER = {
    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
    "num_train_timesteps": 1000, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True,
    "set_alpha_to_one": True, "snr_shift_scale": 1.0, "steps_offset": 0, "timestep_spacing": "trailing",
}

# The tiny Wan: two blocks of two 64-wide heads (head dim 64 is one of fsattn's tuned sizes).
TINY_TRANSFORMER = {
    **WAN21_T2V_1_3B_TRANSFORMER,
    "num_attention_heads": 2,
    "attention_head_dim": 64,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 256,
    "num_layers": 2,
    "rope_max_seq_len": 64,
}
# The tiny HunyuanVideo: one block of each kind (refiner, dual-stream, single-stream), 64-wide heads.
TINY_HUNYUANVIDEO_TRANSFORMER = {
    **HUNYUANVIDEO_TRANSFORMER,
    "num_attention_heads": 2,
    "attention_head_dim": 64,
    "num_layers": 1,
    "num_single_layers": 1,
    "num_refiner_layers": 1,
    "text_embed_dim": 32,
    "pooled_projection_dim": 16,
    "rope_axes_dim": [16, 24, 24],  # sums to the head dim
}
# The tiny CogVideoX: two blocks of two 64-wide heads, a 16-token text, 128x128 pixels (its
# sample size: 8x VAE compression, then the 2x2 patch).
TINY_COGVIDEOX_TRANSFORMER = {
    **COGVIDEOX_5B_TRANSFORMER,
    "num_attention_heads": 2,
    "num_layers": 2,
    "text_embed_dim": 32,
    "time_embed_dim": 32,
    "max_text_seq_length": 16,
    "sample_frames": 9,
    "sample_height": 16,
    "sample_width": 16,
}
# Wan's VAE with its real latent layout (16 channels, 4x temporal and 8x spatial compression:
# three downsamplings, the last two also in time) and very few channels.
TINY_VAE = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 1, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
}
TINY_TEXT_ENCODER = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}
# For the real-size Wan architectures: the encoder must output the transformer's text width
# (4096); one narrow layer keeps it a few million parameters.
WIDE_TEXT_ENCODER = {"d_model": 4096, "d_kv": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2}
# Share of real prompt tokens (the rest is padding) in the random HunyuanVideo prompt embeddings.
HUNYUAN_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class BuiltinModel:
    """One built-in architecture and the generation defaults that suit it."""

    name: str
    family: str  # "wan", "hunyuanvideo" or "cogvideox"
    description: str
    transformer_config: dict = field(repr=False)
    height: int
    width: int
    num_frames: int
    steps: int
    guidance_scale: float
    has_text_encoder: bool  # False: callers pass prompt embeddings (random_prompt_inputs)
    has_vae: bool  # False: the pipeline stops at latents
    fps: int = 16


BUILTIN_MODELS = {
    m.name: m
    for m in (
        BuiltinModel("tiny", "wan", "tiny random-weight Wan 2.1 pipeline (CPU-sized)", TINY_TRANSFORMER,
                     height=256, width=256, num_frames=17, steps=8, guidance_scale=5.0,
                     has_text_encoder=True, has_vae=True),
        BuiltinModel("wan2.1-t2v-1.3b", "wan", "Wan2.1-T2V-1.3B transformer architecture, random weights",
                     WAN21_T2V_1_3B_TRANSFORMER, height=480, width=832, num_frames=81, steps=50,
                     guidance_scale=5.0, has_text_encoder=True, has_vae=True),
        BuiltinModel("wan2.1-t2v-14b", "wan", "Wan2.1-T2V-14B transformer architecture, random weights",
                     WAN21_T2V_14B_TRANSFORMER, height=720, width=1280, num_frames=81, steps=50,
                     guidance_scale=5.0, has_text_encoder=True, has_vae=True),
        BuiltinModel("tiny-hunyuanvideo", "hunyuanvideo", "tiny random-weight HunyuanVideo transformer (CPU-sized)",
                     TINY_HUNYUANVIDEO_TRANSFORMER, height=128, width=128, num_frames=9, steps=4,
                     guidance_scale=6.0, has_text_encoder=False, has_vae=False, fps=24),
        BuiltinModel("hunyuanvideo", "hunyuanvideo", "HunyuanVideo transformer architecture, random weights",
                     HUNYUANVIDEO_TRANSFORMER, height=720, width=1280, num_frames=129, steps=50,
                     guidance_scale=6.0, has_text_encoder=False, has_vae=False, fps=24),
        BuiltinModel("tiny-cogvideox", "cogvideox", "tiny random-weight CogVideoX transformer (CPU-sized)",
                     TINY_COGVIDEOX_TRANSFORMER, height=128, width=128, num_frames=9, steps=4, guidance_scale=6.0,
                     has_text_encoder=False, has_vae=False, fps=8),
        BuiltinModel("cogvideox-5b", "cogvideox", "CogVideoX-5B transformer architecture, random weights",
                     COGVIDEOX_5B_TRANSFORMER, height=480, width=720, num_frames=49, steps=50, guidance_scale=6.0,
                     has_text_encoder=False, has_vae=False, fps=8),
    )
}


def get_builtin(name: str) -> BuiltinModel:
    """The :class:`BuiltinModel` called ``name``; raises ``KeyError`` naming the choices."""
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise KeyError(f"model={name!r} is not a built-in; built-ins are {sorted(BUILTIN_MODELS)}") from None


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def build_tokenizer(model_max_length: int = 512):
    """A byte-level tokenizer built in code (no vocabulary file): every UTF-8 byte is one token.

    It follows T5's conventions (``<pad>`` = 0, ``</s>`` = 1 appended to every sequence), so it
    drops into WanPipeline where Wan's UMT5 tokenizer goes. Vocabulary: 3 specials + 256 bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=model_max_length)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _construct(cls, config: dict, device, dtype: torch.dtype):
    """``cls(**config)`` built directly on ``device`` in ``dtype``.

    Parameters are created in ``dtype`` where they are born (default-dtype context): building a
    14B model in float32 first and casting would take 56 GB and minutes of CPU initialisation.
    The modules diffusers keeps in float32 when loading a checkpoint in 16 bits
    (``_keep_in_fp32_modules``) are put back in float32, so time and numerics match a real load.
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype} is not supported; expected torch.float32, torch.float16 or torch.bfloat16")
    with torch.device(device), _default_dtype(dtype):
        model = cls(**config)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    if dtype != torch.float32 and keep:
        for name, param in model.named_parameters():
            if any(part in keep for part in name.split(".")):
                param.data = param.data.float()
    return model.eval().requires_grad_(False)


def _seeded(device, seed: int):
    """Seed weight initialisation without touching the caller's global random state."""
    device = torch.device(device)
    devices = [device] if device.type == "cuda" else []
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"))
    torch.manual_seed(seed)
    return stack


def build_transformer(name: str, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """The transformer of built-in ``name`` with random weights, built on ``device`` in ``dtype``.

    ``device="meta"`` builds it without memory (for counting parameters or checking shapes).
    """
    spec = get_builtin(name)
    if spec.family == "wan":
        from diffusers import WanTransformer3DModel as cls
    elif spec.family == "cogvideox":
        from diffusers import CogVideoXTransformer3DModel as cls
    else:
        from diffusers import HunyuanVideoTransformer3DModel as cls
    if str(device) == "meta":
        return _construct(cls, spec.transformer_config, "meta", dtype)
    with _seeded(device, seed):
        return _construct(cls, spec.transformer_config, device, dtype)


def build_pipeline(name: str, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """The pipeline of built-in ``name`` (module docstring), with random weights, on ``device``.

    The transformer and text encoder are in ``dtype``; Wan's VAE stays float32, as Wan's own
    examples load it. Returns a ``WanPipeline``, a ``HunyuanVideoPipeline`` or a ``CogVideoXPipeline``.
    """
    spec = get_builtin(name)
    transformer = build_transformer(name, device, dtype, seed)
    if spec.family == "cogvideox":
        from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline

        return CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                                 scheduler=CogVideoXDDIMScheduler(**COGVIDEOX_SCHEDULER))
    if spec.family == "hunyuanvideo":
        from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

        return HunyuanVideoPipeline(
            text_encoder=None, tokenizer=None, transformer=transformer, vae=None,
            scheduler=FlowMatchEulerDiscreteScheduler(**HUNYUANVIDEO_SCHEDULER),
            text_encoder_2=None, tokenizer_2=None)

    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer()
    encoder_shape = TINY_TEXT_ENCODER if name == "tiny" else WIDE_TEXT_ENCODER
    if encoder_shape["d_model"] != spec.transformer_config["text_dim"]:
        raise AssertionError(f"text encoder width {encoder_shape['d_model']} != text_dim of {name!r}")
    text_config = UMT5Config(vocab_size=len(tokenizer), relative_attention_num_buckets=8,
                             relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                             pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **encoder_shape)
    with _seeded(device, seed + 1):
        text_encoder = _construct(UMT5EncoderModel, {"config": text_config}, device, dtype)
        vae = _construct(AutoencoderKLWan, TINY_VAE, device, torch.float32)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER), transformer=transformer)


def random_prompt_inputs(name: str, batch_size: int, device, dtype: torch.dtype, generator=None) -> dict:
    """Prompt embeddings for a built-in without text encoders (HunyuanVideo, CogVideoX), as call kwargs.

    Shapes are those of the real encoders. HunyuanVideo: Llama hidden states ``(B, 256, 4096)``
    with a mask that keeps the first :data:`HUNYUAN_PROMPT_TOKENS` tokens (a short prompt; the rest
    is padding, so the joint attention gets its real key-padding mask), and a CLIP pooled vector
    ``(B, 768)``. CogVideoX: T5 hidden states ``(B, 226, 4096)`` for the prompt and the negative
    prompt (its pipeline pads every prompt to that length, unmasked).
    """
    spec = get_builtin(name)
    if spec.has_text_encoder:
        raise ValueError(f"model={name!r} has a text encoder: pass a prompt instead of random embeddings")
    cfg = spec.transformer_config
    if spec.family == "cogvideox":
        shape = (batch_size, cfg["max_text_seq_length"], cfg["text_embed_dim"])
        embeds, negative = (torch.randn(shape, generator=generator, device=device) for _ in range(2))
        return {"prompt_embeds": embeds.to(dtype), "negative_prompt_embeds": negative.to(dtype)}
    seq = 256  # HunyuanVideoPipeline's max_sequence_length
    embeds = torch.randn(batch_size, seq, cfg["text_embed_dim"], generator=generator, device=device)
    pooled = torch.randn(batch_size, cfg["pooled_projection_dim"], generator=generator, device=device)
    mask = torch.zeros(batch_size, seq, dtype=torch.int64, device=device)
    mask[:, :HUNYUAN_PROMPT_TOKENS] = 1
    return {"prompt_embeds": embeds.to(dtype), "pooled_prompt_embeds": pooled.to(dtype),
            "prompt_attention_mask": mask}


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
