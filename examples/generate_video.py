#!/usr/bin/env python
"""Generate a video with a Wan or HunyuanVideo diffusers pipeline, attention through fsattn or SDPA.

    python examples/generate_video.py                   # built-in `tiny` (random weights), CPU-sized
    python examples/generate_video.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompt "A cat surfing"
    python examples/generate_video.py --model wan2.1-t2v-1.3b --steps 10 --no-decode   # GPU timing
    python examples/generate_video.py --model wan2.1-t2v-1.3b --steps 10 --no-decode --recipe   # the whole recipe
    torchrun --nproc-per-node 2 examples/generate_video.py --model wan2.1-t2v-14b --ulysses-degree 2 --no-decode

``--model`` is a built-in name (fsattn_diffusers.builtin_models: tiny, wan2.1-t2v-1.3b,
wan2.1-t2v-14b, hunyuanvideo, tiny-hunyuanvideo, cogvideox-5b, tiny-cogvideox; random weights,
nothing downloaded) or a hub id / local folder of a Wan, HunyuanVideo or CogVideoX diffusers
pipeline (``DiffusionPipeline.from_pretrained``). At the end it
prints the time per step and in total, the attention backend, fsattn's speculative-max
fallbacks, the peak GPU memory and where the video went. ab_compare.py reuses these functions.

The recipe's parts (``fsattn_diffusers.apply_recipe``) are flags: ``--fuse-qkv`` (with Wan's
one-pass query/key norm and RoPE), ``--fp8-linear``
(torchao float8 linear layers, with apply_recipe's fused GELU feed-forward; a CUDA GPU of
compute capability 8.9+ and bf16;
``--fp8-conditioning`` puts the rest of the cross-attention in FP8 too), ``--compile``
(regional, ``fullgraph=True``), or ``--recipe`` for all of them with fsattn. Whatever the run
needs after the denoising loop (a video writer) is checked before the model is loaded.

Under ``torchrun`` with ``--ulysses-degree`` / ``--ring-degree`` (their product must be the number
of processes), the transformer runs with diffusers' context parallelism, one GPU per process:
every rank runs the whole pipeline on its share of the video tokens, and rank 0 alone writes the
video and the JSON and prints the summary, with each rank's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import fsattn_diffusers
from fsattn_diffusers import builtin_models
from fsattn_diffusers.config import FSAttnConfig
from fsattn_diffusers.metrics import to_uint8

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


# ----------------------------------------------------------------------------- arguments

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block indices such as '0,1,29', got {text!r}")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options that pick the pipeline, the video and the machine (shared with ab_compare.py)."""
    names = ", ".join(builtin_models.BUILTIN_MODELS)
    parser.add_argument("--model", default="tiny",
                        help=f"built-in architecture ({names}; random weights) or a hub id / local path of a Wan or "
                             "HunyuanVideo diffusers pipeline")
    parser.add_argument("--prompt", default="A red panda surfing a wave at sunset, cinematic")
    parser.add_argument("--negative-prompt", default=None, help="Wan and CogVideoX (HunyuanVideo uses embedded guidance)")
    parser.add_argument("--height", type=_positive_int, default=None, help="default: the model's (tiny: 256)")
    parser.add_argument("--width", type=_positive_int, default=None, help="default: the model's (tiny: 256)")
    parser.add_argument("--num-frames", type=_positive_int, default=None,
                        help="a multiple of 4 plus 1 (the VAE packs 4 frames per latent); default: the model's")
    parser.add_argument("--steps", type=_positive_int, default=None, help="denoising steps; default: the model's")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's (Wan 5.0, Hunyuan 6.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=_positive_int, default=None, help="of the written mp4 (Wan 16, Hunyuan 24)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                        help="of the transformer and text encoder; default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="enable_model_cpu_offload: components move to the GPU only while they run")
    parser.add_argument("--no-decode", action="store_true",
                        help="stop at the latents (no VAE decode, no mp4): times only the denoising loop")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="untimed denoising steps run first (Triton/cuDNN/compile warm-up); default 1 on cuda, 0 on cpu")
    parser.add_argument("--ulysses-degree", type=_positive_int, default=1,
                        help="context parallelism: GPUs that split the heads of each attention (Ulysses); "
                             "run under torchrun, ulysses x ring = number of processes")
    parser.add_argument("--ring-degree", type=_positive_int, default=1,
                        help="context parallelism: GPUs that pass key/value chunks around a ring (ring attention)")
    add_recipe_args(parser)


_DYNAMIC = {"auto": None, "true": True, "false": False}


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """The parts of fsattn_diffusers.apply_recipe besides the attention."""
    parser.add_argument("--compile", action="store_true",
                        help="regional torch.compile of the transformer blocks (fullgraph=True; the first step "
                             "compiles)")
    parser.add_argument("--fuse-qkv", action="store_true",
                        help="one GEMM for the Q, K, V projections where the model family offers it, and (Wan) the "
                             "self-attention's query/key norm and RoPE in one kernel")
    parser.add_argument("--fp8-linear", action="store_true",
                        help="the blocks' linear layers in FP8 e4m3, per-row scales (torchao; bf16 model, CUDA GPU of "
                             "compute capability 8.9+), the GELU feed-forwards' activation and FP8 scaling in one kernel; "
                             "replaces the weights")
    parser.add_argument("--fp8-conditioning", action="store_true",
                        help="with --fp8-linear or --recipe: the cross-attention's K/V and output projections / the text "
                             "stream in FP8 too (less bf16 work; more of the error that guidance multiplies)")
    parser.add_argument("--recipe", action="store_true",
                        help="the whole recipe: fsattn + --fuse-qkv + --fp8-linear + --compile")
    parser.add_argument("--dynamic", choices=sorted(_DYNAMIC), default="auto",
                        help="torch.compile's dynamic shapes: auto (torch's default: one recompile at the first new "
                             "size, dynamic from then on), true, false (one graph per size)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (inductor; eager or aot_eager only trace, for checks)")


def add_fsattn_args(parser: argparse.ArgumentParser, config_help: str | None = None) -> None:
    """apply_fsattn's options (`config_help`: ``--fsattn-config``'s help, where a script reads it otherwise)."""
    parser.add_argument("--fsattn-config", default=None,
                        help=config_help or "FSAttnConfig fields as JSON, or a path to a JSON file, e.g. "
                                            "'{\"pv_format\": \"16bit\"}'")
    parser.add_argument("--skip-first-steps", type=int, default=0,
                        help="run the first N denoising steps with SDPA (they shape the layout of the video)")
    parser.add_argument("--skip-last-steps", type=int, default=0, help="run the last N steps with SDPA")
    parser.add_argument("--skip-blocks", type=_int_list, default=(),
                        help="comma-separated transformer block indices that keep SDPA, e.g. '0,29'")
    parser.add_argument("--self-attention-only", action="store_true",
                        help="leave cross-attention (to text) on SDPA")
    parser.add_argument("--strict", action="store_true",
                        help="raise instead of falling back to SDPA for attention fsattn cannot take")


def parse_fsattn_config(text: str | None) -> FSAttnConfig | None:
    """``--fsattn-config``: JSON text or a path to a JSON file, to an FSAttnConfig (None: default)."""
    if not text:
        return None
    source = text
    if os.path.exists(text):
        with open(text) as f:
            source = f.read()
    try:
        fields = json.loads(source)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--fsattn-config={text!r} is neither a JSON object nor a JSON file: {exc}")
    if not isinstance(fields, dict):
        raise SystemExit(f"--fsattn-config must be a JSON object of FSAttnConfig fields, got {fields!r}")
    try:
        return FSAttnConfig(**fields)
    except TypeError as exc:
        raise SystemExit(f"--fsattn-config={text!r}: {exc}")


def resolve_device_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device={device!r} but torch sees no CUDA GPU (torch {torch.__version__})")
    if dtype is None:
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, _DTYPES[dtype]


# ----------------------------------------------------------------------------- context parallelism

@dataclass
class Parallel:
    """This process's place in a torchrun launch with context parallelism."""

    rank: int
    local_rank: int
    world_size: int
    ulysses_degree: int
    ring_degree: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_parallel_args(ulysses_degree: int, ring_degree: int, attention: str, environ=None) -> Parallel | None:
    """The torchrun launch asked for, checked against the degrees; None for a plain single-process run.

    `environ` (default ``os.environ``) supplies torchrun's ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``.
    """
    environ = os.environ if environ is None else environ
    world_size = int(environ.get("WORLD_SIZE", "1"))
    degrees = ulysses_degree * ring_degree
    if degrees == 1 and world_size == 1:
        return None
    if degrees != world_size:
        how = (f"it runs {world_size} processes" if "WORLD_SIZE" in environ else
               "it was not launched by torchrun (one process)")
        raise SystemExit(
            f"--ulysses-degree={ulysses_degree} x --ring-degree={ring_degree} = {degrees}, but {how}: the product must "
            f"equal the number of processes, e.g. torchrun --nproc-per-node {degrees} examples/generate_video.py "
            f"--ulysses-degree {ulysses_degree} --ring-degree {ring_degree} ...")
    if ring_degree > 1 and attention == "sdpa":
        raise SystemExit(f"--ring-degree={ring_degree} with --attention sdpa: diffusers' native attention cannot run "
                         "ring attention (its op returns no log-sum-exp); use --attention fsattn or --ulysses-degree")
    return Parallel(rank=int(environ.get("RANK", "0")), local_rank=int(environ.get("LOCAL_RANK", "0")),
                    world_size=world_size, ulysses_degree=ulysses_degree, ring_degree=ring_degree)


def start_parallel(parallel: Parallel, device: str | None) -> torch.device:
    """Join the process group (NCCL) and return this rank's GPU."""
    import torch.distributed as dist

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        raise SystemExit("--ulysses-degree / --ring-degree need one CUDA GPU per process (diffusers' "
                         "enable_parallelism places each rank on an accelerator)")
    dev = torch.device("cuda", parallel.local_rank)
    torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=dev)
    return dev


def enable_context_parallelism(loaded: "LoadedModel", parallel: Parallel) -> None:
    """diffusers' context parallelism on every transformer of the pipeline (after the attention is set)."""
    from diffusers import ContextParallelConfig

    for name, component in loaded.pipe.components.items():
        if name.startswith("transformer") and isinstance(component, torch.nn.Module):
            component.enable_parallelism(config=ContextParallelConfig(
                ulysses_degree=parallel.ulysses_degree, ring_degree=parallel.ring_degree))


def gather_rank_times(result: "RunResult", parallel: Parallel) -> dict:
    """Every rank's total and denoising time (rank order), for rank 0's summary."""
    import torch.distributed as dist

    times = [None] * parallel.world_size
    dist.all_gather_object(times, {"total_seconds": result.total_seconds, "denoise_seconds": result.denoise_seconds})
    return {"world_size": parallel.world_size, "ulysses_degree": parallel.ulysses_degree,
            "ring_degree": parallel.ring_degree,
            "rank_total_seconds": [t["total_seconds"] for t in times],
            "rank_denoise_seconds": [t["denoise_seconds"] for t in times]}


# ----------------------------------------------------------------------------- the pipeline

@dataclass
class LoadedModel:
    pipe: object
    name: str
    family: str  # "wan", "hunyuanvideo", "cogvideox" or "other"
    spec: builtin_models.BuiltinModel | None  # set for built-ins
    device: torch.device
    dtype: torch.dtype

    @property
    def random_weights(self) -> bool:
        return self.spec is not None

    @property
    def can_decode(self) -> bool:
        return getattr(self.pipe, "vae", None) is not None


def _family_of(pipe) -> str:
    name = type(pipe).__name__
    if name.startswith("Wan"):
        return "wan"
    if name.startswith("HunyuanVideo"):
        return "hunyuanvideo"
    if name.startswith("CogVideoX"):
        return "cogvideox"
    return "other"


def _required_inputs(pipe) -> list[str]:
    """The pipeline call's parameters without a default (an image-to-video pipeline's ``image``)."""
    parameters = inspect.signature(pipe.__call__).parameters.values()
    return [p.name for p in parameters
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def load_model(model: str, device: torch.device, dtype: torch.dtype, cpu_offload: bool = False,
               seed: int = 0) -> LoadedModel:
    """A built-in (random weights, built in code) or a pipeline from ``from_pretrained``."""
    build_on = torch.device("cpu") if cpu_offload else device
    if builtin_models.is_builtin(model):
        spec = builtin_models.get_builtin(model)
        pipe = builtin_models.build_pipeline(model, build_on, dtype, seed=seed)
        loaded = LoadedModel(pipe, model, spec.family, spec, device, dtype)
    else:
        import diffusers
        from diffusers import DiffusionPipeline
        from packaging.version import Version

        # diffusers 0.42 renamed torch_dtype to dtype (the old name still works, with a warning).
        dtype_kw = "dtype" if Version(diffusers.__version__).release >= (0, 42) else "torch_dtype"
        try:
            pipe = DiffusionPipeline.from_pretrained(model, **{dtype_kw: dtype})
        except Exception as exc:
            raise SystemExit(
                f"--model={model!r} is not a built-in ({', '.join(builtin_models.BUILTIN_MODELS)}) and "
                f"DiffusionPipeline.from_pretrained failed: {type(exc).__name__}: {exc}") from exc
        needed = _required_inputs(pipe)
        if needed:
            raise SystemExit(
                f"--model={model!r}: {type(pipe).__name__} needs {', '.join(needed)} as input; this example "
                "generates from a text prompt only (text-to-video pipelines)")
        family = _family_of(pipe)
        if family == "other":
            print(f"warning: {type(pipe).__name__} is not a Wan, HunyuanVideo or CogVideoX pipeline; "
                  "trying anyway", file=sys.stderr)
        if family == "wan" and getattr(pipe, "vae", None) is not None:
            pipe.vae.to(torch.float32)  # Wan's VAE is run in float32 in Wan's own examples
        if family in ("hunyuanvideo", "cogvideox") and getattr(pipe, "vae", None) is not None:
            pipe.vae.enable_tiling()  # as both models' examples decode (HunyuanVideo's 720p needs it)
        if not cpu_offload:
            pipe.to(device)
        loaded = LoadedModel(pipe, model, family, None, device, dtype)
    if cpu_offload:
        if device.type != "cuda":
            raise SystemExit(f"--cpu-offload needs a CUDA device, got --device={device}")
        pipe.enable_model_cpu_offload(device=device)
    return loaded


def set_attention(loaded: LoadedModel, backend: str, config: FSAttnConfig | None = None, **skip) -> str:
    """Route the transformer's attention to ``backend`` ("sdpa" or "fsattn"); returns a description."""
    if backend not in ("sdpa", "fsattn"):
        raise ValueError(f"attention backend {backend!r}; expected 'sdpa' or 'fsattn'")
    clear_attention(loaded)
    if backend == "sdpa":
        return "sdpa (diffusers' default: torch scaled_dot_product_attention)"
    fsattn_diffusers.apply_fsattn(loaded.pipe, config=config, **skip)
    return f"fsattn ({describe_config(config)}{describe_skips(skip)})"


def clear_attention(loaded: LoadedModel) -> None:
    """Back to diffusers' own attention, uncompiled and unfused (both removals are harmless where nothing was
    applied; FP8 weights stay FP8, see fsattn_diffusers.remove_recipe)."""
    fsattn_diffusers.remove_recipe(loaded.pipe)
    fsattn_diffusers.remove_fsattn(loaded.pipe)


def short_label(backend: str, config: FSAttnConfig | None = None, parts: "RecipeParts | None" = None) -> str:
    """"sdpa", "fsattn", "fsattn[field=value, ...]" for a non-default config, then the recipe's parts
    ("+fused-qkv+fp8+compile"), for tables and plots."""
    suffix = parts.label() if parts is not None else ""
    if backend != "fsattn" or config is None:
        return backend + suffix
    text = describe_config(config).removeprefix("config ")
    return ("fsattn" if text == "default" else f"fsattn[{text}]") + suffix


def describe_config(config: FSAttnConfig | None) -> str:
    if config is None:
        return "default config"
    default = FSAttnConfig()
    changed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(default, f.name)}
    return "config " + (", ".join(f"{k}={v!r}" for k, v in changed.items()) or "default")


def describe_skips(skip: dict) -> str:
    shown = {k: v for k, v in skip.items() if v}
    return ("; " + ", ".join(f"{k}={v}" for k, v in shown.items())) if shown else ""


def skip_kwargs(args) -> dict:
    return {"skip_first_steps": args.skip_first_steps, "skip_last_steps": args.skip_last_steps,
            "skip_blocks": tuple(args.skip_blocks), "self_attention_only": args.self_attention_only,
            "strict": args.strict}


@dataclass(frozen=True)
class RecipeParts:
    """The recipe's parts besides the attention (``fsattn_diffusers.apply_recipe``'s switches)."""

    fuse_qkv: bool = False
    fp8_linear: bool = False
    fp8_conditioning: bool = False
    compile: bool = False
    dynamic: bool | None = None
    compile_backend: str = "inductor"

    @property
    def any(self) -> bool:
        return self.fuse_qkv or self.fp8_linear or self.compile

    def label(self) -> str:
        """``+fused-qkv+fp8+compile``-style suffix for tables ("" when no part is on)."""
        return "".join(f"+{name}" for name, on in (("fused-qkv", self.fuse_qkv), ("fp8", self.fp8_linear),
                                                     ("fp8-conditioning", self.fp8_conditioning),
                                                     ("compile", self.compile)) if on)


def recipe_parts(args) -> RecipeParts:
    """The parts the flags ask for (``--recipe``: all of them)."""
    every = args.recipe
    if args.fp8_conditioning and not (every or args.fp8_linear):
        raise SystemExit("--fp8-conditioning adds the cross-attention's K/V and output projections to --fp8-linear's "
                         "layers; give --fp8-linear or --recipe too")
    return RecipeParts(fuse_qkv=every or args.fuse_qkv, fp8_linear=every or args.fp8_linear,
                       fp8_conditioning=args.fp8_conditioning, compile=every or args.compile,
                       dynamic=_DYNAMIC[args.dynamic], compile_backend=args.compile_backend)


def check_recipe_parts(parts: RecipeParts, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any model is loaded, parts that cannot run here (FP8 on a CPU or an older GPU, or not in bf16)."""
    from fsattn_diffusers.recipe import fp8_unavailable_reason

    if not parts.fp8_linear:
        return
    reason = fp8_unavailable_reason(device)
    if reason is not None:
        raise SystemExit(f"--fp8-linear (also part of --recipe): {reason}. Leave it out (--fuse-qkv --compile give the "
                         "rest of the recipe)")
    if dtype != torch.bfloat16:
        raise SystemExit(f"--fp8-linear needs the transformer in bfloat16 (torchao's per-row float8), got "
                         f"--dtype {str(dtype).replace('torch.', '')}; use --dtype bf16")


def set_up(loaded: LoadedModel, backend: str, config: FSAttnConfig | None, skip: dict, parts: RecipeParts) -> str:
    """The attention (``set_attention``) and, if asked, the rest of the recipe (``apply_recipe``); describes the
    attention (``recipe_summary`` the rest)."""
    if not parts.any:
        return set_attention(loaded, backend, config, **skip)
    if backend not in ("sdpa", "fsattn"):
        raise ValueError(f"attention backend {backend!r}; expected 'sdpa' or 'fsattn'")
    clear_attention(loaded)
    fsattn = backend == "fsattn"
    fsattn_diffusers.apply_recipe(
        loaded.pipe, fsattn=fsattn, fsattn_options=dict(config=config, **skip) if fsattn else None,
        fuse_qkv=parts.fuse_qkv, fuse_norm_rope=parts.fuse_qkv, fp8_linear=parts.fp8_linear,
        fp8_conditioning=parts.fp8_conditioning, compile=parts.compile, dynamic=parts.dynamic,
        compile_options={"backend": parts.compile_backend} if parts.compile else None)
    if fsattn:
        return f"fsattn ({describe_config(config)}{describe_skips(skip)})"
    return "sdpa (diffusers' default: torch scaled_dot_product_attention)"


def recipe_summary(loaded: LoadedModel) -> dict | None:
    """Per transformer: fused attention modules, FP8 layers, compiled modules (None without a recipe)."""
    summary = fsattn_diffusers.recipe_summary(loaded.pipe)
    if all(entry is None for entry in summary.values()):
        return None
    return {name: None if entry is None else {
        "fused_modules": entry["fused_modules"], "fp8_linear_layers": len(entry["fp8_linear"]),
        "fused_feed_forwards": len(entry["fused_ffn"]), "compiled_modules": entry["compiled_modules"],
        "dynamic": entry["parts"]["dynamic"]}
        for name, entry in summary.items()}


def describe_recipe(summary: dict | None) -> str:
    if not summary:
        return "none"
    parts = []
    for name, entry in summary.items():
        if entry is not None:
            dynamic = {None: "auto", True: "true", False: "false"}[entry["dynamic"]]
            parts.append(f"{name}: {entry['fused_modules']} fused QKV modules, {entry['fp8_linear_layers']} FP8 linear "
                         f"layers, {entry['fused_feed_forwards']} fused feed-forwards, {entry['compiled_modules']} "
                         f"compiled blocks (dynamic {dynamic})")
    return "; ".join(parts)


def check_video_writer() -> None:
    """Refuse up front a run whose video could not be written at the end (write_video's needs)."""
    try:
        import imageio  # noqa: F401
    except ImportError:
        raise SystemExit("writing the mp4 needs imageio (pip install imageio imageio-ffmpeg); it is not installed. "
                         "Install it, or pass --no-decode") from None
    for module in ("imageio_ffmpeg", "cv2"):
        try:
            __import__(module)
            return
        except ImportError:
            continue
    raise SystemExit("writing the mp4 needs imageio-ffmpeg (pip install imageio-ffmpeg) or OpenCV; neither is "
                     "installed. Install one, or pass --no-decode")


@dataclass
class GenerationSettings:
    prompt: str
    negative_prompt: str | None
    height: int
    width: int
    num_frames: int
    steps: int
    guidance_scale: float
    seed: int
    fps: int
    decode: bool


def resolve_settings(args, loaded: LoadedModel) -> GenerationSettings:
    """Command-line values, with the model's defaults where none was given."""
    spec = loaded.spec
    pipe_defaults = {"wan": (480, 832, 81, 50, 5.0, 16), "hunyuanvideo": (720, 1280, 129, 50, 6.0, 24),
                     "cogvideox": (480, 720, 49, 50, 6.0, 8)}
    h, w, f, s, g, fps = ((spec.height, spec.width, spec.num_frames, spec.steps, spec.guidance_scale, spec.fps)
                          if spec else pipe_defaults.get(loaded.family, (480, 832, 81, 50, 5.0, 16)))
    if spec is None and loaded.family == "cogvideox":
        # CogVideoXPipeline's own defaults, from the checkpoint's config: CogVideoX 1.0 480x720x49,
        # CogVideoX1.5 768x1360x81.
        config, scale = loaded.pipe.transformer.config, loaded.pipe.vae_scale_factor_spatial
        h, w, f = config.sample_height * scale, config.sample_width * scale, config.sample_frames
    decode = not args.no_decode
    if decode and not loaded.can_decode:
        print(f"note: {loaded.name!r} has no VAE: stopping at the latents (no mp4)", file=sys.stderr)
        decode = False
    return GenerationSettings(
        prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height or h, width=args.width or w,
        num_frames=args.num_frames or f, steps=args.steps or s,
        guidance_scale=g if args.guidance_scale is None else args.guidance_scale, seed=args.seed,
        fps=args.fps or fps, decode=decode)


@dataclass
class RunResult:
    frames: np.ndarray | None  # uint8 (F, H, W, 3), None without decode
    latents: torch.Tensor  # the final latents, float32 on the CPU
    step_seconds: list[float]
    total_seconds: float
    prepare_seconds: float  # prompt encoding and latent preparation
    denoise_seconds: float
    decode_seconds: float
    peak_gpu_bytes: int | None
    stats: dict = field(default_factory=dict)
    warmup_seconds: float | None = None  # the untimed warm-up steps (compilation happens there), if any

    @property
    def steady_step_seconds(self) -> float:
        """Mean time of the steps after the first (which carries one-off warm-up costs)."""
        tail = self.step_seconds[1:] or self.step_seconds
        return statistics.fmean(tail)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_kwargs(loaded: LoadedModel, settings: GenerationSettings, steps: int, decode: bool) -> dict:
    """The pipeline call's keyword arguments: a prompt, or random embeddings for built-ins without a text encoder."""
    device = loaded.device
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    kwargs = dict(height=settings.height, width=settings.width, num_frames=settings.num_frames,
                  num_inference_steps=steps, guidance_scale=settings.guidance_scale, generator=generator,
                  output_type="np" if decode else "latent")
    if loaded.spec is not None and not loaded.spec.has_text_encoder:
        # Same seed, same embeddings: both runs of an A/B comparison see identical prompts.
        embed_gen = torch.Generator(device="cpu").manual_seed(settings.seed + 1)
        kwargs.update(builtin_models.random_prompt_inputs(loaded.name, 1, "cpu", loaded.dtype, embed_gen))
        kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    else:
        kwargs["prompt"] = settings.prompt
        if settings.negative_prompt is not None and loaded.family in ("wan", "cogvideox"):
            kwargs["negative_prompt"] = settings.negative_prompt
    return kwargs


def run_pipeline(loaded: LoadedModel, settings: GenerationSettings, warmup_steps: int = 0,
                 desc: str = "denoising") -> RunResult:
    """One timed generation. Per-step times come from the step-end callback, synchronised."""
    pipe, device = loaded.pipe, loaded.device
    # no_grad, as diffusers' own __call__ uses, not inference_mode: tensors born in inference mode
    # (fsattn's device-side fallback counters) cannot be zeroed by reset_stats() outside it.
    warmup_seconds = None
    if warmup_steps > 0:
        pipe.set_progress_bar_config(desc=f"warm-up ({desc})", leave=False)
        _sync(device)
        warmup_start = time.perf_counter()
        with torch.no_grad():
            pipe(**call_kwargs(loaded, settings, warmup_steps, decode=False))
        _sync(device)
        warmup_seconds = time.perf_counter() - warmup_start
    fsattn_diffusers.reset_stats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    marks: dict = {"steps": [], "latents": None}

    def on_first_forward(module, args):
        if "denoise_start" not in marks:
            _sync(device)
            marks["denoise_start"] = time.perf_counter()

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        _sync(device)
        marks["steps"].append(time.perf_counter())
        if step == settings.steps - 1:
            marks["latents"] = callback_kwargs["latents"].detach().float().cpu()
        return callback_kwargs

    hook = pipe.transformer.register_forward_pre_hook(on_first_forward)
    pipe.set_progress_bar_config(desc=desc, leave=True)
    try:
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            output = pipe(**call_kwargs(loaded, settings, settings.steps, settings.decode),
                          callback_on_step_end=on_step_end)
        _sync(device)
        end = time.perf_counter()
    finally:
        hook.remove()
    video = output.frames[0]
    frames = to_uint8(video) if settings.decode else None
    latents = marks["latents"] if marks["latents"] is not None else torch.as_tensor(video).float().cpu()
    stamps = [marks.get("denoise_start", start)] + marks["steps"]
    return RunResult(
        frames=frames, latents=latents, step_seconds=[b - a for a, b in zip(stamps, stamps[1:])],
        total_seconds=end - start, prepare_seconds=stamps[0] - start, denoise_seconds=stamps[-1] - stamps[0],
        decode_seconds=end - stamps[-1],
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        stats=fsattn_diffusers.stats(), warmup_seconds=warmup_seconds)


def write_video(frames: np.ndarray, path: str, fps: int) -> str:
    """uint8 ``(F, H, W, 3)`` frames to an H.264 mp4 through imageio-ffmpeg.

    Where imageio-ffmpeg is missing (some GPU images carry OpenCV but no ffmpeg), OpenCV's
    MPEG-4 writer is used instead, with a note.
    """
    import imageio.v2 as imageio

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return _write_video_opencv(frames, path, fps)
    # macro_block_size=1: keep the exact size (Wan and Hunyuan sizes are multiples of 16 anyway).
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, pixelformat="yuv420p",
                            macro_block_size=1, ffmpeg_log_level="error") as writer:
        for frame in frames:
            writer.append_data(frame)
    return path


def _write_video_opencv(frames: np.ndarray, path: str, fps: int) -> str:
    try:
        import cv2
    except ImportError:
        raise SystemExit("writing an mp4 needs imageio-ffmpeg (pip install imageio-ffmpeg) or OpenCV; "
                         "neither is installed (or pass --no-decode to skip the video)") from None
    print("note: imageio-ffmpeg is not installed; writing the mp4 with OpenCV (MPEG-4 Part 2)", file=sys.stderr)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise SystemExit(f"OpenCV could not open {path!r} for writing")
    for frame in frames:
        writer.write(frame[..., ::-1].copy())  # OpenCV takes BGR
    writer.release()
    return path


# ----------------------------------------------------------------------------- reporting

def fallback_line(stats: dict) -> str:
    tiles, fell = stats.get("q_tiles", 0), stats.get("fallback_q_tiles", 0)
    share = f" ({100.0 * fell / tiles:.2f} %)" if tiles else ""
    sdpa = stats.get("sdpa_fallbacks") or {}
    sdpa_text = ", ".join(f"{k}: {v}" for k, v in sdpa.items()) or "none"
    calls = ", ".join(f"{k}: {v}" for k, v in (stats.get("calls") or {}).items()) or "none"
    return f"fsattn calls {calls}; speculative-max fallbacks {fell} of {tiles} query tiles{share}; SDPA fallbacks {sdpa_text}"


def format_gib(n: int | None) -> str:
    return "n/a (not a CUDA run)" if n is None else f"{n / 2**30:.2f} GiB"


def summary_dict(loaded: LoadedModel, settings: GenerationSettings, attention: str, result: RunResult,
                 output: str | None, parallel: dict | None = None) -> dict:
    steps = result.step_seconds
    return {
        "model": loaded.name, "family": loaded.family, "random_weights": loaded.random_weights,
        "note": builtin_models.RANDOM_WEIGHTS_NOTE.format(name=loaded.name) if loaded.random_weights else None,
        "device": str(loaded.device), "dtype": str(loaded.dtype).replace("torch.", ""),
        "gpu": torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else None,
        "torch": torch.__version__,
        "height": settings.height, "width": settings.width, "num_frames": settings.num_frames,
        "steps": settings.steps, "guidance_scale": settings.guidance_scale, "seed": settings.seed,
        "attention": attention,
        "step_seconds": steps,
        "step_seconds_mean": statistics.fmean(steps), "step_seconds_median": statistics.median(steps),
        "step_seconds_steady_mean": result.steady_step_seconds,
        "total_seconds": result.total_seconds, "prepare_seconds": result.prepare_seconds,
        "denoise_seconds": result.denoise_seconds, "decode_seconds": result.decode_seconds,
        "warmup_seconds": result.warmup_seconds,
        "peak_gpu_bytes": result.peak_gpu_bytes, "fsattn_stats": result.stats,
        "recipe": recipe_summary(loaded),
        "output": output,
        "frames_written": None if result.frames is None else int(result.frames.shape[0]),
        "parallel": parallel,
    }


def print_summary(summary: dict) -> None:
    steps = summary["step_seconds"]
    rows = [
        ("model", summary["model"] + ("  [RANDOM WEIGHTS: the video is noise-like by construction]"
                                      if summary["random_weights"] else "")),
        ("video", f"{summary['num_frames']} frames x {summary['height']}x{summary['width']}, {summary['steps']} steps, "
                  f"guidance {summary['guidance_scale']}, seed {summary['seed']}"),
        ("device / dtype", f"{summary['device']}{' (' + summary['gpu'] + ')' if summary['gpu'] else ''} / "
                           f"{summary['dtype']}"),
        ("attention", summary["attention"]),
        ("time per step", f"{summary['step_seconds_mean']:.3f} s mean, {summary['step_seconds_median']:.3f} s median, "
                          f"{summary['step_seconds_steady_mean']:.3f} s after the first (first {steps[0]:.3f} s)"),
        ("time in total", f"{summary['total_seconds']:.2f} s (prompt + setup {summary['prepare_seconds']:.2f} s, "
                          f"denoising {summary['denoise_seconds']:.2f} s, decode {summary['decode_seconds']:.2f} s)"
                          + (f"; untimed warm-up before it {summary['warmup_seconds']:.2f} s (compilation included)"
                             if summary.get("warmup_seconds") is not None else "")),
        ("fsattn", fallback_line(summary["fsattn_stats"])),
        ("recipe", describe_recipe(summary.get("recipe"))),
        ("peak GPU memory", format_gib(summary["peak_gpu_bytes"])),
        ("output", summary["output"] or "none (latents only: --no-decode or no VAE)"),
    ]
    parallel = summary.get("parallel")
    if parallel:
        per_rank = ", ".join(f"rank {i} {t:.2f} s" for i, t in enumerate(parallel["rank_total_seconds"]))
        rows.insert(3, ("context parallel", f"{parallel['world_size']} GPUs: ulysses {parallel['ulysses_degree']} x "
                                            f"ring {parallel['ring_degree']} (rank 0's numbers below)"))
        rows.append(("time per rank", f"{per_rank}; slowest {max(parallel['rank_total_seconds']):.2f} s"))
    width = max(len(k) for k, _ in rows)
    print("\n== generate_video summary ==")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if summary["note"]:
        print("NOTE: " + summary["note"])


def json_safe(value):
    """JSON without NaN/Infinity literals: non-finite floats become the strings 'inf', '-inf', 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    return value


def write_json(data: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(data), f, indent=2, allow_nan=False)


def default_warmup(args, device: torch.device) -> int:
    if args.warmup_steps is not None:
        if args.warmup_steps < 0:
            raise SystemExit(f"--warmup-steps={args.warmup_steps}; expected an integer >= 0")
        return args.warmup_steps
    return 1 if device.type == "cuda" else 0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--attention", choices=("fsattn", "sdpa"), default=None,
                        help="fsattn (default) or sdpa (diffusers' default attention)")
    add_fsattn_args(parser)
    parser.add_argument("--output", default=None,
                        help="mp4 path (default: outputs/<model>-<attention><+recipe parts>.mp4)")
    parser.add_argument("--summary-json", default=None, help="also write the summary as JSON here")
    args = parser.parse_args(argv)

    if args.recipe and args.attention == "sdpa":
        raise SystemExit("--recipe runs fsattn; it cannot be combined with --attention sdpa (use --fuse-qkv "
                         "--fp8-linear --compile for the other parts on diffusers' attention)")
    args.attention = args.attention or "fsattn"
    parts = recipe_parts(args)
    parallel = check_parallel_args(args.ulysses_degree, args.ring_degree, args.attention)
    if parallel is not None and args.cpu_offload:
        raise SystemExit("--cpu-offload cannot be combined with --ulysses-degree / --ring-degree")
    if args.ring_degree > 1 and (args.skip_first_steps or args.skip_last_steps or args.skip_blocks):
        # Skipped steps and blocks run diffusers' native attention, which cannot run a ring.
        raise SystemExit("--skip-first-steps / --skip-last-steps / --skip-blocks cannot be combined with --ring-degree > 1")
    device_arg = str(start_parallel(parallel, args.device)) if parallel is not None else args.device
    device, dtype = resolve_device_dtype(device_arg, args.dtype)
    config = parse_fsattn_config(args.fsattn_config)
    check_recipe_parts(parts, device, dtype)
    if not args.no_decode:
        check_video_writer()
    loaded = load_model(args.model, device, dtype, cpu_offload=args.cpu_offload, seed=args.seed)
    main_rank = parallel is None or parallel.is_main
    if loaded.random_weights and main_rank:
        print("NOTE: " + builtin_models.RANDOM_WEIGHTS_NOTE.format(name=loaded.name), file=sys.stderr)
    settings = resolve_settings(args, loaded)
    skip = skip_kwargs(args) if args.attention == "fsattn" else {}
    if parallel is not None and parts.any:
        # The recipe goes after context parallelism: its compilation leaves the block carrying the
        # parallel input-splitting hook eager (fsattn_diffusers.recipe).
        enable_context_parallelism(loaded, parallel)
    attention = set_up(loaded, args.attention, config if args.attention == "fsattn" else None, skip, parts)
    if parallel is not None:
        if not parts.any:
            enable_context_parallelism(loaded, parallel)
        attention += f"; context parallel: ulysses {parallel.ulysses_degree} x ring {parallel.ring_degree}"
    result = run_pipeline(loaded, settings, warmup_steps=default_warmup(args, device),
                          desc=f"denoising [{args.attention}]")
    rank_times = gather_rank_times(result, parallel) if parallel is not None else None
    output = None
    if result.frames is not None and main_rank:
        safe_name = os.path.basename(os.path.normpath(args.model)).replace("/", "_")
        default_output = os.path.join("outputs", f"{safe_name}-{args.attention}{parts.label()}.mp4")
        output = write_video(result.frames, args.output or default_output, settings.fps)
    summary = summary_dict(loaded, settings, attention, result, output, rank_times)
    if main_rank:
        print_summary(summary)
        if args.summary_json:
            write_json(summary, args.summary_json)
    if parallel is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
