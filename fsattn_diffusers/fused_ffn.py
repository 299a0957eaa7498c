"""The recipe's fused feed-forward: a GELU feed-forward's activation and its FP8 down projection's
input scaling in one kernel.

diffusers' ``FeedForward`` with a tanh-approximate GELU (``activation_fn="gelu-approximate"``:
Wan, HunyuanVideo, CogVideoX, LTX-Video) computes ``down(gelu(up(x)))``. With the down projection
in torchao's float8 (dynamic per-row activation scales, per-row weight scales), torchao quantizes
the GELU's output row by row before its FP8 GEMM; compiled, the GELU and that quantization are
one inductor reduction that reads the hidden three times (1.02 ms at Wan2.1-1.3B's 32,760 x 8,960
hidden on an H200, 3.9 ms at 14B's 75,600 x 13,824). :func:`fuse_feed_forwards` routes such a
feed-forward through ``fsattn::gelu_tanh_fp8_linear`` instead: the one-pass kernel of
``fsattn_diffusers.kernels.gelu_fp8`` (the GELU rounded to bf16 as the model's own returns it,
the row's scale, e4m3), then the ``torch._scaled_mm`` call torchao makes with the layer's FP8
weight and scales (layers that torchao runs on MSLK's GEMM are not fused). The up projection
stays torchao's. The row's scale is the float32 ``max|y| / 448``, as inductor computes it when
it compiles torchao's path; torchao's eager path rounds that scale to bf16 first, so against it
~1-2 % of the e4m3 values differ by one step.

A feed-forward is fused only where calling its layers would run nothing but their class's
forward (no hooks of torch, accelerate's or diffusers' offloading, no wrappers); where that
changes after fusing, or in training mode, or with a hidden that is not bf16, the fused forward
runs the class's own.

On CPU tensors the op computes the same numbers in PyTorch (or, with
``FSATTN_CPU_PATH=interpreter``, runs the kernel in Triton's interpreter).
"""

from __future__ import annotations

import logging
import types

import torch

from . import ops
from .reference import FP8_MAX

logger = logging.getLogger("fsattn_diffusers")

_FORWARD_ATTR = "forward"  # the instance attribute that routes a module through the fused path


def _gelu_fp8_rows_torch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in PyTorch: the model's bf16 GELU, then per-row e4m3 scaling."""
    y = torch.nn.functional.gelu(rows, approximate="tanh").float()
    amax = y.abs().amax(dim=-1, keepdim=True)
    inv_scale = torch.where(amax > 0, FP8_MAX / amax, torch.zeros_like(amax))
    q = (y * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, amax / FP8_MAX


def gelu_fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh-GELU of each row of 2-D bf16 `rows` in FP8 e4m3, and the per-row float32 scales
    ``(rows, 1)``: the kernel on a GPU, PyTorch (or the interpreter) on a CPU."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.is_cuda or ops.CPU_PATH == "interpreter":
        from .kernels.gelu_fp8 import gelu_tanh_fp8_rows

        with ops.on_device_of(rows):
            return gelu_tanh_fp8_rows(rows)
    return _gelu_fp8_rows_torch(rows)


@torch.library.custom_op("fsattn::gelu_tanh_fp8_linear", mutates_args=())
def gelu_tanh_fp8_linear(hidden: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, use_fast_accum: bool) -> torch.Tensor:
    """``linear(gelu_tanh(hidden), W)`` with ``W = weight_fp8 * weight_scale`` (e4m3 ``(N, K)``, float32
    ``(N, 1)``), the GELU's output quantized per row to e4m3; bf16 ``(..., N)``."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    if rows.shape[0] == 0:
        return hidden.new_empty((*hidden.shape[:-1], weight_fp8.shape[0]), dtype=torch.bfloat16)
    q, scale = gelu_fp8_rows(rows)
    out = torch._scaled_mm(q, weight_fp8.t(), scale_a=scale, scale_b=weight_scale.t(), bias=bias,
                           out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    return out.reshape(*hidden.shape[:-1], weight_fp8.shape[0])


@gelu_tanh_fp8_linear.register_fake
def _(hidden, weight_fp8, weight_scale, bias, use_fast_accum):
    return hidden.new_empty((*hidden.shape[:-1], weight_fp8.shape[0]), dtype=torch.bfloat16)


def _per_row_float8(weight) -> str | None:
    """None where `weight` is torchao's float8 weight with per-row scales and dynamic per-row e4m3
    activation scaling, run by ``torch._scaled_mm`` (what the op reproduces); else what differs."""
    if type(weight).__name__ != "Float8Tensor" or not type(weight).__module__.startswith("torchao."):
        return f"weight is {type(weight).__name__}, not torchao's Float8Tensor"
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if qdata is None or qdata.dtype != torch.float8_e4m3fn or scale is None or tuple(scale.shape) != (qdata.shape[0], 1):
        return "weight is not e4m3 with one scale per output row"
    act = getattr(weight, "act_quant_kwargs", None)
    if act is None or type(getattr(act, "granularity", None)).__name__ != "PerRow":
        return "activations are not quantized per row"
    if getattr(act, "float8_dtype", None) != torch.float8_e4m3fn or getattr(act, "hp_value_lb", None) is not None \
            or getattr(act, "hp_value_ub", None) is not None:
        return "activation scaling is not plain e4m3 per row"
    mm = getattr(weight, "mm_config", None)
    if mm is None or mm.emulate or mm.pad_inner_dim:
        return "the FP8 GEMM is emulated or padded"
    preference = getattr(getattr(weight, "kernel_preference", None), "name", "")
    if preference == "MSLK" or (preference == "AUTO" and _mslk_installed()):
        return "torchao runs this layer on MSLK's GEMM, not torch._scaled_mm"
    return None


def _mslk_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("mslk") is not None


def _hooked(layer: torch.nn.Module) -> bool:
    """Whether calling `layer` would do more than its class's forward (hooks of torch, accelerate or
    diffusers, an instance forward): the fused path, which reads its weight, would skip that."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks or _FORWARD_ATTR in layer.__dict__
                or hasattr(layer, "_hf_hook") or hasattr(layer, "_diffusers_hook"))


def unfusable_reason(module: torch.nn.Module) -> str | None:
    """None where `module` is a diffusers ``FeedForward`` the fused path computes exactly: a
    tanh-GELU activation, dropout only around the down projection, and that projection in
    torchao's per-row float8 with an input width the kernel holds; otherwise why not."""
    from .kernels.gelu_fp8 import MAX_COLS

    if type(module).__name__ != "FeedForward":
        return "not a diffusers FeedForward"
    net = getattr(module, "net", None)
    if not isinstance(net, torch.nn.ModuleList) or len(net) not in (3, 4):
        return "not the activation / dropout / down projection layout"
    act, down = net[0], net[2]
    if type(act).__name__ != "GELU" or getattr(act, "approximate", None) != "tanh" \
            or not isinstance(getattr(act, "proj", None), torch.nn.Linear):
        return "activation is not diffusers' tanh-approximate GELU"
    if not all(isinstance(m, torch.nn.Dropout) for m in list(net)[1::2]) or not isinstance(down, torch.nn.Linear):
        return "not the activation / dropout / down projection layout"
    if not 0 < down.in_features <= MAX_COLS:
        return f"hidden width {down.in_features} is outside 1..{MAX_COLS}"
    if _hooked(act) or _hooked(down):
        return ("its activation or down projection carries hooks (e.g. sequential CPU offload, group "
                "offloading) that the fused path would not call")
    return _per_row_float8(down.weight)


def _fused_forward(self, hidden_states, *args, **kwargs):
    """A fused feed-forward's forward (bound to it as an instance method, so that a deep copy of
    the model binds its own copy). Where the layers changed since fusing (a wrapper such as PEFT's
    around the down projection, hooks added), in training (dropout), or with a hidden that is not
    bf16, it runs the class's forward instead."""
    act, down = self.net[0], self.net[2]
    if self.training or not isinstance(down, torch.nn.Linear) or _hooked(act) or _hooked(down):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    hidden = act.proj(hidden_states)
    if hidden.dtype != torch.bfloat16:
        out = down(self.net[1](act.gelu(hidden)))
        return self.net[3](out) if len(self.net) == 4 else out
    weight = down.weight
    return torch.ops.fsattn.gelu_tanh_fp8_linear(hidden, weight.qdata, weight.scale, down.bias,
                                                 bool(weight.mm_config.use_fast_accum))


def fuse_feed_forwards(model: torch.nn.Module) -> list[str]:
    """Route every feed-forward of `model` that :func:`unfusable_reason` accepts through the fused
    op (an instance ``forward``); returns their paths. Undone by :func:`unfuse_feed_forwards`."""
    fused, left = [], {}
    for path, module in model.named_modules():
        reason = unfusable_reason(module)
        if reason is None and _FORWARD_ATTR in vars(module):
            reason = "it has a forward of its own already (a hook's)"
        if reason is None:
            module.forward = types.MethodType(_fused_forward, module)
            module._fsattn_fused_ffn = True
            fused.append(path)
        elif type(module).__name__ == "FeedForward":
            left.setdefault(reason, []).append(path)
    if fused:
        logger.info("apply_recipe: %s: %d feed-forwards fused (GELU + FP8 scaling in one kernel)",
                    type(model).__name__, len(fused))
    for reason, paths in left.items():
        logger.info("apply_recipe: %s: %d feed-forwards on torchao's path (e.g. %s): %s", type(model).__name__,
                    len(paths), paths[0], reason)
    return fused


def unfuse_feed_forwards(model: torch.nn.Module) -> None:
    """Put back the class's forward on the feed-forwards :func:`fuse_feed_forwards` routed (where a
    hook has wrapped the fused forward since, the hook's forward stays)."""
    for module in model.modules():
        if vars(module).pop("_fsattn_fused_ffn", False):
            forward = vars(module).get(_FORWARD_ATTR)
            if getattr(forward, "__func__", None) is _fused_forward:
                del vars(module)[_FORWARD_ATTR]
