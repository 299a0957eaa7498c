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
from .kernels.launch import Address, carve, carved_bytes, current_stream, launch_key
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
    if query.is_cuda:
        # As on_device_of, keeping the device's index for the call's key and stream.
        device = torch.cuda.current_device()
        if query.device.index not in (None, device):
            with torch.cuda.device(query.device):
                return _on_gpu(query, key, value, key_weight, key_bias, scale, layout, config_json,
                               query.device.index)
        return _on_gpu(query, key, value, key_weight, key_bias, scale, layout, config_json, device)
    cfg = _config_from_json(config_json)
    q, k, v = (_as_bshd(t, layout) for t in (query, key, value))
    bsz, seq_q, heads, head_dim = q.shape
    plan = plan_for(cfg, target_of(q.device), head_dim, key_bias is not None, q.dtype, k.shape[1])
    q_tiles = bsz * heads * -(-seq_q // plan.block_m)
    if CPU_PATH == "interpreter":
        out, lse = _prepare_and_run(plan, cfg, query, key, value, key_weight, key_bias, scale, layout)[:2]
        stats.record_call("kernel", q_tiles)
    else:
        out, lse = _outputs(query, q)
        o, lse_e, fallbacks = emulate_fsattn(
            q, k, v, scale=scale, config=cfg, block_m=plan.block_m, block_n=plan.block_n,
            key_weight=key_weight, key_bias=key_bias, k_per_token=plan.k_per_token, sort_keys=plan.sort_keys)
        _as_bshd(out, layout).copy_(o)
        lse.copy_(lse_e)
        stats.record_call("emulation", q_tiles)
        stats.record_emulated_fallbacks(fallbacks)
    return out, lse


# Calls prepared on a GPU, by _call_key; each kind of call a model makes is one entry.
_prepared_calls: dict = {}
MAX_PREPARED_CALLS = 256


def _call_key(query, key, value, key_weight, key_bias, layout, config_json, device=None):
    """What a :class:`PreparedCall` depends on: the config, the layout, every operand's shape,
    strides, dtype and alignment, and the current device (the plan's target; `device` where the
    caller knows it)."""
    return (config_json, layout, query.shape, query.stride(), key.shape, key.stride(), value.stride(),
            None if key_weight is None else (key_weight.shape, key_weight.stride()),
            None if key_bias is None else (key_bias.shape, key_bias.stride()),
            launch_key(query, key, value, key_weight, key_bias, device=device))


def _on_gpu(query, key, value, key_weight, key_bias, scale, layout, config_json, device):
    """The op on `device`, the current CUDA device (or on CPU tensors, device -1, for tests: the
    same preparation and cache, run in Triton's interpreter with buffers of their own rather
    than carved from one allocation)."""
    call_key = _call_key(query, key, value, key_weight, key_bias, layout, config_json, device)
    prepared = _prepared_calls.get(call_key)
    if prepared is not None:
        out, lse = prepared.run(query, key, value, key_weight, key_bias, scale,
                                current_stream(device) if device >= 0 else None)
    else:
        cfg = _config_from_json(config_json)
        plan = plan_for(cfg, target_of(query.device), query.shape[3], key_bias is not None, query.dtype,
                        key.shape[1 if layout == "NHD" else 2])
        out, lse, prepared = _prepare_and_run(plan, cfg, query, key, value, key_weight, key_bias, scale, layout)
        if len(_prepared_calls) >= MAX_PREPARED_CALLS:
            _prepared_calls.clear()
        _prepared_calls[call_key] = prepared
    stats.record_call("kernel", prepared.q_tiles)
    return out, lse


class PreparedCall:
    """The launches of one kind of call (:func:`_call_key`): the K/V pre-pass (two launches; with
    sorted keys three and a sort, and never from one allocation) and
    the forward (Q's quantisation and the attention kernel), each prepared for its shapes, so
    that a call only allocates its buffers and launches. ``run`` takes the call's operands."""

    __slots__ = ("kv_prepass", "forward", "with_counter", "layout", "lse_shape", "q_tiles", "_sizes", "_bytes",
                 "_buffers")

    def __init__(self, kv_prepass, forward, with_counter: bool, layout: str, lse_shape: tuple, q_tiles: int):
        self.kv_prepass = kv_prepass
        self.forward = forward
        self.with_counter = with_counter  # the Triton kernel: the frozen-max fallback counter and the bias
        self.layout = layout
        self.lse_shape = lse_shape
        self.q_tiles = q_tiles
        # The pre-passes' buffers (workspace, K, V, row-sum weights; Q, its scales, q . k_mean),
        # carved from one allocation on a GPU.
        self._sizes = kv_prepass.buffer_bytes + forward.q_buffer_bytes
        self._bytes = carved_bytes(self._sizes)
        from .kernels.quantize import PrepassBuffers  # imports Triton: not at the module's import

        self._buffers = PrepassBuffers

    def run(self, query, key, value, key_weight, key_bias, scale, stream=None):
        """Launch on `stream` (a raw handle: :func:`~fsattn_diffusers.kernels.launch.current_stream`),
        with the pre-passes' buffers carved from one allocation and passed by address; without a
        stream (CPU tensors: Triton's interpreter), or before every launch goes straight to its
        compiled kernel, in buffers of their own, each launch on the current stream."""
        layout = self.layout
        q, k, v = (query, key, value) if layout == "NHD" else (t.transpose(1, 2) for t in (query, key, value))
        out_in_layout = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=query.device)
        out = out_in_layout if layout == "NHD" else out_in_layout.transpose(1, 2)
        bias = _log2_bias(key_bias, self.kv_prepass.s_pad)
        if stream is None or not (self.kv_prepass.direct and self.forward.direct):
            # Addresses only where every launch goes straight to its compiled kernel: Triton's
            # own path (the interpreter, a launch it did not remember) needs tensors.
            kv = self.kv_prepass.run(k, v, key_weight)
            if self.with_counter:
                self.forward.run(q, kv, out, lse, stats.fallback_counter(q.device), scale, bias)
            else:
                self.forward.run(q, kv, out, lse, scale)
            return out_in_layout, lse
        # Freed on return, while the kernels may still run: the caching allocator hands the
        # bytes out again only in this stream's order, after them.
        scratch = torch.empty(self._bytes, dtype=torch.uint8, device=query.device)
        ws, k_q, v_t, rowsum, q_q, q_scale, q_dot_k_mean = carve(scratch, self._sizes)
        self.kv_prepass.launch(k, v, key_weight, ws, k_q, v_t, rowsum, stream)
        k_mean, v_mean, v_scale, k_scale = (Address(ws + offset) for offset in self.kv_prepass.stat_offsets)
        buffers = self._buffers(ws, k_q, k_scale, k_mean, v_t, v_scale, v_mean, rowsum, q_q, q_scale, q_dot_k_mean)
        if self.with_counter:
            self.forward.run_into(q, buffers, out, lse, stats.fallback_counter(q.device), scale, bias, stream)
        else:
            self.forward.run_into(q, buffers, out, lse, scale, stream)
        return out_in_layout, lse


def _log2_bias(key_bias, s_pad: int):
    """The Triton kernel's bias: `key_bias` in log2 units over `s_pad` keys, padding keys at
    -inf (None: None)."""
    if key_bias is None:
        return None
    bias = torch.full((key_bias.shape[0], s_pad), float("-inf"), dtype=torch.float32, device=key_bias.device)
    bias[:, : key_bias.shape[1]] = key_bias * LOG2E
    return bias


def _outputs(query, q):
    """The output (like `query`) and the LSE (B, H, Sq) float32, unwritten; `q` is `query` as
    (B, S, H, D)."""
    bsz, seq_q, heads, _ = q.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    return out, torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=query.device)


def _prepare_and_run(plan, cfg, query, key, value, key_weight, key_bias, scale, layout):
    """Prepare `plan`'s launches for these operands and run them; returns (out in `layout`, LSE,
    the :class:`PreparedCall`). A Gluon kernel that does not compile with this Triton is turned off
    and the call redone on the plan made without it."""
    from .kernels.quantize import kv_prepass

    q, k, v = (_as_bshd(t, layout) for t in (query, key, value))
    prepass = kv_prepass(k, v, key_weight, block_n=plan.block_n, d_pad=plan.d_pad, k_per_token=plan.k_per_token,
                         smooth_v=plan.smooth_v, v_dtype=plan.v_dtype, pv_key_order=plan.pv_key_order,
                         sort_keys=plan.sort_keys)
    kv = prepass.run(k, v, key_weight)
    out_in_layout, lse = _outputs(query, q)
    out = _as_bshd(out_in_layout, layout)
    q_tiles = q.shape[0] * q.shape[2] * -(-q.shape[1] // plan.block_m)
    if plan.kernel in ("gluon_ws", "gluon"):
        name = "fsattn_fwd_" + plan.kernel
        try:
            module = planning.gluon_module(name)
            if plan.kernel == "gluon_ws":
                forward = module.prepare_fsattn_fwd_gluon_ws(q, kv, out, lse, num_stages=plan.num_stages)
            else:
                forward = module.prepare_fsattn_fwd_gluon(q, kv, out, lse, block_m=plan.block_m,
                                                          num_warps=plan.num_warps, num_stages=plan.num_stages)
            forward.run(q, kv, out, lse, scale)
            return out_in_layout, lse, PreparedCall(prepass, forward, False, layout, tuple(lse.shape), q_tiles)
        except Exception as err:  # noqa: BLE001 - narrowed to compile failures just below
            if not planning.is_compile_failure(err):
                raise
            # Compilation happens before the kernel's launch: the retry below quantises K, V and Q
            # again for its own plan, into buffers of its own, and returns its own output.
            planning.disable_gluon(name, err)
            _prepared_calls.clear()  # the kernel stays off for every call, as for every plan
        plan = plan_for(cfg, target_of(q.device), q.shape[-1], key_bias is not None, q.dtype, k.shape[1])
        return _prepare_and_run(plan, cfg, query, key, value, key_weight, key_bias, scale, layout)
    from .kernels import fsattn_fwd as fwd

    bias = _log2_bias(key_bias, prepass.s_pad)
    counter = stats.fallback_counter(q.device)
    forward = fwd.prepare_fsattn_fwd(q, kv, out, lse, counter, bias, frozen=plan.max_mode_for(k.shape[1]),
                                     exp_mode=plan.exp_mode, pv_fp32=plan.pv_fp32, rowsum_mma=plan.rowsum_mma,
                                     max_threshold=plan.max_threshold, block_m=plan.block_m,
                                     num_warps=plan.num_warps, num_stages=plan.num_stages)
    forward.run(q, kv, out, lse, counter, scale, bias)
    return out_in_layout, lse, PreparedCall(prepass, forward, True, layout, tuple(lse.shape), q_tiles)


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
