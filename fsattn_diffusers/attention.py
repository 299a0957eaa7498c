"""The public entry point: ``fsattn(query, key, value, ...)``: checks, layouts, masks, dispatch."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from . import stats
from .config import DEFAULT_CONFIG, FSAttnConfig
from .ops import attention_op, kernels_available

logger = logging.getLogger("fsattn_diffusers")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 128  # INT8 scores of up to 128 channels fit the exact int-to-float trick (|acc| < 2**22)
# An additive mask value at least this far below the largest of its row masks the key: its softmax
# weight, e**-1e4 relative to that key's, is zero in every float format.
MASKED_BIAS_GAP = 1e4
_logged_fallbacks: set[str] = set()


class UnsupportedInputError(ValueError):
    """An input fsattn cannot compute (a mask that varies over queries, head dim > 128, ...).

    ``reason`` is a short key (counted by :func:`fsattn_diffusers.stats`); integrations catch
    this error to send the call to SDPA instead.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
        ``(B, 1, 1, Sk)``: a key-padding mask. In a float mask, a value 1e4 or more below the
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

    Notes
    -----
    Supported: bf16, fp16 and fp32 (computed in 8 bits, returned in the input dtype); head dims up
    to 128 (64, 96 and 128 are tuned); any lengths from 1. Inference only: inputs that require
    grad raise. On CPU tensors the PyTorch emulation of the kernel's numerics runs; on a GPU
    without FP8 tensor cores (before sm_89) the call goes to SDPA, logged once and counted in
    :func:`~fsattn_diffusers.stats`.``config.sdpa_below_flops`` is not applied here:
    the diffusers integrations apply it, this function always runs the kernels.
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, FSAttnConfig):
        raise TypeError(f"config must be an FSAttnConfig or None, got {type(config).__name__}")
    _check_tensors(query, key, value, layout)
    q_bshd = query if layout == "NHD" else query.transpose(1, 2)
    k_bshd = key if layout == "NHD" else key.transpose(1, 2)
    bsz, seq_q, heads, head_dim = q_bshd.shape
    seq_k = k_bshd.shape[1]
    if scale is None:
        scale = head_dim**-0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if head_dim > MAX_HEAD_DIM:
        raise UnsupportedInputError(
            "head_dim", f"head dim {head_dim} is not supported by fsattn (at most {MAX_HEAD_DIM})")
    key_weight, key_bias = _key_mask(attn_mask, bsz, heads, seq_q, seq_k, query.device)
    if config.check_finite:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or Inf (FSAttnConfig.check_finite=True)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError(
            "fsattn is forward-only (inference): call it under torch.no_grad() or torch.inference_mode()")

    ok, reason = kernels_available(query.device)
    if not ok:
        return _sdpa_fallback(query, key, value, attn_mask, scale, layout, return_lse, reason)
    out, lse = attention_op(query, key, value, key_weight, key_bias, scale, layout, config.to_json())
    return (out, lse) if return_lse else out


def _check_tensors(query, key, value, layout):
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' (B, S, H, D) or 'HND' (B, H, S, D), got {layout!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'B, S, H, D' if layout == 'NHD' else 'B, H, S, D'}), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; fsattn takes bfloat16, float16 or float32")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): every dim must be at least 1")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, "
                         f"{value.device}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    q = query if layout == "NHD" else query.transpose(1, 2)
    k = key if layout == "NHD" else key.transpose(1, 2)
    v = value if layout == "NHD" else value.transpose(1, 2)
    if k.shape != v.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"batch sizes differ: query {q.shape[0]}, key {k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"head dims differ: query {q.shape[3]}, key/value {k.shape[3]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")


def _key_mask(attn_mask, bsz, heads, seq_q, seq_k, device):
    """Split a key-padding mask into (key_weight, key_bias), each (B or 1, Sk) or None."""
    if attn_mask is None:
        return None, None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, the inputs on {device}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (additive), got {attn_mask.dtype}")
    shape = tuple(attn_mask.shape)
    if attn_mask.dim() > 4 or attn_mask.dim() == 0:
        raise ValueError(f"attn_mask of shape {shape} is not broadcastable to (B, H, Sq, Sk)")
    full = (1,) * (4 - attn_mask.dim()) + shape
    for got, want, name in zip(full, (bsz, heads, seq_q, seq_k), ("B", "H", "Sq", "Sk")):
        if got not in (1, want):
            raise ValueError(f"attn_mask of shape {shape} is not broadcastable to (B, H, Sq, Sk) = "
                             f"({bsz}, {heads}, {seq_q}, {seq_k}): dim {name} is {got}")
    if (full[1] != 1 and heads != 1) or (full[2] != 1 and seq_q != 1):
        raise UnsupportedInputError(
            "general_mask", f"attn_mask of shape {shape} varies over heads or queries; fsattn takes key-padding "
            "masks broadcastable to (B, 1, 1, Sk)")
    per_key = attn_mask.reshape(full[0], full[3]).expand(bsz, seq_k)
    if attn_mask.dtype == torch.bool:
        return per_key.float().contiguous(), None
    # An additive mask masks a key by a large negative bias (-inf, finfo.min, or LTX-Video's -1e4).
    # Such keys must also leave the K/V statistics (means, V's FP8 scale), or a padded V coarsens
    # every attended key's grid: they become weight-0 keys, with bias -inf so that none can set a
    # row's max either. Finite biases stay biases.
    bias = per_key.float()
    masked = bias <= bias.amax(dim=1, keepdim=True) - MASKED_BIAS_GAP
    return (~masked).float().contiguous(), bias.masked_fill(masked, float("-inf")).contiguous()


def _sdpa_fallback(query, key, value, attn_mask, scale, layout, return_lse, reason):
    if reason not in _logged_fallbacks:
        _logged_fallbacks.add(reason)
        logger.warning("fsattn: running SDPA instead of the fused-softmax kernels (reason: %s)", reason)
    stats.record_sdpa_fallback(reason)
    q, k, v = (t if layout == "HND" else t.transpose(1, 2) for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = attn_mask
    while mask is not None and mask.dim() < 4:
        mask = mask.unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = torch.nan_to_num(out, nan=0.0)  # all-masked rows: zeros, as the kernels give
    if layout == "NHD":
        out = out.transpose(1, 2)
    out = out.contiguous()
    if not return_lse:
        return out
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return out, torch.logsumexp(s, dim=-1)
