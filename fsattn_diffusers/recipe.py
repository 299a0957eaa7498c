"""apply_recipe / remove_recipe: the whole-step speed recipe on a pipeline's transformer(s), in one call.

Four parts (and two fusions that go with them), each switchable, applied in this order:

1. ``fuse_qkv``: one GEMM for Q, K and V (K and V for cross-attention) where the family offers it:
   diffusers' ``model.fuse_qkv_projections()`` (Wan: per-module ``fuse_projections``; CogVideoX:
   also installs its fused processor). It runs before the attention is patched, because a model's
   own fusion may replace processors, and fsattn must bind the processors that will run. A
   module whose processor does not read the fused layers (HunyuanVideo's) is left unfused.
   The separate projections become views of the fused weight, so fusion costs no memory.

   ``fuse_norm_rope`` (Wan only): the self-attention modules get a processor that computes the
   query/key RMSNorm and the rotary embedding in one pass (:mod:`fsattn_diffusers.fused_norm_rope`;
   compiled, that work took 2.9 ms a Wan2.1-14B block, the pass 0.87 ms, H200). Also before fsattn,
   which then routes that processor's attention call as it routes diffusers' own.
2. ``fsattn``: :func:`~fsattn_diffusers.apply_fsattn` with ``fsattn_options`` passed through.
3. ``fp8_linear``: torchao's float8 e4m3 with dynamic per-row activation scales and per-row
   weight scales (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``) on the
   ``nn.Linear`` layers inside the transformer blocks (:func:`fp8_linear_names`). What stays in
   bf16, and why:

   * everything outside the blocks: patch embedding, time / text / image embedders (and
     HunyuanVideo's token refiner), the output norm and ``proj_out``: their GEMMs are small (few
     rows, or one per frame patch at the ends of the network) and they shape every token;
   * inside the blocks, the adaLN modulation linears (any ``nn.Linear`` under a ``norm*``
     module: HunyuanVideo's ``norm1.linear``, CogVideoX's ``norm1.linear``): they run on the
     time embedding, one row per sample, so FP8 would save nothing measurable, and their output
     scales, shifts and gates every token of the block, so its rounding error would reach all
     of them. (Wan computes its modulation outside the blocks.)
   * inside the blocks, the layers on the conditioning's own path
     (:func:`~fsattn_diffusers.families.carries_conditioning`): a cross-attention module's K, V
     and output projections (Wan's ``attn2``, fused or not, and I2V's image projections) and
     joint attention's text stream (HunyuanVideo's ``add_*_proj``, ``to_add_out``,
     ``ff_context``). In cross-attention models the prompt reaches the video tokens only through
     the former, so their error is what classifier-free guidance multiplies; layers that joint
     attention shares between text and video stay in FP8. Measured on Wan only, where the effect
     is large: on Wan2.1-1.3B (random weights, two steps, guidance 5, decoded), with every other
     block layer in FP8, FP8 on the cross-attention as well took the lowest per-frame PSNR
     against bf16 from 37.2 to 33.6 dB. With fsattn, compilation and the fused feed-forward, the
     output projection alone in FP8 cost 0.9 dB of the lowest frame (34.2 to 33.3); the K/V
     projections run on the text tokens only (512 rows), a negligible share of the FLOPs. The
     cross-attention's query projection projects the video tokens before any text is mixed in:
     it is in FP8 (0.05 dB of the lowest frame at 1.3B; 84 ms off a 7.3 s Wan2.1-14B forward).
     ``fp8_conditioning=True`` puts the rest in FP8 as well: at 14B the output projection in
     FP8 took another 74 ms off.
   * layers whose sizes are not multiples of 16 (``torch._scaled_mm`` needs them; torchao
     would skip them silently).

   When fused, the unused separate projections are in FP8 too, so that undoing the fusion runs
   them in FP8 like the rest: their float8 weights are row slices of the fused layer's (the same
   values as quantising each alone, one scale per output row), not copies, which would cost
   another byte per QKV weight (3 GB at Wan2.1-14B).

   ``fuse_ffn`` (with ``fp8_linear``): each diffusers ``FeedForward`` with a tanh-GELU whose
   down projection is now FP8 computes the GELU and the per-row FP8 scaling of its output in one
   kernel, then torchao's FP8 GEMM on the layer's own FP8 weight
   (:mod:`fsattn_diffusers.fused_ffn`: the numbers of torchao's compiled path up to rounding
   ties; its eager path rounds the activation scale to bf16). Compiled, torchao's
   path is an inductor reduction that reads the hidden three times: 1.02 ms against 0.31 ms at
   Wan2.1-1.3B's FFN, 3.90 ms against 1.23 ms at 14B's, per block (H200); the recipe's 1.3B step
   went from 1.67x to 1.75x the default's speed with it, the 14B forward from 1.66x to 1.67x.
4. ``compile``: diffusers' regional compilation, as ``compile_repeated_blocks(fullgraph=True,
   dynamic=dynamic)`` does it (``nn.Module.compile`` on every module whose class the model
   names in ``_repeated_blocks``: one graph per block class, shared by all its blocks, fsattn's
   custom op inside, no graph break allowed); models without ``_repeated_blocks`` get each block
   of their block lists compiled the same way, and blocks carrying diffusers hooks stay eager
   (context parallelism's, below). Block inputs get row-major strides before the compiled call:
   Dynamo specialises a graph on its inputs' strides, so that a block whose inputs arrive as
   slices would otherwise compile a second graph of its class. CogVideoX's first block gets
   slices of the joint text-video sequence (every later block whole tensors): they are copied,
   two activations a forward against a whole second compilation. HunyuanVideo's single-stream
   blocks after the first get token-axis slices of the joint sequence: at batch one these are
   contiguous with only the batch stride off, and get a view with row-major strides (no copy). Inductor gets one option, :data:`INDUCTOR_OPTIONS`'s
   ``emulate_precision_casts``: a fused chain of bf16 elementwise ops then rounds each result
   to bf16 as eager does, instead of carrying float32 through the chain. Without it, compiling
   alone moved the output further from eager diffusers than fsattn or FP8 did (Wan2.1-1.3B, two
   steps with guidance 5, decoded, H200: lowest frame 34.9 dB for diffusers' attention compiled,
   against 41-42 for fsattn eager and 37.2 for FP8 eager; the whole recipe 34.1). With it: 41.4
   and 36.7, for about 1 % of the recipe's forward. The caller's ``options`` go over it
   (``compile_options={"options": {"emulate_precision_casts": False}}`` turns it off). torchao's
   ``set_inductor_config`` is off (it would switch on coordinate-descent tuning for
   every later compile in the process). That tuning, asked for per compile
   (``compile_options={"options": {"coordinate_descent_tuning": True}}``), shortened a
   Wan2.1-1.3B forward by 1.8-2.4 % while inductor still compiled the feed-forward's GELU and
   FP8 scaling; with ``fuse_ffn``'s kernel in its place it gives nothing measurable (H200:
   Wan2.1-14B 7.208 against 7.203 s a forward, 1.3B 0.3555 against 0.3545 s) and makes a fresh
   process's first call 10-25 s longer. It is not on by default.

What can be undone (:func:`remove_recipe`): compilation (``nn.Module.compile`` sets
``_compiled_call_impl``; it is reset), fsattn, the fused feed-forwards, and the QKV fusion
(processors put back, fused layers deleted; the separate projections keep the same values). The
FP8 quantization *replaces* the weights: they stay FP8 after :func:`remove_recipe` unless
``keep_original_weights=True``, which keeps the bf16 weights alive (their memory stays in use)
and puts them back.

Supported order with the rest of diffusers:

* LoRA: load and fuse it first, then apply the recipe (``pipe.load_lora_weights(...)``,
  ``pipe.fuse_lora()``, ``pipe.unload_lora_weights()``, then :func:`apply_recipe`). Fusion and
  FP8 refuse a transformer that still carries PEFT layers (they would fuse or quantize the base
  weights without the adapter).
* ``enable_model_cpu_offload``: either order; FP8 needs the GPU that the offload runs on (the
  pipeline's execution device) to have FP8 tensor cores.
* Context parallelism (``transformer.enable_parallelism(...)``): enable it first, then apply the
  recipe. Its input-splitting hook sits on the first block (Wan's ``blocks.0``), which Dynamo
  cannot trace with ``fullgraph=True``: that block stays eager, the others are compiled.
  Enabled after a compiled recipe, the hook lands inside a compiled block and its first call fails.

Errors in the options, an FP8 request where torchao's float8 cannot run (a CPU, a GPU below
sm_89), non-bf16 weights for FP8, or PEFT layers are reported before anything changes; an error
after that undoes what was done, the FP8 weights included.
"""

from __future__ import annotations

import inspect
import logging
import types
from dataclasses import dataclass, field

import torch

from . import families, fused_ffn, fused_norm_rope, patch

logger = logging.getLogger("fsattn_diffusers")

_STATE_ATTR = "_fsattn_recipe"
_MISSING = object()
# Fused layer -> the projections it concatenates (in order), as diffusers' fuse_projections builds them.
_FUSED_LAYERS = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "to_added_kv": ("add_k_proj", "add_v_proj"),
}
_FP8_MIN_CAPABILITY = (8, 9)  # FP8 e4m3 tensor cores arrived with Ada (sm_89)


@dataclass
class _FusedModule:
    module: torch.nn.Module
    added: list[str]  # fused layers created on it (to_qkv, ...)
    fused_flag: object  # the instance's own fused_projections before, or _MISSING


@dataclass
class _RecipeState:
    """What apply_recipe changed on one transformer, for remove_recipe and recipe_summary."""

    parts: dict
    fused: list[_FusedModule] = field(default_factory=list)
    processors_before_fusion: list[tuple[torch.nn.Module, object]] = field(default_factory=list)
    model_attrs_before_fusion: dict = field(default_factory=dict)
    fp8_names: list[str] = field(default_factory=list)
    fused_ffns: list[str] = field(default_factory=list)
    norm_rope: list = field(default_factory=list)  # (module, processor before) of fused_norm_rope
    original_weights: dict[str, tuple[torch.nn.Module, torch.nn.Parameter]] = field(default_factory=dict)
    compiled: list[torch.nn.Module] = field(default_factory=list)


# ----------------------------------------------------------------------------- options and checks

def _targets(pipe_or_model, who: str):
    """The transformer(s): apply_fsattn's choice (``transformer*`` components, or the model itself)."""
    try:
        return patch._transformers(pipe_or_model)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("apply_fsattn:", f"{who}:", 1)) from None


# torch.compile's keyword arguments (read once: a wrapped or patched torch.compile may hide them).
_COMPILE_KEYWORDS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def _check_options(fsattn, fsattn_options, fuse_qkv, fp8_linear, fp8_conditioning, fuse_ffn, keep_original_weights,
                   compile, dynamic, compile_options, fuse_norm_rope) -> dict:
    for name, value in (("fsattn", fsattn), ("fuse_qkv", fuse_qkv), ("fp8_linear", fp8_linear),
                        ("fp8_conditioning", fp8_conditioning), ("fuse_ffn", fuse_ffn),
                        ("fuse_norm_rope", fuse_norm_rope),
                        ("keep_original_weights", keep_original_weights), ("compile", compile)):
        if not isinstance(value, bool):
            raise TypeError(f"apply_recipe: {name}={value!r}; expected True or False")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"apply_recipe: dynamic={dynamic!r}; expected None (torch's automatic dynamic shapes), "
                        "True or False")
    for name, value in (("fsattn_options", fsattn_options), ("compile_options", compile_options)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"apply_recipe: {name}={value!r}; expected a dict of keyword arguments or None")
    if fsattn_options and not fsattn:
        raise ValueError(f"apply_recipe: fsattn_options={fsattn_options!r} with fsattn=False; they configure fsattn")
    accepted = {p.name: p.default for p in inspect.signature(patch.apply_fsattn).parameters.values()
                if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(fsattn_options or {}) - set(accepted))
    if unknown:
        raise TypeError(f"apply_recipe: fsattn_options has {unknown}, which apply_fsattn does not take; it takes "
                        f"{sorted(accepted)}")
    try:  # their values too, before anything changes (apply_fsattn checks them only once it runs)
        patch._check_options(**{**accepted, **(fsattn_options or {})})
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("apply_fsattn:", "apply_recipe: fsattn_options:", 1)) from None
    unknown = sorted(set(compile_options or {}) - _COMPILE_KEYWORDS)
    if unknown:
        raise TypeError(f"apply_recipe: compile_options has {unknown}, which torch.compile does not take; it takes "
                        f"{sorted(_COMPILE_KEYWORDS)}")
    fixed = sorted(set(compile_options or {}) & {"fullgraph", "dynamic"})
    if fixed:
        raise ValueError(f"apply_recipe: compile_options sets {fixed}; fullgraph is always True (no graph break) and "
                         "dynamic is its own argument")
    if compile_options and not compile:
        raise ValueError(f"apply_recipe: compile_options={compile_options!r} with compile=False")
    if compile_options and compile_options.get("mode") is not None and compile_options.get("options") is not None:
        raise ValueError("apply_recipe: compile_options sets both mode and options; torch.compile takes one of them")
    if compile:
        try:  # an unknown mode, before anything changes
            compile_arguments(compile_options or {}, dynamic)
        except RuntimeError as exc:
            raise ValueError(f"apply_recipe: compile_options: {exc}") from None
    if keep_original_weights and not fp8_linear:
        raise ValueError("apply_recipe: keep_original_weights=True keeps the weights that fp8_linear replaces; "
                         "fp8_linear is False")
    if fp8_conditioning and not fp8_linear:
        raise ValueError("apply_recipe: fp8_conditioning=True adds the conditioning's layers to fp8_linear's; "
                         "fp8_linear is False")
    return dict(fsattn=fsattn, fuse_qkv=fuse_qkv, fp8_linear=fp8_linear, fp8_conditioning=fp8_conditioning,
                fuse_ffn=fuse_ffn and fp8_linear, fuse_norm_rope=fuse_norm_rope, compile=compile, dynamic=dynamic)


def _peft_layers(model) -> list[str]:
    return [name for name, module in model.named_modules() if type(module).__module__.startswith("peft.")]


def _execution_device(pipe_or_model, model) -> torch.device:
    """Where the transformer runs: a pipeline's execution device (offload hooks included), else its weights'."""
    if patch._is_pipeline(pipe_or_model):
        return torch.device(pipe_or_model._execution_device)
    hook = getattr(model, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def fp8_unavailable_reason(device) -> str | None:
    """Why torchao's float8 linear layers cannot run on `device`, or None where they can.

    torchao's own check is an ``AssertionError`` raised deep inside ``quantize_``; this one
    answers before anything is changed.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return (f"the transformer runs on {device}; torchao's float8 linear layers run on CUDA GPUs of compute "
                "capability 8.9 or newer (Ada, Hopper, Blackwell)")
    if torch.version.hip is not None:
        try:
            from torchao.utils import is_MI300, is_MI350
        except ImportError:
            return "this torchao cannot tell whether this ROCm GPU has FP8 support"
        return None if (is_MI300() or is_MI350()) else "this ROCm GPU is neither an MI300 nor an MI350"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability < _FP8_MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(index)} has compute capability {capability[0]}.{capability[1]}; "
                "float8 GEMMs need 8.9 or newer (Ada, Hopper, Blackwell)")
    return None


def _fp8_config():
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    except ImportError as exc:
        raise ImportError(f"apply_recipe: fp8_linear=True needs torchao with Float8DynamicActivationFloat8WeightConfig "
                          f"and PerRow (pip install 'torchao>=0.14'): {exc}") from exc
    # set_inductor_config=False: torchao would otherwise turn on coordinate-descent tuning for every
    # later torch.compile in the process, which is process-wide, irreversible and slow to compile.
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


def _is_float8(weight) -> bool:
    return type(weight).__module__.startswith("torchao.")


# ----------------------------------------------------------------------------- layer selection

def _fp8_candidates(model, conditioning: bool) -> list[tuple[str, torch.nn.Linear]]:
    """The ``nn.Linear`` layers of the blocks that get FP8 (module docstring), bf16 or not, not yet float8."""
    chosen = []
    for list_name, blocks in families.block_lists(model):
        for path, module in blocks.named_modules(prefix=list_name):
            if not isinstance(module, torch.nn.Linear) or _is_float8(module.weight):
                continue
            inside_block = path.split(".")[2:]  # drop "<list>.<index>"
            if any(part.startswith("norm") for part in inside_block[:-1]):
                continue  # adaLN modulation
            if not conditioning and families.carries_conditioning(path, model):
                continue  # cross-attention, joint attention's text stream
            if module.in_features % 16 or module.out_features % 16:
                continue
            chosen.append((path, module))
    return chosen


def fp8_linear_names(pipe_or_model, *, fp8_conditioning: bool = False) -> dict[str, list[str]]:
    """The module names :func:`apply_recipe` would put in FP8 now, per transformer component.

    A pipeline gives ``{"transformer": [...], "transformer_2": [...]}``; a model ``{"model": [...]}``.
    Layers already in float8 are not listed. The answer depends on whether the QKV projections
    are fused (``to_qkv`` then joins the list). `fp8_conditioning` as for :func:`apply_recipe`.
    """
    return {name: [path for path, _ in _fp8_candidates(model, fp8_conditioning)]
            for name, model in _targets(pipe_or_model, "fp8_linear_names")}


# ----------------------------------------------------------------------------- fusion

def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _names_read(function, seen: set) -> set[str]:
    """Names the code of `function` loads, following the functions of its own module that it calls."""
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return set()
    seen.add(code)
    names = _code_names(code)
    for name in list(names):
        value = function.__globals__.get(name)
        if isinstance(value, types.FunctionType) and value.__module__ == function.__module__:
            names |= _names_read(value, seen)
    return names


def _reads_fused_layers(processor) -> bool:
    """Whether `processor` uses the fused projections when its module has them (Wan's, CogVideoX's fused one)."""
    call = getattr(type(processor), "__call__", None)
    return bool(_names_read(call, set()) & ({"fused_projections"} | set(_FUSED_LAYERS)))


def _fuse(model, state: _RecipeState) -> None:
    fuse = getattr(model, "fuse_qkv_projections", None)
    if fuse is None:
        logger.info("apply_recipe: %s has no fuse_qkv_projections(); QKV projections stay separate",
                    type(model).__name__)
        return
    modules = [module for _, module in families.attention_modules(model)]
    before = {id(m): (set(dict(m.named_children())), m.__dict__.get("fused_projections", _MISSING)) for m in modules}
    state.processors_before_fusion = [(m, m.processor) for m in modules]
    state.model_attrs_before_fusion = {"original_attn_processors": model.__dict__.get("original_attn_processors",
                                                                                       _MISSING)}
    try:
        fuse()
    except ValueError as exc:  # diffusers refuses some models (added KV projections): no fusion there
        refused = exc
    except (AttributeError, TypeError, NotImplementedError) as exc:
        # FP8 from an earlier recipe stays: diffusers' generic fuse_projections (CogVideoX's) copies
        # the concatenated weights into a new bf16 layer, which torchao's float8 cannot do.
        if not any(_is_float8(getattr(m, name).weight) for m in modules for name in ("to_q", "to_k", "to_v")
                   if isinstance(getattr(m, name, None), torch.nn.Linear)):
            raise
        refused = f"their projections are FP8 already and {type(model).__name__} cannot fuse FP8 weights"
    else:
        refused = None
    ignored = 0
    for module in modules:
        children, flag = before[id(module)]
        added = sorted(set(dict(module.named_children())) - children)
        if not added:
            continue
        record = _FusedModule(module, added, flag)
        if refused is not None or not _reads_fused_layers(module.processor):
            _unfuse_module(record)  # its processor would never run the fused layers: they would only cost memory
            ignored += 1
            continue
        _share_fused_storage(module, added)
        state.fused.append(record)
    if refused is not None:
        _unfuse(model, state)
        logger.info("apply_recipe: %s: QKV projections stay separate (%s)", type(model).__name__, refused)
        return
    logger.info("apply_recipe: %s: %d attention modules with fused projections%s", type(model).__name__,
                len(state.fused), f" ({ignored} left unfused: their processors read separate projections)"
                if ignored else "")


def _share_fused_storage(module, added: list[str]) -> None:
    """Make the separate projections' weights views of the fused weight (same values, same Parameter
    objects), so that fusion costs no memory and unfusing leaves them as they were."""
    for fused_name in added:
        sources = _FUSED_LAYERS.get(fused_name)
        fused = getattr(module, fused_name)
        if sources is None or not all(isinstance(getattr(module, s, None), torch.nn.Linear) for s in sources):
            continue
        for kind in ("weight", "bias"):
            parts = [getattr(getattr(module, s), kind) for s in sources]
            whole = getattr(fused, kind)
            if whole is None or any(p is None or _is_float8(p) for p in parts):
                continue  # float8 projections (FP8 applied before, not undone) keep their own data
            with torch.no_grad():
                if not torch.equal(torch.cat([p.detach() for p in parts]), whole.detach()):
                    continue  # not the concatenation we know: leave the projections alone
            offset = 0
            for part in parts:  # the same Parameter objects, their data now a slice of the fused one
                part.data = whole.detach()[offset:offset + part.shape[0]]
                offset += part.shape[0]


def _unfuse_module(record: _FusedModule) -> None:
    for name in record.added:
        delattr(record.module, name)
    if record.fused_flag is _MISSING:
        record.module.__dict__.pop("fused_projections", None)
    else:
        record.module.fused_projections = record.fused_flag


def _unfuse(model, state: _RecipeState) -> None:
    for record in state.fused:
        _unfuse_module(record)
    for module, processor in state.processors_before_fusion:
        if module.processor is not processor:
            patch._set_processor(module, processor)
    for name, value in state.model_attrs_before_fusion.items():
        if value is _MISSING:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = value
    state.fused, state.processors_before_fusion, state.model_attrs_before_fusion = [], [], {}


# ----------------------------------------------------------------------------- FP8 and compilation

def _quantize(model, state: _RecipeState, config) -> None:
    """FP8 on the chosen layers; the replaced weights stay in ``state.original_weights`` (the caller
    drops them unless they are to be kept), so that an error anywhere in apply_recipe can put them back."""
    from torchao.quantization import quantize_

    chosen = _fp8_candidates(model, state.parts["fp8_conditioning"])
    originals = {path: (module, module.weight) for path, module in chosen}
    slices = _fused_slices(state, {id(module) for _, module in chosen})
    ids = {id(module) for _, module in chosen} - set(slices)
    try:
        quantize_(model, config, filter_fn=lambda module, fqn: id(module) in ids)
        unsliced = _take_fused_slices(slices)
        if unsliced:  # a torchao whose float8 weights cannot be sliced: quantized on their own
            quantize_(model, config, filter_fn=lambda module, fqn: id(module) in unsliced)
        missed = [path for path, module in chosen if not _is_float8(module.weight)]
        if missed:
            raise RuntimeError(f"apply_recipe: torchao left {len(missed)} chosen layers unquantized (e.g. "
                               f"{missed[0]}); the model was put back as it was")
    except BaseException:
        _restore_weights(originals)
        raise
    state.fp8_names = [path for path, _ in chosen]
    state.original_weights = originals
    logger.info("apply_recipe: %s: %d linear layers in FP8 (per-row e4m3)", type(model).__name__, len(chosen))


def _fused_slices(state: _RecipeState, chosen: set) -> dict:
    """``{id(projection): (projection, fused layer, first row)}`` for the chosen separate
    projections whose weight is a slice of a chosen fused layer's (QKV fusion shares the storage,
    :func:`_share_fused_storage`): FP8 gives them slices of the fused layer's float8 weight."""
    slices = {}
    for record in state.fused:
        for fused_name in record.added:
            fused = getattr(record.module, fused_name)
            sources = _FUSED_LAYERS.get(fused_name, ())
            parts = [getattr(record.module, name, None) for name in sources]
            if id(fused) not in chosen or not all(isinstance(p, torch.nn.Linear) and id(p) in chosen for p in parts):
                continue
            whole, start = fused.weight, 0
            for part in parts:
                weight = part.weight
                shared = weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                if (not shared or not weight.is_contiguous()
                        or weight.storage_offset() != whole.storage_offset() + start * whole.shape[1]):
                    break
                start += part.out_features
            else:
                start = 0
                for part in parts:
                    slices[id(part)] = (part, fused, start)
                    start += part.out_features
    return slices


def _take_fused_slices(slices: dict) -> set:
    """Give each projection of `slices` (:func:`_fused_slices`) its rows of the fused layer's float8
    weight, scales included: the values quantising it on its own gives (one scale per output
    row), without a second copy. Returns the ids of those this torchao could not slice."""
    failed = set()
    for key, (module, fused, start) in slices.items():
        try:
            rows = fused.weight[start:start + module.out_features]
        except Exception:  # noqa: BLE001 - any refusal of the slice: quantized on its own instead
            rows = None
        if rows is None or not _is_float8(rows) or tuple(rows.shape) != tuple(module.weight.shape):
            failed.add(key)
            continue
        module.weight = torch.nn.Parameter(rows, requires_grad=False)
    return failed


def _restore_weights(originals: dict) -> None:
    for module, weight in originals.values():
        module.weight = weight
        module.__dict__.pop("extra_repr", None)  # torchao's per-instance repr of the float8 weight


def _compile_regions(model) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """The modules to compile, and those left eager.

    The regions of diffusers' ``compile_repeated_blocks`` (modules whose class is named in the
    model's ``_repeated_blocks``), or each block of the model's block lists where it names none.
    A module carrying diffusers hooks stays eager: context parallelism puts its input-splitting
    hook on the first block (Wan's ``blocks.0``), and Dynamo cannot trace that hook with
    ``fullgraph=True``.
    """
    repeated = getattr(model, "_repeated_blocks", None)
    if repeated:
        regions = [(path, m) for path, m in model.named_modules() if type(m).__name__ in repeated]
    else:
        regions = [(f"{name}.{i}", block) for name, blocks in families.block_lists(model)
                   for i, block in enumerate(blocks)]
    hooked = [path for path, m in regions if getattr(getattr(m, "_diffusers_hook", None), "hooks", None)]
    return [(path, m) for path, m in regions if path not in hooked], hooked


# Eager's roundings to bf16 kept in inductor's fused kernels (module docstring, item 4).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def _backend_name(backend):
    if backend is None:  # torch.compile's own default, which torch >= 2.11 lets a program change
        get_default = getattr(torch.compiler, "get_default_backend", None)
        backend = get_default() if get_default is not None else "inductor"
    return backend if isinstance(backend, str) else None


def compile_arguments(compile_options: dict, dynamic) -> dict:
    """torch.compile's keyword arguments for the recipe's regions: `compile_options`, with
    :data:`INDUCTOR_OPTIONS` under the caller's own ``options`` when the backend is inductor (a
    ``mode`` becomes the options it stands for, as torch.compile expands it). Other backends,
    a callable one included, get `compile_options` as given. A new dict at every call:
    torch.compile takes some entries out of the options it is given."""
    arguments = dict(compile_options)
    if _backend_name(arguments.get("backend")) != "inductor":
        return arguments
    from torch._inductor import config as inductor_config, list_mode_options

    mode = arguments.pop("mode", None)
    options = {k: v for k, v in INDUCTOR_OPTIONS.items() if hasattr(inductor_config, k)}  # older torch: fewer
    if mode not in (None, "default"):
        options.update(list_mode_options(mode, dynamic))
    # torch.compile reads "a-b" as "a_b": the caller's spelling must replace ours, not sit beside it.
    options.update({k.replace("-", "_"): v for k, v in (arguments.pop("options", None) or {}).items()})
    return {**arguments, "options": options}


def _row_major_strides(shape) -> tuple:
    """The strides of ``torch.empty(shape)``: what every block of a class should see."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _needs_relayout(value) -> bool:
    """A tensor whose strides are not row-major, other than by broadcasting (a zero stride on a
    dimension longer than one): a slice, a permutation, or a slice along a dimension of size one
    (``is_contiguous()`` is true there, but Dynamo guards on that dimension's stride too)."""
    if not isinstance(value, torch.Tensor) or value.stride() == _row_major_strides(value.shape):
        return False
    return not any(stride == 0 and size > 1 for stride, size in zip(value.stride(), value.shape))


def _relayout(value: torch.Tensor) -> torch.Tensor:
    """`value` with row-major strides: a view when it is contiguous already (only the strides of
    dimensions of size one differ, and those address nothing), a copy otherwise."""
    if value.is_contiguous():
        return value.as_strided(value.shape, _row_major_strides(value.shape))
    return value.contiguous()


def _with_contiguous_inputs(compiled_call):
    """`compiled_call` (a region's ``_compiled_call_impl``), given its tensor arguments with
    row-major strides (:func:`_relayout`): the block's graph is then the one its class's other
    blocks use (module docstring, item 4). Broadcast tensors pass as they are: every block gets
    them alike."""

    def call(*args, **kwargs):
        if any(map(_needs_relayout, args)) or any(map(_needs_relayout, kwargs.values())):
            args = tuple(_relayout(a) if _needs_relayout(a) else a for a in args)
            kwargs = {k: (_relayout(v) if _needs_relayout(v) else v) for k, v in kwargs.items()}
        return compiled_call(*args, **kwargs)

    return call


def _compile(model, state: _RecipeState, dynamic, compile_options: dict) -> None:
    regions, hooked = _compile_regions(model)
    for _, module in regions:
        # compile_repeated_blocks's call, with the recipe's inductor options
        module.compile(**compile_arguments(compile_options, dynamic), fullgraph=True, dynamic=dynamic)
        module._compiled_call_impl = _with_contiguous_inputs(module._compiled_call_impl)
    state.compiled = [module for _, module in regions]
    if hooked:
        logger.info("apply_recipe: %s: %s left uncompiled (diffusers hooks on them, e.g. context parallelism's)",
                    type(model).__name__, ", ".join(hooked))


def _uncompile(state: _RecipeState) -> None:
    for module in state.compiled:
        module._compiled_call_impl = None
    state.compiled = []


def _check_target(pipe_or_model, name, model, fuse_qkv, fp8_linear, fp8_conditioning, compile) -> None:
    """What would stop the recipe on one transformer, raised before anything changes."""
    peft = _peft_layers(model)
    if peft and (fuse_qkv or fp8_linear):
        raise ValueError(
            f"apply_recipe: {name} carries PEFT (LoRA) layers, e.g. {peft[0]}; fuse_qkv and fp8_linear would fuse "
            "or quantize the base weights without the adapter. Fuse the LoRA into the weights first: "
            "pipe.fuse_lora(); pipe.unload_lora_weights(); then apply_recipe (or pass fuse_qkv=False, "
            "fp8_linear=False)")
    if compile and not _compile_regions(model)[0]:
        raise ValueError(f"apply_recipe: {name} ({type(model).__name__}) declares no _repeated_blocks and has no "
                         "block lists fsattn knows, so there is nothing to compile regionally; pass compile=False")
    if not fp8_linear:
        return
    reason = fp8_unavailable_reason(_execution_device(pipe_or_model, model))
    if reason is not None:
        raise RuntimeError(f"apply_recipe: fp8_linear=True cannot run here: {reason}. Pass fp8_linear=False to "
                           "apply the rest of the recipe")
    not_bf16 = [(path, m.weight.dtype) for path, m in _fp8_candidates(model, fp8_conditioning)
                if m.weight.dtype != torch.bfloat16]
    if not_bf16:
        (path, dtype), count = not_bf16[0], len(not_bf16)
        raise TypeError(f"apply_recipe: fp8_linear=True needs bfloat16 weights (torchao's per-row float8 takes only "
                        f"those); {name}.{path} is {dtype} ({count} such layers). Load the model with "
                        "torch_dtype=torch.bfloat16")


# ----------------------------------------------------------------------------- public API

def apply_recipe(pipe_or_model, *, fsattn: bool = True, fsattn_options: dict | None = None, fuse_qkv: bool = True,
                 fp8_linear: bool = True, fp8_conditioning: bool = False, fuse_ffn: bool = True,
                 fuse_norm_rope: bool = True, keep_original_weights: bool = False, compile: bool = True,
                 dynamic: bool | None = None, compile_options: dict | None = None):
    """Fused QKV, fsattn, FP8 linear layers and regional compilation on a pipeline's transformer(s).

    Parameters
    ----------
    pipe_or_model : DiffusionPipeline or torch.nn.Module
        A pipeline (every ``transformer*`` component, e.g. Wan 2.2's ``transformer_2``, gets the
        same treatment) or a transformer model.
    fsattn : bool
        Run attention on fsattn (:func:`~fsattn_diffusers.apply_fsattn`).
    fsattn_options : dict or None
        Keyword arguments for :func:`~fsattn_diffusers.apply_fsattn` (``config``, ``skip_blocks``, ...).
    fuse_qkv : bool
        One GEMM for the Q, K, V projections where the family offers it (module docstring).
    fp8_linear : bool
        FP8 e4m3 per-row linear layers in the blocks (torchao); needs bf16 weights and a GPU of
        compute capability 8.9 or newer. See :func:`fp8_linear_names` for the exact layers.
    fp8_conditioning : bool
        Also put the layers on the conditioning's path (a cross-attention's K, V and output
        projections, joint attention's text stream; module docstring) in FP8. At Wan2.1-14B the
        output projection in FP8 took a forward from 7.22 to 7.14 s (one process), and the error
        that classifier-free guidance multiplies grows (Wan2.1-1.3B with guidance 5: 0.9 dB off
        the lowest per-frame PSNR against bf16 for the output projection alone). Default False.
    fuse_ffn : bool
        Where a tanh-GELU feed-forward's down projection is in torchao's per-row FP8 (this
        recipe's, or an earlier one's that stayed), compute the GELU and that layer's input
        scaling in one kernel (module docstring). Ignored without ``fp8_linear``. Default True.
    fuse_norm_rope : bool
        Wan's self-attention: the query/key RMSNorm and rotary embedding in one pass
        (:mod:`fsattn_diffusers.fused_norm_rope`); other families are left as they are. Default True.
    keep_original_weights : bool
        Keep the bf16 weights that FP8 replaces, so that :func:`remove_recipe` puts them back
        (their memory stays in use). Default False: FP8 is then not undone.
    compile : bool
        ``compile_repeated_blocks(fullgraph=True, dynamic=dynamic)``: the first call compiles.
    dynamic : bool or None
        torch.compile's ``dynamic``. None (default): compiled for the first shape, and once
        more with dynamic shapes at the first new resolution or frame count, then no more
        (two graphs per block class). False: one graph per shape, up to torch._dynamo's
        ``recompile_limit`` (8). True: dynamic from the start.
    compile_options : dict or None
        More ``torch.compile`` arguments (``backend``, ``mode``, ``options``; not ``mode`` and
        ``options`` together, as torch.compile refuses). With inductor, the recipe adds
        :data:`INDUCTOR_OPTIONS` (``emulate_precision_casts=True``: the compiled blocks round as
        eager diffusers does) under the caller's ``options``, and a ``mode`` is passed as the
        options it stands for; ``{"options": {"emulate_precision_casts": False}}`` turns it off
        (the explicit option also overrides inductor's global config and its environment
        variable). Module docstring, item 4, on this and on coordinate-descent tuning.

    Returns
    -------
    The same `pipe_or_model`. Applying again replaces the previous recipe (and an earlier
    :func:`~fsattn_diffusers.apply_fsattn`).
    """
    parts = _check_options(fsattn, fsattn_options, fuse_qkv, fp8_linear, fp8_conditioning, fuse_ffn,
                           keep_original_weights, compile, dynamic, compile_options, fuse_norm_rope)
    targets = _targets(pipe_or_model, "apply_recipe")
    for name, model in targets:
        _check_target(pipe_or_model, name, model, fuse_qkv, fp8_linear, fp8_conditioning, compile)
    fp8_config = _fp8_config() if fp8_linear else None

    remove_recipe(pipe_or_model)
    patch.remove_fsattn(pipe_or_model)  # its patch would hold the processors that fusion may replace
    states = [(model, _RecipeState(parts)) for _, model in targets]
    try:
        for model, state in states:
            setattr(model, _STATE_ATTR, state)
            if fuse_qkv:
                _fuse(model, state)
            if fuse_norm_rope:  # before fsattn, which binds the processors that will run
                state.norm_rope = fused_norm_rope.fuse_norm_rope(model)
        if fsattn:
            patch.apply_fsattn(pipe_or_model, **(fsattn_options or {}))
        for model, state in states:
            if fp8_linear:
                _quantize(model, state, fp8_config)
            if parts["fuse_ffn"]:
                state.fused_ffns = fused_ffn.fuse_feed_forwards(model)
            if compile:
                _compile(model, state, dynamic, compile_options or {})
    except BaseException:
        _undo(pipe_or_model, states)
        raise
    if not keep_original_weights:
        for _, state in states:
            state.original_weights = {}  # the bf16 weights are freed: FP8 is not undone
    return pipe_or_model


def _undo(pipe_or_model, states) -> None:
    """Undo in reverse order: compilation, fsattn, the fused feed-forwards, FP8 (where the bf16 weights
    are held), the fused norm and RoPE, the QKV fusion."""
    for model, state in states:
        _uncompile(state)
        fused_ffn.unfuse_feed_forwards(model)
        state.fused_ffns = []
    if any(state.parts["fsattn"] for _, state in states):
        patch.remove_fsattn(pipe_or_model)
    for model, state in states:
        if state.original_weights:
            _restore_weights(state.original_weights)
            state.original_weights, state.fp8_names = {}, []
        fused_norm_rope.unfuse_norm_rope(state.norm_rope)
        state.norm_rope = []
        _unfuse(model, state)
        model.__dict__.pop(_STATE_ATTR, None)


def remove_recipe(pipe_or_model):
    """Undo :func:`apply_recipe` where it can be undone; harmless where it was not applied.

    Compilation, fsattn, the fused feed-forwards, the fused norm and RoPE and the QKV fusion are
    undone; the FP8 weights are put back in bf16 only if the recipe was applied with
    ``keep_original_weights=True``, and otherwise stay FP8 (the fused projections' separate
    layers included). Returns `pipe_or_model`.
    """
    targets = _targets(pipe_or_model, "remove_recipe")
    states = [(model, model.__dict__[_STATE_ATTR]) for _, model in targets if _STATE_ATTR in model.__dict__]
    if states:
        _undo(pipe_or_model, states)
    return pipe_or_model


def recipe_summary(pipe_or_model) -> dict:
    """What :func:`apply_recipe` did, per transformer component (None where it was not applied).

    Each entry: ``parts`` (the switches and ``dynamic``), ``fused_modules`` (attention modules
    running fused projections), ``fp8_linear`` (module names this application put in FP8: layers
    an earlier recipe left in FP8, which stays, are not listed again), ``fused_ffn`` (feed-forwards
    on the one-kernel GELU + FP8 scaling), ``fp8_reversible`` (original weights kept),
    ``fused_norm_rope`` (attention modules on the fused query/key norm and RoPE) and
    ``compiled_modules`` (modules compiled regionally).
    """
    out = {}
    for name, model in _targets(pipe_or_model, "recipe_summary"):
        state = model.__dict__.get(_STATE_ATTR)
        out[name] = None if state is None else {
            "parts": dict(state.parts), "fused_modules": len(state.fused), "fp8_linear": list(state.fp8_names),
            "fused_ffn": list(state.fused_ffns), "fused_norm_rope": len(state.norm_rope),
            "fp8_reversible": bool(state.original_weights), "compiled_modules": len(state.compiled)}
    return out


__all__ = ["INDUCTOR_OPTIONS", "apply_recipe", "compile_arguments", "fp8_linear_names", "fp8_unavailable_reason",
           "recipe_summary", "remove_recipe"]
