"""apply_fsattn / remove_fsattn: patch the attention of a pipeline's transformer(s), reversibly.

Instances only, never classes: each attention module of the transformer gets a bound copy of its
own processor (:func:`fsattn_diffusers.processor.bind`), and the originals are kept on the model
so that :func:`remove_fsattn` puts the very same objects back (bit-identical output).

Denoising steps are counted by the pipeline's scheduler, not by transformer calls: a pipeline
calls ``scheduler.set_timesteps`` once before its loop and ``scheduler.step`` once per step, after
every transformer call of that step, however many there are (classifier-free guidance as two
calls, Wan 2.2's two transformers). Counting transformer calls would count CFG twice; tracking the
timestep passed to the transformer would need a device sync and a hook inside the (possibly
compiled) forward. The scheduler hook stays outside the model: the compiled graph only reads one
Python bool, so it compiles at most twice (fsattn on, fsattn off). Pipelines that start part-way
through the schedule (video-to-video, ``strength`` < 1) run fewer steps than ``set_timesteps``
made; the first ``scheduler.step`` tells where the run started (its timestep's place in the
schedule), and the last steps are counted from there.
"""

from __future__ import annotations

import logging

import torch

from . import families
from .config import FSAttnConfig
from .diffusers_backend import reset_fsattn_backend
from .processor import AttentionRoute, FSAttnProcessor, bind, record_own_processor_classes

logger = logging.getLogger("fsattn_diffusers")

_PATCH_ATTR = "_fsattn_patch"
_STEPS_ATTR = "_fsattn_steps"
_MISSING = object()


class DenoisingSteps:
    """Counts a pipeline's denoising steps and says whether fsattn runs in the current one.

    ``enabled`` is False during the first `skip_first` and the last `skip_last` steps of each run.
    """

    def __init__(self, skip_first: int, skip_last: int):
        self.skip_first = skip_first
        self.skip_last = skip_last
        self.step = 0
        self.total = None
        self.enabled = skip_first == 0

    def start(self, total: int) -> None:
        self.step, self.total = 0, total
        self._update()

    def started_at(self, index: int) -> None:
        """The run began at step `index` of the schedule (strength < 1): `index` fewer steps remain."""
        if self.total is not None and index > 0:
            self.total -= index
            self._update()

    def advance(self) -> None:
        self.step += 1
        self._update()

    def _update(self) -> None:
        late = self.total is not None and self.step >= self.total - self.skip_last
        self.enabled = self.step >= self.skip_first and not late


class _ModelPatch:
    """What apply_fsattn changed on one model: each patched module's processor to restore, and the
    routes its bound processors use."""

    def __init__(self, options: dict, steps):
        self.options = options
        self.steps = steps
        self.originals: dict[torch.nn.Module, object] = {}
        self.routes: dict[tuple, AttentionRoute] = {}

    def route(self, module, processor, kind: str) -> AttentionRoute:
        key = (type(module), type(processor), kind)
        route = self.routes.get(key)
        if route is None:
            route = AttentionRoute(f"{type(module).__name__} {kind} ({type(processor).__name__})",
                                   config=self.options["config"], strict=self.options["strict"], gate=self.steps)
            self.routes[key] = route
        return route


class _RebindingSetProcessor:
    """A patched module's ``set_processor``: a processor set while fsattn is applied is bound to
    fsattn too, so that ``fuse_qkv_projections()`` (which installs fused processors, CogVideoX) and
    ``unfuse_qkv_projections()`` keep fsattn on; :func:`remove_fsattn` restores the last one set."""

    def __init__(self, module, patch: _ModelPatch, kind: str):
        self.module, self.patch, self.kind = module, patch, kind

    def __call__(self, processor) -> None:
        module = self.module
        if getattr(type(processor), "fsattn_route", None) is None:
            self.patch.originals[module] = processor
            bound = bind(processor, self.patch.route(module, processor, self.kind))
            if bound is None:
                logger.warning("fsattn: %s at %s reaches attention in a way fsattn cannot swap; it runs without "
                               "fsattn", type(processor).__name__, type(module).__name__)
            else:
                processor = bound
        type(module).set_processor(module, processor)


def _set_processor(module, processor) -> None:
    # MochiAttention has no set_processor; the attribute is what its forward reads.
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


def _unwrap(model):
    return getattr(model, "_orig_mod", model)  # a torch.compile'd module wraps the original


def _is_pipeline(obj) -> bool:
    from diffusers import DiffusionPipeline

    return isinstance(obj, DiffusionPipeline)


def _transformers(pipe_or_model) -> list[tuple[str, torch.nn.Module]]:
    """The transformer(s) to patch: ``transformer``/``transformer_2`` of a pipeline, or the model itself."""
    if _is_pipeline(pipe_or_model):
        found = [(name, _unwrap(component)) for name, component in pipe_or_model.components.items()
                 if name.startswith("transformer") and isinstance(component, torch.nn.Module)]
        if not found:
            raise ValueError(f"apply_fsattn: {type(pipe_or_model).__name__} has no transformer component "
                             f"(components: {sorted(pipe_or_model.components)})")
        return found
    if isinstance(pipe_or_model, torch.nn.Module):
        return [("model", _unwrap(pipe_or_model))]
    raise TypeError(f"apply_fsattn: pipe_or_model must be a diffusers pipeline or a torch.nn.Module, "
                    f"got {type(pipe_or_model).__name__}")


def _check_options(config, skip_first_steps, skip_last_steps, skip_blocks, self_attention_only, strict):
    if config is not None and not isinstance(config, FSAttnConfig):
        raise TypeError(f"apply_fsattn: config must be an FSAttnConfig or None, got {type(config).__name__}")
    for name, value in (("skip_first_steps", skip_first_steps), ("skip_last_steps", skip_last_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"apply_fsattn: {name}={value!r}; expected an int >= 0")
    for name, value in (("self_attention_only", self_attention_only), ("strict", strict)):
        if not isinstance(value, bool):
            raise TypeError(f"apply_fsattn: {name} must be a bool, got {value!r}")
    try:
        blocks = tuple(skip_blocks)
    except TypeError:
        raise TypeError(f"apply_fsattn: skip_blocks={skip_blocks!r}; expected an iterable of block indices") from None
    if any(isinstance(i, bool) or not isinstance(i, int) for i in blocks):
        raise TypeError(f"apply_fsattn: skip_blocks={skip_blocks!r}; expected int block indices")
    return frozenset(blocks)


def apply_fsattn(pipe_or_model, *, config: FSAttnConfig | None = None, skip_first_steps: int = 0,
                 skip_last_steps: int = 0, skip_blocks=(), self_attention_only: bool = False,
                 strict: bool = False):
    """Run the attention of a pipeline's transformer(s) on fsattn; undo with :func:`remove_fsattn`.

    Parameters
    ----------
    pipe_or_model : DiffusionPipeline or torch.nn.Module
        A pipeline (its ``transformer`` and ``transformer_2`` are patched, never the VAE or the
        text and image encoders) or a transformer model.
    config : FSAttnConfig or None
        Numerical choices of fsattn.
    skip_first_steps, skip_last_steps : int
        Denoising steps at the start and end of each pipeline run that keep the original
        attention (counted by the pipeline's scheduler; classifier-free guidance's second
        transformer call is the same step). Need a pipeline.
    skip_blocks : iterable of int
        Indices of transformer blocks that keep the original attention, counted through the
        model's block lists in the order its forward runs them (HunyuanVideo: double-stream
        blocks, then single-stream blocks; Wan VACE: the control blocks, then the main blocks).
    self_attention_only : bool
        Leave cross-attention (to text or image) on the original attention.
    strict : bool
        Raise :class:`~fsattn_diffusers.UnsupportedInputError` on a call fsattn cannot take,
        instead of running it on the original attention (logged once per reason, counted in
        :func:`~fsattn_diffusers.stats`); and raise ``ValueError`` for a model with no attention
        modules (a VAE, a plain module), which otherwise only logs a warning.

    Returns
    -------
    The same `pipe_or_model`. Applying again replaces the previous patch (nothing is patched twice).
    """
    skip_set = _check_options(config, skip_first_steps, skip_last_steps, skip_blocks, self_attention_only, strict)
    targets = _transformers(pipe_or_model)
    steps = None
    if skip_first_steps or skip_last_steps:
        if not _is_pipeline(pipe_or_model) or getattr(pipe_or_model, "scheduler", None) is None:
            raise ValueError(
                f"apply_fsattn: skip_first_steps={skip_first_steps}, skip_last_steps={skip_last_steps} count denoising "
                f"steps, which only a pipeline's scheduler knows; got {type(pipe_or_model).__name__}. Pass the pipeline, "
                "or leave both at 0")
    for name, model in targets:
        if not families.attention_modules(model):
            detail = (f"apply_fsattn: {name} ({type(model).__name__}) has no attention module that diffusers knows "
                      "(Attention, MochiAttention or an AttentionModuleMixin); nothing of it runs on fsattn. Pass the "
                      "pipeline or its transformer")
            if strict:
                raise ValueError(detail)
            logger.warning("%s", detail)
    for _, model in targets:
        n_blocks = families.count_blocks(model)
        bad = sorted(i for i in skip_set if not 0 <= i < n_blocks)
        if bad:
            raise ValueError(f"apply_fsattn: skip_blocks={sorted(skip_set)} has indices {bad} outside "
                             f"{type(model).__name__}'s {n_blocks} blocks (0..{n_blocks - 1})")
    remove_fsattn(pipe_or_model)
    if skip_first_steps or skip_last_steps:
        steps = DenoisingSteps(skip_first_steps, skip_last_steps)
        _hook_scheduler(pipe_or_model.scheduler, steps)
    options = dict(config=config, skip_blocks=skip_set, self_attention_only=self_attention_only, strict=strict)
    for _, model in targets:
        _patch_model(model, options, steps)
    return pipe_or_model


def _patch_model(model, options, steps) -> None:
    patch = _ModelPatch(options, steps)
    kept: dict[str, str] = {}  # what keeps its original attention, and why -> an example path
    planned = []
    for path, module in families.attention_modules(model):
        kind = "cross-attention" if families.is_cross_attention(path, module, model) else "self-attention"
        where = f"{type(module).__name__} {kind}"
        keep_reason = None
        block = families.block_index_of(path, model)
        if block is not None and block in options["skip_blocks"]:
            keep_reason = "skip_blocks"
        elif kind == "cross-attention" and options["self_attention_only"]:
            keep_reason = "self_attention_only"
        if keep_reason is not None:
            kept.setdefault(f"{where} ({keep_reason})", path)
            continue
        original = module.processor
        bound = bind(original, patch.route(module, original, kind))
        if bound is None:
            detail = (f"{type(original).__qualname__} reaches attention neither through dispatch_attention_fn nor through "
                      "F.scaled_dot_product_attention")
            if options["strict"]:
                raise RuntimeError(f"apply_fsattn: {path}: {detail}; strict=True forbids keeping the original")
            kept.setdefault(f"{where} (processor not swappable: {detail})", path)
            continue
        planned.append((module, original, bound, kind))
    # Nothing is changed until every module has been planned, so an error above leaves the model as it was.
    for module, original, bound, kind in planned:
        _set_processor(module, bound)
        patch.originals[module] = original
        if hasattr(type(module), "set_processor"):
            module.__dict__["set_processor"] = _RebindingSetProcessor(module, patch, kind)
    setattr(model, _PATCH_ATTR, patch)
    kept_text = "; ".join(f"{what}, e.g. {path}" for what, path in kept.items())
    logger.info("fsattn: %s: %d attention modules run on fsattn%s", type(model).__name__, len(patch.originals),
                f"; kept original attention: {kept_text}" if kept else "")


def remove_fsattn(pipe_or_model):
    """Undo every way fsattn was switched on for `pipe_or_model`; harmless where it was not.

    * :func:`apply_fsattn`: the very processors it replaced are put back, the scheduler unhooked.
    * ``set_attn_processor(FSAttnProcessor())``: those modules get a fresh instance of the
      processor diffusers gives them.
    * ``set_attention_backend("fsattn")``: the model's processors name no backend again, and the
      process-wide active backend, which diffusers' ``set_attention_backend`` also sets and its
      ``reset_attention_backend`` leaves, goes back to the one active before fsattn registered.

    Returns `pipe_or_model`.
    """
    for _, model in _transformers(pipe_or_model):
        reset_fsattn_backend(model)
        patch = model.__dict__.pop(_PATCH_ATTR, None)
        if patch is not None:
            for module, original in patch.originals.items():
                module.__dict__.pop("set_processor", None)
                # enable_parallelism() after apply_fsattn set the model's parallel config on the bound
                # copies only; without it the original would attend over this rank's tokens alone.
                parallel = getattr(module.processor, "_parallel_config", None)
                if parallel is not None and hasattr(original, "_parallel_config"):
                    original._parallel_config = parallel
                _set_processor(module, original)
            for route in patch.routes.values():
                route.release()
        _remove_shared_processors(model)
    if _is_pipeline(pipe_or_model) and getattr(pipe_or_model, "scheduler", None) is not None:
        _unhook_scheduler(pipe_or_model.scheduler)
    return pipe_or_model


def _remove_shared_processors(model) -> None:
    modules = [(path, module) for path, module in families.attention_modules(model)
               if isinstance(module.processor, FSAttnProcessor)]
    if modules:
        record_own_processor_classes(model)
    for path, module in modules:
        own_cls = families.own_processor_class(path, module, model)
        if own_cls is None:
            raise RuntimeError(f"remove_fsattn: {path} runs an FSAttnProcessor and fsattn cannot tell which processor "
                               f"diffusers gives it; set one with set_attn_processor")
        fused_cls = families.fused_processor_class(own_cls, model)
        if fused_cls is not None and getattr(module, "fused_projections", False):
            own_cls = fused_cls
        _set_processor(module, own_cls())


def _hook_scheduler(scheduler, steps: DenoisingSteps) -> None:
    """Count steps through the scheduler instance (instance attributes; the class is untouched)."""
    saved = {name: scheduler.__dict__.get(name, _MISSING) for name in ("set_timesteps", "step")}
    original_set_timesteps, original_step = scheduler.set_timesteps, scheduler.step

    def set_timesteps(*args, **kwargs):
        result = original_set_timesteps(*args, **kwargs)
        steps.start(len(scheduler.timesteps))
        return result

    def step(*args, **kwargs):
        first = steps.step == 0
        result = original_step(*args, **kwargs)
        if first:
            steps.started_at(_schedule_index(scheduler, kwargs.get("timestep", args[1] if len(args) > 1 else None)))
        steps.advance()
        return result

    scheduler.set_timesteps, scheduler.step = set_timesteps, step
    scheduler.__dict__[_STEPS_ATTR] = (steps, saved)


def _schedule_index(scheduler, timestep) -> int:
    """Where `timestep` first sits in the scheduler's timesteps (0 if it is not there). Once a run:
    reading the index back waits for the device."""
    timesteps = getattr(scheduler, "timesteps", None)
    if timestep is None or not isinstance(timesteps, torch.Tensor):
        return 0
    value = torch.as_tensor(timestep).flatten()[:1].to(timesteps.device, timesteps.dtype)
    found = (timesteps == value).nonzero()
    return int(found[0, 0]) if len(found) else 0


def _unhook_scheduler(scheduler) -> None:
    hooked = scheduler.__dict__.pop(_STEPS_ATTR, None)
    if hooked is None:
        return
    _, saved = hooked
    for name, value in saved.items():
        if value is _MISSING:
            scheduler.__dict__.pop(name, None)
        else:
            scheduler.__dict__[name] = value


__all__ = ["DenoisingSteps", "apply_fsattn", "remove_fsattn"]
