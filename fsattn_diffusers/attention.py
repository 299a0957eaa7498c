"""The public entry point ``fsattn()``, the one answer to "can fsattn take this call?", and the exact
attention that runs what it cannot.

:func:`refusal` is that answer, for every route: :func:`fsattn` raises on it, and the diffusers
integrations (processor, backend, context parallelism; :mod:`fsattn_diffusers.routing`) send a
refused call to the attention the model would have run. It is pure and cheap, and torch.compile
traces it: a call fsattn would refuse never reaches it inside a compiled graph.
"""

from __future__ import annotations

import logging
import math
import numbers

import torch
import torch.nn.functional as F

from . import stats
from .config import DEFAULT_CONFIG, FSAttnConfig
from .ops import attention_impl, attention_op, kernels_available

logger = logging.getLogger("fsattn_diffusers")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 128  # the kernels' tiles and registers are sized for padded head dims up to 128
# An additive mask value at least this far below the largest of its row masks the key: its softmax
# weight, e**-1000 relative to that key's, is zero in every float format (float64's smallest
# subnormal is e**-744). Not 1e4: LTX-Video's -10000 rounds to -9984 in a bfloat16 mask.
MASKED_BIAS_GAP = 1e3
# Rows of float32 scores the exact fallback's log-sum-exp holds at once, over all heads (256 MiB).
EXACT_LSE_SCORES = 1 << 26
_logged_fallbacks: set[str] = set()


class UnsupportedInputError(ValueError):
    """An input fsattn cannot compute (a mask that varies over queries, head dim > 128, ...).

    ``reason`` is a short key (counted by :func:`fsattn_diffusers.stats`); integrations catch
    this error to send the call to SDPA instead.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# What a refusal raises in fsattn(). "Unsupported" calls are valid attention outside what fsattn
# computes; the others are malformed calls, which SDPA would refuse too.
_ERRORS = {"layout": ValueError, "not_tensor": TypeError, "not_4d": ValueError, "dtype": TypeError,
           "empty": ValueError, "devices": ValueError, "dtypes": TypeError, "shapes": ValueError,
           "heads": ValueError, "mask": ValueError, "mask_type": TypeError, "scale": ValueError,
           "autograd": NotImplementedError}


def refusal(query, key, value, attn_mask=None, scale=None, *, layout="NHD", dropout_p=0.0, is_causal=False,
            enable_gqa=True, check_device=True):
    """Why fsattn cannot take this attention call, as ``(reason, detail)``, or None if it can.

    Parameters are those of :func:`fsattn`, plus the SDPA arguments an integration meets
    (`dropout_p`, `is_causal`, and `enable_gqa`, without which SDPA refuses unequal head counts).
    `reason` is a short key, counted in :func:`~fsattn_diffusers.stats` when a route falls back;
    ``"no_kernels"``-type reasons (from the device) are left out with ``check_device=False``.
    The detail string is built only for a refusal: an accepted call costs comparisons only.
    """
    if layout not in ("NHD", "HND"):
        return "layout", f"layout must be 'NHD' (B, S, H, D) or 'HND' (B, H, S, D), got {layout!r}"
    if dropout_p:
        return "dropout", f"dropout_p={dropout_p} (fsattn is inference-only and has no dropout)"
    if is_causal:
        return "is_causal", "is_causal=True (fsattn computes non-causal attention only)"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            return "not_tensor", f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return "not_4d", (f"{name} must be 4-D ({'B, S, H, D' if layout == 'NHD' else 'B, H, S, D'}), "
                              f"got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            return "dtype", f"{name} has dtype {t.dtype}; fsattn takes bfloat16, float16 or float32"
        if t.numel() == 0:
            return "empty", f"{name} is empty (shape {tuple(t.shape)}): every dim must be at least 1"
    if key.device != query.device or value.device != query.device:
        return "devices", f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtypes", f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
    seq_axis, head_axis = (1, 2) if layout == "NHD" else (2, 1)
    if key.shape != value.shape:
        return "shapes", f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}"
    if key.shape[0] != query.shape[0]:
        return "shapes", f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}"
    if key.shape[3] != query.shape[3]:
        return "shapes", f"head dims differ: query {query.shape[3]}, key/value {key.shape[3]}"
    heads, kv_heads = query.shape[head_axis], key.shape[head_axis]
    if heads % kv_heads != 0:
        return "heads", f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})"
    if heads != kv_heads and not enable_gqa:
        return "heads_mismatch", f"{heads} query heads, {kv_heads} key heads, enable_gqa=False"
    if query.shape[3] > MAX_HEAD_DIM:
        return "head_dim", f"head dim {query.shape[3]} is not supported by fsattn (at most {MAX_HEAD_DIM})"
    if scale is not None and type(scale) is not float:  # every call checks: floats take one test
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            return "scale", f"scale must be a real number or None, got {scale!r}"
    if scale is not None and not math.isfinite(scale):
        return "scale", f"scale must be finite, got {scale}"
    if attn_mask is not None:
        found = _mask_refusal(attn_mask, query.device, query.shape[0], heads, query.shape[seq_axis],
                              key.shape[seq_axis])
        if found is not None:
            return found
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (attn_mask is not None and attn_mask.requires_grad)):
        return "autograd", ("inputs that require grad: fsattn is forward-only (inference); call it under "
                            "torch.no_grad() or torch.inference_mode()")
    if check_device:
        ok, reason = kernels_available(query.device)
        if not ok:
            return reason, f"no fsattn kernels for {query.device} ({reason})"
    return None


def _mask_refusal(attn_mask, device, bsz, heads, seq_q, seq_k):
    if not isinstance(attn_mask, torch.Tensor):
        return "mask_type", f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}"
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        return "mask_type", f"attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}"
    if attn_mask.device != device:
        return "mask", f"attn_mask is on {attn_mask.device}, the inputs on {device}"
    shape = tuple(attn_mask.shape)
    if attn_mask.dim() > 4 or attn_mask.dim() == 0:
        return "mask", f"attn_mask of shape {shape} is not broadcastable to (B, H, Sq, Sk)"
    full = (1,) * (4 - attn_mask.dim()) + shape
    for got, want, name in zip(full, (bsz, heads, seq_q, seq_k), ("B", "H", "Sq", "Sk")):
        if got != 1 and got != want:
            return "mask", (f"attn_mask of shape {shape} is not broadcastable to (B, H, Sq, Sk) = "
                            f"({bsz}, {heads}, {seq_q}, {seq_k}): dim {name} is {got}")
    if (full[1] != 1 and heads != 1) or (full[2] != 1 and seq_q != 1):
        return "general_mask", (f"attn_mask of shape {shape} has a row per head or per query; fsattn takes "
                                "key-padding masks broadcastable to (B, 1, 1, Sk) (it does not read a mask to find "
                                "out whether its rows agree)")
    return None


def raise_refusal(reason: str, detail: str):
    """Raise what :func:`fsattn` raises for a :func:`refusal`."""
    error = _ERRORS.get(reason)
    if error is None:
        raise UnsupportedInputError(reason, detail)
    raise error(detail)


def fsattn(query, key, value, attn_mask=None, scale=None, layout="NHD", return_lse=False, config=None):
    """Fused-softmax 8-bit attention (non-causal), a drop-in for video-DiT attention.

    Parameters
    ----------
    query : Tensor
        ``(B, Sq, Hq, D)`` for ``layout="NHD"`` (what diffusers passes) or ``(B, Hq, Sq, D)`` for
        ``layout="HND"`` (what SDPA takes). Any strides: views straight from the projections work.
    key, value : Tensor
        ``(B, Sk, Hkv, D)`` / ``(B, Hkv, Sk, D)``, same dtype and device as ``query``; ``Hq`` must
        be a multiple of ``Hkv`` (grouped-query attention). ``Sk`` may differ from ``Sq``.
    attn_mask : Tensor or None
        Boolean (True = attend) or additive float, broadcastable (SDPA's rules) to
        ``(B, 1, 1, Sk)``: a key-padding mask. In a float mask, a value 1,000 or more below the
        largest of its row (``-inf``, ``torch.finfo(dtype).min``, ``-10000``) masks that key, as a
        boolean False does; other values are added to the scores. A mask that varies over queries
        or heads raises :class:`UnsupportedInputError`. A row whose keys are all masked returns
        zeros (and ``-inf`` log-sum-exp), where SDPA would return NaN.
    scale : float or None
        Softmax scale; default ``D ** -0.5``.
    layout : {"NHD", "HND"}
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's scaled scores, float32 ``(B, Hq, Sq)``.
    config : FSAttnConfig or None
        Numerical choices; default :data:`~fsattn_diffusers.config.DEFAULT_CONFIG`.

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``return_lse``
        The output in ``query``'s dtype and layout (contiguous), and the LSE.

    Raises
    ------
    UnsupportedInputError
        For valid attention outside what fsattn computes (head dim > 128, a mask that varies over
        queries or heads); ``TypeError``/``ValueError`` for malformed calls;
        ``NotImplementedError`` for inputs that require grad (fsattn is forward-only).

    Notes
    -----
    Supported: bf16, fp16 and fp32 (computed in 8 bits, returned in the input dtype); head dims up
    to 128 (tiles tuned at 64 and 128; 96 runs padded to 128); any lengths from 1. On CPU tensors
    the PyTorch emulation of the kernel's numerics runs; on a GPU without FP8 tensor cores (before
    sm_89) the call runs exact attention (SDPA), logged once and counted in
    :func:`~fsattn_diffusers.stats`.
    ``config.sdpa_below_flops`` and ``config.sdpa_below_keys`` are not applied here: the diffusers
    integrations apply them, this function always runs the kernels. No host synchronisation: it
    can be captured in a CUDA graph.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, FSAttnConfig):
        raise TypeError(f"config must be an FSAttnConfig or None, got {type(config).__name__}")
    found = refusal(query, key, value, attn_mask, scale, layout=layout, check_device=False)
    if found is not None:
        raise_refusal(*found)
    head_dim = query.shape[3]
    scale = head_dim**-0.5 if scale is None else float(scale)
    if config.check_finite:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or Inf (FSAttnConfig.check_finite=True)")
    ok, reason = kernels_available(query.device)
    if not ok:
        return _exact_fallback(query, key, value, attn_mask, scale, layout, return_lse, reason)
    key_weight, key_bias = key_mask(attn_mask, query, key, layout)
    # The custom op exists for torch.compile (one opaque node); eagerly, its dispatch would only add
    # host time to every call.
    run = attention_op if torch.compiler.is_compiling() else attention_impl
    out, lse = run(query, key, value, key_weight, key_bias, scale, layout, config.to_json())
    return (out, lse) if return_lse else out


def key_mask(attn_mask, query, key, layout="NHD"):
    """A key-padding mask (checked by :func:`refusal`) as ``(key_weight, key_bias)``, each ``(B, Sk)``
    or None: the weight is 0 for masked keys, 1 for attended ones; the bias, float32 and for float
    masks only, is added to the scores in natural-log units (``-inf`` where masked). A boolean
    mask's weight is the mask itself, a view (the K/V pre-pass reads booleans as 0/1): no launch
    and no copy for it; a float mask's weight is float32."""
    if attn_mask is None:
        return None, None
    bsz = query.shape[0]
    seq_k = key.shape[1 if layout == "NHD" else 2]
    full = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    per_key = attn_mask.reshape(full[0], full[3]).expand(bsz, seq_k)
    if attn_mask.dtype == torch.bool:
        return per_key, None
    # An additive mask masks a key by a large negative bias (-inf, finfo.min, or LTX-Video's -1e4).
    # Such keys must also leave the K/V statistics (means, V's FP8 scale), or a padded V coarsens
    # every attended key's grid: they become weight-0 keys, with bias -inf so that none can set a
    # row's max either. Finite biases stay biases.
    bias = _gap_masked(per_key.float()).contiguous()
    return (bias != float("-inf")).float(), bias


def _exact_fallback(query, key, value, attn_mask, scale, layout, return_lse, reason):
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.warning("fsattn: running exact attention (SDPA) instead of the fused-softmax kernels (reason: %s)",
                       reason)
    stats.record_sdpa_fallback(reason)
    return exact_attention(query, key, value, attn_mask, scale=scale, layout=layout, return_lse=return_lse)


def _stored_values(mask: torch.Tensor) -> torch.Tensor:
    """`mask` without the dimensions it only broadcasts over (stride 0, kept at size 1)."""
    return mask[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in mask.stride())]


def _gap_masked(mask: torch.Tensor) -> torch.Tensor:
    """A float mask with -inf wherever a value is MASKED_BIAS_GAP or more below the largest of its
    row (the threshold in float32): the one rule for :func:`key_mask` and the exact fallback.
    Dimensions the mask only broadcasts over (stride 0) stay broadcast: a per-key mask is never
    expanded per query."""
    stored = _stored_values(mask)
    threshold = stored.amax(-1, keepdim=True).float() - MASKED_BIAS_GAP
    return stored.masked_fill(stored <= threshold, float("-inf")).expand(mask.shape)


def exact_attention(query, key, value, attn_mask=None, *, scale=None, layout="NHD", return_lse=False):
    """Exact attention with fsattn's conventions: SDPA for the output, and the natural-log LSE.

    The fallback wherever the kernels cannot run, and the ring's op for calls fsattn refuses. A
    float mask masks a key as :func:`fsattn` reads it (a value :data:`MASKED_BIAS_GAP` or more
    below the largest of its row), and a row whose keys are all masked gives zeros and ``-inf``
    LSE, as the kernels do (SDPA: NaN; and a row of ``finfo.min`` alone would be attended evenly).
    The LSE is computed from float32 scores in blocks of query rows (at most
    :data:`EXACT_LSE_SCORES` scores at once), never the whole score matrix.

    Parameters and returns as :func:`fsattn` (`attn_mask` broadcastable to ``(B, H, Sq, Sk)``).
    """
    q, k, v = (t if layout == "HND" else t.transpose(1, 2) for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = attn_mask
    while mask is not None and mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.dtype != torch.bool:
        mask = _gap_masked(mask)
    # SDPA and the checks below get the mask's stored values, broadcast where they are used: SDPA's
    # boolean-to-float conversion, the cast and a comparison would each make a full-size copy of a
    # broadcast view. SDPA takes a float mask only in the query's dtype; fsattn() takes any.
    stored = None if mask is None else _stored_values(mask)
    sdpa_mask = stored if stored is None or stored.dtype in (torch.bool, q.dtype) else stored.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=scale)
    # SDPA's CPU kernel gives a NaN query row a finite output (its NaN keys and V it keeps): the
    # row is made NaN here, as on fsattn's kernels.
    out = out + (0.0 * torch.sum(q, -1, keepdim=True, dtype=torch.float32)).to(out.dtype)
    if stored is not None:
        # Zeros where every key is masked (SDPA: NaN); a NaN the inputs put elsewhere stays.
        attended = stored if stored.dtype == torch.bool else stored > float("-inf")
        out = out.masked_fill(~attended.any(-1, keepdim=True), 0.0)
    out = (out if layout == "HND" else out.transpose(1, 2)).contiguous()
    if not return_lse:
        return out
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bsz, heads, seq_q, _ = q.shape
    rows = max(1, EXACT_LSE_SCORES // (bsz * heads * k.shape[2]))
    lse = torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=q.device)
    kf = k.float().transpose(-1, -2)
    for i0 in range(0, seq_q, rows):
        s = torch.matmul(q[:, :, i0:i0 + rows].float(), kf) * scale
        if mask is not None:
            m = mask[:, :, i0:i0 + rows] if mask.shape[2] > 1 else mask
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
        lse[:, :, i0:i0 + rows] = torch.logsumexp(s, dim=-1)
    return out, lse
