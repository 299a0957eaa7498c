"""The launch plan of an fsattn call: which kernel runs it, with which tiles and operand layouts.

Every kernel decision lives here, made once per (config, target, head dim, mask kind, dtype, at
most :data:`TRITON_MAX_KEYS` keys or not) and cached: per call the op only looks its plan up. A
target is a CUDA device's compute capability, or the CPU paths: Triton's interpreter (the real
kernels, tests) and the PyTorch emulation.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from .config import FSAttnConfig
from .kernels.configs import (EXP_MODE_BITS, EXP_MODE_HALF, EXP_MODE_SFU, FROZEN_OFF, FROZEN_RECOMPUTE,
                              FROZEN_RESCALE)

logger = logging.getLogger("fsattn_diffusers")

_EXP_MODES = {0.0: EXP_MODE_SFU, 0.5: EXP_MODE_HALF, 1.0: EXP_MODE_BITS}
# Sampling the speculative max costs two score tiles per query tile; with fewer key tiles than this
# (cross-attention to text) that is most of the work, and the online softmax runs instead.
MIN_TILES_FOR_FROZEN_MAX = 5

# At most this many keys (cross-attention to text), `kernel="auto"` runs the Triton kernel at
# padded head dim 128: with a few key tiles the warp-specialised kernel's pipeline never fills.
# H200, Wan's queries (32,760 x 12 heads / 75,600 x 40): 512 keys 0.30 / 2.05 ms against 0.40 /
# 2.75, 1,024 keys 0.44 / 3.17 against 0.52 / 3.68; at 2,048 the Triton kernel 2.5 % faster / 0.4 %
# slower; from 4,096 on the warp-specialised kernel is 10-23 % faster (benchmarks/NOTES.md v18).
# Made persistent (one program per SM over many query blocks), it tied the Triton kernel (v27 (c)).
# Not measured at head dim 64.
TRITON_MAX_KEYS = 1024

INTERPRETER = "interpreter"
EMULATION = "emulation"


@dataclass(frozen=True)
class LaunchPlan:
    """How one kind of call runs. ``kernel`` is ``"gluon_ws"``, ``"gluon"`` or ``"triton"`` (on
    the emulation target: the Triton kernel it models)."""

    kernel: str
    block_m: int  # query rows per program
    block_n: int  # keys per tile, also the K-scale granularity when k_per_token is False
    num_warps: int
    num_stages: int
    d_pad: int  # head dim padded for the INT8 GEMM
    k_per_token: bool
    sort_keys: bool  # the K/V pre-pass orders each head's keys by size (k_granularity "sorted_block", "auto")
    v_dtype: torch.dtype
    smooth_v: bool
    pv_key_order: str  # "natural", or "wgmma" for the warp-specialised kernel
    sampled_max_mode: int  # FROZEN_*: the max policy of a call with enough key tiles
    exp_mode: int
    pv_fp32: bool
    rowsum_mma: bool
    max_threshold: float

    def max_mode_for(self, seq_k: int) -> int:
        """The max policy (FROZEN_*) of a call with `seq_k` keys."""
        return self.sampled_max_mode if -(-seq_k // self.block_n) >= MIN_TILES_FOR_FROZEN_MAX else FROZEN_OFF


def padded_head_dim(head_dim: int) -> int:
    from .kernels.configs import padded_head_dim as padded

    return padded(head_dim)


def pv_dtype(config: FSAttnConfig, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of P and V in the PV product."""
    if config.pv_format == "fp8_e4m3":
        return torch.float8_e4m3fn
    return torch.float16 if input_dtype == torch.float16 else torch.bfloat16


def plan_for(config: FSAttnConfig, target, head_dim: int, has_bias: bool, dtype: torch.dtype,
             seq_k: int | None = None) -> LaunchPlan:
    """The plan of a call (cached). `target`: a CUDA compute capability ``(major, minor)``,
    :data:`INTERPRETER` or :data:`EMULATION`; `has_bias`: whether a float mask adds a bias;
    `seq_k`: the call's key count (None: a call with many keys)."""
    few_keys = seq_k is not None and seq_k <= TRITON_MAX_KEYS
    return _plan(config.to_json(), target, padded_head_dim(head_dim), has_bias, dtype, few_keys)


@functools.lru_cache(maxsize=256)
def _plan(config_json: str, target, d_pad: int, has_bias: bool, dtype: torch.dtype, few_keys: bool) -> LaunchPlan:
    from .kernels.configs import GLUON_WS_BLOCK_N, GLUON_WS_STAGES, INTERPRETER_TILES
    from .kernels.configs import default_launch_config

    config = FSAttnConfig.from_json(config_json)
    if target == INTERPRETER:
        base = INTERPRETER_TILES
    else:
        # The emulation models the Triton kernel with the H200's tiles.
        base = default_launch_config((9, 0) if target == EMULATION else target, d_pad)
    if config.max_policy == "online":
        frozen = FROZEN_OFF
    else:
        frozen = FROZEN_RESCALE if config.on_violation == "rescale" else FROZEN_RECOMPUTE
    # Sorted keys need a key order per head; a bias is one per key for every head, so with one the
    # keys stay in order and keep a scale each. "auto" is per key here; the warp-specialised
    # kernel's branch below sorts where it measured faster.
    granularity = config.k_granularity
    sort_keys = granularity == "sorted_block" and not has_bias
    plan = LaunchPlan(
        kernel="triton", block_m=config.block_m or base.block_m, block_n=config.block_n or base.block_n,
        num_warps=config.num_warps or base.num_warps, num_stages=config.num_stages or base.num_stages,
        d_pad=d_pad, k_per_token=granularity in ("token", "auto") or (granularity == "sorted_block" and has_bias),
        sort_keys=sort_keys, v_dtype=pv_dtype(config, dtype),
        smooth_v=config.smooths_v, pv_key_order="natural", sampled_max_mode=frozen,
        exp_mode=_EXP_MODES[float(config.exp_offload)], pv_fp32=config.pv_accum == "fp32",
        rowsum_mma=config.rowsum == "mma", max_threshold=float(config.max_threshold))
    if target in (INTERPRETER, EMULATION) or tuple(target) != (9, 0):
        return plan  # the Gluon kernels are written for Hopper's wgmma and TMA
    wanted = config.kernel
    if wanted == "auto":
        # The warp-specialised kernel measured 25-36 % faster than the Triton kernel on the H200 at
        # head dim 128, and at 64 with the K scales in the ring (the kernel alone) 15 % with three
        # consumers (through fsattn() 1.44-1.45x SDPA under Triton 3.6, 1.41x voting early under 3.9;
        # benchmarks/NOTES.md v11 (d), v14 (c), v31 (a), v35); at 32 it was never measured.
        wanted = "gluon_ws" if d_pad in (64, 128) and not (few_keys and d_pad == 128) else "triton"
    if wanted == "gluon_ws":
        ws = _dataclass_replace(plan, kernel="gluon_ws", block_n=config.block_n or GLUON_WS_BLOCK_N,
                                num_stages=config.num_stages or GLUON_WS_STAGES, pv_key_order="wgmma")
        if _gluon_ws_covers(ws, has_bias, config) and gluon_available("fsattn_fwd_gluon_ws"):
            from .kernels.configs import GLUON_WS_ROWS, gluon_ws_consumers

            ws = _dataclass_replace(ws, block_m=GLUON_WS_ROWS * gluon_ws_consumers(ws.block_n, d_pad))
            if granularity == "auto" and not few_keys:
                # Keys sorted by size, one K scale per tile: through fsattn() 903 -> 989 TFLOP/s at
                # Wan2.1-14B 720p, 906 -> 959 at 1.3B 480p, 601 -> 623 at head dim 64; whole steps
                # 4.3-4.5 % (14B) and 2.9-3.0 % (1.3B) shorter, the latents as close to SDPA's as per key
                # (benchmarks/NOTES.md v42). With a few key tiles the sort and its launch weigh more
                # and a tile's scale is shared by keys of more sizes: those calls keep a scale per key.
                ws = _dataclass_replace(ws, k_per_token=False, sort_keys=True)
            return ws
    if wanted == "gluon" and _gluon_covers(plan, has_bias) and gluon_available("fsattn_fwd_gluon"):
        return _dataclass_replace(plan, kernel="gluon")
    return plan


def _default_numerics(plan: LaunchPlan, has_bias: bool) -> bool:
    """The numerics both Gluon kernels implement, but for the K scales (per key in both; per tile
    over sorted keys also in the warp-specialised one): online max, FP8 PV with the hardware
    accumulator, the row sum on the tensor cores, no float mask."""
    return (not has_bias and plan.sampled_max_mode == FROZEN_OFF and plan.exp_mode == EXP_MODE_SFU and not plan.pv_fp32
            and plan.rowsum_mma and plan.v_dtype == torch.float8_e4m3fn)


def _gluon_ws_covers(plan: LaunchPlan, has_bias: bool, config: FSAttnConfig) -> bool:
    from .kernels.configs import GLUON_WS_MAX_STAGES, GLUON_WS_ROWS

    return (_default_numerics(plan, has_bias) and (plan.k_per_token or plan.sort_keys)
            and plan.block_n in GLUON_WS_MAX_STAGES
            and (config.block_m or GLUON_WS_ROWS) == GLUON_WS_ROWS and plan.num_warps == 4
            and 2 <= plan.num_stages <= GLUON_WS_MAX_STAGES[plan.block_n])


def _gluon_covers(plan: LaunchPlan, has_bias: bool) -> bool:
    # Only the tiles it was tested with. With one stage the loop would wait for a tile it issues
    # only later (a hang); more than four do not fit shared memory at head dim 128.
    return (_default_numerics(plan, has_bias) and plan.k_per_token and plan.block_m == 64 and plan.block_n == 128
            and plan.num_warps == 4 and 2 <= plan.num_stages <= 4)


def _dataclass_replace(plan: LaunchPlan, **changes) -> LaunchPlan:
    import dataclasses

    return dataclasses.replace(plan, **changes)


# ----------------------------------------------------------------------------- Gluon availability

_DISABLED_GLUON: set[str] = set()


def gluon_available(name: str) -> bool:
    """Whether Gluon kernel module `name` imports here and has not failed to compile."""
    return name not in _DISABLED_GLUON and gluon_module(name) is not None


@functools.lru_cache(maxsize=None)
def gluon_module(name: str):
    """``kernels.<name>``, or None where this Triton lacks the Gluon API it uses (logged once)."""
    try:
        return importlib.import_module(f".kernels.{name}", __package__)
    except ImportError as err:  # a Triton without Gluon's Hopper API: the Triton kernel runs everything
        logger.warning("fsattn: the Gluon kernel %s cannot be imported (%s); the Triton kernel runs its calls",
                       name, err)
        return None


def disable_gluon(name: str, err: Exception) -> None:
    """Turn Gluon kernel `name` off for the session after it failed to compile (logged once).

    Gluon is Triton's experimental layer and its API moves between releases: a Triton this kernel
    was not written for must cost speed, not the call. Plans made since are dropped.
    """
    message = getattr(err, "error_message", None) or str(err) or type(err).__name__
    logger.warning("fsattn: the Gluon kernel %s does not compile with this Triton (%s: %s); the Triton kernel "
                   "runs its calls", name, type(err).__name__,
                   message.strip().splitlines()[-1] if message.strip() else "")
    _DISABLED_GLUON.add(name)
    _plan.cache_clear()


def is_compile_failure(err: Exception) -> bool:
    """Triton's own compile errors (front end, ptxas, resources) and MLIR pass failures."""
    try:
        from triton.errors import TritonError
    except ImportError:  # older Triton: its compile errors have no common base
        from triton.compiler.errors import CompilationError as TritonError
    return isinstance(err, TritonError) or (isinstance(err, RuntimeError) and "PassManager" in str(err))
