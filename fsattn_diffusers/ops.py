"""The ``fsattn::attention`` torch custom op: one opaque node for torch.compile, plus its fake impl.

The op takes already-checked tensors (see :func:`fsattn_diffusers.attention.fsattn`) and runs
the Triton kernels on a GPU, or the PyTorch emulation of their numerics on the CPU.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace

import torch

from . import stats
from .config import FSAttnConfig, uses_frozen_max
from .reference import emulate_fsattn

# Optional: where Triton is missing (macOS, Windows) the CPU emulation still works.
try:
    import triton  # noqa: F401

    _HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    _HAS_TRITON = False

# "emulation" (default) runs the PyTorch emulation on CPU tensors; "interpreter" runs the real
# Triton kernels in Triton's interpreter (needs TRITON_INTERPRET=1 before Triton is imported).
CPU_PATH = os.environ.get("FSATTN_CPU_PATH", "emulation")
_EXP_MODES = {0.0: 0, 0.5: 1, 1.0: 2}  # kernels/fsattn_fwd.py: EXP_MODE_SFU, _HALF, _BITS


@functools.lru_cache(maxsize=None)
def _config_from_json(text: str) -> FSAttnConfig:
    return FSAttnConfig.from_json(text)


def launch_config(config: FSAttnConfig, device: torch.device, head_dim: int):
    """The tiles and launch parameters used for `config` on `device` (config overrides win)."""
    from .kernels.configs import INTERPRETER, default_launch_config

    if device.type == "cuda":
        base = default_launch_config(_capability(device.index), head_dim)
    elif CPU_PATH == "interpreter":
        base = INTERPRETER
    else:
        # The CPU emulation takes the H200's tiles; it models the Triton kernel, which runs head
        # dim 64 there; at 65-128 the H200 runs the warp-specialised kernel, whose speculative
        # max rounds P differently (as close to float64; NOTES v10).
        base = default_launch_config((9, 0), head_dim)
    return type(base)(
        block_m=config.block_m or base.block_m,
        block_n=config.block_n or base.block_n,
        num_warps=config.num_warps or base.num_warps,
        num_stages=config.num_stages or base.num_stages,
    )


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


def _as_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "NHD" else t.transpose(1, 2)


def pv_dtype(config: FSAttnConfig, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of P and V in the PV product."""
    if config.pv_format == "fp8_e4m3":
        return torch.float8_e4m3fn
    return torch.float16 if input_dtype == torch.float16 else torch.bfloat16


def _run_kernels(q, k, v, key_weight, key_bias, scale, cfg, launch, out, lse):
    from .kernels import fsattn_fwd as fwd
    from .kernels.configs import GLUON_WS_BLOCK_N, GLUON_WS_STAGES
    from .kernels.quantize import KVLayout, quantize_kv

    def quantized(pv_key_order, block_n=launch.block_n):
        return quantize_kv(k, v, key_weight, block_n=block_n, d_pad=_padded_dim(q.shape[-1]),
                           k_per_token=cfg.k_granularity == "token",
                           smooth_v=cfg.smooths_v, v_dtype=pv_dtype(cfg, q.dtype), pv_key_order=pv_key_order)

    if not uses_frozen_max(cfg, -(-k.shape[1] // launch.block_n)):
        frozen = fwd.FROZEN_OFF
    else:
        frozen = fwd.FROZEN_RESCALE if cfg.on_violation == "rescale" else fwd.FROZEN_RECOMPUTE
    kernel_args = dict(bias=key_bias, frozen=frozen, exp_mode=_EXP_MODES[float(cfg.exp_offload)],
                       pv_fp32=cfg.pv_accum == "fp32", rowsum_mma=cfg.rowsum == "mma",
                       block_m=launch.block_m, num_warps=launch.num_warps)
    gluon_args = dict(kernel_args, num_stages=launch.num_stages)
    kernel = preferred_kernel(cfg, q.shape[-1])
    # The warp-specialised kernel reads V in its own key order: decide before quantising.
    layout = KVLayout(cfg.k_granularity == "token", pv_dtype(cfg, q.dtype), launch.block_n)
    ws_stages = cfg.num_stages or GLUON_WS_STAGES
    ws_block_n = cfg.block_n or GLUON_WS_BLOCK_N  # its own default tile: see kernels/configs.py
    ws_layout = replace(layout, pv_key_order="wgmma", block_n=ws_block_n)
    if kernel == "gluon_ws" and _gluon_covers("fsattn_fwd_gluon_ws", q, out, ws_layout,
                                              dict(gluon_args, num_stages=ws_stages)):
        if _launch_gluon("fsattn_fwd_gluon_ws", q, quantized("wgmma", ws_block_n), out, lse, sm_scale=scale,
                         num_stages=ws_stages):
            return
    kv = quantized("natural")
    if kernel == "gluon" and _gluon_covers("fsattn_fwd_gluon", q, out, layout, gluon_args):
        if _launch_gluon("fsattn_fwd_gluon", q, kv, out, lse, sm_scale=scale, block_m=launch.block_m,
                         num_warps=launch.num_warps, num_stages=launch.num_stages):
            return
    bias = None
    if key_bias is not None:
        bias = torch.full((key_bias.shape[0], kv.k_q.shape[2]), float("-inf"), dtype=torch.float32, device=q.device)
        bias[:, : key_bias.shape[1]] = key_bias.float() * 1.4426950408889634  # natural -> log2 units
    fwd.fsattn_fwd(q, kv, out, lse, stats.fallback_counter(q.device), sm_scale=scale,
                   max_threshold=cfg.max_threshold, num_stages=launch.num_stages, **dict(kernel_args, bias=bias))


def preferred_kernel(config: FSAttnConfig, head_dim: int) -> str:
    """The kernel a call asks for before coverage is checked: ``config.kernel``, with ``"auto"``
    resolved to the warp-specialised Gluon kernel at padded head dim 128 (where it measured 25-36 %
    faster than the Triton kernel on the H200) and to the Triton kernel below (at 64 the two are
    within 2 %; benchmarks/NOTES.md v10 (d), v11 (d))."""
    if config.kernel != "auto":
        return config.kernel
    return "gluon_ws" if _padded_dim(head_dim) == 128 else "triton"


def _gluon_covers(module: str, q, out, layout, kernel_args) -> bool:
    """Whether Gluon kernel `module` (Hopper only) takes this call, with K/V quantised to `layout`
    (a :class:`~.kernels.quantize.KVLayout`); else the Triton kernel runs it."""
    if q.device.type != "cuda" or _capability(q.device.index) != (9, 0) or out.stride(-1) != 1:
        return False
    gluon = None if module in _DISABLED_GLUON else _gluon_module(module)
    return gluon is not None and gluon.supports(layout, **kernel_args)


def _launch_gluon(name: str, *args, **kwargs) -> bool:
    """Run Gluon kernel `name`; False (and that kernel off for the session, logged) if it does not
    compile. Gluon is Triton's experimental layer and its API moves between releases: a Triton
    this kernel was not written for must cost speed, not the call. Compilation happens before the
    launch and the output is written only by the launch, so a False leaves `out` to the caller."""
    try:
        getattr(_gluon_module(name), name)(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - narrowed to compile failures just below
        if not _is_compile_failure(err):
            raise
        message = getattr(err, "error_message", None) or str(err) or type(err).__name__
        logging.getLogger("fsattn_diffusers").warning(
            "fsattn: the Gluon kernel %s does not compile with this Triton (%s: %s); the Triton kernel runs its calls",
            name, type(err).__name__, message.strip().splitlines()[-1] if message.strip() else "")
        _DISABLED_GLUON.add(name)
        return False
    return True


def _is_compile_failure(err: Exception) -> bool:
    """Triton's own compile errors (front end, ptxas, resources) and MLIR pass failures."""
    try:
        from triton.errors import TritonError
    except ImportError:  # older Triton: its compile errors have no common base
        from triton.compiler.errors import CompilationError as TritonError
    return isinstance(err, TritonError) or (isinstance(err, RuntimeError) and "PassManager" in str(err))


_DISABLED_GLUON: set[str] = set()


@functools.lru_cache(maxsize=None)
def _gluon_module(name: str):
    """``kernels.<name>``, or None where this Triton lacks the Gluon API it uses (logged once)."""
    import importlib

    try:
        return importlib.import_module(f".kernels.{name}", __package__)
    except ImportError as err:  # a Triton without Gluon's Hopper API: the Triton kernel runs everything
        logging.getLogger("fsattn_diffusers").warning(
            "fsattn: the Gluon kernel %s cannot be imported (%s); the Triton kernel runs its calls", name, err)
        return None


def _padded_dim(head_dim):
    from .kernels.configs import padded_head_dim

    return padded_head_dim(head_dim)


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
    cfg = _config_from_json(config_json)
    q, k, v = (_as_bshd(t, layout) for t in (query, key, value))
    bsz, seq_q, heads, head_dim = q.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=query.device)
    launch = launch_config(cfg, q.device, head_dim)
    q_tiles = bsz * heads * -(-seq_q // launch.block_m)
    if q.device.type == "cuda":
        # Triton launches on the current device; a model on cuda:1 (device_map, multi-GPU pipelines)
        # may run while cuda:0 is current.
        with torch.cuda.device(q.device):
            _run_kernels(q, k, v, key_weight, key_bias, scale, cfg, launch, _as_bshd(out, layout), lse)
        stats.record_call("kernel", q_tiles)
    elif CPU_PATH == "interpreter":
        _run_kernels(q, k, v, key_weight, key_bias, scale, cfg, launch, _as_bshd(out, layout), lse)
        stats.record_call("kernel", q_tiles)
    else:
        o, lse_e, fallbacks = emulate_fsattn(
            q, k, v, scale=scale, config=cfg, block_m=launch.block_m, block_n=launch.block_n,
            key_weight=key_weight, key_bias=key_bias)
        _as_bshd(out, layout).copy_(o)
        lse.copy_(lse_e)
        stats.record_call("emulation", q_tiles)
        stats.record_emulated_fallbacks(fallbacks)
    return out, lse


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
