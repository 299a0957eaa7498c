"""The per-call policy of the diffusers integrations: fsattn, or the attention the model would run.

Every route (the processors, the ``"fsattn"`` backend, context parallelism) decides with
:func:`~fsattn_diffusers.attention.refusal`, the same check :func:`~fsattn_diffusers.fsattn`
raises on, and with :func:`too_small_for_fsattn` (a speed choice, not a refusal). Refused calls
are logged once per (caller, reason), counted in :func:`fsattn_diffusers.stats`, and run on the
fallback, or raise in strict mode. This module imports nothing from diffusers.
"""

from __future__ import annotations

import logging

import torch

from .attention import UnsupportedInputError, fsattn, refusal
from .config import DEFAULT_CONFIG
# Not `from . import stats`: the package rebinds that name to the stats() function.
from .stats import record_sdpa_fallback

logger = logging.getLogger("fsattn_diffusers")

# Devices where small calls go to SDPA: the threshold was measured on CUDA GPUs (H200).
ROUTED_DEVICE_TYPES = ("cuda",)
_logged: set[tuple[str, str]] = set()


def _seq_axis(layout) -> int:
    return 1 if layout == "NHD" else 2


def attention_flops(query, key, layout) -> float:
    """``4 * B * Hq * Sq * Sk * D``: the two GEMMs of non-causal attention."""
    seq_axis = _seq_axis(layout)
    heads = query.shape[3 - seq_axis]
    return 4.0 * query.shape[0] * heads * query.shape[seq_axis] * key.shape[seq_axis] * query.shape[3]


def too_small_for_fsattn(query, key, layout, config, work_factor: int = 1) -> bool:
    """Whether SDPA beats fsattn at this size: a CUDA call under ``config.sdpa_below_flops`` FLOPs,
    or with fewer keys than ``config.sdpa_below_keys``.

    `work_factor` scales the given shapes to those of the call that will run (under Ulysses of
    degree u, a rank's shards become u times the sequence over 1/u of the heads: u times the work
    and u times the keys).
    """
    if query.device.type not in ROUTED_DEVICE_TYPES:
        return False  # the CPU emulation is a stand-in for the GPU kernel, not a speed choice
    config = config if config is not None else DEFAULT_CONFIG
    seq_k = key.shape[_seq_axis(layout)] * work_factor
    return (attention_flops(query, key, layout) * work_factor < config.sdpa_below_flops
            or seq_k < config.sdpa_below_keys)


def run_small_call(where: str, backend: str, fallback):
    """Run a call too small for fsattn (``sdpa_below_flops``, ``sdpa_below_keys``) on `fallback`. A
    performance choice, not a refusal: strict mode does not object, it is logged at info, and
    counted as ``small_problem``."""
    note_backend(where + " (below FSAttnConfig.sdpa_below_flops or sdpa_below_keys)", backend)
    if not torch.compiler.is_compiling():
        record_sdpa_fallback("small_problem")
    return fallback()


def as_key_padding_mask(attn_mask, query, key):
    """A 2-D ``(batch, keys)`` mask as ``(batch, 1, 1, keys)`` (diffusers' convention, as in its
    native backend); any other mask as it is. Tensors are ``(B, S, H, D)``."""
    if (attn_mask is not None and attn_mask.dim() == 2 and attn_mask.shape[0] == query.shape[0]
            and attn_mask.shape[1] == key.shape[1]):
        return attn_mask[:, None, None, :]
    return attn_mask


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
    found = refusal(query, key, value, attn_mask, scale, layout=layout, dropout_p=dropout_p, is_causal=is_causal,
                    enable_gqa=enable_gqa)
    if found is None:
        if too_small_for_fsattn(query, key, layout, config):
            return run_small_call(where, "SDPA", fallback)
        note_backend(where, "fsattn")
        return fsattn(query, key, value, attn_mask=attn_mask, scale=scale, layout=layout, config=config)
    reason, detail = found
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
