"""Experiment (NOTES v19, Next): Q quantised inside the Triton forward kernel, for calls with few keys.

With 512 keys (Wan's cross-attention to text) Q's quantisation pass is 361 µs of a 2.05 ms call at
Wan2.1-14B 720p and 51 µs of 0.30 ms at 1.3B (NOTES v18 (e)): it reads bf16 Q, writes INT8 Q and
its scales, and the kernel reads them back. Here one kernel loads bf16 Q, quantises it in registers
exactly as ``_quantize_q_kernel`` does, computes V's corrected mean itself (``quantize_q``'s other
job, per program instead of once per head), and runs the product's online pass and epilogue.
Same numbers as the product's two launches, so the output must be bit-equal to theirs.

    python benchmarks/experiments/fused_q_probe.py --out fq.json          # H200: time, bits, float64
    TRITON_INTERPRET=1 FSATTN_CPU_PATH=interpreter python benchmarks/experiments/fused_q_probe.py --check   # CPU: bits and float64
    python benchmarks/experiments/fused_q_probe.py --compile-check     # CPU: sm_90a builds, registers and spills

Per shape, one process: SDPA, ``fsattn()`` (plan "auto": the Triton kernel up to 1,024 keys), the
product's K/V pre-pass + quantize_q + forward, and the pre-pass + the fused kernel; bit-equality
of the fused output and LSE with the product's, float64 accuracy on sampled rows, the fused
kernel's registers and spills.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
from fsattn_diffusers import FSAttnConfig, fsattn  # noqa: E402
from fsattn_diffusers.kernels import fsattn_fwd as fwd  # noqa: E402
from fsattn_diffusers.kernels import quantize  # noqa: E402
from fsattn_diffusers.kernels.launch import cdiv  # noqa: E402
from fsattn_diffusers.kernels.lowp import IN_INTERPRETER, LN2, LOG2E  # noqa: E402
from fsattn_diffusers.metrics import cosine_similarity, relative_l1  # noqa: E402
from fsattn_diffusers.ops import call_plan  # noqa: E402
from fsattn_diffusers.reference import attention_reference  # noqa: E402

# name -> (B, H, Sq, Sk, D)
SHAPES = {"wan13b_cross": (1, 12, 32760, 512, 128), "wan14b_cross": (1, 40, 75600, 512, 128),
          "wan13b_1024": (1, 12, 32760, 1024, 128), "wan14b_1024": (1, 40, 75600, 1024, 128)}
CHECK_SHAPES = {"tiny_512": (1, 2, 200, 512, 128), "tiny_300": (2, 2, 130, 300, 128), "tiny_d64": (1, 2, 100, 256, 64)}


@triton.jit
def _fused_q_fwd_kernel(
    q_ptr, ws_ptr, out_ptr, lse_ptr, kq_ptr, ks_ptr, vt_ptr, w_ptr,
    seq_q, head_dim, n_q_heads, group, n_tiles, s_pad, sm_scale, n_split,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_ob, stride_os, stride_oh, stride_od, stride_wb,
    PV_FP32: tl.constexpr, ROWSUM_MMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, ROWSUM_COLS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n_kv_heads = n_q_heads // group
    bh_kv = b * n_kv_heads + h // group
    n_bh = tl.num_programs(2) * n_kv_heads
    stats, _, v_err, _ = quantize._workspace(ws_ptr, n_bh, n_split, D_PAD)
    rd = tl.arange(0, D_PAD)
    stat = stats + bh_kv * D_PAD + rd
    row = n_bh * D_PAD
    # V's corrected mean, as quantize_q's first program of the head computes it (same order, same bits).
    err = quantize._reduce_partials(v_err + bh_kv * n_split * D_PAD + rd, n_split, D_PAD, quantize._SUM, SPLIT_BLOCK)
    n_attended = tl.maximum(tl.load(stat + 4 * row), 1.0)
    v_scale = tl.load(stat + 2 * row)
    v_mean = tl.load(stat + 3 * row) - tl.math.div_rn(err, n_attended) * v_scale

    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_q
    io_mask = row_ok[:, None] & (rd < head_dim)[None, :]
    q = tl.load(q_ptr + b * stride_qb + rows[:, None] * stride_qs + h * stride_qh + rd[None, :] * stride_qd,
                mask=io_mask, other=0.0).to(tl.float32)
    q_log2 = q * (sm_scale * LOG2E)
    amax = tl.maximum(tl.max(tl.abs(q_log2), 1), 1e-20)
    q8 = quantize._round_half_away(q_log2 * (127.0 / amax)[:, None]).to(tl.int8)
    qs = amax / 127.0
    qkm = tl.sum(q * tl.load(stat)[None, :], 1) * sm_scale

    kq_base = bh_kv * s_pad * D_PAD
    acc_o, l_acc, shift = fwd._online_pass(
        q8, qs, kq_ptr, kq_base, ks_ptr, bh_kv * s_pad, vt_ptr, bh_kv * D_PAD * s_pad, w_ptr, b * stride_wb,
        ks_ptr, 0, n_tiles, s_pad, False, True, PV_FP32, ROWSUM_MMA, BLOCK_M, BLOCK_N, D_PAD, ROWSUM_COLS,
        SOFT_ROUND)
    attended = l_acc > 0.0
    inv_l = tl.where(attended, 1.0 / tl.where(attended, l_acc, 1.0), 0.0)
    o = acc_o * inv_l[:, None] * v_scale[None, :] + tl.where(attended, 1.0, 0.0)[:, None] * v_mean[None, :]
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_os + h * stride_oh + rd[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=io_mask)
    lse = tl.where(attended, (shift + tl.log2(tl.where(attended, l_acc, 1.0))) * LN2 + qkm, float("-inf"))
    tl.store(lse_ptr + (b * n_q_heads + h) * seq_q + rows, lse, mask=row_ok)


def fused_q_fwd(q, kv, out, lse, *, sm_scale, plan):
    """The fused launch; only what the cross-attention calls use (per-token K scales, no mask, online max)."""
    assert kv.k_per_token and kv.pv_key_order == "natural"
    bsz, seq_q, heads, dim = q.shape
    grid = (cdiv(seq_q, plan.block_m), heads, bsz)
    return _fused_q_fwd_kernel[grid](
        q, kv.workspace, out, lse, kv.k_q, kv.k_scale, kv.v_t, kv.rowsum_weights,
        seq_q, dim, heads, heads // kv.k_q.shape[1], kv.n_tiles, kv.k_q.shape[2], float(sm_scale), kv.n_split,
        *q.stride(), *out.stride(), kv.rowsum_weights.stride(0) if kv.rowsum_weights.shape[0] > 1 else 0,
        PV_FP32=plan.pv_fp32, ROWSUM_MMA=plan.rowsum_mma, BLOCK_M=plan.block_m, BLOCK_N=kv.block_n,
        D_PAD=kv.k_q.shape[3], ROWSUM_COLS=kv.rowsum_weights.shape[1], SPLIT_BLOCK=quantize.SPLIT_BLOCK,
        SOFT_ROUND=IN_INTERPRETER, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )


def runners(q, k, v, plan):
    scale = q.shape[-1] ** -0.5
    assert plan.kernel == "triton" and plan.max_mode_for(k.shape[1]) == fwd.FROZEN_OFF, plan
    assert plan.exp_mode == fwd.EXP_MODE_SFU

    def prepass():
        return quantize.quantize_kv(k, v, None, block_n=plan.block_n, d_pad=plan.d_pad, k_per_token=plan.k_per_token,
                                    smooth_v=plan.smooth_v, v_dtype=plan.v_dtype, pv_key_order=plan.pv_key_order)

    def outputs():
        return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                                                device=q.device)

    def product():
        out, lse = outputs()
        fwd.fsattn_fwd(q, prepass(), out, lse, torch.zeros(1, dtype=torch.int32, device=q.device), sm_scale=scale,
                       frozen=fwd.FROZEN_OFF, exp_mode=plan.exp_mode, pv_fp32=plan.pv_fp32,
                       rowsum_mma=plan.rowsum_mma, block_m=plan.block_m, num_warps=plan.num_warps,
                       num_stages=plan.num_stages)
        return out, lse

    def fused():
        out, lse = outputs()
        fused_q_fwd(q, prepass(), out, lse, sm_scale=scale, plan=plan)
        return out, lse

    return product, fused


def accuracy(out, q, k, v, rows=512):
    gen = torch.Generator(device=q.device).manual_seed(1)
    idx = torch.randperm(q.shape[1], device=q.device, generator=gen)[:rows]
    ref, _ = attention_reference(q[:, idx, :2], k[:, :, :2], v[:, :, :2])
    return {"cos": cosine_similarity(out[:, idx, :2], ref), "rel_l1": relative_l1(out[:, idx, :2], ref)}


def measure(name, shape, device, timed):
    bsz, heads, seq_q, seq_k, dim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(bsz, s, heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
               for s in (seq_q, seq_k, seq_k))
    plan = call_plan(FSAttnConfig(kernel="triton"), device, dim, dtype=torch.bfloat16, seq_k=seq_k)
    product, fused = runners(q, k, v, plan)
    (po, pl), (fo, fl) = product(), fused()
    row = {"shape": shape, "plan": {f: getattr(plan, f) for f in ("block_m", "block_n", "num_warps", "num_stages")},
           "bit_equal_out": bool(torch.equal(po, fo)), "bit_equal_lse": bool(torch.equal(pl, fl)),
           "max_abs_diff": (po.float() - fo.float()).abs().max().item(),
           "accuracy_product": accuracy(po, q, k, v), "accuracy_fused": accuracy(fo, q, k, v)}
    if timed:
        from triton.testing import do_bench

        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        ms = {"sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh), "fsattn": lambda: fsattn(q, k, v),
              "product": product, "fused": fused}
        row["ms"] = {label: do_bench(fn, warmup=50, rep=300) for label, fn in ms.items()}
        row["vs_sdpa"] = {label: row["ms"]["sdpa"] / t for label, t in row["ms"].items()}
        kernel = next(iter(_fused_q_fwd_kernel.device_caches[torch.cuda.current_device()][0].values()), None)
        if kernel is not None:
            row["fused_kernel"] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills}
    print(name, json.dumps(row), flush=True)
    return row


def compile_check():
    """The product's online-max launches and the fused one, built for sm_90a at the Hopper plan's tiles."""
    import compile_check as cc
    from fsattn_diffusers.plan import plan_for

    plan = plan_for(FSAttnConfig(kernel="triton"), cc.SM90, 128, False, torch.bfloat16, 512)
    q, k, v = (torch.randn(1, s, 12, 128, dtype=torch.bfloat16) for s in (cc.SEQ_LEN, 512, 512))
    product, fused = runners(q, k, v, plan)
    rows = {}
    for label, fn in (("product", product), ("fused", fused)):
        with cc.sm90_builds() as builds:
            fn()
        rows[label] = {b.kernel: {"regs": b.regs, "spill": b.spill, "smem": b.compiled.metadata.shared,
                                  "wgmma": b.ptx.count("wgmma.mma_async")} for b in builds}
    print(json.dumps({"triton": triton.__version__, "plan": str(plan), **rows}, indent=1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--compile-check", action="store_true", help="CPU: build for sm_90a, no run")
    parser.add_argument("--shapes", nargs="+", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.compile_check:
        return compile_check()
    if args.check:
        if not IN_INTERPRETER:
            raise SystemExit("--check runs under TRITON_INTERPRET=1")
        device, shapes = torch.device("cpu"), CHECK_SHAPES
    else:
        device, shapes = torch.device("cuda"), SHAPES
    names = args.shapes or list(shapes)
    report = {"environment": {"torch": torch.__version__, "triton": triton.__version__,
                              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
              "rows": {n: measure(n, shapes[n], device, timed=not args.check) for n in names}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    failed = [n for n, r in report["rows"].items() if not (r["bit_equal_out"] and r["bit_equal_lse"])]
    if failed:
        raise SystemExit(f"fused output differs from the product's at {failed}")


if __name__ == "__main__":
    main()
