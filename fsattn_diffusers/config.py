"""The numerical choices of fused-softmax attention, as one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from .kernels.configs import P_LOG2_CEILING

_CHOICES = {
    "k_granularity": ("auto", "block", "sorted_block", "token"),
    "pv_format": ("fp8_e4m3", "16bit"),
    "max_policy": ("sampled", "online"),
    "on_violation": ("rescale", "recompute"),
    "rowsum": ("mma", "fma"),
    "pv_accum": ("fp32", "hw"),
    "kernel": ("auto", "triton", "gluon", "gluon_ws"),
}
_EXP_OFFLOAD_SHARES = (0.0, 0.5, 1.0)
_FIELD_TYPES = {
    **{name: str for name in _CHOICES},
    "smooth_v": bool, "check_finite": bool,
    "max_threshold": (int, float), "exp_offload": (int, float), "sdpa_below_flops": (int, float),
    "sdpa_below_keys": int,
    "block_m": int, "block_n": int, "num_warps": int, "num_stages": int,
}
_OPTIONAL_FIELDS = ("smooth_v", "block_m", "block_n", "num_warps", "num_stages")
_BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class FSAttnConfig:
    """Numerical choices of :func:`fsattn_diffusers.fsattn`; the defaults are the safe, tested ones.

    Q and K are always INT8 with one scale per query token (INT8 runs at the FP8 tensor-core rate
    on Hopper and is far more accurate than FP8 e4m3 for Q and K: docs/design.md §2.2).

    Attributes
    ----------
    k_granularity : {"auto", "token", "block", "sorted_block"}
        ``"auto"`` (default): ``"sorted_block"`` where the warp-specialised Hopper kernel runs a
        call with more than 1,024 keys (the faster path, measured as close to exact attention and to
        SDPA's video as per-key scales), ``"token"`` on every other call (fsattn_diffusers/plan.py
        decides). ``"token"``: one K scale per key (a multiply per score before the dequantising
        FMA). ``"block"``: one per block of ``block_n`` keys (a per-tile scalar in the kernel: the
        dequantisation is one FMA per score), but a block's largest key sets the step of all its
        keys, which costs accuracy on peaky scores. ``"sorted_block"``: one per block after the K/V
        pre-pass has ordered each head's keys by their size (the largest absolute value of the
        mean-removed key), largest first, masked keys last; attention does not depend on the keys'
        order, and each block then holds keys of nearly one size, so it stays about as accurate as
        ``"token"`` on random and peaky scores (keys whose size grows along the sequence lose more:
        4.3 % relative L1 against 3.8 %; docs/design.md §2.2). Calls with a float mask keep one
        scale per key under ``"sorted_block"`` (a float mask is read as a bias per key, which would
        have to follow each head's order).
    pv_format : {"fp8_e4m3", "16bit"}
        Format of P and V in the PV GEMM. ``"fp8_e4m3"``: FP8 with one scale per V channel, the
        fast path. ``"16bit"``: P and V in bf16 (fp16 for fp16 inputs), twice the PV GEMM's
        tensor-core time, about a third of the output error.
    smooth_v : bool or None
        Subtract the per-channel mean of V before quantising it to FP8 and add it back at the end
        (exact: the weights of a row sum to one). ``None``: on for FP8, off for 16-bit, where
        rounding the centred V back to 16 bits would bias every output the same way.
    max_policy : {"online", "sampled"}
        ``"online"`` (default): a running row max. The Triton kernel takes every key tile's max
        and rescales; the default Hopper kernel (``"gluon_ws"``) starts each tile from the max of
        the tiles before it and corrects only a tile where some P saturated FP8 (docs/design.md
        §2.4). ``"sampled"`` (Triton kernel only): a row max taken from two sampled key tiles
        (the first, and the one level with the query tile) and held frozen while no score passes
        it by more than ``max_threshold``; violations are repaired exactly and counted in
        ``stats()["fallback_q_tiles"]``. No clamped P reaches the output either way.
    on_violation : {"rescale", "recompute"}
        What a query tile does when a score passes the frozen max by more than
        ``max_threshold``: ``"rescale"`` raises the max of the offending rows to that tile's
        max, rescales what was accumulated, and recomputes that tile's P (cheap, exact);
        ``"recompute"`` finishes the pass, then redoes the whole query tile with the online
        softmax. Either way no clamped P ever reaches the output.
    max_threshold : float
        How far (log2 units) a score may exceed the frozen max before that counts as a
        violation. P is stored as ``2**(s - max + 8.75 - max_threshold)``, so a larger threshold
        means fewer violations and a higher floor for the smallest probabilities.
    exp_offload : {0.0, 0.5, 1.0}
        Share of exponentials computed with integer/FMA bit arithmetic (a corrected
        Schraudolph exp2 that writes FP8 bits directly) instead of the special-function unit.
    rowsum : {"mma", "fma"}
        Row sum of P on the tensor cores (a ones column beside V, summing exactly the quantised
        P that was multiplied) or on the FMA units (sum of the unquantised P).
    pv_accum : {"fp32", "hw"}
        ``"fp32"`` adds each tile's PV product into an FP32 accumulator; ``"hw"`` keeps the
        accumulation inside the tensor core's FP8 accumulator across tiles (faster on Hopper,
        slightly less precise).
    block_m, block_n : int or None
        Tile sizes (query rows per program, keys per tile). ``None`` picks the tuned default for
        the GPU and head dim. ``block_n`` is also the K-scale granularity. The warp-specialised
        Gluon kernel takes ``block_n`` 128 (its default: two consumer warpgroups at head dims 65-128,
        three at 33-64) or 64 (three; at head dims 65-128 two from Triton 3.8 on, whose builds of
        three have their GEMMs serialised there).
    num_warps, num_stages : int or None
        Launch overrides for the Triton kernel (``None``: tuned default).
    sdpa_below_flops : float
        Used by the diffusers integrations (:class:`FSAttnProcessor`, :func:`apply_fsattn`, the
        ``"fsattn"`` backend), not by :func:`fsattn` itself: on CUDA devices, attention calls of
        fewer than this many FLOPs (``4 * B * Hq * Sq * Sk * D``) run the model's own attention
        (SDPA), which is exact and, at that size, faster, because fsattn has a fixed cost per call
        (quantisation launches, host time). The default, 3e11 (about 7,000 tokens at 12 heads of
        128), lies at the measured crossover on the H200 (README, "Measured": SDPA faster at 4,096
        tokens, fsattn at 8,192). ``0`` runs every call of any size on fsattn.
    sdpa_below_keys : int
        Used by the diffusers integrations as ``sdpa_below_flops`` is: on CUDA devices, calls that
        attend to fewer keys than this run the model's own attention. fsattn quantises every query
        row and writes its LSE whatever the number of keys, so with few keys that fixed cost per
        row outweighs the faster 8-bit GEMMs however many rows there are: cross-attention to 512
        text tokens measured 0.75x SDPA at Wan2.1-14B 720p (75,600 queries, 40 heads; 0.54-0.56x on the
        warp-specialised kernel), where it has 2.6x the FLOPs of ``sdpa_below_flops``. The
        default, 4096, is where fsattn won on the H200 with Wan's queries (75,600 x 40 heads and
        32,760 x 12): 1.00x and 0.91x SDPA at 2,048 keys, 1.21x and 1.11x at 4,096 (README,
        "Measured"). ``0`` turns the rule off.
    kernel : {"auto", "triton", "gluon", "gluon_ws"}
        Which forward kernel runs; all compute the same attention to within FP8 rounding.
        ``"auto"`` (default): the fastest measured, i.e. ``"gluon_ws"`` on Hopper at head dims
        33-128 where it covers the call, except calls with at most 1,024 keys at head dims
        65-128 (cross-attention to text: there the Triton kernel was 16-34 % faster), else the
        Triton kernel. ``"triton"``: the Triton kernel, every configuration and GPU.
        ``"gluon_ws"`` (Hopper only): the warp-specialised Gluon kernel (a TMA producer warp, two
        or three consumer warpgroups taking turns at the tensor cores, a speculative running
        max); its P is rounded from another max than the Triton kernel's, so
        the two are equally close to exact attention but not bit-equal. ``"gluon"`` (Hopper only,
        kept as the simplest Gluon schedule, slower than the Triton kernel). Both Gluon kernels
        cover the default numerics only (online max policy, per-key K scales, FP8 PV with the
        hardware accumulator, tensor-core row sum, no float mask), the warp-specialised one also
        per-tile K scales over sorted keys; other calls and other GPUs run the Triton kernel
        (fsattn_diffusers/plan.py decides).
    check_finite : bool
        Check the inputs for NaN and Inf and raise (costs a pass over the inputs and a sync).
        Without it a non-finite input gives NaN outputs where it reaches (its query's row, every
        row of the query heads that read a non-finite attended key, a V channel's column), never
        a finite value.
    """

    k_granularity: str = "auto"
    pv_format: str = "fp8_e4m3"
    smooth_v: bool | None = None
    max_policy: str = "online"
    on_violation: str = "rescale"
    max_threshold: float = 3.0
    exp_offload: float = 0.0
    rowsum: str = "mma"
    pv_accum: str = "hw"
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    sdpa_below_flops: float = 3e11
    sdpa_below_keys: int = 4096
    kernel: str = "auto"
    check_finite: bool = False

    def __post_init__(self):
        self._check_types()
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"FSAttnConfig.{name}={value!r} is not supported; expected one of {allowed}")
        if self.smooth_v and self.pv_format == "16bit":
            raise ValueError(
                "FSAttnConfig: smooth_v=True with pv_format='16bit' would round the centred V back to 16 bits, "
                "a bias shared by every output; leave smooth_v=None"
            )
        if not 0.0 < self.max_threshold <= P_LOG2_CEILING - 0.25:
            raise ValueError(
                f"FSAttnConfig.max_threshold={self.max_threshold!r} must lie in (0, {P_LOG2_CEILING - 0.25}] "
                "(log2 units; P = 2**(s - max + 8.75 - threshold) must fit FP8 e4m3's 448)"
            )
        if float(self.exp_offload) not in _EXP_OFFLOAD_SHARES:
            raise ValueError(f"FSAttnConfig.exp_offload={self.exp_offload!r}; expected one of {_EXP_OFFLOAD_SHARES}")
        if self.exp_offload and self.pv_format != "fp8_e4m3":
            raise ValueError("FSAttnConfig: exp_offload > 0 writes FP8 bits directly and needs pv_format='fp8_e4m3'")
        if self.exp_offload and self.rowsum == "fma":
            raise ValueError(
                "FSAttnConfig: rowsum='fma' sums the unquantised P, which the bit-level exponential "
                "(exp_offload > 0) never forms; use rowsum='mma'"
            )
        if not (self.sdpa_below_flops >= 0 and math.isfinite(self.sdpa_below_flops)):
            raise ValueError(f"FSAttnConfig.sdpa_below_flops={self.sdpa_below_flops!r}; expected a finite number >= 0")
        if self.sdpa_below_keys < 0:
            raise ValueError(f"FSAttnConfig.sdpa_below_keys={self.sdpa_below_keys!r}; expected an int >= 0")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value is not None and value not in _BLOCK_SIZES:
                raise ValueError(f"FSAttnConfig.{name}={value!r}; expected None or one of {_BLOCK_SIZES}")
        if self.block_n is not None and self.block_n < 32:
            raise ValueError(f"FSAttnConfig.block_n={self.block_n!r}: the FP8 PV product needs at least 32 keys per tile")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FSAttnConfig.num_warps={self.num_warps!r}; expected None or a power of two up to 16")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise ValueError(f"FSAttnConfig.num_stages={self.num_stages!r}; expected None or an int in 1..8")
        # Serialised once: the custom op takes the config as a string, and torch.compile cannot
        # trace json.dumps, but it can read a constant attribute.
        object.__setattr__(self, "_json", json.dumps(dataclasses.asdict(self), sort_keys=True))

    def _check_types(self):
        """Reject values of the wrong type here, not as a TypeError deep inside a kernel launch."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = _FIELD_TYPES[f.name]
            if value is None and f.name in _OPTIONAL_FIELDS:
                continue
            # bool is an int subclass: True must not pass for num_stages=1, nor 1 for check_finite=True.
            ok = isinstance(value, expected) and (isinstance(value, bool) == (expected is bool))
            if not ok:
                wanted = {str: "a string", bool: "a bool", int: "an int", (int, float): "a number"}[expected]
                if f.name in _OPTIONAL_FIELDS:
                    wanted += " or None"
                raise TypeError(f"FSAttnConfig.{f.name}={value!r} ({type(value).__name__}); expected {wanted}")

    @property
    def smooths_v(self) -> bool:
        """Whether V is mean-centred before quantisation (resolves ``smooth_v=None``)."""
        return self.pv_format == "fp8_e4m3" if self.smooth_v is None else self.smooth_v

    @property
    def p_offset(self) -> float:
        """log2 of the scale of the frozen-max P: P = 2**(s - max + p_offset) <= 2**8.75 < 448."""
        return P_LOG2_CEILING - float(self.max_threshold)

    def replace(self, **changes) -> "FSAttnConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """A canonical string form, used to pass the config through the torch custom op."""
        return self._json

    @classmethod
    def from_json(cls, text: str) -> "FSAttnConfig":
        return cls(**json.loads(text))


DEFAULT_CONFIG = FSAttnConfig()

