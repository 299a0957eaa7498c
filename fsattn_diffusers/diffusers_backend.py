"""The "fsattn" attention backend for diffusers, and the per-call fallback policy every route shares.

This is the only module that touches diffusers' private attention registry
(``diffusers.models.attention_dispatch``). :func:`register_fsattn_backend` adds the name
``"fsattn"`` to ``AttentionBackendName`` (a closed ``str`` Enum) and registers
:func:`_fsattn_attention` under it, so that ``model.set_attention_backend("fsattn")`` and
``with attention_backend("fsattn"):`` work.

:func:`attention_or_fallback` decides, per call, whether fsattn can take an attention call and
sends the rest to the call the model would have made anyway (SDPA, or the backend it chose): it
logs each (caller, reason) once, counts every fallback in :func:`fsattn_diffusers.stats`, and in
strict mode raises instead.
"""

from __future__ import annotations

import logging
import threading

import torch

from .attention import MAX_HEAD_DIM, SUPPORTED_DTYPES, UnsupportedInputError, fsattn
from .config import FSAttnConfig
from .ops import kernels_available
# Not `from . import stats`: the package rebinds that name to the stats() function.
from .stats import record_sdpa_fallback

logger = logging.getLogger("fsattn_diffusers")

BACKEND_NAME = "fsattn"

_register_lock = threading.Lock()
_backend_options = {"config": None, "strict": False}  # what set_attention_backend("fsattn") runs with
_logged: set[tuple[str, str]] = set()


# ----------------------------------------------------------------------------- fallback policy


def fallback_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False,
                    layout="NHD"):
    """Why fsattn must not take this call, as ``(reason, detail)``, or ``(None, "")``.

    Uses the reason keys of :class:`UnsupportedInputError`. Head dims and masks are checked here
    too, although fsattn raises for them, because torch.compile cannot trace the raising of that
    error: a call that fsattn would refuse must never reach it inside a compiled graph.
    """
    if dropout_p:
        return "dropout", f"dropout_p={dropout_p} (fsattn is inference-only and has no dropout)"
    if is_causal:
        return "is_causal", "is_causal=True (fsattn computes non-causal attention only)"
    for t in (query, key, value):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return "not_4d", f"an input of shape {shape} (fsattn takes 4-D query, key and value)"
        if t.dtype not in SUPPORTED_DTYPES:
            return "dtype", f"dtype {t.dtype} (fsattn takes bfloat16, float16 or float32)"
    head_axis = 2 if layout == "NHD" else 1
    seq_q = query.shape[1 if layout == "NHD" else 2]
    if query.shape[-1] > MAX_HEAD_DIM:
        return "head_dim", f"head dim {query.shape[-1]} (fsattn takes at most {MAX_HEAD_DIM})"
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() <= 4:
        full = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        if (full[1] != 1 and query.shape[head_axis] != 1) or (full[2] != 1 and seq_q != 1):
            return "general_mask", (f"attn_mask of shape {tuple(attn_mask.shape)} varies over heads or queries "
                                    "(fsattn takes key-padding masks broadcastable to (B, 1, 1, Sk))")
    if query.shape[head_axis] != key.shape[head_axis] and not enable_gqa:
        # SDPA refuses unequal head counts unless enable_gqa=True; keep its behaviour.
        return "heads_mismatch", f"{query.shape[head_axis]} query heads, {key.shape[head_axis]} key heads, enable_gqa=False"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return "autograd", "inputs that require grad (fsattn is forward-only; use torch.no_grad() for inference)"
    ok, reason = kernels_available(query.device)
    if not ok:
        return reason, f"no fsattn kernels for {query.device} ({reason})"
    return None, ""


def attention_or_fallback(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, layout,
                          config, strict, where, fallback):
    """Run one attention call with fsattn, or with `fallback` (a no-argument callable) where it cannot.

    Parameters
    ----------
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        The arguments of the attention call, as SDPA names them; tensors in `layout`.
    layout : {"NHD", "HND"}
        ``(B, S, H, D)`` as diffusers' dispatcher passes them, or ``(B, H, S, D)`` as SDPA takes them.
    config : FSAttnConfig or None
    strict : bool
        Raise :class:`UnsupportedInputError` instead of falling back.
    where : str
        Names the caller (module class and kind of attention) in log lines and errors.
    fallback : callable
        Makes the call the model would have made without fsattn, with the original arguments.
    """
    reason, detail = fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, layout)
    if reason is None:
        try:
            out = fsattn(query, key, value, attn_mask=attn_mask, scale=scale, layout=layout, config=config)
        except UnsupportedInputError as err:
            reason, detail = err.reason, str(err)
        else:
            note_backend(where, "fsattn")
            return out
    if strict:
        raise UnsupportedInputError(
            reason, f"{where}: fsattn cannot run this attention call: {detail}. strict=True forbids the SDPA "
            "fallback; pass strict=False to let such calls run on SDPA (logged once, counted in stats())")
    note_fallback(where, reason, detail)
    return fallback()


def note_backend(where: str, backend: str) -> None:
    """Log, once per (caller, backend), which backend a kind of attention runs on."""
    # Under torch.compile this runs once, while tracing; logging from traced code would break the graph.
    if torch.compiler.is_compiling():
        return
    key = (where, backend)
    if key not in _logged:
        _logged.add(key)
        logger.info("fsattn: %s runs on %s", where, backend)


def note_fallback(where: str, reason: str, detail: str) -> None:
    """Count one SDPA fallback by reason; log it once per (caller, reason)."""
    if torch.compiler.is_compiling():
        return  # counted per call only in eager mode (see note_backend)
    record_sdpa_fallback(reason)
    key = (where, "fallback:" + reason)
    if key not in _logged:
        _logged.add(key)
        logger.warning("fsattn: %s runs on SDPA instead of fsattn (reason: %s): %s", where, reason, detail)


def reset_logged() -> None:
    """Forget which one-time log lines were written (tests use this to see them again)."""
    _logged.clear()


# ----------------------------------------------------------------------------- the backend


def _fsattn_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """The function registered as the "fsattn" backend; tensors are ``(B, S, H, D)``."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    native = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]

    def sdpa():
        return native(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, _parallel_config=_parallel_config)

    options = _backend_options
    where = f"attention backend {BACKEND_NAME!r}"
    if _parallel_config is not None:
        # Context parallelism: not supported yet, so such calls run on diffusers' native backend,
        # which supports it. To support it, register with supports_context_parallel=True and call
        # diffusers' _templated_context_parallel_attention(..., forward_op=_fsattn_forward_op,
        # backward_op=_fsattn_backward_op, _parallel_config=_parallel_config) here.
        if options["strict"]:
            raise UnsupportedInputError("context_parallel", f"{where}: context parallelism is not supported yet "
                                        "and strict=True forbids the fallback to the native backend")
        note_fallback(where, "context_parallel", "context parallelism is not supported by fsattn yet")
        return sdpa()
    if (attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        # diffusers' convention (as in its native backend): a 2-D mask is (batch, keys).
        attn_mask = attn_mask[:, None, None, :]
    return attention_or_fallback(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, layout="NHD",
        config=options["config"], strict=options["strict"], where=where, fallback=sdpa)


_fsattn_attention._fsattn_diffusers_backend = True  # marks our function across module reloads


def _fsattn_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Forward op in the form diffusers' templated context-parallel attention takes.

    Returns ``out`` (B, S, H, D), and with `return_lse` the natural-log LSE as float32
    ``(B, S, H)``, the layout diffusers' ring attention merges partial results with.
    """
    if dropout_p or is_causal:
        raise UnsupportedInputError("is_causal" if is_causal else "dropout",
                                    "fsattn's context-parallel forward takes neither dropout nor causal masks")
    config = _backend_options["config"]
    if not return_lse:
        return fsattn(query, key, value, attn_mask=attn_mask, scale=scale, config=config)
    out, lse = fsattn(query, key, value, attn_mask=attn_mask, scale=scale, return_lse=True, config=config)
    return out, lse.permute(0, 2, 1)


def _fsattn_backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("fsattn is forward-only (inference); there is no backward pass")


# ----------------------------------------------------------------------------- registration


def _constraints():
    """diffusers' own checks for an NHD backend (device and dtype match, shapes agree)."""
    from diffusers.models import attention_dispatch as dispatch

    return [check for check in (getattr(dispatch, "_check_device", None), getattr(dispatch, "_check_shape", None))
            if check is not None]


def add_enum_member(enum_cls, value: str):
    """Add `value` to a closed ``str`` Enum as member ``value.upper()``; return the member.

    Does what ``EnumType`` does for a member defined in the class body (Python 3.10 to 3.13):
    the member is found by attribute, by value (``enum_cls(value)``), by ``__members__`` and by
    iteration. If the value is already a member, that member is returned unchanged.
    """
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    name = value.upper()
    if name in enum_cls._member_map_ or name in vars(enum_cls):
        raise RuntimeError(f"{enum_cls.__name__} already has an attribute {name!r}; cannot add value {value!r}")
    member = enum_cls._member_type_.__new__(enum_cls, value)
    member._value_ = value
    member._name_ = name
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    if hasattr(enum_cls, "_add_member_"):  # Python 3.13+: sets the class attribute and _member_map_
        enum_cls._add_member_(name, member)
    else:
        type.__setattr__(enum_cls, name, member)  # EnumType.__setattr__ would refuse once mapped
        enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    enum_cls._value2member_map_[value] = member
    return member


def register_fsattn_backend(*, config: FSAttnConfig | None = None, strict: bool = False):
    """Register the ``"fsattn"`` attention backend with diffusers (idempotent); return its enum member.

    After it, ``model.set_attention_backend("fsattn")`` and ``with attention_backend("fsattn"):``
    run every attention call that a model makes through ``dispatch_attention_fn`` on
    :func:`~fsattn_diffusers.fsattn`. Calls fsattn cannot take (causal, dropout, masks that vary
    over queries, head dim > 128, a GPU without FP8 tensor cores, context parallelism) run on
    diffusers' native SDPA backend, logged once per reason and counted in
    :func:`~fsattn_diffusers.stats`.

    Parameters
    ----------
    config : FSAttnConfig or None
        Numerical choices the backend runs with (default: the defaults).
    strict : bool
        Raise :class:`~fsattn_diffusers.UnsupportedInputError` instead of falling back.

    Notes
    -----
    Calling it again only replaces `config` and `strict`. Processors that call
    ``F.scaled_dot_product_attention`` directly (CogVideoX, Mochi, ``AttnProcessor2_0``) never reach
    a backend; :class:`~fsattn_diffusers.FSAttnProcessor` and :func:`~fsattn_diffusers.apply_fsattn`
    cover them.
    """
    if config is not None and not isinstance(config, FSAttnConfig):
        raise TypeError(f"config must be an FSAttnConfig or None, got {type(config).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    with _register_lock:
        member = add_enum_member(AttentionBackendName, BACKEND_NAME)
        registered = _AttentionBackendRegistry._backends.get(member)
        if registered is not None and not getattr(registered, "_fsattn_diffusers_backend", False):
            raise RuntimeError(
                f"diffusers already has an attention backend named {BACKEND_NAME!r} ({registered!r}) that is not "
                "fsattn-diffusers'; refusing to replace it")
        _backend_options.update(config=config, strict=strict)
        if registered is not _fsattn_attention:
            # Context parallelism is not supported yet (see _fsattn_attention), hence False.
            _AttentionBackendRegistry.register(member, constraints=_constraints(),
                                               supports_context_parallel=False)(_fsattn_attention)
    return member


__all__ = ["BACKEND_NAME", "attention_or_fallback", "register_fsattn_backend"]
