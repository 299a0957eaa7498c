#!/usr/bin/env python
"""End to end: the speed recipe's rows on a real video-DiT architecture (random weights), in one process.

    python benchmarks/bench_e2e.py --model wan2.1-t2v-1.3b --steps 3 --out e2e_13b.json     # 480x832, 81 frames
    python benchmarks/bench_e2e.py --model wan2.1-t2v-14b --steps 2 --out e2e_14b.json      # 720x1280, 81 frames
    python benchmarks/bench_e2e.py --model hunyuanvideo --steps 2 --out e2e_hunyuan.json    # 720x1280, 129 frames
    python benchmarks/bench_e2e.py --model cogvideox-5b --steps 2 --out e2e_cogvideox.json   # 480x720, 49 frames
    python benchmarks/bench_e2e.py --model wan2.1-t2v-14b --rows recipe --first-call-only --cache-dir /tmp/cc
    python benchmarks/bench_e2e.py --model tiny --height 64 --width 96 --frames 9          # CPU, seconds

Rows (``--rows``, comma-separated; each an attention, then parts joined by ``+``):

=========================== ==============================================================
``default``                 the model as diffusers builds it (attention: ``--baseline-backend``)
``default+compile``         diffusers' regional compilation of the blocks
``default+fuse+fp8+ffn+rope+compile`` the recipe without fsattn: fused QKV, FP8 linear layers,
                            fused feed-forward, fused query/key norm and RoPE, compile
``fsattn``                  ``apply_fsattn``
``fsattn+compile``          fsattn, compiled
``recipe``                  ``fsattn+fuse+fp8+ffn+rope+compile``: ``fsattn_diffusers.apply_recipe``
                            as it defaults
=========================== ==============================================================

Any other combination of ``fuse``, ``fp8`` (or ``fp8c``), ``ffn``, ``rope`` and ``compile`` after
``default`` or ``fsattn`` works too (e.g. ``fsattn+fp8+ffn+rope+compile`` isolates the QKV fusion;
``fsattn+fuse+fp8+rope+compile`` the feed-forward's one-kernel GELU + FP8 scaling (``ffn``: apply_recipe's
``fuse_ffn``, needs ``fp8``); ``fsattn+fuse+fp8+ffn+compile`` Wan's one-pass query/key norm and RoPE
(``rope``: apply_recipe's ``fuse_norm_rope``; results files before 2026-12-03's v28 have no ``rope``
part, and their ``recipe`` row ran without it); ``fsattn+fuse+fp8c+ffn+rope+compile`` is the recipe with
``fp8_conditioning=True``: the cross-attention's K/V and output projections / the text stream
in FP8 as well).
One model build serves every row. FP8 replaces the weights, so rows run in the order given except
that ``default`` goes first, then the bf16 rows, the ``fp8`` rows and the ``fp8c`` rows; FP8 rows
share the quantized weights (a later ``fp8`` row quantizes nothing more, an ``fp8c`` row only the
conditioning's layers).

Per row: one first call (a transformer forward on the first step's inputs, wall time: it carries
compilation, autotuning and Triton's JIT; ``torch._dynamo.reset()`` before it, so each row
compiles from scratch, unless ``--cache-dir`` holds a previous process's artefacts), then a short
denoising loop of ``--steps`` steps as the family's pipeline runs it (Wan: UniPC with its flow
shift, classifier-free guidance as two forwards per step; HunyuanVideo: flow-matching Euler,
embedded guidance, one forward per step; CogVideoX: DDIM, classifier-free guidance as one forward of
a batch of two), each forward and step timed with CUDA events. Peak
memory is ``max_memory_allocated`` over the loop (weights included). Quality against the
reference row (``default``, run first whenever it is asked for; else the first row): cosine of
the first call's output, cosine and relative L1 of the final latents, and where a VAE is built
(``tiny``, ``wan2.1-t2v-1.3b``) the decoded video's per-frame PSNR / SSIM. Random weights:
nothing here is picture quality, only the difference a row makes. No text encoder (random
prompt embeddings of the real shapes).

The JSON is written after every row (a time box that ends the process keeps the rows done), with
the GPU and the torch / Triton / diffusers / torchao versions. ``--budget-s`` skips rows that the
times measured so far say would not finish in time.

Compilation cost: ``--first-call-only`` builds, applies each row and times its first call only.
``--cache-dir DIR`` points inductor's caches (FX graph, AOTAutograd) and Triton's at ``DIR``, so a
second process with the same ``DIR`` reuses the first one's artefacts; the JSON records the cache
hits. ``--cache-artifacts FILE`` does the same through ``torch.compiler.save_cache_artifacts`` /
``load_cache_artifacts`` (loaded at the start if the file exists, saved at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time

import torch

import fsattn_diffusers
from fsattn_diffusers import builtin_models, metrics

MODELS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "hunyuanvideo", "cogvideox-5b", "tiny", "tiny-hunyuanvideo",
          "tiny-cogvideox")
DEFAULT_ROWS = ("default", "default+compile", "default+fuse+fp8+ffn+rope+compile", "fsattn", "fsattn+compile",
                "recipe")
ALIASES = {"recipe": "fsattn+fuse+fp8+ffn+rope+compile"}
# fp8c: fp8 with the conditioning's path (apply_recipe's fp8_conditioning); ffn: apply_recipe's fuse_ffn;
# rope: apply_recipe's fuse_norm_rope
PARTS = ("fuse", "fp8", "fp8c", "ffn", "rope", "compile")
TEXT_TOKENS = 512  # WanPipeline's max_sequence_length: prompt embeddings are always padded to it
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Outermost profiler ops that are one attention call (see attention_share).
ATTENTION_OP = re.compile(r"^(fsattn::attention|aten::_?(scaled_dot_product\w*|flash_attention\w*|"
                          r"efficient_attention\w*|_flash_attention\w*|_efficient_attention\w*|_cudnn_attention\w*))$")
# By device kernel name: fsattn's Triton kernels, and the SDPA kernels of flash, the
# memory-efficient path (fmha) and cuDNN (its fused kernels carry "sdpa" or "flash" in the name).
ATTENTION_KERNEL = re.compile(r"_fsattn_|_quantize_(q|kv)_kernel|flash|fmha|sdpa|attention", re.IGNORECASE)

TOP_KERNELS = 20  # kernels listed by device time in a profiled row

CPU_TIMING_NOTE = ("CPU run: fsattn runs a PyTorch emulation of the GPU kernel's numerics here, so these times say "
                   "nothing about GPU speed; the fidelity figures do stand for the GPU kernel.")


# ----------------------------------------------------------------------------- rows and arguments

@dataclasses.dataclass(frozen=True)
class Row:
    name: str  # as given (an alias stays an alias)
    fsattn: bool
    fuse: bool = False
    fp8: bool = False
    fp8_conditioning: bool = False
    ffn: bool = False
    rope: bool = False
    compile: bool = False

    @property
    def recipe(self) -> bool:
        """Whether the row goes through apply_recipe (any part besides the attention)."""
        return self.fuse or self.fp8 or self.rope or self.compile


def parse_row(text: str) -> Row:
    tokens = ALIASES.get(text, text).split("+")
    bad = [t for t in tokens[1:] if t not in PARTS] + ([] if tokens[0] in ("default", "fsattn") else [tokens[0]])
    parts = tokens[1:]
    fp8 = "fp8" in parts or "fp8c" in parts
    if bad or len(set(tokens)) != len(tokens) or {"fp8", "fp8c"} <= set(tokens) or ("ffn" in parts and not fp8):
        raise argparse.ArgumentTypeError(
            f"row {text!r}: expected 'default' or 'fsattn', then parts from {', '.join(PARTS)} (fp8 or fp8c, not "
            f"both; ffn only with one of them) joined by '+' (e.g. fsattn+fp8+compile), or an alias "
            f"({', '.join(ALIASES)})")
    return Row(text, tokens[0] == "fsattn", fuse="fuse" in parts, fp8=fp8, fp8_conditioning="fp8c" in parts,
               ffn="ffn" in parts, rope="rope" in parts, compile="compile" in parts)


def _rows(text: str) -> tuple[Row, ...]:
    rows = tuple(parse_row(t.strip()) for t in text.split(",") if t.strip())
    names = [(r.fsattn, r.fuse, r.fp8, r.fp8_conditioning, r.ffn, r.rope, r.compile) for r in rows]
    if not rows or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--rows={text!r}: expected a comma-separated list of distinct rows")
    # FP8 replaces the weights: every bf16 row first, in the order given, then the FP8 rows, those
    # with the conditioning's layers last; the reference row (the first plain "default") before them all.
    ordered = ([r for r in rows if not r.fp8] + [r for r in rows if r.fp8 and not r.fp8_conditioning]
               + [r for r in rows if r.fp8_conditioning])
    plain = [r for r in ordered if not r.fsattn and not r.recipe]
    if plain:
        ordered.remove(plain[0])
        ordered.insert(0, plain[0])
    return tuple(ordered)


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = _nonnegative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="wan2.1-t2v-1.3b",
                        help="built-in architecture, random weights (default wan2.1-t2v-1.3b; tiny* are CPU-sized)")
    parser.add_argument("--height", type=_positive_int, default=None, help="default: the model's")
    parser.add_argument("--width", type=_positive_int, default=None, help="default: the model's")
    parser.add_argument("--frames", type=_positive_int, default=None, help="video frames, 4k+1; default: the model's")
    parser.add_argument("--rows", type=_rows, default=None,
                        help=f"rows to run (default {','.join(DEFAULT_ROWS)}, without the FP8 ones where FP8 cannot "
                             "run); default first, FP8 rows last")
    parser.add_argument("--steps", type=_positive_int, default=2, help="denoising steps timed per row (default 2)")
    parser.add_argument("--first-call-only", action="store_true",
                        help="per row, only the first call (compilation cost): no loop, no quality")
    parser.add_argument("--baseline-backend", default=None,
                        help="diffusers attention backend of the default rows (e.g. native, flash, _native_cudnn, "
                             "sage); default: diffusers' active backend")
    parser.add_argument("--fsattn-config", default=None, help="FSAttnConfig fields as JSON for the fsattn rows")
    parser.add_argument("--dynamic", choices=("auto", "true", "false"), default="auto",
                        help="torch.compile's dynamic for compiled rows (auto: torch's default)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (tests use eager)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--inductor-options", default=None,
                        help="torch.compile options= for the compiled rows, as JSON, e.g. "
                             "'{\"coordinate_descent_tuning\": true}' (per compile, unlike the flag below)")
    parser.add_argument("--coordinate-descent-tuning", action="store_true",
                        help="turn on inductor's coordinate-descent tuning, as torchao's set_inductor_config does "
                             "(the recipe leaves it off): measures what it costs and gains")
    parser.add_argument("--cache-dir", default=None,
                        help="TORCHINDUCTOR_CACHE_DIR=DIR/inductor and TRITON_CACHE_DIR=DIR/triton: a second process "
                             "with the same DIR reuses the compiled artefacts")
    parser.add_argument("--cache-artifacts", default=None,
                        help="file for torch.compiler.save_cache_artifacts (loaded at the start when it exists)")
    parser.add_argument("--decode", action=argparse.BooleanOptionalAction, default=None,
                        help="decode the final latents with the built-in tiny VAE and compare videos per frame "
                             "(default: on for tiny and wan2.1-t2v-1.3b)")
    parser.add_argument("--profile", action="store_true",
                        help="one extra forward per row under torch.profiler: the attention share")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip rows that the times measured so far say would end past this many seconds")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's; Wan <= 1: no CFG")
    parser.add_argument("--seed", type=int, default=0, help="weights, noise and prompt embeddings (default 0)")
    parser.add_argument("--device", default="auto", help="auto (default): cuda when available, else cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--out", default=None, help="write the results as JSON here (after every row)")
    return parser


@dataclasses.dataclass
class Settings:
    model: str
    family: str
    height: int
    width: int
    frames: int
    latent_shape: tuple[int, ...]
    video_tokens: int
    rows: list[str]
    steps: int
    first_call_only: bool
    guidance_scale: float
    baseline_backend: str | None
    fsattn_config: dict | None
    dynamic: bool | None
    compile_backend: str
    compile_mode: str | None
    inductor_options: dict | None
    coordinate_descent_tuning: bool
    cache_dir: str | None
    decode: bool
    profile: bool
    budget_s: float | None
    seed: int
    device: str
    dtype: str


def resolve_settings(parser, args) -> tuple[Settings, list[Row], torch.device, torch.dtype]:
    """Checked settings with the model's defaults; argument errors go through ``parser.error``."""
    spec = builtin_models.get_builtin(args.model)
    height, width, frames = args.height or spec.height, args.width or spec.width, args.frames or spec.num_frames
    cfg = spec.transformer_config
    patch_hw = cfg["patch_size"][1] if spec.family == "wan" else cfg["patch_size"]
    patch_t = cfg["patch_size"][0] if spec.family == "wan" else cfg.get("patch_size_t") or 1
    multiple = 8 * patch_hw  # the VAE's 8x spatial compression, then the patch
    for name, value in (("--height", height), ("--width", width)):
        if value % multiple:
            parser.error(f"{name}={value}: expected a multiple of {multiple} (8x VAE compression x {patch_hw}x"
                         f"{patch_hw} patch), e.g. {max(multiple, value // multiple * multiple)}")
    if frames % 4 != 1:
        parser.error(f"--frames={frames}: expected 4k+1 frames (the VAE packs 4 frames per latent), e.g. "
                     f"{frames // 4 * 4 + 1}")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device={args.device!r} is not a torch device; expected auto, cpu or cuda")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device={args.device!r}: expected auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device={args.device!r} but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    from fsattn_diffusers import recipe

    fp8_refusal = recipe.fp8_unavailable_reason(device) or (
        None if dtype == torch.bfloat16 else "torchao's per-row float8 takes bfloat16 weights: use --dtype bf16")
    rows = list(args.rows or _rows(",".join(DEFAULT_ROWS)))
    fp8_rows = [r.name for r in rows if r.fp8]
    if fp8_rows and fp8_refusal is not None:
        if args.rows is not None:
            parser.error(f"rows {fp8_rows} need FP8 linear layers, which cannot run here: {fp8_refusal}; choose "
                         "--rows without fp8")
        rows = [r for r in rows if not r.fp8]
        print(f"note: the default rows {fp8_rows} are left out: {fp8_refusal}", file=sys.stderr)
    fsattn_config = None
    if args.fsattn_config:
        try:
            fsattn_config = json.loads(args.fsattn_config)
            fsattn_diffusers.FSAttnConfig(**fsattn_config)
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            parser.error(f"--fsattn-config={args.fsattn_config!r}: expected a JSON object of FSAttnConfig fields "
                         f"({exc})")
    inductor_options = None
    if args.inductor_options is not None:
        try:
            inductor_options = json.loads(args.inductor_options)
        except json.JSONDecodeError as exc:
            parser.error(f"--inductor-options={args.inductor_options!r}: expected a JSON object ({exc})")
        if not isinstance(inductor_options, dict):
            parser.error(f"--inductor-options={args.inductor_options!r}: expected a JSON object of inductor options")
        if args.compile_mode:
            parser.error(f"--inductor-options with --compile-mode={args.compile_mode!r}: torch.compile takes one of "
                         "mode and options, not both")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s}: expected a positive number of seconds")
    latent_frames = (frames - 1) // 4 + 1
    latent_shape = (1, cfg["in_channels"], latent_frames, height // 8, width // 8)
    if spec.family == "cogvideox":  # CogVideoX's latents put the frames before the channels
        latent_shape = (1, latent_frames, cfg["in_channels"], height // 8, width // 8)
    tokens = latent_frames // patch_t * (height // multiple) * (width // multiple)
    decode = args.decode if args.decode is not None else args.model in ("tiny", "wan2.1-t2v-1.3b")
    if decode and not spec.has_vae:
        parser.error(f"--decode: {args.model} is built without a VAE (its pipeline stops at the latents)")
    settings = Settings(
        model=args.model, family=spec.family, height=height, width=width, frames=frames, latent_shape=latent_shape,
        video_tokens=tokens, rows=[r.name for r in rows], steps=args.steps, first_call_only=args.first_call_only,
        guidance_scale=spec.guidance_scale if args.guidance_scale is None else args.guidance_scale,
        baseline_backend=args.baseline_backend, fsattn_config=fsattn_config,
        dynamic={"auto": None, "true": True, "false": False}[args.dynamic], compile_backend=args.compile_backend,
        compile_mode=args.compile_mode, inductor_options=inductor_options,
        coordinate_descent_tuning=args.coordinate_descent_tuning,
        cache_dir=args.cache_dir, decode=decode and not args.first_call_only, profile=args.profile,
        budget_s=args.budget_s, seed=args.seed, device=str(device), dtype=str(dtype).replace("torch.", ""))
    return settings, rows, device, dtype


# ----------------------------------------------------------------------------- the model and its loop

class Loop:
    """One family's denoising loop, as its diffusers pipeline runs it, on fixed noise and prompts."""

    def __init__(self, settings: Settings, transformer, device: torch.device, dtype: torch.dtype):
        self.settings, self.device, self.dtype = settings, device, dtype
        generator = torch.Generator("cpu").manual_seed(settings.seed)
        self.noise = torch.randn(settings.latent_shape, generator=generator, dtype=torch.float32).to(device)
        if settings.family == "cogvideox":  # CogVideoXPipeline draws its noise in the prompt's dtype
            self.noise = self.noise.to(dtype)
        if settings.family == "wan":
            text_dim = transformer.config.text_dim
            embeds = [torch.randn(1, TEXT_TOKENS, text_dim, generator=generator).to(device, dtype) for _ in range(2)]
            self.conditions = [{"encoder_hidden_states": embeds[0]}]
            if settings.guidance_scale > 1.0:  # WanPipeline.do_classifier_free_guidance: the uncond pass
                self.conditions.append({"encoder_hidden_states": embeds[1]})
        elif settings.family == "cogvideox":
            prompt = builtin_models.random_prompt_inputs(settings.model, 1, "cpu", dtype, generator)
            embeds = prompt["prompt_embeds"]
            if settings.guidance_scale > 1.0:  # CogVideoXPipeline batches the unconditional pass, first
                embeds = torch.cat([prompt["negative_prompt_embeds"], embeds])
            from diffusers import CogVideoXPipeline

            pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                                     scheduler=self.scheduler())
            rotary = pipe._prepare_rotary_positional_embeddings(settings.height, settings.width,
                                                                settings.latent_shape[1], device)
            self.conditions = [{"encoder_hidden_states": embeds.to(device), "image_rotary_emb": rotary}]
        else:
            prompt = builtin_models.random_prompt_inputs(settings.model, 1, "cpu", dtype, generator)
            guidance = torch.tensor([settings.guidance_scale * 1000.0], dtype=dtype, device=device)
            self.conditions = [{"encoder_hidden_states": prompt["prompt_embeds"].to(device),
                                "encoder_attention_mask": prompt["prompt_attention_mask"].to(device),
                                "pooled_projections": prompt["pooled_prompt_embeds"].to(device), "guidance": guidance}]

    def scheduler(self):
        import numpy as np
        from diffusers import CogVideoXDDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

        steps = self.settings.steps
        if self.settings.family == "cogvideox":
            scheduler = CogVideoXDDIMScheduler(**builtin_models.COGVIDEOX_SCHEDULER)
            scheduler.set_timesteps(steps, device=self.device)
        elif self.settings.family == "wan":
            # diffusers' WanPipeline docs: flow_shift 3.0 for 480p, 5.0 for 720p.
            shift = 5.0 if min(self.settings.height, self.settings.width) >= 720 else 3.0
            scheduler = UniPCMultistepScheduler(**{**builtin_models.WAN_SCHEDULER, "flow_shift": shift})
            scheduler.set_timesteps(steps, device=self.device)
        else:
            scheduler = FlowMatchEulerDiscreteScheduler(**builtin_models.HUNYUANVIDEO_SCHEDULER)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], device=self.device)
        if hasattr(scheduler, "set_begin_index"):  # DDIM steps by timestep value, with no index to set
            scheduler.set_begin_index(0)
        return scheduler

    @property
    def batched_guidance(self) -> bool:
        """Whether one forward carries both guidance passes (CogVideoX: a batch of two)."""
        return self.settings.family == "cogvideox" and self.settings.guidance_scale > 1.0

    def forward(self, transformer, latents, t, condition: int):
        if self.batched_guidance:
            latents = torch.cat([latents, latents])  # DDIM's scale_model_input is the identity
        timestep = t.expand(latents.shape[0])
        if self.settings.family == "hunyuanvideo":
            timestep = timestep.to(latents.dtype)  # as HunyuanVideoPipeline passes it
        return transformer(hidden_states=latents.to(self.dtype), timestep=timestep, **self.conditions[condition],
                           return_dict=False)[0]

    def step(self, transformer, scheduler, latents, index: int, forward_times: list):
        t = scheduler.timesteps[index]
        preds = []
        for condition in range(len(self.conditions)):
            with Timer(self.device) as timer:
                preds.append(self.forward(transformer, latents, t, condition))
            forward_times.append(timer)
        if self.batched_guidance:
            uncond, cond = preds[0].float().chunk(2)
            pred = uncond + self.settings.guidance_scale * (cond - uncond)
        elif self.settings.family == "cogvideox":
            pred = preds[0].float()  # as CogVideoXPipeline steps its scheduler
        else:
            pred = preds[0] if len(preds) == 1 else preds[1] + self.settings.guidance_scale * (preds[0] - preds[1])
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        # CogVideoXPipeline keeps its latents in the prompt's dtype between steps.
        return latents.to(self.dtype) if self.settings.family == "cogvideox" else latents


def build(settings: Settings, device: torch.device, dtype: torch.dtype):
    """The transformer, and the pipeline whose VAE decodes (None without --decode)."""
    if settings.decode:
        pipe = builtin_models.build_pipeline(settings.model, device, dtype, seed=settings.seed)
        return pipe.transformer, pipe
    return builtin_models.build_transformer(settings.model, device, dtype, seed=settings.seed), None


def decode(pipe, latents: torch.Tensor):
    """uint8 ``(F, H, W, 3)`` frames from final latents, as WanPipeline decodes them."""
    vae = pipe.vae
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, vae.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, vae.dtype)
    with torch.no_grad():
        video = vae.decode(latents.to(vae.dtype) / inv_std + mean, return_dict=False)[0]
    return metrics.to_uint8(pipe.video_processor.postprocess_video(video, output_type="np")[0])


class Timer:
    """Seconds of a region: CUDA events on a GPU (read after a sync), perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.wall_start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.end.record()
        self.wall_end = time.perf_counter()
        return False

    @property
    def seconds(self) -> float:
        if self.device.type == "cuda":
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.wall_end - self.wall_start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- attention share

def _outermost_attention_ops(events):
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CPU or not ATTENTION_OP.match(ev.name):
            continue
        parent = ev.cpu_parent
        while parent is not None and not ATTENTION_OP.match(parent.name):
            parent = parent.cpu_parent
        if parent is None:
            yield ev


def _kind(ev) -> str:
    shapes = ev.input_shapes or []
    if len(shapes) >= 2 and shapes[0] and shapes[1]:
        return "self" if list(shapes[0]) == list(shapes[1]) else "cross"
    return "unknown"


def attention_share(prof, device: torch.device, wall_seconds: float, steps: int) -> dict:
    """Attention time and share of profiled work.

    On a GPU: the device time of the attention kernels (by name, ``ATTENTION_KERNEL``) over the
    device time of every kernel; the outermost attention ops (``ATTENTION_OP``) tell self- from
    cross-attention by their input shapes, and their ``device_time_total`` is kept as a
    cross-check only (on torch 2.11 it overcounts: SDPA at 101 % of a step on the H200). Also
    the kernels that took the most device time (``top_kernels``: name, launches and seconds per
    step), which says where the rest of the step goes. On a CPU: the ops' CPU time over the wall time.
    """
    events = prof.events()
    on_gpu = device.type == "cuda"
    by_kind: dict[str, dict] = {}
    total_attention = 0.0
    for ev in _outermost_attention_ops(events):
        seconds = (ev.device_time_total if on_gpu else ev.cpu_time_total) / 1e6
        row = by_kind.setdefault(_kind(ev), {"seconds_per_step": 0.0, "calls_per_step": 0.0, "ops": set()})
        row["seconds_per_step"] += seconds / steps
        row["calls_per_step"] += 1 / steps
        row["ops"].add(ev.name)
        total_attention += seconds
    for row in by_kind.values():
        row["ops"] = sorted(row["ops"])
    result = {"profiled_steps": steps, "profiled_wall_seconds_per_step": wall_seconds / steps,
              "attention_seconds_per_step": total_attention / steps, "by_kind": by_kind}
    if on_gpu:
        # Kernels, memcpy, memset; GPU user annotations (compiled-graph ranges) span kernels already counted.
        kernels = [ev for ev in events if ev.device_type != torch.autograd.DeviceType.CPU
                   and not getattr(ev, "is_user_annotation", False)
                   and "annotation" not in str(getattr(ev, "activity_type", None) or "")]
        per_kernel: dict[str, list] = {}  # name -> [launches, seconds]
        for ev in kernels:
            entry = per_kernel.setdefault(ev.name, [0, 0.0])
            entry[0] += 1
            entry[1] += ev.time_range.elapsed_us() / 1e6
        device_total = sum(seconds for _, seconds in per_kernel.values())
        by_name = sum(seconds for name, (_, seconds) in per_kernel.items() if ATTENTION_KERNEL.search(name))
        top = sorted(per_kernel.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
        result.update(
            method="device time of attention kernels / device time of all kernels; by_kind: the ops' "
                   "device_time_total (overcounts on torch 2.11)",
            device_seconds_per_step=device_total / steps, attention_seconds_per_step=by_name / steps,
            top_kernels=[{"name": name, "launches_per_step": n / steps, "seconds_per_step": seconds / steps}
                         for name, (n, seconds) in top],
            attention_share=by_name / device_total if device_total else None,
            op_device_time_crosscheck={"attention_seconds_per_step": total_attention / steps,
                                       "attention_share": total_attention / device_total if device_total else None})
    else:
        result.update(method="CPU time of the outermost attention ops / wall time",
                      attention_share=total_attention / wall_seconds if wall_seconds else None)
    return result


# ----------------------------------------------------------------------------- one row

def active_attention_backend() -> str:
    """The backend diffusers runs for processors that name none ("native" unless DIFFUSERS_ATTN_BACKEND says)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry  # read only

    return _AttentionBackendRegistry.get_active_backend()[0].value


def set_up_row(row: Row, transformer, settings: Settings, default_backend: str) -> str:
    """Apply one row to the transformer; a description of what runs."""
    config = fsattn_diffusers.FSAttnConfig(**settings.fsattn_config) if settings.fsattn_config else None
    backend = settings.baseline_backend or default_backend
    if backend != default_backend:
        transformer.set_attention_backend(backend)  # what fsattn falls back to, in the fsattn rows
    if row.recipe:
        options = {"backend": settings.compile_backend}
        if settings.compile_mode:
            options["mode"] = settings.compile_mode
        if settings.inductor_options is not None:
            options["options"] = dict(settings.inductor_options)
        fsattn_diffusers.apply_recipe(
            transformer, fsattn=row.fsattn, fsattn_options={"config": config} if row.fsattn else None,
            fuse_qkv=row.fuse, fp8_linear=row.fp8, fp8_conditioning=row.fp8_conditioning, fuse_ffn=row.ffn,
            fuse_norm_rope=row.rope, compile=row.compile, dynamic=settings.dynamic,
            compile_options=options if row.compile else None)
    elif row.fsattn:
        fsattn_diffusers.apply_fsattn(transformer, config=config)
    attention = "fsattn" if row.fsattn else f"diffusers attention backend {backend!r}"
    fp8 = "FP8 linear, all of the cross-attention" if row.fp8_conditioning else "FP8 linear"
    parts = [p for p, on in (("fused QKV", row.fuse), (fp8, row.fp8), ("fused feed-forward", row.ffn),
                                 ("fused norm and RoPE", row.rope), ("compiled", row.compile)) if on]
    return attention + (" + " + " + ".join(parts) if parts else "")


def tear_down_row(transformer, default_backend: str) -> None:
    fsattn_diffusers.remove_recipe(transformer)
    fsattn_diffusers.remove_fsattn(transformer)
    if active_attention_backend() != default_backend:
        # set_attention_backend also moved diffusers' process-wide backend, which reset leaves alone.
        transformer.set_attention_backend(default_backend)
    transformer.reset_attention_backend()


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {group: dict(counters[group]) for group in ("stats", "graph_break", "recompiles", "inductor",
                                                       "aot_autograd")}


def _counter_delta(before: dict, after: dict) -> dict:
    keep = {"stats": ("unique_graphs",), "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss"),
            "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")}
    out = {f"{group}.{key}": after[group].get(key, 0) - before[group].get(key, 0)
           for group, keys in keep.items() for key in keys}
    out["graph_breaks"] = sum(after["graph_break"].values()) - sum(before["graph_break"].values())
    return out


def run_row(row: Row, transformer, loop: Loop, pipe, settings: Settings, device: torch.device,
            default_backend: str) -> dict:
    """One row: set up, first call, timed loop, quality material (``_output``, ``_latents``, ``_frames``)."""
    torch._dynamo.reset()  # each row compiles from scratch (or from --cache-dir), never from an earlier row
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = _counters()
    start = time.perf_counter()
    label = set_up_row(row, transformer, settings, default_backend)
    setup_seconds = time.perf_counter() - start
    scheduler = loop.scheduler()
    with torch.no_grad():  # not inference_mode: fsattn's stats counters must stay resettable
        _sync(device)
        start = time.perf_counter()
        output = loop.forward(transformer, loop.noise, scheduler.timesteps[0], 0)
        _sync(device)
        first_call = time.perf_counter() - start
        result = {"row": row.name, "label": label, "setup_seconds": setup_seconds, "first_call_seconds": first_call,
                  "_output": output.float().cpu()}
        summary = fsattn_diffusers.recipe_summary(transformer)["model"]
        # FP8 is not undone between rows: a later FP8 row finds the layers already in FP8 (the
        # same weights, quantised the same way) and quantises none itself, so count what runs.
        fp8_running = sum(isinstance(m, torch.nn.Linear) and type(m.weight).__module__.startswith("torchao.")
                          for m in transformer.modules())
        result["recipe"] = None if summary is None else {
            "fused_modules": summary["fused_modules"], "fp8_linear_layers_quantized_here": len(summary["fp8_linear"]),
            "fp8_linear_layers": fp8_running, "fused_feed_forwards": len(summary["fused_ffn"]),
            "compiled_modules": summary["compiled_modules"]}
        if not settings.first_call_only:
            fsattn_diffusers.reset_stats()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            latents, forwards, steps = loop.noise.clone(), [], []
            for index in range(settings.steps):
                with Timer(device) as timer:
                    latents = loop.step(transformer, scheduler, latents, index, forwards)
                steps.append(timer)
            step_seconds = [t.seconds for t in steps]
            forward_seconds = [t.seconds for t in forwards]
            result.update(
                forward_seconds=forward_seconds, forward_seconds_median=statistics.median(forward_seconds),
                step_seconds=step_seconds, step_seconds_median=statistics.median(step_seconds),
                compile_seconds_estimate=first_call - statistics.median(forward_seconds),
                peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                fsattn_stats=fsattn_diffusers.stats(), _latents=latents.float().cpu())
            if pipe is not None:
                result["_frames"] = decode(pipe, latents)
            if settings.profile:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                    with Timer(device) as timer:
                        loop.forward(transformer, loop.noise, scheduler.timesteps[0], 0)
                    wall = timer.seconds
                result["attention"] = attention_share(prof, device, wall, 1)
                del prof
    result["dynamo"] = _counter_delta(before, _counters())
    tear_down_row(transformer, default_backend)
    return result


def quality(result: dict, reference: dict) -> dict:
    """A row's outputs against the reference row's."""
    out = {"output_cosine": metrics.cosine_similarity(result["_output"], reference["_output"])}
    if "_latents" in result and "_latents" in reference:
        error = metrics.attention_error(result["_latents"], reference["_latents"])
        out.update(latents_cosine=error["cosine"], latents_rel_l1=error["rel_l1"])
    if "_frames" in result and "_frames" in reference:
        psnr = metrics.psnr_per_frame(reference["_frames"], result["_frames"])
        ssim = metrics.ssim_per_frame(reference["_frames"], result["_frames"])
        out.update(psnr_db=psnr.tolist(), psnr_db_summary=metrics.summarize(psnr), ssim=ssim.tolist(),
                   ssim_summary=metrics.summarize(ssim))
    return out


def estimate_row_seconds(row: Row, done: list[dict], settings: Settings, forwards_per_step: int) -> float | None:
    """Seconds a row would take, from the rows already run (None before any)."""
    if not done:
        return None
    forward = max(r.get("forward_seconds_median") or r["first_call_seconds"] for r in done)
    compiles = [r["first_call_seconds"] - (r.get("forward_seconds_median") or 0.0) for r in done
                if r["row_parts"]["compile"]]
    first = forward + (max(compiles) if compiles and row.compile else 0.0)
    loop = 0.0 if settings.first_call_only else settings.steps * forwards_per_step * forward
    return first + loop + max(r["setup_seconds"] for r in done)


# ----------------------------------------------------------------------------- report

def environment(device: torch.device) -> dict:
    import diffusers

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__,
            "fsattn_diffusers": fsattn_diffusers.__version__, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M"), "device": str(device), "gpu": None, "capability": None,
            "cuda": None, "triton": None, "torchao": None}
    for name in ("triton", "torchao"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                    cuda=torch.version.cuda)
    return info


def json_safe(value):
    """JSON without NaN/Infinity literals: non-finite floats become the strings 'inf', '-inf', 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_report(report: dict) -> None:
    cfg = report["config"]
    machine = report["environment"]["gpu"] or report["environment"]["device"]
    print(f"\n== bench_e2e: {cfg['model']} {cfg['height']}x{cfg['width']}, {cfg['frames']} frames "
          f"({cfg['video_tokens']} tokens), {cfg['steps']} steps, on {machine} ==")
    head = ("row", "first call s", "forward s", "step s", "speed-up", "peak GiB", "out cos", "latents cos",
            "PSNR dB mean / lowest frame")
    lines = [head]
    for r in report["rows"]:
        if r.get("skipped"):
            lines.append((r["row"], "skipped: " + r["skipped"], "", "", "", "", "", "", ""))
            continue
        q = r.get("quality") or {}
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        psnr = q.get("psnr_db_summary") or {}
        lines.append((r["row"], fmt(r["first_call_seconds"], ".1f"), fmt(r.get("forward_seconds_median"), ".3f"),
                      fmt(r.get("step_seconds_median"), ".3f"), fmt(r.get("speedup_per_step"), ".3f"),
                      _gib(r.get("peak_memory_bytes")), fmt(q.get("output_cosine"), ".6f"),
                      fmt(q.get("latents_cosine"), ".6f"),
                      f"{fmt(psnr.get('mean'), '.1f')} / {fmt(psnr.get('min'), '.1f')}" if psnr else "-"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(f"{str(c):<{w}}" for c, w in zip(line, widths)).rstrip())
    for r in report["rows"]:
        top = (r.get("attention") or {}).get("top_kernels")
        if top:
            print(f"{r['row']}: most device time per step: " + "; ".join(
                f"{k['seconds_per_step'] * 1e3:.1f} ms {k['name'][:60]} (x{k['launches_per_step']:g})"
                for k in top[:5]))
    for line in report["warnings"]:
        print("WARNING: " + line)
    for note in (report["note"], report["timing_note"]):
        if note:
            print("NOTE: " + note)


def write_report(report: dict, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        with open(out + ".tmp", "w") as f:
            json.dump(json_safe(report), f, indent=1, allow_nan=False)
        os.replace(out + ".tmp", out)  # never a half-written file, even if a time box ends the process


def use_cache_dir(cache_dir: str) -> dict:
    """Point inductor's and Triton's on-disk caches at `cache_dir` (before anything compiles)."""
    paths = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
             "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton")}
    for key, path in paths.items():
        os.makedirs(path, exist_ok=True)
        os.environ[key] = path
    return paths


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings, rows, device, dtype = resolve_settings(parser, args)
    if settings.cache_dir:
        use_cache_dir(settings.cache_dir)
    if args.cache_artifacts and os.path.exists(args.cache_artifacts):
        with open(args.cache_artifacts, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    if settings.coordinate_descent_tuning:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
        inductor_config.coordinate_descent_check_all_directions = True
    started = time.perf_counter()
    transformer, pipe = build(settings, device, dtype)
    build_seconds = time.perf_counter() - started
    loop = Loop(settings, transformer, device, dtype)
    default_backend = active_attention_backend()
    report = {
        "benchmark": "bench_e2e", "environment": environment(device), "config": dataclasses.asdict(settings),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv) if __name__ == "__main__" else None,
        "build_seconds": build_seconds, "forwards_per_step": len(loop.conditions), "rows": [],
        "note": builtin_models.RANDOM_WEIGHTS_NOTE.format(name=settings.model),
        "timing_note": CPU_TIMING_NOTE if device.type == "cpu" else None, "warnings": [],
    }
    reference = None  # the first row run: "default" whenever it is among the rows
    done = []
    for row in rows:
        estimate = estimate_row_seconds(row, done, settings, len(loop.conditions))
        elapsed = time.perf_counter() - started
        if settings.budget_s is not None and estimate is not None and elapsed + estimate > settings.budget_s:
            why = f"estimated {estimate:.0f} s after {elapsed:.0f} s would pass --budget-s {settings.budget_s:.0f}"
            report["rows"].append({"row": row.name, "skipped": why})
            write_report(report, args.out)
            continue
        result = run_row(row, transformer, loop, pipe, settings, device, default_backend)
        result["row_parts"] = dataclasses.asdict(row)
        reference = reference or result
        result["reference_row"] = reference["row"]
        result["quality"] = quality(result, reference)
        if result is not reference:
            for key in ("_output", "_latents", "_frames"):  # only the reference's are needed later
                result.pop(key, None)
        if "step_seconds_median" in result and "step_seconds_median" in reference:
            result["speedup_per_forward"] = reference["forward_seconds_median"] / result["forward_seconds_median"]
            result["speedup_per_step"] = reference["step_seconds_median"] / result["step_seconds_median"]
        if result["dynamo"]["graph_breaks"]:
            report["warnings"].append(f"row {row.name}: {result['dynamo']['graph_breaks']} graph breaks")
        fused_before = max((r["recipe"]["fused_modules"] for r in done if r["row_parts"]["fuse"] and r.get("recipe")),
                           default=0)
        if row.fuse and result.get("recipe") and result["recipe"]["fused_modules"] < fused_before:
            # CogVideoX: diffusers' generic fusion cannot copy the FP8 weights an earlier row left.
            report["warnings"].append(
                f"row {row.name}: {result['recipe']['fused_modules']} attention modules fused against "
                f"{fused_before} in an earlier row (this model cannot fuse the FP8 weights an earlier row "
                "left): compare it with that row in a process of its own")
        refused = {k: v for k, v in (result.get("fsattn_stats") or {}).get("sdpa_fallbacks", {}).items()
                   if k != "small_problem"}
        if refused:
            report["warnings"].append(f"row {row.name}: fsattn sent calls to SDPA instead: {refused}")
        done.append(result)
        report["rows"].append(result)
        write_report(report, args.out)
    if args.cache_artifacts:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.cache_artifacts, "wb") as f:
                f.write(saved[0])
    report["total_seconds"] = time.perf_counter() - started
    write_report(report, args.out)
    print_report(report)
    if args.out:
        print(f"results: {args.out}")
    return report


if __name__ == "__main__":
    main()
