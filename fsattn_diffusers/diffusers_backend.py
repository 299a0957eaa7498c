"""The "fsattn" attention backend for diffusers, and fsattn under diffusers' context parallelism.

This is the only module that touches diffusers' private attention registry
(``diffusers.models.attention_dispatch``). :func:`register_fsattn_backend` adds the name
``"fsattn"`` to ``AttentionBackendName`` (a closed ``str`` Enum) and registers
:func:`_fsattn_attention` under it, so that ``model.set_attention_backend("fsattn")`` and
``with attention_backend("fsattn"):`` work. Which calls fsattn takes is decided as on every route,
by :mod:`fsattn_diffusers.routing`.

Under diffusers' context parallelism (``model.enable_parallelism(config=ContextParallelConfig(...))``:
Ulysses, ring, or both), :func:`context_parallel_attention` hands fsattn to diffusers' own
``_templated_context_parallel_attention`` as the per-rank attention op, the way diffusers' flash and
sage backends plug in: the all-to-alls and the ring's key/value rotation stay diffusers', and each
rank's partial result comes back with its log-sum-exp for the ring merge.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch

from .attention import UnsupportedInputError, exact_attention, fsattn, refusal
from .config import FSAttnConfig
from .routing import (as_key_padding_mask, attention_or_fallback, note_backend, note_fallback, run_small_call,
                      too_small_for_fsattn)

logger = logging.getLogger("fsattn_diffusers")

BACKEND_NAME = "fsattn"

_register_lock = threading.Lock()
# What set_attention_backend("fsattn") runs with, and the process-wide active backend that
# registration found (diffusers' set_attention_backend also makes its backend the process-wide one,
# which its reset_attention_backend does not undo: remove_fsattn puts this one back).
_backend_options = {"config": None, "strict": False, "active_before": None}


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
        return context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _parallel_config,
            config=options["config"], strict=options["strict"], where=where + " (context parallel)", fallback=sdpa)
    return attention_or_fallback(
        query, key, value, as_key_padding_mask(attn_mask, query, key), dropout_p, is_causal, scale, enable_gqa,
        layout="NHD", config=options["config"], strict=options["strict"], where=where, fallback=sdpa)


_fsattn_attention._fsattn_diffusers_backend = True  # marks our function across module reloads


# ----------------------------------------------------------------------------- context parallelism


def context_parallel_fallback_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     enable_gqa=False, *, ring_degree=1):
    """Why fsattn must not take this context-parallel call, as ``(reason, detail)``, or None.

    :func:`~fsattn_diffusers.attention.refusal`, plus what diffusers' templated attention refuses
    (grouped-query attention) and masks under a ring. Depends only on what every rank shares
    (shapes, dtypes, flags, degrees), so all ranks take the same path and make the same collective
    calls.
    """
    if enable_gqa or (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 4
                      and query.shape[2] != key.shape[2]):
        return "cp_gqa", "unequal query and key head counts (diffusers' context-parallel attention refuses GQA)"
    if attn_mask is not None and ring_degree > 1:
        return "cp_ring_mask", _RING_MASK_DETAIL
    if ring_degree > 1 and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value)):
        # The ring's exact fallback op is forward-only too: no backend here can train through a ring.
        return "cp_ring_autograd", ("inputs that require grad under ring attention (fsattn and its exact "
                                    "fallback op are forward-only; use torch.no_grad() for inference)")
    return refusal(query, key, value, attn_mask, layout="NHD", dropout_p=dropout_p, is_causal=is_causal,
                   enable_gqa=enable_gqa)


# Reasons no fallback can serve under context parallelism (see context_parallel_attention).
_NO_CP_FALLBACK = ("cp_ring_mask", "is_causal", "cp_gqa", "cp_ring_autograd")
_RING_MASK_DETAIL = (
    "attn_mask with ring_degree > 1: diffusers' ring attention hands the same mask to every rank's key chunk, so "
    "no backend can apply a key mask correctly there (diffusers' native backend cannot run a ring at all); use "
    "ulysses_degree for models that pass masks")


def context_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                               parallel_config, *, config, strict, where, fallback):
    """One attention call under diffusers' context parallelism, on fsattn or on a fallback.

    fsattn runs as the per-rank op (:func:`_fsattn_forward_op`) of diffusers'
    ``_templated_context_parallel_attention``, which does the Ulysses all-to-alls and the ring's
    key/value rotation and merges the ring's partial results by their log-sum-exp. Calls fsattn
    cannot take (:func:`context_parallel_fallback_reason`) are logged once and counted, or raise
    with `strict`, and run:

    * Ulysses only: `fallback`, the original backend's own context-parallel path;
    * with a ring: exact attention (:func:`_sdpa_forward_op`) in the same template, because
      diffusers' native op gives no log-sum-exp and so cannot run a ring at all (0.36 to 0.42).

    Masks under a ring, causal attention and grouped-query attention raise
    :class:`UnsupportedInputError` whatever `strict` says: diffusers' templated attention refuses
    the last two for every backend, and applies a mask to a ring's key chunks wrongly.

    Parameters
    ----------
    query, key, value : Tensor (B, S_local, H, D)
        This rank's share of the sequence, as diffusers' dispatcher passes it.
    attn_mask : Tensor or None
        A key-padding mask of this rank's keys (2-D ``(B, S_local)`` or broadcastable to
        ``(B, 1, 1, S_local)``): diffusers' Ulysses all-gathers it along with the keys.
    parallel_config : diffusers ParallelConfig
        The model's, with ``context_parallel_config`` set up (device mesh and ranks).
    config, strict, where, fallback
        As for :func:`attention_or_fallback`.
    """
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    ring_degree = parallel_config.context_parallel_config.ring_degree
    attn_mask = as_key_padding_mask(attn_mask, query, key)
    found = context_parallel_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                                             ring_degree=ring_degree)
    reason, detail = found if found is not None else (None, "")

    def templated(forward_op):
        return _templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, False, scale, False, False, forward_op=forward_op,
            backward_op=_fsattn_backward_op, _parallel_config=parallel_config)

    ulysses_degree = parallel_config.context_parallel_config.ulysses_degree
    if reason is None and ring_degree == 1 and too_small_for_fsattn(query, key, "NHD", config, ulysses_degree):
        # Ulysses gathers the whole sequence, so this rank's problem is the full-length one over
        # fewer heads; when even that is small, the original backend's own path is faster. (A ring
        # needs the LSE, which diffusers' native op cannot give: it stays on fsattn.)
        return run_small_call(where, "the original backend", fallback)
    if reason is None:
        note_backend(where, "fsattn")
        return templated(functools.partial(_fsattn_forward_op, config=config))
    if strict or reason in _NO_CP_FALLBACK:
        raise UnsupportedInputError(
            reason, f"{where}: fsattn cannot run this attention call: {detail}" +
            (". strict=True forbids the fallback; pass strict=False to allow it" if strict else ""))
    note_fallback(where, reason, detail)
    if ring_degree > 1:
        return templated(_sdpa_forward_op)
    return fallback()


_REGISTERED_CONFIG = object()  # _fsattn_forward_op's default: the config the backend was registered with


def _fsattn_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None, *,
                       config=_REGISTERED_CONFIG):
    """Forward op in the form diffusers' templated context-parallel attention calls it.

    Parameters
    ----------
    ctx : autograd context (unused: fsattn is forward-only and saves nothing)
    query, key, value : Tensor (B, S, H, D)
        What this rank attends with: after the Ulysses all-to-all, all of the sequence for a share
        of the heads; in a ring step, this rank's queries and one rank's key/value chunk.
    config : FSAttnConfig or None
        Default: the config :func:`register_fsattn_backend` was given.

    Returns
    -------
    ``out`` (B, S, H, D) in the input dtype, and with `return_lse` the natural-log LSE of each
    row's scaled scores, float32 ``(B, S, H)``: the layout diffusers' flash and cuDNN ops give
    (theirs permuted from (B, H, S)), which the ring merges partial results with
    (``sigmoid(lse_b - lse_a)`` is the share of chunk b, which needs natural log). The LSE
    includes fsattn's key-mean correction (``sm_scale * q . mean(k)`` of the chunk it saw), so
    LSEs of different key chunks are comparable.
    """
    if dropout_p or is_causal:
        raise UnsupportedInputError("is_causal" if is_causal else "dropout",
                                    "fsattn's context-parallel forward takes neither dropout nor causal masks")
    if config is _REGISTERED_CONFIG:
        config = _backend_options["config"]
    if not return_lse:
        return fsattn(query, key, value, attn_mask=attn_mask, scale=scale, config=config)
    out, lse = fsattn(query, key, value, attn_mask=attn_mask, scale=scale, return_lse=True, config=config)
    return out, lse.permute(0, 2, 1)


def _fsattn_backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("fsattn's context-parallel attention is forward-only (inference); there is no "
                              "backward pass")


def _sdpa_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Exact attention as a templated context-parallel forward op, with the LSE a ring needs
    (diffusers' native op returns none, so it cannot run a ring): the ring's op for calls fsattn
    refuses. Tensors ``(B, S, H, D)``; the LSE float32 ``(B, S, H)``. Forward-only, like fsattn's op."""
    if dropout_p or is_causal:
        raise UnsupportedInputError("is_causal" if is_causal else "dropout",
                                    "the exact context-parallel forward takes neither dropout nor causal masks")
    if not return_lse:
        return exact_attention(query, key, value, attn_mask, scale=scale)
    out, lse = exact_attention(query, key, value, attn_mask, scale=scale, return_lse=True)
    return out, lse.permute(0, 2, 1)


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
    over queries, head dim > 128, a GPU without FP8 tensor cores) run on diffusers' native SDPA
    backend, logged once per reason and counted in :func:`~fsattn_diffusers.stats`. The backend
    supports diffusers' context parallelism (``enable_parallelism`` with Ulysses, ring or both):
    key-padding masks run on fsattn under Ulysses; under a ring a masked call raises
    (:func:`context_parallel_attention`).

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
        if _backend_options["active_before"] is None:
            _backend_options["active_before"] = _AttentionBackendRegistry._active_backend
        member = add_enum_member(AttentionBackendName, BACKEND_NAME)
        registered = _AttentionBackendRegistry._backends.get(member)
        if registered is not None and not getattr(registered, "_fsattn_diffusers_backend", False):
            raise RuntimeError(
                f"diffusers already has an attention backend named {BACKEND_NAME!r} ({registered!r}) that is not "
                "fsattn-diffusers'; refusing to replace it")
        _backend_options.update(config=config, strict=strict)
        if registered is not _fsattn_attention:
            _AttentionBackendRegistry.register(member, constraints=_constraints(),
                                               supports_context_parallel=True)(_fsattn_attention)
    return member


def reset_fsattn_backend(model) -> bool:
    """Undo ``model.set_attention_backend("fsattn")`` for `model` and for the process.

    The processors of `model` that name the ``"fsattn"`` backend go back to none (the process-wide
    default), and if the process-wide active backend is ``"fsattn"`` it goes back to the one that
    was active when :func:`register_fsattn_backend` first ran. Returns whether anything changed.
    Harmless where the backend was never registered.
    """
    if _backend_options["active_before"] is None:
        return False  # never registered: neither the model nor the process can name it
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    changed = False
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if getattr(processor, "_attention_backend", None) == BACKEND_NAME:
            processor._attention_backend = None
            changed = True
    if _AttentionBackendRegistry._active_backend == BACKEND_NAME:
        previous = _backend_options["active_before"]
        _AttentionBackendRegistry.set_active_backend(
            previous if previous != BACKEND_NAME else AttentionBackendName.NATIVE)
        changed = True
    return changed


__all__ = ["BACKEND_NAME", "context_parallel_attention", "register_fsattn_backend", "reset_fsattn_backend"]
