#!/usr/bin/env python
"""End to end: Wan 2.1's denoising loop on diffusers' default attention, then on fsattn, in one process.

    python benchmarks/bench_e2e.py --model wan2.1-t2v-1.3b --steps 3 --out e2e_13b.json      # 480x832, 81 frames
    python benchmarks/bench_e2e.py --model wan2.1-t2v-14b --steps 2 --out e2e_14b.json       # 720x1280, 81 frames
    python benchmarks/bench_e2e.py --model wan2.1-t2v-1.3b --compile --out e2e_13b_compiled.json
    torchrun --nproc-per-node 2 benchmarks/bench_e2e.py --model wan2.1-t2v-14b --ulysses-degree 2
    python benchmarks/bench_e2e.py --model tiny --height 64 --width 96 --frames 9   # CPU, seconds

What is timed: the denoising loop only, written out as diffusers' ``WanPipeline.__call__`` runs it
(UniPC scheduler with Wan's flow shift, a conditional and an unconditional transformer forward per
step, the guidance combine, ``scheduler.step``). There is no text encoder (the prompt embeddings
are random, of the real shape ``(1, 512, 4096)``) and no VAE decode. The transformer is the real
Wan 2.1 architecture with random weights (``builtin_models.build_transformer``): nothing is
downloaded, and the outputs measure speed and the A/B difference, never picture quality.

Both sides run on the same transformer object, the same initial noise and the same prompt
embeddings, in the order ``--sides`` gives (default: baseline first, then fsattn, always). The
baseline is the model as diffusers builds it; fsattn is ``apply_fsattn(transformer)`` (or, with
context parallelism, the ``"fsattn"`` attention backend), removed afterwards and checked to
restore the original processors. Per side: ``--warmup-steps`` untimed steps (Triton, cuDNN and
torch.compile warm-up), ``--steps`` steps timed with CUDA events (synchronised after each step),
then ``--profile-steps`` steps under torch.profiler for the attention share. Peak memory is
``max_memory_allocated`` over the timed steps (weights included).

Context parallelism (``--ulysses-degree``/``--ring-degree`` under torchrun): diffusers' public
``transformer.enable_parallelism(config=ContextParallelConfig(...))``, once, before both sides;
rank 0 reports each rank's step times and, per step, the slowest rank's. The fsattn side then
uses the ``"fsattn"`` backend by name, which diffusers accepts only if fsattn_diffusers registers
it with context-parallel support (assumed here; the script refuses up front otherwise).

Attention share: the profiled steps are extra steps, so the profiler's overhead never touches the
timed ones. On a GPU, the device time of the attention kernels (fsattn's ``_fsattn_*`` and
``_quantize_*`` Triton kernels; the flash, fmha and cuDNN SDPA kernels) over the device time of
every kernel in the profiled steps. The outermost attention ops (``fsattn::attention``, the custom op
around all of fsattn's kernels, or aten's ``scaled_dot_product_attention`` family) tell self- from
cross-attention by their input shapes (query and key shapes equal: self); their
``device_time_total`` is kept as a cross-check only, because on torch 2.11 it overcounts (SDPA at
101 % of the step on the H200). On a CPU the ops' CPU time over the profiled steps' wall time.
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

MODELS = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "tiny")
SIDES = ("baseline", "fsattn")
TEXT_TOKENS = 512  # WanPipeline's max_sequence_length: prompt embeddings are always padded to it
# The targets of issue 5, per (model, height, width): fsattn's speed-up per denoising step.
SPEEDUP_TARGETS = {("wan2.1-t2v-1.3b", 480, 832): 1.3, ("wan2.1-t2v-14b", 720, 1280): 1.4}
PEAK_MEMORY_TARGET = 1.10  # fsattn's peak memory over the baseline's, at most
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Outermost profiler ops that are one attention call (see the module docstring).
ATTENTION_OP = re.compile(r"^(fsattn::attention|aten::_?(scaled_dot_product\w*|flash_attention\w*|"
                          r"efficient_attention\w*|_flash_attention\w*|_efficient_attention\w*|_cudnn_attention\w*))$")
# Cross-check by device kernel name: fsattn's Triton kernels, and the SDPA kernels of flash, the
# memory-efficient path (fmha) and cuDNN (its fused kernels carry "sdpa" or "flash" in the name).
ATTENTION_KERNEL = re.compile(r"_fsattn_|_quantize_(q|kv)_kernel|flash|fmha|sdpa|attention", re.IGNORECASE)

CPU_TIMING_NOTE = ("CPU run: fsattn runs a PyTorch emulation of the GPU kernel's numerics here, so these times and "
                   "the speed-up say nothing about GPU speed; the fidelity figures do stand for the GPU kernel.")
SCOPE_NOTE = ("Timed: the denoising loop only (two transformer forwards for classifier-free guidance, the "
              "guidance combine and scheduler.step per step), as WanPipeline runs it; no text encoder (random "
              "prompt embeddings of the real shape) and no VAE decode. Random weights.")


# ----------------------------------------------------------------------------- arguments

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


def _sides(text: str) -> tuple[str, ...]:
    sides = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in sides if s not in SIDES]
    if not sides or bad or len(set(sides)) != len(sides):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated, non-repeating list of {', '.join(SIDES)} (run in that order), got {text!r}")
    return sides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="wan2.1-t2v-1.3b",
                        help="built-in Wan transformer (random weights; tiny is CPU-sized); default wan2.1-t2v-1.3b")
    parser.add_argument("--height", type=_positive_int, default=None, help="default: the model's (1.3B 480, 14B 720)")
    parser.add_argument("--width", type=_positive_int, default=None, help="default: the model's (1.3B 832, 14B 1280)")
    parser.add_argument("--frames", type=_positive_int, default=None,
                        help="video frames, 4k+1; default: the model's (81)")
    parser.add_argument("--steps", type=_positive_int, default=3, help="timed denoising steps per side (default 3)")
    parser.add_argument("--warmup-steps", type=_nonnegative_int, default=1,
                        help="untimed steps first, per side (default 1; at least 1 with --compile: they carry "
                             "the compile)")
    parser.add_argument("--profile-steps", type=_nonnegative_int, default=1,
                        help="extra steps under torch.profiler for the attention share (default 1; 0: none)")
    parser.add_argument("--schedule-steps", type=_positive_int, default=None,
                        help="length of the scheduler's schedule (default: warm-up + timed + profiled steps, so the "
                             "loop runs a whole schedule); larger runs the first steps of a longer schedule")
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's (5.0); <= 1: no CFG")
    parser.add_argument("--flow-shift", type=float, default=None,
                        help="UniPC flow shift; default 3.0 below 720p, 5.0 at 720p and above (as Wan uses)")
    parser.add_argument("--seed", type=int, default=0, help="weights, initial noise and prompt embeddings (default 0)")
    parser.add_argument("--sides", type=_sides, default=SIDES,
                        help="which sides to run, in this order (default baseline,fsattn)")
    parser.add_argument("--fsattn-config", default=None,
                        help="FSAttnConfig fields as JSON, e.g. '{\"pv_format\": \"16bit\"}'")
    parser.add_argument("--fsattn-via", choices=("auto", "apply", "backend"), default="auto",
                        help="apply: apply_fsattn(transformer); backend: register_fsattn_backend() + "
                             "set_attention_backend('fsattn'); auto (default): backend under context parallelism, "
                             "else apply")
    parser.add_argument("--compile", action="store_true", help="torch.compile the transformer (both sides)")
    parser.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                        help="blocks (default): compile_repeated_blocks(), regional, as diffusers recommends; "
                             "model: the whole transformer")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (default inductor; tests use eager)")
    for name in ("--ulysses-degree", "--ring-degree"):
        parser.add_argument(name, type=_positive_int, default=1, help="context parallelism, under torchrun (default 1)")
    parser.add_argument("--check-restore-forward", action="store_true",
                        help="also check that after remove_fsattn one forward is bit-identical to one before "
                             "apply_fsattn (two extra forwards); the processors are always checked")
    parser.add_argument("--device", default="auto", help="auto (default): cuda when available, else cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


@dataclasses.dataclass
class Settings:
    model: str
    height: int
    width: int
    frames: int
    latent_shape: tuple[int, ...]  # (B, C, F, H, W) of the latents
    video_tokens: int  # self-attention sequence length (after the 1x2x2 patch)
    steps: int
    warmup_steps: int
    profile_steps: int
    schedule_steps: int
    guidance_scale: float
    flow_shift: float
    seed: int
    sides: tuple[str, ...]
    fsattn_config: dict | None
    fsattn_via: str
    compile: bool
    compile_scope: str
    compile_backend: str
    ulysses_degree: int
    ring_degree: int
    device: str
    dtype: str


def resolve_settings(parser: argparse.ArgumentParser, args) -> tuple[Settings, torch.device, torch.dtype]:
    """Checked settings with the model's defaults filled in; argument errors go through ``parser.error``."""
    spec = builtin_models.get_builtin(args.model)
    height, width, frames = args.height or spec.height, args.width or spec.width, args.frames or spec.num_frames
    patch = spec.transformer_config["patch_size"]
    multiple = 8 * patch[1]  # the VAE's 8x spatial compression, then the 2x2 patch
    for name, value in (("--height", height), ("--width", width)):
        if value % multiple:
            parser.error(f"{name}={value}: expected a multiple of {multiple} (8x VAE compression x 2x2 patch), "
                         f"e.g. {max(multiple, value // multiple * multiple)}")
    if frames % 4 != 1:
        parser.error(f"--frames={frames}: expected 4k+1 frames (the VAE packs 4 frames per latent), e.g. "
                     f"{frames // 4 * 4 + 1}")
    if args.compile and args.warmup_steps < 1:
        parser.error(f"--warmup-steps={args.warmup_steps} with --compile: expected at least 1, the compile happens in "
                     "the first step and must not be timed")
    run_steps = args.warmup_steps + args.steps + args.profile_steps
    schedule_steps = args.schedule_steps or run_steps
    if schedule_steps < run_steps:
        parser.error(f"--schedule-steps={schedule_steps} is shorter than the {run_steps} steps run "
                     f"(warm-up {args.warmup_steps} + timed {args.steps} + profiled {args.profile_steps})")

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device={args.device!r} is not a torch device; expected auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device={args.device!r} but torch {torch.__version__} sees no CUDA GPU; use --device cpu")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device={args.device!r}: expected auto, cpu or cuda")
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    parallel = args.ulysses_degree * args.ring_degree
    if parallel > 1:
        if device.type != "cuda":
            parser.error(f"--ulysses-degree={args.ulysses_degree} --ring-degree={args.ring_degree} on {device}: "
                         "context parallelism needs CUDA GPUs (diffusers' enable_parallelism puts each rank on an "
                         "accelerator)")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != parallel:
            parser.error(f"--ulysses-degree={args.ulysses_degree} x --ring-degree={args.ring_degree} = {parallel} "
                         f"processes, but WORLD_SIZE={world}; run under torchrun --nproc-per-node {parallel}")
        heads = spec.transformer_config["num_attention_heads"]
        if heads % args.ulysses_degree:
            parser.error(f"--ulysses-degree={args.ulysses_degree} does not divide {args.model}'s {heads} heads")

    fsattn_config = None
    if args.fsattn_config:
        try:
            fsattn_config = json.loads(args.fsattn_config)
            fsattn_diffusers.FSAttnConfig(**fsattn_config)
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            parser.error(f"--fsattn-config={args.fsattn_config!r}: expected a JSON object of FSAttnConfig fields "
                         f"({exc})")
    via = args.fsattn_via
    if via == "auto":
        via = "backend" if parallel > 1 else "apply"

    latent_frames = (frames - 1) // 4 + 1
    channels = spec.transformer_config["in_channels"]
    latent_shape = (1, channels, latent_frames, height // 8, width // 8)
    tokens = latent_frames // patch[0] * (height // 8 // patch[1]) * (width // 8 // patch[2])
    guidance = spec.guidance_scale if args.guidance_scale is None else args.guidance_scale
    # diffusers' WanPipeline docs: flow_shift 3.0 for 480p, 5.0 for 720p.
    flow_shift = args.flow_shift if args.flow_shift is not None else (5.0 if min(height, width) >= 720 else 3.0)
    settings = Settings(
        model=args.model, height=height, width=width, frames=frames, latent_shape=latent_shape, video_tokens=tokens,
        steps=args.steps, warmup_steps=args.warmup_steps, profile_steps=args.profile_steps,
        schedule_steps=schedule_steps, guidance_scale=guidance, flow_shift=flow_shift, seed=args.seed,
        sides=tuple(args.sides), fsattn_config=fsattn_config, fsattn_via=via, compile=args.compile,
        compile_scope=args.compile_scope, compile_backend=args.compile_backend,
        ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree, device=str(device),
        dtype=str(dtype).replace("torch.", ""))
    return settings, device, dtype


# ----------------------------------------------------------------------------- distributed

class Group:
    """This process's place among the context-parallel ranks (one rank when not under torchrun)."""

    def __init__(self, settings: Settings, device: torch.device):
        self.size = settings.ulysses_degree * settings.ring_degree
        self.rank = 0
        self.device = device
        if self.size > 1:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if device.type == "cuda":
                torch.cuda.set_device(local_rank)
                self.device = torch.device("cuda", local_rank)
            torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self.rank = torch.distributed.get_rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (a list of one without context parallelism)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.size > 1:
            torch.distributed.destroy_process_group()


def active_attention_backend() -> str:
    """The backend diffusers runs for processors that name none ("native" unless DIFFUSERS_ATTN_BACKEND says)."""
    # diffusers' registry is private (the package keeps it to diffusers_backend.py); a benchmark only reads it.
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry.get_active_backend()[0].value


def backend_supports_context_parallel(member) -> bool:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return _AttentionBackendRegistry._is_context_parallel_available(member)


def enable_context_parallelism(transformer, settings: Settings) -> None:
    """diffusers' public API: ``enable_parallelism(config=ContextParallelConfig(...))``, once per model."""
    from diffusers import ContextParallelConfig

    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=settings.ulysses_degree,
                                                                ring_degree=settings.ring_degree))


# ----------------------------------------------------------------------------- inputs and the loop

@dataclasses.dataclass
class Inputs:
    latents: torch.Tensor  # float32 initial noise, as WanPipeline.prepare_latents makes it
    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor


def make_inputs(settings: Settings, text_dim: int, device: torch.device, dtype: torch.dtype) -> Inputs:
    """Noise and prompt embeddings from a CPU generator: the same on every side and every rank."""
    generator = torch.Generator("cpu").manual_seed(settings.seed)
    latents = torch.randn(settings.latent_shape, generator=generator, dtype=torch.float32)
    embeds = [torch.randn(1, TEXT_TOKENS, text_dim, generator=generator) for _ in range(2)]
    return Inputs(latents.to(device), embeds[0].to(device, dtype), embeds[1].to(device, dtype))


def make_scheduler(settings: Settings, device: torch.device):
    """Wan's UniPC scheduler (the Wan 2.1 repos' scheduler_config.json) with the flow shift chosen."""
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(**{**builtin_models.WAN_SCHEDULER, "flow_shift": settings.flow_shift})
    scheduler.set_timesteps(settings.schedule_steps, device=device)
    scheduler.set_begin_index(0)
    return scheduler


def denoise_step(transformer, scheduler, latents, index: int, inputs: Inputs, guidance_scale: float,
                 dtype: torch.dtype, keep: dict | None = None) -> torch.Tensor:
    """One step of WanPipeline.__call__'s loop (diffusers 0.42): cond and uncond forwards, combine, step."""
    t = scheduler.timesteps[index]
    latent_model_input = latents.to(dtype)
    timestep = t.expand(latents.shape[0])
    context = {"step_index": index, "sigma": float(scheduler.sigmas[index]),
               "num_inference_steps": len(scheduler.timesteps)}
    with transformer.cache_context("cond", **context):
        noise_pred = transformer(hidden_states=latent_model_input, timestep=timestep,
                                 encoder_hidden_states=inputs.prompt_embeds, return_dict=False)[0]
    if keep is not None:
        keep["cond"] = noise_pred
    if guidance_scale > 1.0:  # WanPipeline.do_classifier_free_guidance
        with transformer.cache_context("uncond", **context):
            noise_uncond = transformer(hidden_states=latent_model_input, timestep=timestep,
                                       encoder_hidden_states=inputs.negative_prompt_embeds, return_dict=False)[0]
        noise_pred = noise_uncond + guidance_scale * (noise_pred - noise_uncond)
    return scheduler.step(noise_pred, t, latents, return_dict=False)[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Seconds of one step: CUDA events on a GPU (synchronised at the end), perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        _sync(self.device)
        self.wall_start = time.perf_counter()
        if self.device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.end.record()
        _sync(self.device)
        self.wall = time.perf_counter() - self.wall_start
        self.seconds = self.start.elapsed_time(self.end) / 1e3 if self.device.type == "cuda" else self.wall
        return False


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
    """Attention time and share of the profiled steps (method in the module docstring)."""
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
        # Device-side work: kernels, memcpy, memset. GPU user annotations (ranges such as compiled
        # graph markers) span kernels already counted, so they are left out.
        # getattr: older torch releases (the GPU machine's) may lack these attributes.
        kernels = [ev for ev in events if ev.device_type != torch.autograd.DeviceType.CPU
                   and not getattr(ev, "is_user_annotation", False)
                   and "annotation" not in str(getattr(ev, "activity_type", None) or "")]
        device_total = sum(ev.time_range.elapsed_us() for ev in kernels) / 1e6
        by_name = sum(ev.time_range.elapsed_us() for ev in kernels if ATTENTION_KERNEL.search(ev.name)) / 1e6
        # The share is counted by kernel name. The ops' device_time_total (by_kind) overcounts on
        # torch 2.11: on the H200 it gave SDPA 101 % of the step's device time (1.242 s of 1.225 s
        # for Wan-1.3B), while by kernel name it was 56 %; the ops still tell self from cross.
        result.update(
            method="device time of attention kernels (fsattn's Triton kernels, SDPA's flash/fmha/cuDNN kernels) / "
                   "device time of all kernels, over the profiled steps; by_kind: the ops' device_time_total "
                   "(overcounts on torch 2.11)",
            device_seconds_per_step=device_total / steps,
            attention_seconds_per_step=by_name / steps,
            attention_share=by_name / device_total if device_total else None,
            op_device_time_crosscheck={"attention_seconds_per_step": total_attention / steps,
                                       "attention_share": total_attention / device_total if device_total else None})
    else:
        result.update(method="CPU time of the outermost attention ops / wall time of the profiled steps",
                      attention_share=total_attention / wall_seconds if wall_seconds else None)
    return result


# ----------------------------------------------------------------------------- one side

def attention_processors(transformer) -> dict:
    return dict(transformer.attn_processors)


def enable_fsattn(transformer, settings: Settings) -> str:
    """Route attention to fsattn the way ``settings.fsattn_via`` says; returns a description."""
    config = fsattn_diffusers.FSAttnConfig(**settings.fsattn_config) if settings.fsattn_config else None
    if settings.fsattn_via == "apply":
        fsattn_diffusers.apply_fsattn(transformer, config=config)
        return "apply_fsattn(transformer)"
    member = fsattn_diffusers.register_fsattn_backend(config=config)
    transformer.set_attention_backend(member.value)
    return "set_attention_backend('fsattn')"


def check_fsattn_route(settings: Settings) -> None:
    """Refuse, before any side runs, a route to fsattn that context parallelism would refuse."""
    if "fsattn" not in settings.sides or settings.fsattn_via != "backend":
        return
    if settings.ulysses_degree * settings.ring_degree == 1:
        return
    if not backend_supports_context_parallel(fsattn_diffusers.register_fsattn_backend()):
        raise SystemExit("the 'fsattn' attention backend of this fsattn_diffusers is registered without context-"
                         "parallel support, so diffusers refuses it under context parallelism. Run without "
                         "--ulysses-degree/--ring-degree, or with --fsattn-via apply (whose calls then fall back to "
                         "the native backend, counted in fsattn_stats: that would measure the baseline twice)")


def disable_fsattn(transformer, settings: Settings, previous_backend: str) -> None:
    if settings.fsattn_via == "apply":
        fsattn_diffusers.remove_fsattn(transformer)
    else:
        # set_attention_backend also changed diffusers' process-wide active backend, which
        # reset_attention_backend leaves alone: put the previous one back first.
        transformer.set_attention_backend(previous_backend)
        transformer.reset_attention_backend()


def run_side(side: str, transformer, inputs: Inputs, settings: Settings, group: Group, dtype: torch.dtype) -> dict:
    """Warm-up, timed and profiled steps of one side over one schedule; the final latents in ``latents``."""
    from torch._dynamo.utils import counters

    device = group.device
    scheduler = make_scheduler(settings, device)
    latents = inputs.latents.clone()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    memory_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    graphs_before = counters["stats"]["unique_graphs"]
    index = 0
    warmup, steps = [], []
    with torch.no_grad():  # as WanPipeline.__call__; not inference_mode (fsattn's stats counters must stay resettable)
        for _ in range(settings.warmup_steps):
            with StepTimer(device) as timer:
                latents = denoise_step(transformer, scheduler, latents, index, inputs, settings.guidance_scale, dtype)
            warmup.append(timer.wall)
            index += 1
        graphs_compiled = counters["stats"]["unique_graphs"] - graphs_before
        fsattn_diffusers.reset_stats()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(settings.steps):
            with StepTimer(device) as timer:
                latents = denoise_step(transformer, scheduler, latents, index, inputs, settings.guidance_scale, dtype)
            steps.append(timer.seconds)
            index += 1
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        peak_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        fsattn_stats = fsattn_diffusers.stats()
        share = None
        if settings.profile_steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                with StepTimer(device) as timer:
                    for _ in range(settings.profile_steps):
                        latents = denoise_step(transformer, scheduler, latents, index, inputs,
                                               settings.guidance_scale, dtype)
                        index += 1
            share = attention_share(prof, device, timer.wall, settings.profile_steps)
            del prof
    # Every rank times its own steps; a step of the group lasts as long as its slowest rank.
    per_rank = group.gather({"rank": group.rank, "step_seconds": steps, "warmup_step_seconds": warmup,
                             "peak_memory_bytes": peak, "peak_memory_reserved_bytes": peak_reserved})
    step_seconds = [max(r["step_seconds"][i] for r in per_rank) for i in range(len(steps))]
    warmup_seconds = [max(r["warmup_step_seconds"][i] for r in per_rank) for i in range(len(warmup))]
    median = statistics.median(step_seconds)
    result = {
        "side": side,
        "step_seconds": step_seconds,
        "step_seconds_median": median,
        "step_seconds_mean": statistics.fmean(step_seconds),
        "step_seconds_min": min(step_seconds),
        "warmup_step_seconds": warmup_seconds,
        # The first warm-up step carries compile (and Triton/cuDNN set-up); a steady step is the median.
        "compile_seconds_estimate": (warmup_seconds[0] - median) if settings.compile and warmup_seconds else None,
        "graphs_compiled_in_warmup": graphs_compiled if settings.compile else None,
        "peak_memory_bytes": None if peak is None else max(r["peak_memory_bytes"] for r in per_rank),
        "peak_memory_reserved_bytes": None if peak is None else max(r["peak_memory_reserved_bytes"] for r in per_rank),
        "memory_before_bytes": memory_before,
        "fsattn_stats": fsattn_stats,
        "attention": share,
        "per_rank": per_rank if group.size > 1 else None,
    }
    result["latents"] = latents.float().cpu()
    return result


def run_fsattn_side(transformer, inputs: Inputs, settings: Settings, group: Group, dtype: torch.dtype,
                    default_backend: str, check_restore_forward: bool) -> tuple[dict, dict]:
    """The fsattn side between enabling and removing fsattn; and whether removing it restored the model."""
    originals = attention_processors(transformer)
    before = restore_forward_check(transformer, inputs, settings, group, dtype) if check_restore_forward else None
    label = "fsattn via " + enable_fsattn(transformer, settings)
    result = run_side("fsattn", transformer, inputs, settings, group, dtype)
    result["label"] = label
    disable_fsattn(transformer, settings, default_backend)
    now = attention_processors(transformer)
    restore = {
        # remove_fsattn puts the very same processor objects back; the backend route only sets and
        # resets their backend attribute, so the objects never change there.
        "processors_restored": now.keys() == originals.keys() and all(now[k] is originals[k] for k in originals),
        "backends_reset": all(getattr(p, "_attention_backend", None) is None for p in now.values())
        and active_attention_backend() == default_backend,
    }
    if before is not None:
        after = restore_forward_check(transformer, inputs, settings, group, dtype)
        restore["forward_max_abs_difference"] = float((after - before).abs().max())
        restore["forward_identical"] = bool(torch.equal(after, before))
    return result, restore


def fsattn_side_warnings(result: dict, restore: dict) -> list[str]:
    """What makes the fsattn side's numbers mean something else than they seem to."""
    warnings = []
    if not (restore["processors_restored"] and restore["backends_reset"] and restore.get("forward_identical", True)):
        warnings.append(f"removing fsattn did not restore the transformer: {restore}")
    stats = result["fsattn_stats"]
    if sum(stats["calls"].values()) == 0:
        warnings.append("the fsattn side made no fsattn call: it measured the original attention")
    # "small_problem" is the size routing (FSAttnConfig.sdpa_below_flops), a choice, not a failure.
    refused = {reason: n for reason, n in stats["sdpa_fallbacks"].items() if reason != "small_problem"}
    if refused:
        warnings.append(f"fsattn sent calls to SDPA instead (reason: calls): {refused}")
    return warnings


def restore_forward_check(transformer, inputs: Inputs, settings: Settings, group: Group, dtype) -> torch.Tensor:
    """One conditional forward at the schedule's first timestep (for the remove_fsattn check)."""
    scheduler = make_scheduler(settings, group.device)
    keep: dict = {}
    with torch.no_grad():
        denoise_step(transformer, scheduler, inputs.latents, 0, inputs, 1.0, dtype, keep=keep)
    return keep["cond"].float().cpu()


# ----------------------------------------------------------------------------- report

def environment(device: torch.device, group: Group) -> dict:
    import diffusers

    info = {"torch": torch.__version__, "diffusers": diffusers.__version__,
            "fsattn_diffusers": fsattn_diffusers.__version__, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M"), "device": str(device), "world_size": group.size,
            "gpu": None, "capability": None, "triton": None}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["cuda"] = torch.version.cuda
    return info


def fidelity(latents: torch.Tensor, reference: torch.Tensor) -> dict:
    """fsattn's final latents against the baseline's: cosine, relative L1, RMSE, PSNR over the baseline's range."""
    error = metrics.attention_error(latents, reference)
    peak_to_peak = float(reference.max() - reference.min())
    rmse = error["rmse"]
    psnr = math.inf if rmse == 0 else 20 * math.log10(peak_to_peak / rmse)
    return {"cosine": error["cosine"], "rel_l1": error["rel_l1"], "rmse": rmse, "max_abs": error["max_abs"],
            "psnr_db": psnr, "psnr_peak_to_peak": peak_to_peak}


def evaluate_targets(settings: Settings, device: torch.device, speedup, memory_ratio) -> dict:
    """Issue 5's targets where they apply: the speed-up only at its (model, size) on a GPU, memory on any GPU."""
    target = SPEEDUP_TARGETS.get((settings.model, settings.height, settings.width)) if device.type == "cuda" else None
    return {
        "speedup": target,
        "speedup_met": None if target is None or speedup is None else speedup >= target,
        "peak_memory_ratio": PEAK_MEMORY_TARGET,
        "peak_memory_met": None if memory_ratio is None else memory_ratio <= PEAK_MEMORY_TARGET,
    }


def json_safe(value):
    """JSON without NaN/Infinity literals: non-finite floats become the strings 'inf', '-inf', 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _share(side):
    a = side.get("attention")
    if not a or a.get("attention_share") is None:
        return "-"
    return f"{100 * a['attention_share']:.1f} % ({a['attention_seconds_per_step']:.3f} s)"


def print_report(report: dict) -> None:
    cfg = report["config"]
    machine = report["environment"]["gpu"] or report["environment"]["device"]
    print(f"\n== bench_e2e: {cfg['model']} {cfg['height']}x{cfg['width']}, {cfg['frames']} frames "
          f"({cfg['video_tokens']} tokens), {cfg['steps']} timed steps, CFG {cfg['guidance_scale']}"
          f"{', compiled' if cfg['compile'] else ''} on {machine} ==")
    rows = [("", "time/step median", "peak memory", "attention share (time/step)", "compile (s)")]
    for name, side in report["sides"].items():
        compile_s = side["compile_seconds_estimate"]
        rows.append((name, f"{side['step_seconds_median']:.3f} s", _gib(side["peak_memory_bytes"]), _share(side),
                     "-" if compile_s is None else f"{compile_s:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip())
    if report["speedup"] is not None:
        target = report["targets"]["speedup"]
        verdict = "met" if report["targets"]["speedup_met"] else "NOT met"
        print(f"speed-up per step (median): {report['speedup']:.3f}x"
              + (f" (target >= {target}x: {verdict})" if target else ""))
    if report["peak_memory_ratio"] is not None:
        print(f"peak memory fsattn / baseline: {report['peak_memory_ratio']:.3f} (target <= {PEAK_MEMORY_TARGET}: "
              f"{'met' if report['targets']['peak_memory_met'] else 'NOT met'})")
    if report["fidelity"] is not None:
        f = report["fidelity"]
        print(f"final latents fsattn vs baseline: cos {f['cosine']:.6f}, rel-L1 {100 * f['rel_l1']:.2f} %, "
              f"PSNR {f['psnr_db']:.1f} dB")
    for line in report["warnings"]:
        print("WARNING: " + line)
    for note in (report["note"], report["timing_note"]):
        if note:
            print("NOTE: " + note)


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings, device, dtype = resolve_settings(parser, args)
    group = Group(settings, device)
    try:
        return _run(settings, group, dtype, args.out, args.check_restore_forward)
    finally:
        group.close()


def _run(settings: Settings, group: Group, dtype: torch.dtype, out: str | None, check_restore_forward: bool) -> dict:
    device = group.device
    check_fsattn_route(settings)
    transformer = builtin_models.build_transformer(settings.model, device=device, dtype=dtype, seed=settings.seed)
    inputs = make_inputs(settings, transformer.config.text_dim, device, dtype)
    if group.size > 1:
        enable_context_parallelism(transformer, settings)
    if settings.compile:
        # Compiled once: apply_fsattn swaps processors, the guards fail and the fsattn side
        # recompiles in its first warm-up step (graphs_compiled_in_warmup shows it).
        if settings.compile_scope == "blocks":
            transformer.compile_repeated_blocks(backend=settings.compile_backend)
        else:
            transformer.compile(backend=settings.compile_backend)
    default_backend = active_attention_backend()

    sides, latents, warnings = {}, {}, []
    restore = None
    for side in settings.sides:
        if side == "baseline":
            result = run_side(side, transformer, inputs, settings, group, dtype)
            result["label"] = f"diffusers default attention (backend {default_backend!r})"
        else:
            result, restore = run_fsattn_side(transformer, inputs, settings, group, dtype, default_backend,
                                              check_restore_forward)
            warnings += fsattn_side_warnings(result, restore)
        latents[side] = result.pop("latents")
        sides[side] = result

    both = all(s in sides for s in SIDES)
    speedup = sides["baseline"]["step_seconds_median"] / sides["fsattn"]["step_seconds_median"] if both else None
    peaks = [sides[s]["peak_memory_bytes"] for s in SIDES if s in sides]
    memory_ratio = peaks[1] / peaks[0] if both and None not in peaks else None
    attention_speedup = None
    if both and all(sides[s]["attention"] for s in SIDES):
        fs_attention = sides["fsattn"]["attention"]["attention_seconds_per_step"]
        if fs_attention:
            attention_speedup = sides["baseline"]["attention"]["attention_seconds_per_step"] / fs_attention
    report = {
        "benchmark": "bench_e2e",
        "environment": environment(device, group),
        "config": dataclasses.asdict(settings),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv) if __name__ == "__main__" else None,
        "order": list(settings.sides),
        "note": SCOPE_NOTE + " " + builtin_models.RANDOM_WEIGHTS_NOTE.format(name=settings.model),
        "timing_note": CPU_TIMING_NOTE if device.type == "cpu" else None,
        "sides": sides,
        "speedup": speedup,
        "attention_speedup": attention_speedup,
        "peak_memory_ratio": memory_ratio,
        "fidelity": fidelity(latents["fsattn"], latents["baseline"]) if both else None,
        "restore_check": restore,
        "targets": evaluate_targets(settings, device, speedup, memory_ratio),
        "warnings": warnings,
    }
    if group.is_main:
        print_report(report)
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as f:
                json.dump(json_safe(report), f, indent=1, allow_nan=False)
            print(f"results: {out}")
    return report


if __name__ == "__main__":
    main()
