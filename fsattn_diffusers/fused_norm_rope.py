"""The recipe's fused query/key norm and rotary embedding for Wan's self-attention.

Wan's self-attention normalises each token's query and key over all heads (``norm_q``/``norm_k``,
RMSNorm with a weight), then rotates each head's channel pairs by the token's angles
(``WanAttnProcessor``'s nested ``apply_rotary_emb``). Compiled, that is one inductor reduction
per block that reads the rows twice and runs at ~1 TB/s (2.9 ms at Wan2.1-14B's 75,600 tokens,
1.2 ms at Wan2.1-1.3B's 32,760, standalone on an H200). :func:`fuse_norm_rope` gives the
self-attention modules :class:`WanFusedNormRopeProcessor` instead, which computes the same
through ``fsattn::qk_norm_rope``: on a GPU one Triton pass (``fsattn_diffusers.kernels
.qk_norm_rope``; 0.87 / 0.15 ms there, 99.998 % of values equal to the compiled code's and the
rest one bf16 step apart, benchmarks/NOTES.md v28 (d)); on a CPU the processor's own PyTorch
code. Everything else is ``WanAttnProcessor``'s, the attention call included (which fsattn then
routes as it routes diffusers' own processor).

A module is given the processor only where it runs diffusers' ``WanAttnProcessor`` as a
self-attention (no image or text keys of its own) with RMSNorm query/key norms that have a weight
and an explicit ``eps``; at each call, other arguments (no rotary embedding, norms changed since)
take the processor's PyTorch code, and a call with ``encoder_hidden_states`` (which diffusers never
makes to a self-attention) takes ``WanAttnProcessor`` itself, outside fsattn.

The processor's self-attention path is a copy of ``WanAttnProcessor.__call__``'s as diffusers
0.36-0.42 write it (projections, norms, rotation, ``dispatch_attention_fn`` with the processor's
backend and parallel config, output projection); a later diffusers that changes that path is not
detected here: the CPU tests compare the two processors' outputs bit for bit on the installed one.
"""

from __future__ import annotations

import copy
import functools
import logging

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn

from . import families, fused_ffn, ops, patch

logger = logging.getLogger("fsattn_diffusers")


def rotated(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """``WanAttnProcessor``'s rotary embedding of (B, S, H, D) `x` (diffusers 0.36-0.42)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def norm_rope_torch(query, key, weight_q, weight_k, eps: float, freqs_cos, freqs_sin, heads: int):
    """What the processor computes without the fused pass: RMSNorm of (B, S, H*D) rows, then the
    rotation of each head."""
    n = query.shape[-1]
    q = F.rms_norm(query, (n,), weight_q, eps).unflatten(2, (heads, -1))
    k = F.rms_norm(key, (n,), weight_k, eps).unflatten(2, (heads, -1))
    return rotated(q, freqs_cos, freqs_sin), rotated(k, freqs_cos, freqs_sin)


@torch.library.custom_op("fsattn::qk_norm_rope", mutates_args=())
def qk_norm_rope(query: torch.Tensor, key: torch.Tensor, weight_q: torch.Tensor, weight_k: torch.Tensor, eps: float,
                 freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (over all H*D channels, times the weights) and Wan's rotary embedding of the query and
    key, (B, S, H*D) in, (B, S, H, D) out: the Triton pass where it takes the arguments (a GPU, or
    ``FSATTN_CPU_PATH=interpreter``), :func:`norm_rope_torch` otherwise."""
    if query.is_cuda or ops.CPU_PATH == "interpreter":
        from .kernels import qk_norm_rope as kernel

        if kernel.unsupported_reason(query, key, weight_q, weight_k, freqs_cos, freqs_sin, heads) is None:
            with ops.on_device_of(query):
                return kernel.launch(query, key, weight_q, weight_k, eps, freqs_cos, freqs_sin, heads)
    q, k = norm_rope_torch(query, key, weight_q, weight_k, eps, freqs_cos, freqs_sin, heads)
    return q.contiguous(), k.contiguous()


@qk_norm_rope.register_fake
def _(query, key, weight_q, weight_k, eps, freqs_cos, freqs_sin, heads):
    b, s, n = query.shape
    shape = (b, s, heads, n // heads)
    return query.new_empty(shape), key.new_empty(shape)


def _fusable_norms(attn) -> bool:
    """Whether `attn`'s query/key norms are what the fused pass computes: RMSNorm over the whole
    row, with a weight, one explicit eps for both, no hooks."""
    norms = (getattr(attn, "norm_q", None), getattr(attn, "norm_k", None))
    if not all(type(n) is torch.nn.RMSNorm for n in norms):
        return False
    if any(n.weight is None or n.eps is None or len(n.normalized_shape) != 1 for n in norms):
        return False
    if any(fused_ffn._hooked(n) for n in norms):  # hooks the op would not call
        return False
    return norms[0].eps == norms[1].eps


@functools.cache
def _wan_processor_class():
    """``WanAttnProcessor``, or None where this diffusers has none (or not its helpers)."""
    try:
        from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections  # noqa: F401
    except ImportError:
        return None
    return WanAttnProcessor


def _fused_call(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
    """``WanAttnProcessor.__call__`` for a self-attention, the query/key norm and rotation fused."""
    if encoder_hidden_states is not None or attn.add_k_proj is not None:
        return _wan_processor_class().__call__(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                                               rotary_emb)
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    if rotary_emb is not None and _fusable_norms(attn):
        query, key = torch.ops.fsattn.qk_norm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight,
                                                   float(attn.norm_q.eps), rotary_emb[0], rotary_emb[1], attn.heads)
    else:
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotated(query, *rotary_emb), rotated(key, *rotary_emb)
    value = value.unflatten(2, (attn.heads, -1))
    hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                          backend=self._attention_backend, parallel_config=self._parallel_config)
    hidden_states = hidden_states.flatten(2, 3).type_as(query)
    hidden_states = attn.to_out[0](hidden_states)
    return attn.to_out[1](hidden_states)


@functools.cache
def processor_class():
    """:class:`WanFusedNormRopeProcessor` (built on first use: it subclasses diffusers' class)."""
    base = _wan_processor_class()
    if base is None:
        return None
    return type("WanFusedNormRopeProcessor", (base,), {
        "__call__": _fused_call, "__module__": __name__,
        "__doc__": "WanAttnProcessor for a self-attention, with the query/key RMSNorm and rotary embedding fused "
                   "(fsattn_diffusers.fused_norm_rope)."})


def fuse_norm_rope(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """Give every Wan self-attention module of `model` that runs ``WanAttnProcessor`` with fusable
    norms a :class:`WanFusedNormRopeProcessor` (a copy of its processor's state); returns (module,
    processor it had) pairs for :func:`unfuse_norm_rope`. Modules running another processor (other
    families, a user's) are left alone."""
    cls = processor_class()
    if cls is None:
        return []
    changed = []
    for path, module in families.attention_modules(model):
        processor = getattr(module, "processor", None)
        if type(processor) is not _wan_processor_class() or families.is_cross_attention(path, module, model):
            continue
        if getattr(module, "add_k_proj", None) is not None or not _fusable_norms(module):
            continue
        fused = copy.copy(processor)
        fused.__class__ = cls
        patch._set_processor(module, fused)
        changed.append((module, processor))
    if changed:
        logger.info("apply_recipe: %s: %d self-attention modules with the query/key norm and RoPE fused",
                    type(model).__name__, len(changed))
    return changed


# What diffusers sets on a module's processor after the recipe (``enable_parallelism``,
# ``set_attention_backend``): carried back to the processor put back, or each rank of a
# context-parallel run would attend over its own tokens only.
_CARRIED_BACK = ("_parallel_config", "_attention_backend")


def unfuse_norm_rope(changed: list[tuple[torch.nn.Module, object]]) -> None:
    """Put back the processors :func:`fuse_norm_rope` replaced (where one is still in place), with the
    parallel config and attention backend set on the fused one since."""
    cls = processor_class()
    for module, processor in changed:
        current = getattr(module, "processor", None)
        if cls is not None and isinstance(current, cls):
            for name in _CARRIED_BACK:
                if hasattr(current, name) and hasattr(processor, name):
                    setattr(processor, name, getattr(current, name))
            patch._set_processor(module, processor)
