"""FSAttnProcessor: run a module's own diffusers processor with only its attention call swapped.

Model-specific work (projections, RoPE, norms, how text joins video) stays in diffusers' own
processors, which change every release; fsattn never forks them. A *bound* processor is a copy of
the module's own processor whose class is a subclass of the original with one change: its
``__call__`` runs the original's code with the two names through which diffusers' processors reach
attention, ``dispatch_attention_fn`` and ``F`` (``torch.nn.functional``, for
``F.scaled_dot_product_attention``), pointing at an :class:`AttentionRoute` instead. Everything
else in the function (arguments, defaults, signature, closures) is the original, so
``Attention.forward``, which drops keywords the processor's signature does not name, sees the
original signature, and torch.compile traces it like the original (no graph break from us).

``pipe.transformer.set_attn_processor(FSAttnProcessor())`` hands one instance to every module;
it looks up, per module, which processor diffusers would have run there (the module class's
``_default_processor_cls``, or for diffusers' generic ``Attention`` class the families table,
:mod:`fsattn_diffusers.families`) and calls a bound copy of it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn

from . import families
from .attention import UnsupportedInputError
from .config import FSAttnConfig
from .diffusers_backend import context_parallel_attention
from .routing import as_key_padding_mask, attention_or_fallback, note_fallback

# Set on generic attention modules once the processor diffusers gives them is known.
OWN_PROCESSOR_ATTR = "_fsattn_own_processor_cls"


class AttentionRoute:
    """Where one kind of attention call goes: fsattn, or the original call when fsattn cannot take it.

    Parameters
    ----------
    where : str
        Names the kind of attention in log lines and errors, e.g. "WanAttention self-attention".
    config : FSAttnConfig or None
    strict : bool
        Raise instead of falling back to the original call.
    gate : object or None
        Anything with a bool ``enabled``; while False (a skipped denoising step) every call runs
        the original attention, bit for bit.
    """

    def __init__(self, where: str, *, config: FSAttnConfig | None, strict: bool, gate=None):
        self.where = where
        self.config = config
        self.strict = strict
        self.gate = gate
        # torch.nn.functional with SDPA swapped, for processors that call F.scaled_dot_product_attention.
        self.functional = types.ModuleType("fsattn_diffusers.functional")
        self.functional.__dict__.update(F.__dict__)
        self.functional.scaled_dot_product_attention = self.scaled_dot_product_attention
        self.bound_classes: dict[type, type] = {}
        self.module_names: list[str] = []  # modules holding swapped globals (see swap_attention_calls)

    def __repr__(self):
        return f"AttentionRoute({self.where!r}, strict={self.strict})"

    def dispatch_attention_fn(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        """Stands in for diffusers' ``dispatch_attention_fn`` (same arguments, ``(B, S, H, D)`` tensors)."""

        def original():
            return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                         attention_kwargs=attention_kwargs, backend=backend,
                                         parallel_config=parallel_config)

        if self.gate is not None and not self.gate.enabled:
            return original()
        if attention_kwargs:
            # Backend-specific arguments: only the original backend knows them.
            return self._refuse("attention_kwargs", "attention_kwargs is not supported by fsattn yet", original)
        if parallel_config is not None:
            return context_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                              parallel_config, config=self.config, strict=self.strict,
                                              where=self.where + " (context parallel)", fallback=original)
        return attention_or_fallback(query, key, value, as_key_padding_mask(attn_mask, query, key), dropout_p,
                                     is_causal, scale, enable_gqa, layout="NHD", config=self.config,
                                     strict=self.strict, where=self.where, fallback=original)

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        """Stands in for ``F.scaled_dot_product_attention`` (same arguments, ``(B, H, S, D)`` tensors)."""

        def original():
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

        if self.gate is not None and not self.gate.enabled:
            return original()
        return attention_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                     layout="HND", config=self.config, strict=self.strict, where=self.where,
                                     fallback=original)

    def release(self) -> None:
        """Drop the modules of swapped globals from sys.modules once no processor uses this route."""
        release_modules(self.module_names)

    def _refuse(self, reason, detail, original):
        if self.strict:
            raise UnsupportedInputError(reason, f"{self.where}: {detail}; strict=True forbids the fallback")
        note_fallback(self.where, reason, detail)
        return original()


def release_modules(names: list[str]) -> None:
    for name in names:
        sys.modules.pop(name, None)
    names.clear()


def _global_names(code: types.CodeType) -> set[str]:
    """Global names a function's code (and the code of functions defined inside it) may load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def swap_attention_calls(function, route: AttentionRoute):
    """A copy of `function` whose attention calls go to `route`, or None if it makes none we can see.

    The copy shares the original's code, defaults and closure; only its globals differ, in the
    names bound to diffusers' ``dispatch_attention_fn``, to ``torch.nn.functional`` (when the code
    uses ``scaled_dot_product_attention``) or to ``F.scaled_dot_product_attention`` itself.
    """
    if not isinstance(function, types.FunctionType):
        return None
    names = _global_names(function.__code__)
    replaced = {}
    for name in names:
        value = function.__globals__.get(name)
        if value is dispatch_attention_fn:
            replaced[name] = route.dispatch_attention_fn
        elif value is F and "scaled_dot_product_attention" in names:
            replaced[name] = route.functional
        elif value is F.scaled_dot_product_attention:
            replaced[name] = route.scaled_dot_product_attention
    if not replaced:
        return None
    # The copy's globals are the __dict__ of a module registered in sys.modules under its own name:
    # torch.compile finds a function's globals by importing its globals' __name__ to guard on them,
    # and must not find the original module there. __package__ stays, for relative imports.
    name = f"fsattn_diffusers.swapped.{function.__module__}.{function.__qualname__}.{id(route):x}"
    module = types.ModuleType(name)
    module.__dict__.update(function.__globals__)
    module.__dict__.update(replaced, __name__=name)
    sys.modules[name] = module
    route.module_names.append(name)
    swapped = types.FunctionType(function.__code__, module.__dict__, function.__name__, function.__defaults__,
                                 function.__closure__)
    swapped.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(swapped, function)


def bound_processor_class(own_cls: type, route: AttentionRoute):
    """The subclass of `own_cls` whose ``__call__`` sends attention to `route` (cached), or None."""
    cls = route.bound_classes.get(own_cls)
    if cls is None:
        call = swap_attention_calls(getattr(own_cls, "__call__", None), route)
        if call is None:
            return None
        cls = type(f"FSAttn{own_cls.__name__}", (own_cls,), {
            "__call__": call,
            "__module__": __name__,
            "__doc__": f"{own_cls.__qualname__} with its attention calls sent to fsattn ({route.where}).",
            "fsattn_route": route,
            "fsattn_own_class": own_cls,
        })
        route.bound_classes[own_cls] = cls
    return cls


def bind(processor, route: AttentionRoute):
    """A copy of `processor` (same state) whose attention calls go to `route`, or None if not possible."""
    cls = bound_processor_class(type(processor), route)
    if cls is None:
        return None
    bound = copy.copy(processor)
    bound.__class__ = cls
    return bound


def _accepted_keywords(processor_cls):
    """Keyword names the processor's ``__call__`` takes, or None if it takes ``**kwargs``."""
    params = inspect.signature(processor_cls.__call__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def attention_kind(module) -> str:
    if getattr(module, "is_cross_attention", False):
        return "cross-attention"
    return "attention"


class FSAttnProcessor:
    """Attention processor that runs each module's own diffusers processor with fsattn as its attention.

    ``pipe.transformer.set_attn_processor(FSAttnProcessor())`` works on every attention module of
    diffusers' video transformers (Wan, HunyuanVideo, CogVideoX, LTX-Video, ...): projections,
    norms and RoPE stay the module's own; only the attention call changes. Calls fsattn cannot
    take (causal, dropout, masks varying over queries such as HunyuanVideo's token refiner's, head
    dim > 128, a GPU without FP8 tensor cores) run the original attention, logged once per reason
    and counted in :func:`fsattn_diffusers.stats`.

    Parameters
    ----------
    config : FSAttnConfig or None
        Numerical choices of fsattn (default: the defaults).
    strict : bool
        Raise :class:`~fsattn_diffusers.UnsupportedInputError` instead of falling back.

    Notes
    -----
    The one-liner replaces the processors before fsattn sees them, so for modules of diffusers'
    generic ``Attention`` class (HunyuanVideo, CogVideoX) the processor diffusers gives them comes
    from :mod:`fsattn_diffusers.families`, found on the module's first call by looking up the
    calling model on the call stack (under torch.compile, once while tracing). Fused QKV
    projections (``fuse_qkv_projections()``) must come first: fusing afterwards installs
    diffusers' fused processors in place of this one, and attention leaves fsattn (CogVideoX).
    :func:`~fsattn_diffusers.apply_fsattn` keeps fsattn on through fusing, keeps each module's
    processor state, and can be undone exactly.

    Context parallelism (``enable_parallelism``) sets its configuration on this processor as on
    diffusers' own, and fsattn runs each rank's share as the ``"fsattn"`` backend does. Set the
    processor first, as diffusers asks for attention backends; set after ``enable_parallelism``,
    the model's configuration is taken from the calling model on the first eager call (a model
    compiled before any eager call would attend over each rank's tokens alone).
    """

    # diffusers' enable_parallelism() sets the model's configuration on processors that have this.
    _parallel_config = None

    def __init__(self, config: FSAttnConfig | None = None, strict: bool = False):
        if config is not None and not isinstance(config, FSAttnConfig):
            raise TypeError(f"FSAttnProcessor: config must be an FSAttnConfig or None, got {type(config).__name__}")
        if not isinstance(strict, bool):
            raise TypeError(f"FSAttnProcessor: strict must be a bool, got {strict!r}")
        self.config = config
        self.strict = strict
        # (module class, own processor class, kind) -> (bound processor, keywords it takes)
        self._bound: dict[tuple, tuple] = {}
        self._module_names: list[str] = []
        self._looked_for_parallel_model = False
        weakref.finalize(self, release_modules, self._module_names)
        self._prebuild()

    def __repr__(self):
        return f"FSAttnProcessor(config={self.config!r}, strict={self.strict})"

    def __call__(self, attn, *args, **kwargs):  # signature for diffusers' keyword filter: set below
        bound, accepted = self._bound_for(attn)
        if accepted is not None:
            kwargs = {name: value for name, value in kwargs.items() if name in accepted}
        if not self._looked_for_parallel_model and not torch.compiler.is_compiling():
            self._adopt_parallel_config_of_calling_model(attn)
        if self._parallel_config is not None and hasattr(bound, "_parallel_config"):
            bound._parallel_config = self._parallel_config
        return bound(attn, *args, **kwargs)

    def _adopt_parallel_config_of_calling_model(self, attn):
        """Where enable_parallelism() ran before this processor was set, the calling model holds
        the configuration that diffusers gave the processors this one replaced."""
        self._looked_for_parallel_model = True
        found = None if self._parallel_config is not None else _calling_model(id(attn))
        parallel = getattr(found[0] if found else None, "_parallel_config", None)
        if getattr(parallel, "context_parallel_config", None) is not None:
            self._parallel_config = parallel

    def _bound_for(self, attn):
        own_cls = getattr(type(attn), "_default_processor_cls", None)
        if own_cls is None:
            own = getattr(attn, OWN_PROCESSOR_ATTR, None)
            if own is None:
                own = _own_processor_classes_from_calling_model(id(attn), type(attn).__name__)
            # fuse_qkv_projections() swaps a generic module's processor for its fused variant.
            own_cls = own[1] if own[1] is not None and getattr(attn, "fused_projections", False) else own[0]
        entry = self._bound.get((type(attn), own_cls, attention_kind(attn)))
        if entry is None:
            entry = self._build(type(attn), own_cls, attention_kind(attn))
        return entry

    @torch.compiler.disable
    def _build(self, module_cls, own_cls, kind):
        where = f"{module_cls.__name__} {kind} ({own_cls.__name__})"
        route = AttentionRoute(where, config=self.config, strict=self.strict)
        cls = bound_processor_class(own_cls, route)
        if cls is None:
            raise RuntimeError(
                f"FSAttnProcessor: {own_cls.__qualname__}, the processor of {module_cls.__name__}, reaches attention "
                "neither through diffusers' dispatch_attention_fn nor through F.scaled_dot_product_attention; fsattn "
                "cannot swap its attention call. Keep its own processor on those modules (apply_fsattn does).")
        self._module_names.extend(route.module_names)
        bound = object.__new__(cls)
        own_cls.__init__(bound)
        entry = (bound, _accepted_keywords(own_cls))
        self._bound[(module_cls, own_cls, kind)] = entry
        return entry

    def _prebuild(self):
        """Build the bound processors of the attention classes loaded now, and of the generic modules'
        processors in the families table, so that torch.compile finds them built (it cannot trace
        building one)."""
        from diffusers.models.attention import AttentionModuleMixin
        from diffusers.models.attention_processor import Attention, MochiAttention

        for own_cls in families.generic_processor_classes():
            for module_cls in (Attention, MochiAttention):
                for kind in ("attention", "cross-attention"):
                    try:
                        self._build(module_cls, own_cls, kind)
                    except Exception:  # noqa: BLE001 - best effort: _build raises again, in context, on a real call
                        pass

        pending = [AttentionModuleMixin]
        while pending:
            cls = pending.pop()
            pending.extend(cls.__subclasses__())
            own_cls = getattr(cls, "_default_processor_cls", None)
            if own_cls is not None and cls is not AttentionModuleMixin:
                for kind in ("attention", "cross-attention"):
                    try:
                        self._build(cls, own_cls, kind)
                    except Exception:  # noqa: BLE001 - best effort: _build raises again, in context, on a real call
                        pass


# torch.compile runs this while tracing and keeps the answer as a constant (a module's processor
# class does not change while it is compiled), so fullgraph=True works without an eager forward
# first; the first lookup records the answer on every generic module of the model, and later ones
# read that instead. It takes the module's id, not the module: torch 2.11's dynamo passes only
# constants to such a function (it fails on a module argument; 2.13's does not).
@torch.compiler.assume_constant_result
def _own_processor_classes_from_calling_model(attn_id: int, attn_class: str):
    """``(processor, fused processor or None)`` classes diffusers gives the module whose ``id`` is
    `attn_id`, for modules that do not name them themselves.

    Finds the model running that module on the call stack (the nearest ``ModelMixin``), records the
    family table's answer on each of that model's generic attention modules, and returns the one
    for the module.
    """
    found = _calling_model(attn_id)
    if found is None:
        raise RuntimeError(
            f"FSAttnProcessor: called on a {attn_class} module outside a diffusers model's forward, so it "
            "cannot tell which processor diffusers gives that module. Use apply_fsattn(model) instead.")
    owner, attn = found
    record_own_processor_classes(owner)
    own = getattr(attn, OWN_PROCESSOR_ATTR, None)
    if own is None:
        raise RuntimeError(
            f"FSAttnProcessor: {attn_class} modules of {type(owner).__name__} carry no default "
            "processor and the families table (fsattn_diffusers/families.py) does not say which one "
            f"{type(owner).__name__} installs, so fsattn cannot run them. Use apply_fsattn(model) instead: "
            "it keeps each module's own processor.")
    return own


def _calling_model(attn_id: int):
    """``(model, module)``: the nearest diffusers model on the call stack that has the module whose
    ``id`` is `attn_id` among its attention modules, and that module; or None.

    A frame's ``self`` is looked at first, then its other locals. The second matters while
    torch.compile traces a function that calls the model (``torch.compile(lambda m, x: m(x))``):
    dynamo does not run the function's or the model's frames as Python, and the model is found
    as a local of dynamo's own frames (its module-call step, under torch 2.11 and 2.13)."""
    from diffusers.models.modeling_utils import ModelMixin

    seen = set()
    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        candidates = [local.get("self"), *(value for name, value in list(local.items()) if name != "self")]
        for owner in candidates:
            # type(), not isinstance(): a mock's __class__ can claim to be a model.
            if not issubclass(type(owner), ModelMixin) or id(owner) in seen:
                continue
            seen.add(id(owner))
            for _, module in families.attention_modules(owner):
                if id(module) == attn_id:
                    return owner, module
        frame = frame.f_back
    return None


def record_own_processor_classes(model) -> None:
    """Record, on each generic attention module of `model`, the processor classes diffusers gives it
    (its own, and the fused variant ``fuse_qkv_projections()`` installs, or None)."""
    for path, module in families.attention_modules(model):
        if getattr(type(module), "_default_processor_cls", None) is None:
            own_cls = families.own_processor_class(path, module, model)
            if own_cls is not None:
                setattr(module, OWN_PROCESSOR_ATTR, (own_cls, families.fused_processor_class(own_cls, model)))


def _call_signature():
    kind = inspect.Parameter
    params = [kind("self", kind.POSITIONAL_OR_KEYWORD), kind("attn", kind.POSITIONAL_OR_KEYWORD),
              kind("args", kind.VAR_POSITIONAL)]
    params += [kind(name, kind.KEYWORD_ONLY, default=None) for name in families.PROCESSOR_KEYWORDS]
    params.append(kind("kwargs", kind.VAR_KEYWORD))
    return inspect.Signature(params)


# diffusers' attention modules pass a processor only the keywords its signature names; this
# one forwards each to the module's own processor, so it names every keyword any of them takes.
FSAttnProcessor.__call__.__signature__ = _call_signature()

__all__ = ["AttentionRoute", "FSAttnProcessor", "bind", "swap_attention_calls"]
