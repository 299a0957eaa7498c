"""The float64 reference of attention, and a PyTorch emulation of the fsattn kernel's numerics.

The emulation mirrors the kernels (``fsattn_diffusers/kernels/``) step by step (same
quantisation, same frozen-max sampling, thresholds and fallback granularity, same exponential,
same FP8 formats) so that:

* ``fsattn`` on CPU tensors runs it: examples and tests exercise the real numerics anywhere;
* GPU tests check that the Triton kernel and this emulation agree closely.

It works on canonical ``(B, S, H, D)`` views; :mod:`fsattn_diffusers.attention` does the
argument checks and layout handling for both paths. It needs no Triton.
"""

from __future__ import annotations

import math

import torch

from .config import FSAttnConfig
from .plan import EMULATION, MIN_TILES_FOR_FROZEN_MAX, plan_for

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
FP8_MAX = 448.0
EXP_KAPPA = 0.3431  # fsattn_diffusers/kernels/fsattn_fwd.py: the bit-level exponential's quadratic correction
# Query rows whose scores are materialised at once (per batch and head), to bound memory.
_ROWS_PER_CHUNK = 1024


def attention_reference(q, k, v, attn_mask=None, scale=None, *, rows_per_chunk=1024):
    """Exact attention in float64 on ``(B, S, H, D)`` tensors, on their own device.

    Parameters
    ----------
    q : Tensor (B, Sq, Hq, D); k, v : Tensor (B, Sk, Hkv, D), Hkv dividing Hq
    attn_mask : Tensor or None
        Boolean (True = attend) or additive float, broadcastable to ``(B, Hq, Sq, Sk)``.
    scale : float or None
        Softmax scale, default ``D ** -0.5``.

    Returns
    -------
    (out, lse) : out float64 (B, Sq, Hq, D); lse float64 (B, Hq, Sq), natural log. A row with
        every key masked gives zeros and ``lse = -inf``.
    """
    bsz, seq_q, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    group = heads // k.shape[2]
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    vd = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    out = torch.empty(bsz, heads, seq_q, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(bsz, heads, seq_q, dtype=torch.float64, device=q.device)
    mask = None
    if attn_mask is not None:
        mask = attn_mask
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        mask = mask.expand(bsz, heads, seq_q, k.shape[1])
    for i0 in range(0, seq_q, rows_per_chunk):
        i1 = min(i0 + rows_per_chunk, seq_q)
        s = torch.matmul(qd[:, :, i0:i1], kd.transpose(-1, -2)) * scale
        if mask is not None:
            m = mask[:, :, i0:i1]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
        row_lse = torch.logsumexp(s, dim=-1)
        attended = torch.isfinite(row_lse)
        p = torch.exp(s - torch.where(attended, row_lse, 0.0)[..., None])
        p = torch.where(attended[..., None], p, 0.0)
        out[:, :, i0:i1] = torch.matmul(p, vd)
        lse[:, :, i0:i1] = row_lse
    return out.transpose(1, 2), lse


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 e4m3 (nearest even, saturating at 448 like the GPU's ``satfinite``), as float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def exp2_to_fp8_bits(u: torch.Tensor) -> torch.Tensor:
    """The kernel's bit-level exponential: FP8 of 2**(u/8 - 7), computed as the kernel does."""
    u = u.float().clamp(0.0, 126.0)
    octave = torch.round(u * 0.125 - 0.5)
    frac8 = u - octave * 8.0
    u = frac8 * (frac8 * (EXP_KAPPA / 8.0) - EXP_KAPPA) + u
    byte = torch.round(u).to(torch.uint8)
    return byte.view(torch.float8_e4m3fn).float()


def _round_half_away(x):
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5))


def _masked_mean(x, key_weight):
    """Mean over the attended keys of x (B, H, S, D); all-masked rows give zeros."""
    x = torch.where(key_weight[:, None, :, None] != 0, x, 0.0)  # 0 * inf would be NaN
    return x.sum(2) / key_weight.sum(1).clamp_min(1.0)[:, None, None]


def key_order(k, key_weight):
    """The order of ``quantize_kv(sort_keys=True)``: per (batch, head) of k (B, H, S, D) float32,
    the keys by size (the largest magnitude of the key less the mean of the attended keys),
    largest first, masked keys last, ties in key order; int64 (B, H, S)."""
    centred = (k - _masked_mean(k, key_weight)[:, :, None]).abs().amax(-1)
    size = torch.where(key_weight[:, None, :] != 0, centred, -1.0)
    return torch.argsort(size, dim=-1, descending=True, stable=True)


def _quantize_k(k, key_weight, per_token, block_n):
    """INT8 K after smoothing, one scale per key (`per_token`) or per block; k (B, H, S, D) float32.

    Returns (k8 padded to whole tiles, per-key scales (B, H, S_pad), mean)."""
    bsz, heads, seq_k, dim = k.shape
    s_pad = math.ceil(seq_k / block_n) * block_n
    k_mean = _masked_mean(k, key_weight)
    kc = torch.where(key_weight[:, None, :, None] != 0, k - k_mean[:, :, None], 0.0)
    kc = torch.nn.functional.pad(kc, (0, 0, 0, s_pad - seq_k))
    if per_token:
        amax = kc.abs().amax(-1).clamp_min(1e-20)  # (B, H, S_pad)
        k8 = _round_half_away(kc * (127.0 / amax)[..., None])
        return k8, amax / 127.0, k_mean
    blocks = kc.view(bsz, heads, s_pad // block_n, block_n, dim)
    amax = blocks.abs().amax(dim=(-1, -2)).clamp_min(1e-20)
    k8 = _round_half_away(blocks * (127.0 / amax)[..., None, None]).view_as(kc)
    return k8, (amax / 127.0).repeat_interleave(block_n, -1), k_mean


def _pack_v(v, key_weight, config, low):
    """V as the PV product sees it (FP8 per channel, optionally centred, or 16-bit as is), its
    per-channel scale, and the mean the epilogue adds back, less the mean rounding error of V
    over the attended keys (fsattn_diffusers/kernels/quantize.py says why)."""
    keep = key_weight[:, None, :, None] != 0
    zeros = torch.zeros_like(v[:, :, 0])
    if config.pv_format != "fp8_e4m3":
        v_scale, v_mean = torch.ones_like(zeros), zeros
    else:
        v_mean = _masked_mean(v, key_weight) if config.smooths_v else zeros
        # Over the attended keys only, like kernels/quantize.py (an all-masked row: the floor).
        v_max = torch.where(keep, v, float("-inf")).amax(2)
        v_min = torch.where(keep, v, float("inf")).amin(2)
        amax = torch.maximum(v_max - v_mean, v_mean - v_min).clamp_min(1e-20)
        v_scale = amax / FP8_MAX
    v_scaled = torch.where(keep, v - v_mean[:, :, None], 0.0) * (1.0 / v_scale)[:, :, None]
    if config.pv_format == "fp8_e4m3":
        v_scaled = v_scaled.clamp(-FP8_MAX, FP8_MAX)
    v_low = low(v_scaled)
    v_err = (v_low - v_scaled).sum(2) / key_weight.sum(1).clamp_min(1.0)[:, None, None]
    return v_low, v_scale, v_mean - v_err * v_scale


def emulate_fsattn(q, k, v, *, scale, config: FSAttnConfig, block_m: int, block_n: int,
                   key_weight=None, key_bias=None, k_per_token=None, sort_keys=None):
    """Emulate the kernel on ``(B, S, H, D)`` views.

    Parameters
    ----------
    k_per_token, sort_keys : bool or None
        One K scale per key, and each head's keys taken in :func:`key_order` (as the K/V pre-pass
        stores them; no `key_bias` then). None: as the plan of `config` decides
        (fsattn_diffusers/plan.py).
    key_weight : Tensor (B, Sk) of 0/1 or None
        Boolean key-padding mask as weights (the kernel zeroes masked keys).
    key_bias : Tensor (B, Sk) float or None
        Additive float key mask in natural-log units (``-inf`` masks a key).

    Returns
    -------
    (out float32 (B, Sq, Hq, D), lse float32 (B, Hq, Sq), query tiles whose frozen max was violated)
    """
    bsz, seq_q, heads, dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dev = q.device
    n_tiles = math.ceil(seq_k / block_n)
    s_pad = n_tiles * block_n
    if key_weight is None:
        key_weight = torch.ones(bsz, seq_k, device=dev)
    key_weight = key_weight.float().expand(bsz, seq_k)
    if config.pv_format == "fp8_e4m3":
        low = to_fp8
    else:
        low_dtype = torch.float16 if q.dtype == torch.float16 else torch.bfloat16
        low = lambda t: t.to(low_dtype).float()  # noqa: E731

    qf = q.float().transpose(1, 2)  # (B, H, Sq, D)
    q_log2 = qf * (scale * LOG2E)
    q_amax = q_log2.abs().amax(-1).clamp_min(1e-20)
    q8 = _round_half_away(q_log2 * (127.0 / q_amax)[..., None])
    qs = q_amax / 127.0

    if k_per_token is None or sort_keys is None:
        plan = plan_for(config, EMULATION, dim, key_bias is not None, q.dtype, seq_k)
        k_per_token = plan.k_per_token if k_per_token is None else k_per_token
        sort_keys = plan.sort_keys if sort_keys is None else sort_keys
    kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)
    if sort_keys:
        if key_bias is not None:
            raise ValueError("sorted keys take no key bias (it would have to follow each head's order)")
        order = key_order(kf, key_weight)[..., None]
        kf, vf = kf.gather(2, order.expand_as(kf)), vf.gather(2, order.expand_as(vf))
        # Masked keys come last in every head: the first n_attended keys of each are attended.
        key_weight = (torch.arange(seq_k, device=dev)[None] < (key_weight != 0).sum(1, keepdim=True)).float()
    k8, key_scale, k_mean = _quantize_k(kf, key_weight, k_per_token, block_n)
    v_lo, v_scale, v_mean = _pack_v(vf, key_weight, config, low)
    v_lo = torch.nn.functional.pad(v_lo, (0, 0, 0, s_pad - seq_k))
    w_pad = torch.nn.functional.pad(key_weight, (0, s_pad - seq_k))  # (B, S_pad)
    bias = None
    if key_bias is not None:
        bias = torch.nn.functional.pad(key_bias.float().expand(bsz, seq_k) * LOG2E, (0, s_pad - seq_k),
                                       value=float("-inf"))
    # Expand the KV heads over their query-head groups.
    k8, v_lo, key_scale, k_mean, v_scale, v_mean = (
        t.repeat_interleave(group, 1) for t in (k8, v_lo, key_scale, k_mean, v_scale, v_mean))
    # Smoothing K shifts every score of a row by scale * q . k_mean; the LSE adds it back. As Q's
    # pass: a row where it is not finite (the row or an attended key is not) has a NaN scale, which
    # the epilogue below turns into a NaN row.
    q_dot_kmean = (qf * k_mean[:, :, None]).sum(-1) * scale
    qs = torch.where(q_dot_kmean.isfinite(), qs, float("nan"))

    out = torch.empty(bsz, heads, seq_q, dim, dtype=torch.float32, device=dev)
    lse = torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=dev)
    n_q_blocks = math.ceil(seq_q / block_m)
    rows_per_chunk = max(block_m, (_ROWS_PER_CHUNK // block_m) * block_m)
    violated_tiles = 0
    for i0 in range(0, seq_q, rows_per_chunk):
        i1 = min(i0 + rows_per_chunk, seq_q)
        acc = torch.matmul(q8[:, :, i0:i1], k8.transpose(-1, -2))  # exact integers in fp32
        x_raw = acc * (qs[:, :, i0:i1, None] * key_scale[:, :, None, :])
        if bias is not None:
            x_raw = x_raw + bias[:, None, None, :]
        pv = _PV(v_lo, w_pad, config, low, block_m)
        if config.max_policy == "sampled" and n_tiles >= MIN_TILES_FOR_FROZEN_MAX:
            first_block = i0 // block_m  # i0 is a multiple of block_m: local blocks are the kernel's tiles
            o, l_sum, shift, block_flag, redo = _frozen_pass(x_raw, pv, first_block, n_q_blocks, config, block_n)
            violated_tiles += int(block_flag.sum())
            if redo.any():
                o2, l2, shift2 = _online_pass(x_raw, pv, block_n)
                row_redo = pv.rows_of(redo, x_raw.shape[2])
                o = torch.where(row_redo[..., None], o2, o)
                l_sum = torch.where(row_redo, l2, l_sum)
                shift = torch.where(row_redo, shift2, shift)
        else:
            o, l_sum, shift = _online_pass(x_raw, pv, block_n)
        l_sum = l_sum + 0.0 * qs[:, :, i0:i1]  # NaN where the row's scale is, as the kernels'
        attended = l_sum != 0
        inv_l = torch.where(attended, 1.0 / torch.where(attended, l_sum, 1.0), 0.0)
        out[:, :, i0:i1] = o * inv_l[..., None] * v_scale[:, :, None] + attended[..., None] * v_mean[:, :, None]
        lse[:, :, i0:i1] = torch.where(
            attended, (shift + torch.log2(torch.where(attended, l_sum, 1.0))) * LN2 + q_dot_kmean[:, :, i0:i1],
            float("-inf"))
    return out.transpose(1, 2), lse, violated_tiles


class _PV:
    """The PV product and row sum of one key block, as the kernel forms them."""

    def __init__(self, v_lo, w_pad, config, low, block_m):
        self.v_lo, self.w_pad, self.config, self.low, self.block_m = v_lo, w_pad, config, low, block_m

    def __call__(self, p_lo, p, j0, j1):
        """(P V, row sum) over keys [j0, j1): the row sum of the stored P (tensor-core path) or of
        the unquantised P (FMA path), over attended keys."""
        src = p_lo if self.config.rowsum == "mma" else p
        return p_lo @ self.v_lo[:, :, j0:j1], (src * self.w_pad[:, None, None, j0:j1]).sum(-1)

    def blocks_of(self, row_flags):
        """(B, H, R) row flags -> (B, H, n_blocks): any flagged row marks its query tile."""
        rows = row_flags.shape[-1]
        n_blocks = math.ceil(rows / self.block_m)
        padded = torch.nn.functional.pad(row_flags, (0, n_blocks * self.block_m - rows))
        return padded.view(*row_flags.shape[:-1], n_blocks, self.block_m).any(-1)

    def rows_of(self, block_flags, rows):
        return block_flags.repeat_interleave(self.block_m, -1)[..., :rows]


def _frozen_pass(x_raw, pv, first_block, n_q_blocks, config, block_n):
    """Speculative pass, P = 2**(s - g + C), g sampled from two key tiles; violations rescale
    (``on_violation="rescale"``) or mark the query tile for the online pass ("recompute").

    Returns (acc, row sum, log2 shift, query tiles that saw a violation, query tiles to redo)."""
    bsz, heads, rows, s_pad = x_raw.shape
    n_tiles = s_pad // block_n
    dev = x_raw.device
    tile_max = x_raw.view(bsz, heads, rows, n_tiles, block_n).amax(-1)
    blocks = first_block + torch.arange(rows, device=dev) // pv.block_m
    diag = (blocks * n_tiles) // n_q_blocks
    g = torch.maximum(tile_max[..., 0], tile_max.gather(-1, diag.expand(bsz, heads, rows)[..., None])[..., 0])
    unguessed = pv.blocks_of(g == float("-inf"))
    g = torch.where(g == float("-inf"), 0.0, g)
    c, threshold, rescale = config.p_offset, config.max_threshold, config.on_violation == "rescale"
    keys = block_n // 2 if config.exp_offload == 0.5 else block_n
    acc = torch.zeros(bsz, heads, rows, pv.v_lo.shape[-1], device=dev)
    l_sum = torch.zeros(bsz, heads, rows, device=dev)
    x_max = torch.full((bsz, heads, rows), float("-inf"), device=dev)
    violated_rows = torch.zeros(bsz, heads, rows, dtype=torch.bool, device=dev)
    for j0 in range(0, s_pad, keys):
        bits = config.exp_offload == 1.0 or (config.exp_offload == 0.5 and (j0 // keys) % 2 == 1)

        def exp_block(shift_by):
            x = x_raw[..., j0:j0 + keys] + (c - g)[..., None] - shift_by[..., None]
            if bits:
                return exp2_to_fp8_bits(8.0 * x + 56.0), None, x
            p = torch.exp2(x)
            return pv.low(p), p, x

        p_lo, p, x = exp_block(torch.zeros_like(g))
        block_max = x.amax(-1)
        if rescale:
            violated = block_max - c > threshold
            if violated.any():
                shift = torch.where(violated, block_max - c, 0.0)
                alpha = torch.exp2(-shift)
                acc, l_sum = acc * alpha[..., None], l_sum * alpha
                p_lo, p, _ = exp_block(shift)
                g = g + shift
                violated_rows |= violated
        else:
            x_max = torch.maximum(x_max, block_max)
        pv_block, rowsum = pv(p_lo, p, j0, j0 + keys)
        acc, l_sum = acc + pv_block, l_sum + rowsum
    redo = unguessed
    if not rescale:
        violated_rows = x_max - c > threshold
        redo = redo | pv.blocks_of(violated_rows)
    return acc, l_sum, g - c, pv.blocks_of(violated_rows) | unguessed, redo


def _online_pass(x_raw, pv, block_n):
    """Exact running-max softmax over key tiles, P = 2**(s - m + 8), as the kernel's fallback."""
    bsz, heads, rows, s_pad = x_raw.shape
    acc = torch.zeros(bsz, heads, rows, pv.v_lo.shape[-1], device=x_raw.device)
    l_sum = torch.zeros(bsz, heads, rows, device=x_raw.device)
    m = torch.full((bsz, heads, rows), float("-inf"), device=x_raw.device)
    for j0 in range(0, s_pad, block_n):
        x = x_raw[..., j0:j0 + block_n]
        m_new = torch.maximum(m, x.amax(-1))
        m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp2(m - m_use)
        p = torch.exp2(x - m_use[..., None] + 8.0)
        pv_block, rowsum = pv(pv.low(p), p, j0, j0 + block_n)
        acc = acc * alpha[..., None] + pv_block
        l_sum = l_sum * alpha + rowsum
        m = m_new
    return acc, l_sum, torch.where(m == float("-inf"), 0.0, m) - 8.0
