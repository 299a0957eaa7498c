"""Launch configurations of the forward kernel, per GPU architecture and head dim.

Tiles are pinned per architecture rather than autotuned at run time: the K pre-pass must know
BLOCK_N (it is the K-scale granularity) before the kernel runs, and run-time autotuning would
time every config on a user's first call. The table is filled from benchmarks/bench_attention.py
sweeps (benchmarks/NOTES.md says which run chose what).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


# FP8 e4m3 (the "fn" variant, no infinities) tops out at 448 = 2**8.807. P is stored as
# 2**(s - max + p_offset) and must stay below that even when a score overshoots the sampled max by
# the whole threshold, so p_offset = P_LOG2_CEILING - max_threshold.
P_LOG2_CEILING = 8.75
# The Triton kernel's row-max policies (its FROZEN constexpr) and exponentials (EXP_MODE): plain
# numbers here, so that the launch plan is made where Triton is absent.
FROZEN_OFF = 0  # a running max, rescaled per tile
FROZEN_RECOMPUTE = 1  # sampled max; a violated query tile is redone with the running max after the pass
FROZEN_RESCALE = 2  # sampled max; a violation raises the offending rows' max and rescales once
EXP_MODE_SFU = 0  # every exponential on the special-function unit
EXP_MODE_HALF = 1  # second half of each key tile through the bit-level exponential
EXP_MODE_BITS = 2  # every exponential through the bit-level exponential


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (major, minor) compute capability -> head-dim bucket (padded D) -> config.
_TABLE = {
    # H200 sweeps, 2026-11-29 (benchmarks/NOTES.md): one warpgroup per CTA so that two CTAs share
    # an SM and overlap each other's softmax with their GEMMs. 64 queries x 128 keys beat 128 x 64
    # by 11-13 % at D = 128 (644 vs 579 TFLOP/s) and by 23 % at D = 64.
    (9, 0): {
        32: LaunchConfig(64, 128, 4, 3),
        64: LaunchConfig(64, 128, 4, 3),
        128: LaunchConfig(64, 128, 4, 3),
    },
}
# The warp-specialised Gluon kernel's K/V ring on sm_90: four stages, the most that fit at 128
# keys, measured no slower than three (within the run-to-run spread; NOTES v8).
GLUON_WS_STAGES = 4
# Its key tile: two consumer warpgroups on 128 keys measured 1-3 % faster than three on 64 at
# every head-dim-128 shape (NOTES v11 (d)).
GLUON_WS_BLOCK_N = 128
# What the warp-specialised kernel covers: 64-row consumer warpgroups (one m64 wgmma each) on 64- or
# 128-key tiles, with the ring stages that fit shared memory at head dim 128 (~17 KB per stage at
# 64 keys, ~34 KB at 128).
GLUON_WS_ROWS = 64
GLUON_WS_MAX_STAGES = {64: 8, 128: 4}
# Where its consumers read each key tile's K scales: at padded head dims up to this the producer
# brings them into the ring stage with K and V; above it, a global load issued a softmax ahead
# (the ring measured 2 % faster at 64 and 2-7 % slower at 128; benchmarks/NOTES.md v14 (b)).
GLUON_WS_KS_IN_RING_MAX_D = 64


def gluon_ws_ks_in_ring(d_pad: int) -> bool:
    """Whether the warp-specialised kernel's producer brings per-key K scales into the ring stage
    (one scale per tile is a scalar the consumers load themselves)."""
    return d_pad <= GLUON_WS_KS_IN_RING_MAX_D


# The last Triton release, as (major, minor), that builds the three-consumer forms of the
# warp-specialised kernel (head dim 64; 64-key tiles) within their 160 registers a thread with the
# saturation vote taken while a tile's GEMMs run. From 3.8 Triton gives every GEMM whose operand is
# in registers its own copy of them, and with three consumers ptxas can no longer place the
# correction's wait (in one branch) for such GEMMs in flight (NOTES v34: without the row-sum GEMM it
# still fails); it then serialises every wgmma of the build (its C7512 note). Later releases are
# taken to behave alike until the compile matrix (tests/kernels/test_compile_matrix.py, which fails
# on any serialised build) covers them.
LAST_TRITON_WITH_THREE_CONSUMERS_VOTING_LATE = (3, 7)


@functools.lru_cache(maxsize=None)
def triton_release(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of a Triton version string ("3.7.1", "3.9.0+git..."), by default of the
    Triton this process imports; None where there is none, or where its version does not read as
    one (a build from source may say anything; the kernels then take the choices that hold under
    every release). A given `version` that does not read raises ValueError."""
    installed = version is None
    if installed:
        try:
            import triton
        except ImportError:
            return None
        version = str(getattr(triton, "__version__", ""))
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        if installed:
            return None
        raise ValueError(f"not a Triton version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def _three_consumers_wanted(block_n: int, d_pad: int) -> bool:
    """Three consumer warpgroups (160 registers each) hold a 64-key score tile, or a 128-key one
    when the output tile is 64 wide and the K scales come through the ring (545 TFLOP/s against
    499 with two at head dim 64, bit-equal, NOTES v14 (c))."""
    return block_n == 64 or (d_pad <= 64 and gluon_ws_ks_in_ring(d_pad))


def _late_vote_builds_three(triton_version: str | None) -> bool:
    release = triton_release(triton_version)
    return release is not None and release <= LAST_TRITON_WITH_THREE_CONSUMERS_VOTING_LATE


def gluon_ws_votes_early(block_n: int, d_pad: int, triton_version: str | None = None) -> bool:
    """Whether the warp-specialised kernel built by Triton `triton_version` (default: the one this
    process imports) takes each tile's saturation vote before the tile's GEMMs are issued (a
    saturated tile then takes its P from the true max) rather than while they run (a saturated tile
    then adds correction GEMMs). The early vote builds three consumers at head dim 64 without
    serialising their GEMMs or spilling under every release (3.6-3.9), but it sits on the path from
    the scores to the GEMMs: on the H200 it ran 1.7 % below the late vote with three consumers at
    head dim 64 under Triton 3.6, 11 % below it with two under 3.9, and 15 % below it at head dim
    128 under both (benchmarks/NOTES.md v35). So it is taken only at padded head dims up to 64 (the
    plan sends the kernel 64; 32 only by name, untimed) where the release cannot build three
    consumers voting late: under 3.9.0 three voting early ran 590 TFLOP/s at a CogVideoX-like shape
    against 543 for two voting late. (With the opt-in 64-key tiles at head dim 128, two consumers
    voting late run under 3.8 on; three voting early build there without spills, untimed.)"""
    late_builds_three = _late_vote_builds_three(triton_version)  # first: a given version must read
    return d_pad <= 64 and _three_consumers_wanted(block_n, d_pad) and not late_builds_three


def gluon_ws_consumers(block_n: int, d_pad: int, triton_version: str | None = None) -> int:
    """Consumer warpgroups per program of the warp-specialised kernel built by Triton
    `triton_version` (default: the one this process imports): three where they hold the score
    tile (a 64-key one, or a 128-key one at head dim 64) and the release builds them, voting late
    or early (:func:`gluon_ws_votes_early`); otherwise two (240 registers each)."""
    late_builds_three = _late_vote_builds_three(triton_version)  # first: a given version must read
    three = _three_consumers_wanted(block_n, d_pad) and (
        late_builds_three or gluon_ws_votes_early(block_n, d_pad, triton_version))
    return 3 if three else 2


# Every launch states it: the score dequantisation with the max subtraction, and the exponent's
# argument, are single FMAs by design, and Triton 3.10 turns fusion off by default.
FP_FUSION = True
# Ada (sm_89) and Blackwell run the same kernel; these are conservative, correct choices.
_GENERIC = LaunchConfig(64, 64, 4, 2)
# The Triton interpreter (CPU tests) wants small tiles to stay quick.
INTERPRETER_TILES = LaunchConfig(16, 32, 4, 1)


def padded_head_dim(head_dim: int) -> int:
    """INT8 wgmma needs the reduction dim in multiples of 32; Triton blocks are powers of two."""
    d = 32
    while d < head_dim:
        d *= 2
    return d


def default_launch_config(capability: tuple[int, int] | None, head_dim: int) -> LaunchConfig:
    if capability is None:
        return INTERPRETER_TILES
    return _TABLE.get(tuple(capability), {}).get(padded_head_dim(head_dim), _GENERIC)
