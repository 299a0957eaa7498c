"""The fused-softmax forward in Gluon for Hopper, warp-specialised, with the consumer warpgroups
taking turns at the tensor cores (FlashAttention-3's ping-pong); the default on sm_90 at head
dims 33-128 (``FSAttnConfig(kernel="auto")``; benchmarks/NOTES.md v7, v8, v10, v11, v14), except
calls with at most 1,024 keys at head dims 65-128, where its pipeline never fills (v18 (e)).

Why: the Triton kernel runs one warpgroup per program, two programs per SM, each issuing its own
loads (address arithmetic and ``cp.async`` in the softmax's instruction stream), meeting a
program-wide ``bar.sync`` every tile, and waiting for each GEMM right after issuing it; NOTES v6
found its loop bound by those waits, not by a unit. Here, per program of 2 x 64 query rows
(128-key tiles at head dim 128, the default) or 3 x 64 (at head dim 64, and with 64-key tiles
where the Triton release builds three consumers unserialised; :func:`.configs.gluon_ws_consumers`):

    producer (4 warps, 24 registers)   for each key tile: wait until every consumer released the
                                       ring stage, then TMA K, V^T and the row-sum weights (and at
                                       head dim 64 the per-key K scales) into it
    consumer w (4 warps, w = 0, 1[, 2])  its 64 rows of Q (TMA), then per key tile j: wait for the
                                       score GEMM, softmax; in its turn issue the row sum and PV
                                       of tile j, check P (below; or before the turn), issue the
                                       score GEMM of tile j + 1, hand the turn to the next
                                       warpgroup; wait for PV, release the stage

Only mbarriers synchronise (no program-wide barrier). P goes from the score accumulator to the PV
GEMM's register operand without moving between threads: V and the row-sum weights come in the
"wgmma" key order (``quantize_kv(..., pv_key_order="wgmma")``), which matches the keys each
thread already holds (:func:`_in_wgmma_order`).

The softmax is speculative: a tile's exponentials start from the running max of the tiles before
it, with no row max and no rescale of O in the common path (docs/design.md §2.4). P goes to the
row-sum and PV GEMMs as soon as it is converted, and whether some P saturated FP8 (a score rose
too far above that max) is voted on by the warpgroup while they run (one barrier reduction,
:func:`_any_flag`), off the path from the scores to the GEMMs; only such a tile then takes its
true max, rescales the accumulators and adds the GEMMs of a correction D = P_true - alpha *
P_spec (:func:`_corrected_if_saturated`). No clamped P reaches the output. Where a Triton release
cannot build three consumers that way (3.8 on, at head dim 64), the vote is taken before the turn
instead, on the path to the GEMMs, and a saturated tile's P is taken again from its true max
(:func:`_early_voted_p8`; :func:`.configs.gluon_ws_votes_early` decides).

At head dim 128 two consumer warpgroups on 128-key tiles are the default: with the check after the
GEMM issue they measured 1-3 % faster than three on 64-key tiles at every head-dim-128 shape (NOTES
v11 (d)); three have too few registers for 128-key tiles there. Measured through ``fsattn()`` on the H200
(NOTES v11 (d), SDPA beside): 836 and 888 TFLOP/s at the Wan-1.3B and 14B shapes (1.47x and 1.57x
SDPA), against 656-667 for the Triton kernel; its distance to float64 on the input families of
docs/design.md §4.1 is within 0.08 percentage point of the Triton kernel's relative L1. At head dim
64 the producer also brings the K scales into the ring stage, and the registers that frees let
three consumers take 128-key tiles: 545 TFLOP/s at a CogVideoX-like shape, against 499 with two and
475 for the Triton kernel (NOTES v14 (b), (c); outputs bit-equal to two consumers'). Triton 3.8.0
and 3.9.0 build three consumers past their registers and ptxas serialises the GEMMs when the vote
runs beside them (NOTES v30 (f), v34); voting before a tile's GEMMs are issued
(:func:`_early_voted_p8`) they build cleanly, so from 3.8 on three consumers vote early at head dim
64: 590 TFLOP/s under 3.9.0 against 543 for two voting late (NOTES v35;
:func:`.configs.gluon_ws_votes_early`, which also says why the early vote is not taken elsewhere).
With ``quantize_kv(k_per_token=False)`` (``k_granularity="sorted_block"``, or ``"auto"`` on long
calls: the keys sorted by size first) each tile's one K scale is folded into Q's row factor
(``KS_TILE``).
fsattn_diffusers/plan.py sends it padded head dims 64 and 128.
Gluon does not run in Triton's interpreter: the GPU tests exercise it.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from .configs import GLUON_WS_MAX_STAGES as MAX_STAGES
from .configs import GLUON_WS_ROWS as CONSUMER_ROWS
from .configs import FP_FUSION, GLUON_WS_STAGES, gluon_ws_consumers, gluon_ws_ks_in_ring, gluon_ws_votes_early
from .gluon_common import (ROWSUM_N, GluonOperands, _descriptor, _epilogue, _program_rows, _softmax_scaled,
                           gluon_operands)
from .gluon_compat import tma_async_load
from .launch import BoundLaunch

if not hasattr(gl, "warp_specialize"):  # the caller then runs the Triton kernel
    raise ImportError("this Triton's Gluon has no warp_specialize")

# Registers per thread after setmaxnreg: 2 x 128 x 240 + 128 x 24 fills the 64 K register file
# (232 for two consumers ran 11 % slower, NOTES v7); 3 x 128 x 160 + 128 x 24 = 64,512 of 65,536.
CONSUMER_REGS = {2: 240, 3: 160}
PRODUCER_REGS = 24


@gluon.jit
def _producer(KS_SOURCE: gl.constexpr, q_desc, k_desc, vt_desc, w_desc, ks_desc, q_smem, k_smem, vt_smem, w_smem,
              ks_smem, q_bars, ready, empty, q_row, kv_row, vt_row, w_row, n_tiles):
    # Sizes from the shared-memory shapes (constexpr; warp_specialize passes arguments as values).
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    N_CONSUMERS: gl.constexpr = q_smem.shape[0]
    for c in gl.static_range(N_CONSUMERS):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma_async_load(q_desc, [q_row + c * 64, 0], q_bars.index(c), q_smem.index(c))
    for tile in range(n_tiles):
        stage = tile % STAGES
        # A fresh mbarrier counts as having completed the phase before its first (parity 1), so
        # the first lap over the ring does not wait.
        mbarrier.wait(empty.index(stage), ((tile // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        if KS_SOURCE == KS_RING:
            mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes + w_desc.block_type.nbytes
                            + ks_desc.block_type.nbytes)
            tma_async_load(ks_desc, [kv_row + tile * BLOCK_N], bar, ks_smem.index(stage))
        else:
            mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma_async_load(k_desc, [kv_row + tile * BLOCK_N, 0], bar, k_smem.index(stage))
        tma_async_load(vt_desc, [vt_row, tile * BLOCK_N], bar, vt_smem.index(stage))
        tma_async_load(w_desc, [w_row, tile * BLOCK_N], bar, w_smem.index(stage))


# _in_wgmma_order's split of each 32 keys into (b4, b3, b2 b1, b0) and the axis order that makes
# them operand columns; tests/kernels/test_quantize.py replays both in torch against
# quantize.wgmma_key_of_column, the order V is stored in.
WGMMA_KEY_SPLIT = gl.constexpr((2, 2, 4, 2))
WGMMA_AXES = gl.constexpr((0, 1, 2, 4, 3, 5))


@gluon.jit
def _in_wgmma_order(p, layout: gl.constexpr):
    """P as the PV GEMM's register operand without moving data between threads: column kA of the
    result is key pi(kA), where within each 32 keys pi takes the bits (b4 b3 b2 b1 b0) of kA to
    (b4 b1 b3 b2 b0) (``quantize.wgmma_key_of_column``), the keys each thread already holds in the
    score accumulator's layout; V^T and the row-sum weights are stored in that order, so the
    product is unchanged. The convert is register renaming: the SASS of the loop lost its 16
    SHFL, 16 SEL (604 -> 571 instructions per tile and warp, NOTES v8)."""
    ROWS: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    x = gl.reshape(p, [ROWS, N // 32, WGMMA_KEY_SPLIT[0], WGMMA_KEY_SPLIT[1], WGMMA_KEY_SPLIT[2],
                       WGMMA_KEY_SPLIT[3]])
    x = gl.permute(x, [WGMMA_AXES[0], WGMMA_AXES[1], WGMMA_AXES[2], WGMMA_AXES[3], WGMMA_AXES[4], WGMMA_AXES[5]])
    return gl.convert_layout(gl.reshape(x, [ROWS, N]), layout)


# The speculative running max (NOTES v9, v11): a tile's exponentials start from the max of the
# tiles before it, P = 2^(x - m + SPEC_OFFSET), with no max taken. The conversion rounds P from
# 432 up to 448 (FP8 e4m3's largest, byte 0x7E) and saturates anything larger there, so a tile
# whose score rose log2(432) - SPEC_OFFSET = 4.75 or more above m has a P byte 0x7E or 0x7F (NaN):
# it takes its true max and a correction (a P of 432-448 was only rounded, not clamped, and is
# corrected all the same), and no tile without one needs it. Adding 2 to each byte of a 4-byte word
# sets the byte's top bit exactly for those two (P >= 0: no byte reaches 0x80, so no carry
# crosses bytes). Why 4: a correction holds the turn at the tensor cores through three GEMM
# waits, so the 0.7 % of tiles that offset 6 corrected (Wan's own inputs and randn alike) cost
# 2-3.5 % of the call; at 4 about 0.01 % are. The price: P at the row max is 16, not 64, so a
# score 10 (not 12) log2 units below it is the last still a normal FP8 value (relative L1
# against float64 on randn 3.55 -> 3.57 %). NOTES v28.
SPEC_OFFSET = gl.constexpr(4.0)
SPECULATIVE_MAX = True
# The kernel's SPECULATIVE: the online max, or the speculative one with the saturation vote taken
# while the tile's GEMMs run (then correction GEMMs, :func:`_corrected_if_saturated`) or before
# they are issued (:func:`_early_voted_p8`); :func:`.configs.gluon_ws_votes_early` says which.
ONLINE_MAX = gl.constexpr(0)
VOTE_WHILE_GEMMS_RUN = gl.constexpr(1)
VOTE_BEFORE_GEMMS = gl.constexpr(2)


@gluon.jit
def _or(a, b):
    return a | b


@gluon.jit
def _first(a, b):
    return a


@gluon.jit
def _row_sums(l_tile, KS_SOURCE: gl.constexpr):
    """The row sums in the row-sum GEMM's tile. With one K scale per tile (KS_TILE) every row of
    the weights is the key weights (:class:`QuantizedKV`), so every column of the tile is the row
    sum and each thread keeps its own first: a reduction that returns its first operand, whose
    shuffles and adds are dead code. Otherwise only column 0 is the weights and the 16 columns are
    summed: the first-column form was bit-equal there but took 13-14 % longer at head dim 128
    (NOTES v41 (b)), while with per-tile scales on sorted keys it was 0.7-4.3 % faster."""
    if KS_SOURCE == KS_TILE:
        rows = gl.reduce(l_tile, 1, _first)
    else:
        rows = gl.sum(l_tile, 1)
    return rows


@gluon.jit
def _to_fp8_words(p):
    """P (FP32, PV operand layout) to FP8 as the plain conversion does (round to nearest,
    saturate), four values to a 32-bit word: the word (as element 0 of each 4; elements 1-3 are
    zeros) and the word with 2 added to each byte, whose byte top bits flag 448s and NaNs."""
    # Each 4 values of an instance are the four keys of one row that make one 32-bit register of
    # the GEMM operand. The words travel as INT32 because Triton carries an FP8 tensor across a
    # branch byte by byte (~180 PRMT/LOP3 per tile); ptxas folds the zeros.
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $9, $8;
        cvt.rn.satfinite.e4m3x2.f32 hi, $11, $10;
        mov.b32 $0, {lo, hi};
        add.u32 $4, $0, 0x02020202;
        mov.u32 $1, 0;
        mov.u32 $2, 0;
        mov.u32 $3, 0;
        mov.u32 $5, 0;
        mov.u32 $6, 0;
        mov.u32 $7, 0;
        }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [p], dtype=(gl.int32, gl.int32), is_pure=True, pack=4)


# The warpgroup's vote on its flags: one `bar.red.or.pred` of its 128 threads on named barrier
# VOTE_BARRIER + c (Triton's own named barriers for three partitions stay below 8 on Triton 3.6,
# 3.7 and 3.9: tests/kernels/test_compile_matrix.py checks it). Triton makes a scalar from a
# tensor only by a reduction, which crosses warps through shared memory (a store, a bar.sync, a
# load, and a bar.sync before the buffer is written again; NOTES v9, v20), so the uniform result
# travels in a predicate register of consumer c that the asm declares at function scope
# (`_declare_vote`) and a scalar asm reads. That declaration must reach ptxas exactly once and
# before the votes (LLVM keeps side-effecting asm in order and does not duplicate it here; a
# duplicate would be a ptxas error, which the compile matrix would show). On the H200 it
# measured bit-equal and +4 % at head dim 64, a tie at 128 (NOTES v20).
VOTE_BARRIER = 8


def _vote_asm(c):
    declare = f".reg .pred %fsattn_vote{c};\n\tmov.b32 $0, $1;"
    vote = ("{\n\t.reg .b32 t;\n\t.reg .pred q;\n\tand.b32 t, $1, 0x80808080;\n\tsetp.ne.b32 q, t, 0;\n\t"
            f"bar.red.or.pred %fsattn_vote{c}, {VOTE_BARRIER + c}, 128, q;\n\tmov.b32 $0, 0;\n\t}}")
    read = f"selp.b32 $0, 1, 0, %fsattn_vote{c};"
    return gl.constexpr(declare), gl.constexpr(vote), gl.constexpr(read)


_DECLARE_0, _VOTE_0, _READ_0 = _vote_asm(0)
_DECLARE_1, _VOTE_1, _READ_1 = _vote_asm(1)
_DECLARE_2, _VOTE_2, _READ_2 = _vote_asm(2)


@gluon.jit
def _scalar_asm(asm: gl.constexpr, scalar):
    """`asm` run once per thread on a scalar, with side effects (kept in program order)."""
    return gl.inline_asm_elementwise(asm, "=r,r", [scalar], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _declare_vote(c: gl.constexpr, any_scalar):
    """Declares consumer c's vote register; called once, before its loop."""
    gl.static_assert(c < 3, "the vote has registers and barriers for three consumers")
    if c == 0:
        _scalar_asm(_DECLARE_0, any_scalar)
    elif c == 1:
        _scalar_asm(_DECLARE_1, any_scalar)
    else:
        _scalar_asm(_DECLARE_2, any_scalar)


@gluon.jit
def _any_flag(flags, c: gl.constexpr, any_scalar):
    """Whether a byte top bit is set in any of consumer c's flag words (0x80808080): each warp's
    words ORed (REDUX), then the warpgroup's vote (above). `any_scalar`: any int32 scalar."""
    per_warp = gl.reduce(gl.reshape(flags, [4, flags.numel // 4]), 1, _or)
    if c == 0:
        gl.inline_asm_elementwise(_VOTE_0, "=r,r", [per_warp], dtype=gl.int32, is_pure=False, pack=1)
        hit = _scalar_asm(_READ_0, any_scalar)
    elif c == 1:
        gl.inline_asm_elementwise(_VOTE_1, "=r,r", [per_warp], dtype=gl.int32, is_pure=False, pack=1)
        hit = _scalar_asm(_READ_1, any_scalar)
    else:
        gl.inline_asm_elementwise(_VOTE_2, "=r,r", [per_warp], dtype=gl.int32, is_pure=False, pack=1)
        hit = _scalar_asm(_READ_2, any_scalar)
    return hit != 0


@gluon.jit
def _words_to_fp8(words):
    """The FP8 tensor whose every 4 values are the bytes of element 0 of each 4 of `words`."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [words], dtype=gl.float8e4nv,
                                     is_pure=True, pack=4)


@gluon.jit
def _rescaled(acc, l_acc, alpha):
    """The output and row-sum accumulators times each row's alpha (a moved running max)."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1), l_acc * alpha


# Where a consumer reads a key tile's K scales (the kernel's KS_SOURCE): one per key from global
# memory, loaded a softmax ahead (head dims above GLUON_WS_KS_IN_RING_MAX_D); one per key from the
# ring stage, brought by the producer; or one per tile (quantize_kv(k_per_token=False), with the keys
# sorted by size so that it stays accurate: docs/design.md §2.2), a scalar folded into Q's scale, so
# that no score needs a multiply of its own (77 fewer instructions per tile and warp at head dim 128,
# benchmarks/NOTES.md v39).
KS_GLOBAL = gl.constexpr(0)
KS_RING = gl.constexpr(1)
KS_TILE = gl.constexpr(2)


@gluon.jit
def _scaled_scores(s, ks, qs, KS_SOURCE: gl.constexpr):
    """(the INT32 scores as FP32 times their key's scale, each row's factor to log2 units): with
    one K scale per tile the scale goes into the row factor instead."""
    if KS_SOURCE == KS_TILE:
        return s.to(gl.float32), qs * ks
    else:
        return s.to(gl.float32) * gl.expand_dims(ks, 0), qs


@gluon.jit
def _p_from(pre, qs, m):
    """P = 2^(x - m + SPEC_OFFSET) from the scores times their key's scale, `pre`, and a max m."""
    return gl.exp2(gl.fma(pre, gl.expand_dims(qs, 1), gl.expand_dims(SPEC_OFFSET - m, 1)))


@gluon.jit
def _key_scales(ks_stage, ks_tile_ptr, BLOCK_N: gl.constexpr, layout: gl.constexpr, KS_SOURCE: gl.constexpr):
    """A key tile's K scales (KS_SOURCE): BLOCK_N from its ring stage or from global memory, or
    the tile's one."""
    if KS_SOURCE == KS_RING:
        ks = ks_stage.load(layout)
    elif KS_SOURCE == KS_TILE:
        ks = gl.load(ks_tile_ptr)
    else:
        ks = gl.load(ks_tile_ptr + gl.arange(0, BLOCK_N, layout=layout))
    return ks


@gluon.jit
def _speculative_p8(s, ks, qs, m, p_layout: gl.constexpr, KS_SOURCE: gl.constexpr):
    """A tile's P from the running max m, as FP8 in the PV operand's layout, and its saturation
    flags (:func:`_to_fp8_words`)."""
    pre, qk = _scaled_scores(s, ks, qs, KS_SOURCE)
    p = _p_from(pre, qk, m)
    words, flags = _to_fp8_words(_in_wgmma_order(p, p_layout))
    return _words_to_fp8(words), flags


@gluon.jit
def _fp8_rounded(p):
    """P as :func:`_to_fp8_words` rounds it to FP8 (saturating), back in FP32."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 t;
        .reg .b32 h;
        .reg .f16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 t, $3, $2;
        cvt.rn.f16x2.e4m3x2 h, t;
        mov.b32 {lo, hi}, h;
        cvt.f32.f16 $0, lo;
        cvt.f32.f16 $1, hi;
        }""",
        "=r,=r,r,r", [p], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def _corrected_if_saturated(c: gl.constexpr, flags, qs, m, l_acc, o_tok, l_tok, q_tile, k_tile, w_tile, vt_tile,
                            ks_stage, ks_tile_ptr, n_tiles, KS_SOURCE: gl.constexpr):
    """The running max, row sums and GEMM tokens after a tile whose row-sum and PV GEMMs were
    issued with its speculative P (consumer c's; `n_tiles`: any scalar for the vote): its
    saturation flag is voted on by the warpgroup while they run, and only a saturated tile waits
    for them, takes its scores again (the score GEMM re-issued: keeping them would hold 32 or 64
    registers across the GEMMs; spills), rescales the accumulators to its true max and adds the
    GEMMs of D = P_true - alpha * P_spec, so that alpha * (O + P_spec V) + D V is O with the
    tile's true P (and likewise the row sums); its returned tokens are complete. D also carries
    P_spec's FP8 rounding error, rounded again."""
    if _any_flag(flags, c, n_tiles):
        acc, l_tile = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, l_tok))
        row_layout: gl.constexpr = l_acc.type.layout
        s_layout: gl.constexpr = row_layout.parent
        p_o_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=4)
        p_l_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_tile.type.layout, k_width=4)
        ROWS: gl.constexpr = q_tile.shape[0]
        BLOCK_N: gl.constexpr = k_tile.shape[0]
        l_acc = l_acc + gl.convert_layout(_row_sums(l_tile, KS_SOURCE), row_layout)
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.int32, s_layout),
                              use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        ks = _key_scales(ks_stage, ks_tile_ptr, BLOCK_N, gl.SliceLayout(0, s_layout), KS_SOURCE)
        pre, qk = _scaled_scores(s, ks, qs, KS_SOURCE)
        m_new = gl.maximum(m, gl.max(pre, 1) * qk)
        alpha = gl.exp2(m - m_new)
        # One elementwise expression, so that no two FP32 tiles are live at once (registers); its
        # P_spec takes _speculative_p8's instructions, so it is the P the GEMMs used.
        d = _p_from(pre, qk, m_new) - gl.expand_dims(alpha, 1) * _fp8_rounded(_p_from(pre, qk, m))
        m = m_new
        d8 = _in_wgmma_order(d, p_o_layout).to(gl.float8e4nv)
        acc, l_acc = _rescaled(acc, l_acc, alpha)
        l_tok = warpgroup_mma(gl.convert_layout(d8, p_l_layout), w_tile.permute((1, 0)), gl.zeros_like(l_tile),
                              use_acc=False, is_async=True)
        o_tok = warpgroup_mma(d8, vt_tile.permute((1, 0)), acc, is_async=True)
        acc, l_tile = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, l_tok))
        o_tok = warpgroup_mma_init(acc)
        l_tok = warpgroup_mma_init(l_tile)
    return m, l_acc, o_tok, l_tok


@gluon.jit
def _early_voted_p8(c: gl.constexpr, s, ks, qs, m, acc, l_acc, q_tile, k_tile, n_tiles, p_layout: gl.constexpr,
                    KS_SOURCE: gl.constexpr):
    """A tile's P (FP8, PV operand layout) from the running max m, voted on before any GEMM of the
    tile is issued (consumer c's; `n_tiles`: any scalar for the vote), when the accumulators have
    settled: a saturated tile takes its scores again (score GEMM re-issued, as in
    :func:`_corrected_if_saturated`), its P from its true max, and the accumulators are rescaled
    to it. Returns P and the running max and accumulators after the tile. No GEMM of the tile is in
    flight across the branch, which Triton 3.8 on needs to build three consumers unserialised."""
    pre, qk = _scaled_scores(s, ks, qs, KS_SOURCE)
    words, flags = _to_fp8_words(_in_wgmma_order(_p_from(pre, qk, m), p_layout))
    if _any_flag(flags, c, n_tiles):
        s_layout: gl.constexpr = l_acc.type.layout.parent
        ROWS: gl.constexpr = q_tile.shape[0]
        BLOCK_N: gl.constexpr = k_tile.shape[0]
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.int32, s_layout),
                              use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        pre, qk = _scaled_scores(s, ks, qs, KS_SOURCE)
        m_new = gl.maximum(m, gl.max(pre, 1) * qk)
        acc, l_acc = _rescaled(acc, l_acc, gl.exp2(m - m_new))
        m = m_new
        # The P words (INT32) cross the branch, not FP8 values.
        words, flags = _to_fp8_words(_in_wgmma_order(_p_from(pre, qk, m), p_layout))
    return _words_to_fp8(words), m, acc, l_acc


@gluon.jit
def _online_p8(s, ks, qs, m, acc, l_acc, p_layout: gl.constexpr, KS_SOURCE: gl.constexpr):
    """One tile's P (FP8, PV operand layout) with the online max: the new running max and the
    rescaled accumulators (the Triton kernel's numerics)."""
    pre, qk = _scaled_scores(s, ks, qs, KS_SOURCE)
    p, m, alpha = _softmax_scaled(pre, qk, m, 8.0)
    acc, l_acc = _rescaled(acc, l_acc, alpha)
    return _in_wgmma_order(p.to(gl.float8e4nv), p_layout), m, acc, l_acc


@gluon.jit
def _consumer(c: gl.constexpr, SPECULATIVE: gl.constexpr, KS_SOURCE: gl.constexpr, q_smem, k_smem, vt_smem, w_smem,
              ks_smem, q_bars, ready, empty, turn, qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
              q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os, stride_oh,
              N_CONSUMERS: gl.constexpr):
    """Consumer warpgroup `c`: 64 query rows against every key tile.

    The warpgroups take turns at the tensor cores (FlashAttention-3's ping-pong, round robin): in
    its turn a warpgroup issues the row sum and PV of tile j, checks tile j's speculative P while
    they run (:func:`_corrected_if_saturated`; with SPECULATIVE == VOTE_BEFORE_GEMMS it checked it
    before its turn, :func:`_early_voted_p8`), issues the score GEMM of tile j + 1, hands the
    turn to warpgroup c + 1, and waits for PV (the score GEMM stays in flight); its softmax of
    tile j + 1 then runs while the others' GEMMs do. With SPECULATIVE == ONLINE_MAX, the Triton
    kernel's online numerics (bit-close at its 128-key tiles).
    """
    ROWS: gl.constexpr = 64
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    D_PAD: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D_PAD, 32])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 16, 32])
    p_o_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    p_l_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    # Warpgroup 0 takes the first turn: its first wait is on the parity a fresh mbarrier has done.
    FIRST: gl.constexpr = 1 if c == 0 else 0

    my_row = q_row + c * ROWS
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    qs = gl.load(qs_ptr + my_row + gl.arange(0, ROWS, layout=row_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.int32, layout=s_layout)
    l_zero = gl.zeros([ROWS, ROWSUM_N], gl.float32, layout=l_layout)
    acc = gl.zeros([ROWS, D_PAD], gl.float32, layout=o_layout)
    l_acc = gl.zeros([ROWS], gl.float32, layout=row_layout)
    m = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
    q_tile = q_smem.index(c)
    mbarrier.wait(q_bars.index(c), 0)
    if SPECULATIVE:
        _declare_vote(c, n_tiles)

    # Where this consumer's K scales start, and how far apart two tiles' are.
    if KS_SOURCE == KS_TILE:
        ks_row = bh_kv * n_tiles
        KS_STEP: gl.constexpr = 1
        ks = gl.load(ks_ptr + ks_row)
    else:
        ks_row = kv_row
        KS_STEP: gl.constexpr = BLOCK_N
    if KS_SOURCE == KS_GLOBAL:
        ks = gl.load(ks_ptr + kv_row + cols)
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(turn.index(c), FIRST)
    s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index((c + 1) % N_CONSUMERS), count=1)
    if SPECULATIVE and D_PAD > 64:
        # The first tile has no running max to speculate from: all its P would saturate, and every
        # program would take a correction per consumer. It starts from its own max instead, the
        # max that correction reaches. Not at head dim 64: there the same code made ptxas schedule
        # the loop slower, correction or not (NOTES v36).
        gl.static_assert(KS_SOURCE != KS_RING, "the K scales come through the ring only at head dims up to 64")
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        pre, qk = _scaled_scores(s, ks, qs, KS_SOURCE)
        m = gl.max(pre, 1) * qk  # ks: tile 0's, loaded above
        s_tok = warpgroup_mma_init(s)
    for tile in range(n_tiles - 1):
        stage = tile % STAGES
        nxt = tile + 1
        if KS_SOURCE == KS_RING:  # this stage's ready wait was in the previous iteration (or before the loop)
            ks = ks_smem.index(stage).load(col_layout)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        if SPECULATIVE == VOTE_BEFORE_GEMMS:
            p8, m, acc, l_acc = _early_voted_p8(c, s, ks, qs, m, acc, l_acc, q_tile, k_smem.index(stage), n_tiles,
                                                p_o_layout, KS_SOURCE)
        elif SPECULATIVE:
            p8, flags = _speculative_p8(s, ks, qs, m, p_o_layout, KS_SOURCE)
        else:
            p8, m, acc, l_acc = _online_p8(s, ks, qs, m, acc, l_acc, p_o_layout, KS_SOURCE)
        if KS_SOURCE == KS_TILE:
            ks = gl.load(ks_ptr + ks_row + nxt)
        elif KS_SOURCE == KS_GLOBAL:
            ks = gl.load(ks_ptr + kv_row + nxt * BLOCK_N + cols)
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        mbarrier.wait(turn.index(c), (nxt & 1) ^ FIRST)
        l_tok = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(stage).permute((1, 0)), l_zero,
                              use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p8, vt_smem.index(stage).permute((1, 0)), acc, is_async=True)
        if SPECULATIVE == VOTE_WHILE_GEMMS_RUN:
            m, l_acc, o_tok, l_tok = _corrected_if_saturated(c, flags, qs, m, l_acc, o_tok, l_tok, q_tile,
                                                             k_smem.index(stage), w_smem.index(stage),
                                                             vt_smem.index(stage), ks_smem.index(stage),
                                                             ks_ptr + ks_row + tile * KS_STEP, n_tiles, KS_SOURCE)
        s_tok = warpgroup_mma(q_tile, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.arrive(turn.index((c + 1) % N_CONSUMERS), count=1)
        # Groups retire in order: with one left in flight, the row sum and PV are done.
        acc, l_tile = warpgroup_mma_wait(num_outstanding=1, deps=(o_tok, l_tok))
        mbarrier.arrive(empty.index(stage), count=1)
        l_acc = l_acc + gl.convert_layout(_row_sums(l_tile, KS_SOURCE), row_layout)

    last = n_tiles - 1
    stage = last % STAGES
    if KS_SOURCE == KS_RING:
        ks = ks_smem.index(stage).load(col_layout)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    if SPECULATIVE == VOTE_BEFORE_GEMMS:
        p8, m, acc, l_acc = _early_voted_p8(c, s, ks, qs, m, acc, l_acc, q_tile, k_smem.index(stage), n_tiles,
                                            p_o_layout, KS_SOURCE)
    elif SPECULATIVE:
        p8, flags = _speculative_p8(s, ks, qs, m, p_o_layout, KS_SOURCE)
    else:
        p8, m, acc, l_acc = _online_p8(s, ks, qs, m, acc, l_acc, p_o_layout, KS_SOURCE)
    mbarrier.wait(turn.index(c), ((last + 1) & 1) ^ FIRST)
    l_tok = warpgroup_mma(gl.convert_layout(p8, p_l_layout), w_smem.index(stage).permute((1, 0)), l_zero,
                          use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p8, vt_smem.index(stage).permute((1, 0)), acc, is_async=True)
    if SPECULATIVE == VOTE_WHILE_GEMMS_RUN:
        m, l_acc, o_tok, l_tok = _corrected_if_saturated(c, flags, qs, m, l_acc, o_tok, l_tok, q_tile,
                                                         k_smem.index(stage), w_smem.index(stage),
                                                         vt_smem.index(stage), ks_smem.index(stage),
                                                         ks_ptr + ks_row + last * KS_STEP, n_tiles, KS_SOURCE)
    mbarrier.arrive(turn.index((c + 1) % N_CONSUMERS), count=1)
    acc, l_tile = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, l_tok))
    mbarrier.arrive(empty.index(stage), count=1)
    l_acc = l_acc + gl.convert_layout(_row_sums(l_tile, KS_SOURCE), row_layout)
    _epilogue(acc, l_acc, m, qkm_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr, my_row, row0 + c * ROWS, bh_q, bh_kv,
              b, h, seq_q, head_dim, stride_ob, stride_os, stride_oh, SPEC_OFFSET if SPECULATIVE else 8.0)


@gluon.jit
def _fsattn_fwd_gluon_ws_kernel(
    q_desc, k_desc, vt_desc, w_desc, ks_desc,
    qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
    seq_q, q_pad, head_dim, n_q_heads, group, n_tiles, s_pad, w_rows_per_batch,
    stride_ob, stride_os, stride_oh,
    BLOCK_N: gl.constexpr, D_PAD: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, SPECULATIVE: gl.constexpr, N_CONSUMERS: gl.constexpr,
    KS_SOURCE: gl.constexpr,
):
    BLOCK_M: gl.constexpr = 64 * N_CONSUMERS
    pid_m, h, b, bh_q, bh_kv, q_row, kv_row, vt_row, w_row = _program_rows(
        q_pad, n_q_heads, group, s_pad, w_rows_per_batch, BLOCK_M, D_PAD)
    row0 = pid_m * BLOCK_M

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [N_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D_PAD], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, D_PAD, BLOCK_N], vt_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, ROWSUM_N, BLOCK_N], w_desc.layout)
    if KS_SOURCE == KS_RING:
        ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [STAGES, BLOCK_N], ks_desc.layout)
        ks_src = ks_desc
    else:  # ks_desc is None (warp_specialize takes no None): stand-ins that no partition touches
        ks_smem = k_smem
        ks_src = k_desc
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=N_CONSUMERS)  # one arrive per consumer warpgroup
    turn = gl.allocate_shared_memory(gl.int64, [N_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_CONSUMERS):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)

    consumer_args = (q_smem, k_smem, vt_smem, w_smem, ks_smem, q_bars, ready, empty, turn,
                     qs_ptr, qkm_ptr, ks_ptr, v_scale_ptr, v_mean_ptr, out_ptr, lse_ptr,
                     q_row, kv_row, bh_q, bh_kv, row0, b, h, seq_q, head_dim, n_tiles, stride_ob, stride_os,
                     stride_oh, N_CONSUMERS)
    producer_args = (q_desc, k_desc, vt_desc, w_desc, ks_src, q_smem, k_smem, vt_smem, w_smem, ks_smem, q_bars, ready,
                     empty, q_row, kv_row, vt_row, w_row, n_tiles)
    # The flags go into each literal tuple: inside a tuple built as a variable, warp_specialize
    # hands them to the partitions as tensors, and a branch on them would no longer be constexpr.
    if N_CONSUMERS == 3:
        gl.warp_specialize([(_consumer, (0, SPECULATIVE, KS_SOURCE) + consumer_args),
                            (_consumer, (1, SPECULATIVE, KS_SOURCE) + consumer_args),
                            (_consumer, (2, SPECULATIVE, KS_SOURCE) + consumer_args),
                            (_producer, (KS_SOURCE,) + producer_args)],
                           [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (0, SPECULATIVE, KS_SOURCE) + consumer_args),
                            (_consumer, (1, SPECULATIVE, KS_SOURCE) + consumer_args),
                            (_producer, (KS_SOURCE,) + producer_args)], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


def fsattn_fwd_gluon_ws(q, kv, out, lse, *, sm_scale, num_stages=GLUON_WS_STAGES, speculative=SPECULATIVE_MAX):
    """Quantise Q and launch the warp-specialised kernel; arguments as :func:`.fsattn_fwd.fsattn_fwd`,
    except that `kv` must be quantised with ``pv_key_order="wgmma"`` and ``block_n`` 64 or 128
    (:func:`.configs.gluon_ws_consumers` says how many consumer warpgroups run,
    :func:`.configs.gluon_ws_votes_early` where they vote). `speculative`:
    the speculative running max (the default) or the online one.

    The plan (fsattn_diffusers/plan.py) sends it only what it covers; anything else raises here
    rather than hang the GPU.
    """
    prepare_fsattn_fwd_gluon_ws(q, kv, out, lse, num_stages=num_stages, speculative=speculative).run(
        q, kv, out, lse, sm_scale)
    return out, lse


def prepare_fsattn_fwd_gluon_ws(q, kv, out, lse, *, num_stages=GLUON_WS_STAGES,
                                speculative=SPECULATIVE_MAX) -> "GluonWSForward":
    """The checked, cached :class:`GluonWSForward` of :func:`fsattn_fwd_gluon_ws`'s arguments:
    its ``run(q, kv, out, lse, sm_scale)`` launches on any tensors of the same shapes, strides,
    dtypes, alignment and device (`kv` from :func:`~.quantize.quantize_kv`)."""
    if kv.block_n not in MAX_STAGES or not 2 <= num_stages <= MAX_STAGES[kv.block_n]:
        raise ValueError("the warp-specialised Gluon kernel takes 64-key tiles with 2-8 stages or 128-key tiles "
                         f"with 2-4 stages; got block_n={kv.block_n}, num_stages={num_stages}")
    if kv.pv_key_order != "wgmma":
        raise ValueError("the warp-specialised Gluon kernel reads V in the wgmma key order "
                         f"(quantize_kv(..., pv_key_order='wgmma')), got {kv.pv_key_order!r}")
    bsz, n_kv_heads, s_pad, d_pad = kv.k_q.shape
    ks_in_ring = gluon_ws_ks_in_ring(d_pad) and kv.k_per_token
    if ks_in_ring and (kv.k_scale.dtype != torch.float32 or tuple(kv.k_scale.shape) != (bsz, n_kv_heads, s_pad)
                       or not kv.k_scale.is_contiguous() or kv.k_scale.data_ptr() % 16):
        raise ValueError(f"the warp-specialised kernel at padded head dim {d_pad} loads the K scales by TMA: "
                         f"kv.k_scale must be contiguous float32 of shape {(bsz, n_kv_heads, s_pad)} (one per key), "
                         f"16-byte aligned; got {kv.k_scale.dtype}, shape {tuple(kv.k_scale.shape)}, strides "
                         f"{kv.k_scale.stride()}, address {kv.k_scale.data_ptr():#x}")
    consumers = gluon_ws_consumers(kv.block_n, d_pad)
    if not speculative:
        max_policy = ONLINE_MAX
    elif gluon_ws_votes_early(kv.block_n, d_pad):
        max_policy = VOTE_BEFORE_GEMMS
    else:
        max_policy = VOTE_WHILE_GEMMS_RUN
    if not kv.k_per_token and tuple(kv.k_scale.shape) != (bsz, n_kv_heads, kv.n_tiles):
        raise ValueError(f"with one K scale per tile kv.k_scale must have shape {(bsz, n_kv_heads, kv.n_tiles)}, got "
                         f"{tuple(kv.k_scale.shape)}")
    operands = gluon_operands(q, kv, out, lse, block_m=consumers * CONSUMER_ROWS, q_tile_rows=CONSUMER_ROWS)
    ks_source = (KS_RING if ks_in_ring else KS_GLOBAL) if kv.k_per_token else KS_TILE
    return gluon_ws_forward(operands, kv.block_n, d_pad, num_stages, consumers, max_policy.value, ks_source.value)


@functools.lru_cache(maxsize=256)
def gluon_ws_forward(operands: GluonOperands, block_n: int, d_pad: int, num_stages: int, consumers: int,
                     max_policy: int, ks_source: int) -> "GluonWSForward":
    """The :class:`GluonWSForward` of these operands and options (cached)."""
    return GluonWSForward(operands, block_n, d_pad, num_stages, consumers, max_policy, ks_source)


class GluonWSForward:
    """Q's quantisation and the warp-specialised kernel's launch for one shape (its
    :class:`~.gluon_common.GluonOperands`), everything that depends only on shapes computed once:
    ``run(q, kv, out, lse, sm_scale, stream=None)`` launches on operands :func:`fsattn_fwd_gluon_ws` accepts."""

    def __init__(self, operands: GluonOperands, block_n: int, d_pad: int, num_stages: int, consumers: int,
                 max_policy: int, ks_source: int):
        self._operands = operands
        self.q_buffer_bytes = operands.q_buffer_bytes
        self._ks_in_ring = ks_source == KS_RING.value
        self._block_n = block_n
        self._launch = BoundLaunch(_fsattn_fwd_gluon_ws_kernel, operands.grid, BLOCK_N=block_n, D_PAD=d_pad,
                                   STAGES=num_stages, CONSUMER_REGS=CONSUMER_REGS[consumers],
                                   PRODUCER_REGS=PRODUCER_REGS, SPECULATIVE=max_policy, N_CONSUMERS=consumers,
                                   KS_SOURCE=ks_source, num_warps=4, enable_fp_fusion=FP_FUSION)

    @property
    def direct(self) -> bool:
        """Whether both launches go straight to their compiled kernels."""
        return self._operands.direct and self._launch.direct

    def run(self, q, kv, out, lse, sm_scale, stream=None):
        self._launch_on(self._operands.q_buffers(q, kv, sm_scale, stream), out, lse, stream)

    def run_into(self, q, buffers, out, lse, sm_scale, stream=None):
        """As :meth:`run`, with Q quantised into `buffers`: the
        :class:`~.quantize.PrepassBuffers` of one allocation (:class:`~.launch.Address` es)."""
        self._operands.quantize_q_into(q, buffers, sm_scale, stream)
        self._launch_on(buffers, out, lse, stream)

    def _launch_on(self, buffers, out, lse, stream):
        args = self._operands.args(buffers, out, lse)
        # A TMA descriptor costs host time at every launch: only where the kernel reads it.
        ks_desc = (_descriptor(buffers.k_scale, (self._block_n,), gl.float32, (self._operands.k_scale_numel,), (1,))
                   if self._ks_in_ring else None)
        self._launch(*args[:4], ks_desc, *args[4:], stream=stream)
