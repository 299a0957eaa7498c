"""The attention op: the kernels' launch sequence, and ``fsattn::attention``, the torch custom op
that torch.compile sees as one opaque node (with its fake implementation).

The op takes already-checked tensors (see :func:`fsattn_diffusers.attention.fsattn`) and, by the
call's :class:`~fsattn_diffusers.plan.LaunchPlan`, runs the kernels on a GPU (four launches: K/V
statistics, K/V quantisation, Q quantisation, the forward kernel), or on CPU tensors the PyTorch
emulation of their numerics (or, with ``FSATTN_CPU_PATH=interpreter``, the real kernels in
Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from . import plan as planning
from . import stats
from .config import FSAttnConfig
from .plan import EMULATION, INTERPRETER, plan_for
from .reference import LOG2E, emulate_fsattn

# Optional: where Triton is missing (macOS, Windows) the CPU emulation still works.
try:
    import triton  # noqa: F401

    _HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    _HAS_TRITON = False

# "emulation" (default) runs the PyTorch emulation on CPU tensors; "interpreter" runs the real
# Triton kernels in Triton's interpreter (needs TRITON_INTERPRET=1 before Triton is imported).
CPU_PATH = os.environ.get("FSATTN_CPU_PATH", "emulation")


@functools.lru_cache(maxsize=None)
def _config_from_json(text: str) -> FSAttnConfig:
    return FSAttnConfig.from_json(text)


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


def target_of(device: torch.device):
    """The plan target of tensors on `device`: a CUDA compute capability, or a CPU path."""
    if device.type == "cuda":
        return _capability(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER if CPU_PATH == "interpreter" else EMULATION


def call_plan(config: FSAttnConfig, device: torch.device, head_dim: int, has_bias: bool = False,
              dtype: torch.dtype = torch.bfloat16, seq_k: int | None = None):
    """The :class:`~fsattn_diffusers.plan.LaunchPlan` a call with these properties runs (`seq_k`
    None: a call with many keys)."""
    return plan_for(config, target_of(device), head_dim, has_bias, dtype, seq_k)


def on_device_of(t: torch.Tensor):
    """A context in which `t`'s CUDA device is the current one. Triton launches on the current
    device, and a model on cuda:1 (device_map, multi-GPU pipelines) may run while cuda:0 is
    current; switching costs host time, so it happens only when needed."""
    if not t.is_cuda or t.device.index in (None, torch.cuda.current_device()):
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _as_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "NHD" else t.transpose(1, 2)


def attention_impl(query, key, value, key_weight, key_bias, scale: float, layout: str, config_json: str):
    """Fused-softmax attention on checked inputs; returns (out in `layout`, natural-log LSE (B, H, Sq))."""
    cfg = _config_from_json(config_json)
    q, k, v = (_as_bshd(t, layout) for t in (query, key, value))
    bsz, seq_q, heads, head_dim = q.shape
    plan = plan_for(cfg, target_of(q.device), head_dim, key_bias is not None, q.dtype, k.shape[1])
    q_tiles = bsz * heads * -(-seq_q // plan.block_m)
    if q.device.type == "cuda":
        with on_device_of(q):
            out, lse = _run_kernels(plan, cfg, q, k, v, key_weight, key_bias, scale, query, layout)
        stats.record_call("kernel", q_tiles)
    elif CPU_PATH == "interpreter":
        out, lse = _run_kernels(plan, cfg, q, k, v, key_weight, key_bias, scale, query, layout)
        stats.record_call("kernel", q_tiles)
    else:
        out, lse = _outputs(query, q)
        o, lse_e, fallbacks = emulate_fsattn(
            q, k, v, scale=scale, config=cfg, block_m=plan.block_m, block_n=plan.block_n,
            key_weight=key_weight, key_bias=key_bias)
        _as_bshd(out, layout).copy_(o)
        lse.copy_(lse_e)
        stats.record_call("emulation", q_tiles)
        stats.record_emulated_fallbacks(fallbacks)
    return out, lse


def _outputs(query, q):
    """The output (like `query`) and the LSE (B, H, Sq) float32, unwritten; `q` is `query` as
    (B, S, H, D)."""
    bsz, seq_q, heads, _ = q.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    return out, torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=query.device)


def _run_kernels(plan, cfg, q, k, v, key_weight, key_bias, scale, query, layout):
    """Quantise K/V for `plan` and launch its forward kernel (which quantises Q first); returns the
    output in `query`'s layout and the LSE."""
    from .kernels.quantize import quantize_kv

    kv = quantize_kv(k, v, key_weight, block_n=plan.block_n, d_pad=plan.d_pad, k_per_token=plan.k_per_token,
                     smooth_v=plan.smooth_v, v_dtype=plan.v_dtype, pv_key_order=plan.pv_key_order)
    # Allocated after the K/V launches, while they run (host time before the first launch leaves
    # the GPU idle where nothing else is queued).
    out_in_layout, lse = _outputs(query, q)
    out = _as_bshd(out_in_layout, layout)
    if plan.kernel in ("gluon_ws", "gluon"):
        name = "fsattn_fwd_" + plan.kernel
        try:
            if plan.kernel == "gluon_ws":
                planning.gluon_module(name).fsattn_fwd_gluon_ws(q, kv, out, lse, sm_scale=scale,
                                                                num_stages=plan.num_stages)
            else:
                planning.gluon_module(name).fsattn_fwd_gluon(q, kv, out, lse, sm_scale=scale, block_m=plan.block_m,
                                                    num_warps=plan.num_warps, num_stages=plan.num_stages)
            return out_in_layout, lse
        except Exception as err:  # noqa: BLE001 - narrowed to compile failures just below
            if not planning.is_compile_failure(err):
                raise
            # Compilation happens before the launch: the K/V buffers are only read, and the retry
            # below quantises again for its own plan and returns its own output.
            planning.disable_gluon(name, err)
        plan = plan_for(cfg, target_of(q.device), q.shape[-1], key_bias is not None, q.dtype, k.shape[1])
        return _run_kernels(plan, cfg, q, k, v, key_weight, key_bias, scale, query, layout)
    from .kernels import fsattn_fwd as fwd

    bias = None
    if key_bias is not None:  # natural -> log2 units, padding keys at -inf
        bias = torch.full((key_bias.shape[0], kv.k_q.shape[2]), float("-inf"), dtype=torch.float32, device=q.device)
        bias[:, : key_bias.shape[1]] = key_bias * LOG2E
    fwd.fsattn_fwd(q, kv, out, lse, stats.fallback_counter(q.device), sm_scale=scale, bias=bias,
                   frozen=plan.max_mode_for(k.shape[1]), exp_mode=plan.exp_mode, pv_fp32=plan.pv_fp32,
                   rowsum_mma=plan.rowsum_mma, max_threshold=plan.max_threshold, block_m=plan.block_m,
                   num_warps=plan.num_warps, num_stages=plan.num_stages)
    return out_in_layout, lse


@torch.library.custom_op("fsattn::attention", mutates_args=())
def attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_weight: torch.Tensor | None,
    key_bias: torch.Tensor | None,
    scale: float,
    layout: str,
    config_json: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-softmax attention on checked inputs; returns (out in `layout`, natural-log LSE (B, H, Sq))."""
    return attention_impl(query, key, value, key_weight, key_bias, scale, layout, config_json)


@attention_op.register_fake
def _(query, key, value, key_weight, key_bias, scale, layout, config_json):
    q = _as_bshd(query, layout)
    return (
        torch.empty(query.shape, dtype=query.dtype, device=query.device),
        torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=query.device),
    )


@torch.compiler.assume_constant_result
def kernels_available(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton kernels can run on `device`, and if not, why (a short reason key)."""
    if device.type == "cpu":
        return True, ""  # the emulation (or the interpreter) serves CPU tensors
    if device.type != "cuda":
        return False, f"device_{device.type}"
    if torch.version.hip is not None:
        return False, "rocm_not_supported"
    if not _HAS_TRITON:
        return False, "triton_missing"
    if _capability(device.index if device.index is not None else torch.cuda.current_device()) < (8, 9):
        return False, "gpu_without_fp8"  # FP8 e4m3 tensor cores arrived with Ada (sm_89)
    return True, ""
