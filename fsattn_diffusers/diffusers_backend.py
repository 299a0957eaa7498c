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

from .attention import MAX_HEAD_DIM, SUPPORTED_DTYPES, UnsupportedInputError, fsattn
from .config import DEFAULT_CONFIG, FSAttnConfig
from .ops import kernels_available
# Not `from . import stats`: the package rebinds that name to the stats() function.
from .stats import record_sdpa_fallback

logger = logging.getLogger("fsattn_diffusers")

BACKEND_NAME = "fsattn"

_register_lock = threading.Lock()
# What set_attention_backend("fsattn") runs with, and the process-wide active backend that
# registration found (diffusers' set_attention_backend also makes its backend the process-wide one,
# which its reset_attention_backend does not undo: remove_fsattn puts this one back).
_backend_options = {"config": None, "strict": False, "active_before": None}
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


def as_key_padding_mask(attn_mask, query, key):
    """A 2-D ``(batch, keys)`` mask as ``(batch, 1, 1, keys)`` (diffusers' convention, as in its
    native backend); any other mask as it is. Tensors are ``(B, S, H, D)``."""
    if (attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        return attn_mask[:, None, None, :]
    return attn_mask


# Devices where small calls go to SDPA: the threshold was measured on CUDA GPUs (H200).
ROUTED_DEVICE_TYPES = ("cuda",)


def too_small_for_fsattn(query, key, layout, config, work_factor: int = 1) -> bool:
    """Whether SDPA beats fsattn at this size (a CUDA call under ``config.sdpa_below_flops`` FLOPs).

    `work_factor` scales the FLOPs of the given shapes to those of the call that will run (under
    Ulysses of degree u, a rank's shards become u times the sequence over 1/u of the heads: u
    times the work).
    """
    if query.device.type not in ROUTED_DEVICE_TYPES:
        return False  # the CPU emulation is a stand-in for the GPU kernel, not a speed choice
    threshold = (config if config is not None else DEFAULT_CONFIG).sdpa_below_flops
    return attention_flops(query, key, layout) * work_factor < threshold


def _run_small_call(where: str, backend: str, fallback):
    """Run a call below ``sdpa_below_flops`` on `fallback`. A performance choice, not a refusal:
    strict mode does not object, it is logged at info, and counted as ``small_problem``."""
    note_backend(where + " (below FSAttnConfig.sdpa_below_flops)", backend)
    if not torch.compiler.is_compiling():
        record_sdpa_fallback("small_problem")
    return fallback()


def attention_flops(query, key, layout) -> float:
    """``4 * B * Hq * Sq * Sk * D``: the two GEMMs of non-causal attention."""
    seq_axis = 1 if layout == "NHD" else 2
    heads = query.shape[3 - seq_axis]
    return 4.0 * query.shape[0] * heads * query.shape[seq_axis] * key.shape[seq_axis] * query.shape[3]


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
    if reason is None and too_small_for_fsattn(query, key, layout, config):
        return _run_small_call(where, "SDPA", fallback)
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
    """Why fsattn must not take this context-parallel call, as ``(reason, detail)``, or ``(None, "")``.

    :func:`fallback_reason`, plus what diffusers' templated attention refuses (grouped-query
    attention) and masks under a ring. Depends only on what every rank shares (shapes, dtypes,
    flags, degrees), so all ranks take the same path and make the same collective calls.
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
    return fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, "NHD")


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
    reason, detail = context_parallel_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                                                      ring_degree=ring_degree)

    def templated(forward_op):
        return _templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, False, scale, False, False, forward_op=forward_op,
            backward_op=_fsattn_backward_op, _parallel_config=parallel_config)

    ulysses_degree = parallel_config.context_parallel_config.ulysses_degree
    if reason is None and ring_degree == 1 and too_small_for_fsattn(query, key, "NHD", config, ulysses_degree):
        # Ulysses gathers the whole sequence, so this rank's problem is the full-length one over
        # fewer heads; when even that is small, the original backend's own path is faster. (A ring
        # needs the LSE, which diffusers' native op cannot give: it stays on fsattn.)
        return _run_small_call(where, "the original backend", fallback)
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


_LSE_ROWS = 1024  # query rows whose scores _sdpa_forward_op materialises at once, to bound memory


def _sdpa_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Exact attention as a templated context-parallel forward op, with the LSE a ring needs.

    SDPA gives the output; the natural-log LSE, float32 ``(B, S, H)``, is computed from the
    scores in blocks of query rows (diffusers' native op returns none, so it cannot run a ring).
    Forward-only, like fsattn's op: it is the ring's fallback for calls fsattn cannot take.
    """
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                           scale=scale).transpose(1, 2)
    if not return_lse:
        return out
    # A ring never passes a mask here (context_parallel_attention refuses masks under a ring);
    # the LSE below would ignore one.
    assert attn_mask is None, "_sdpa_forward_op computes the LSE of unmasked attention only"
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    # One (batch, head) at a time and _LSE_ROWS query rows at a time: the float32 scores of a block
    # stay at _LSE_ROWS x S_k (155 MB at Wan-14B 720p's 37800 keys per ring chunk).
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            kf = k[b, h].float().transpose(0, 1)
            for i0 in range(0, q.shape[2], _LSE_ROWS):
                s = torch.matmul(q[b, h, i0:i0 + _LSE_ROWS].float(), kf) * scale
                lse[b, h, i0:i0 + _LSE_ROWS] = torch.logsumexp(s, dim=-1)
    return out, lse.transpose(1, 2)


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
    supports diffusers' context parallelism (``enable_parallelism`` with Ulysses, ring or both);
    masked calls under it run on the native backend's context-parallel path.

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


__all__ = ["BACKEND_NAME", "attention_or_fallback", "context_parallel_attention", "register_fsattn_backend",
           "reset_fsattn_backend"]
