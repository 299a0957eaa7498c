"""NOTES v7: the warp-specialised Gluon kernel (kernels/fsattn_fwd_gluon_ws.py) against the Triton
kernel on the same quantised K/V, then timed with SDPA in the same process.

    python benchmarks/experiments/ws_gluon_probe.py --check      # small shapes, correctness only
    python benchmarks/experiments/ws_gluon_probe.py --bench out.json

Both sides are timed as the op runs them: K/V quantisation + Q quantisation + kernel. The rows
without the ping-pong and with 232 consumer registers in NOTES v7 came from this probe at commit
084f7bd, where the kernel still had those switches.
"""

import argparse
import json
import os

import torch
import triton

from fsattn_diffusers.kernels import fsattn_fwd as fwd
from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as ws
from fsattn_diffusers.kernels.quantize import quantize_kv
from fsattn_diffusers.metrics import cosine_similarity, relative_l1
from fsattn_diffusers.reference import attention_reference


def run(q, k, v, weight, kernel, stages):
    d = q.shape[-1]
    d_pad = 64 if d <= 64 else 128
    kv = quantize_kv(k, v, weight, block_n=128, d_pad=d_pad, k_per_token=True,
                     pv_key_order="wgmma" if kernel == "ws" else "natural")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    if kernel == "ws":
        ws.fsattn_fwd_gluon_ws(q, kv, out, lse, sm_scale=d ** -0.5, num_stages=stages)
    else:
        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
        fwd.fsattn_fwd(q, kv, out, lse, counter, sm_scale=d ** -0.5, frozen=fwd.FROZEN_OFF, pv_fp32=False,
                       block_m=64, num_warps=4, num_stages=stages)
    return out, lse


def check():
    # (batch, seq_q, seq_k, q heads, kv heads, head dim, masked): partial tiles, one key tile,
    # fewer key tiles than stages, grouped heads, head dim 64, a per-batch key mask.
    cases = [(1, 300, 200, 3, 3, 128, False), (2, 64, 100, 2, 2, 128, False), (2, 1000, 1500, 4, 4, 128, False),
             (1, 777, 4096, 8, 2, 128, False), (2, 2048, 2048, 4, 4, 64, False), (2, 700, 900, 4, 4, 128, True)]
    ok = True
    for bsz, sq, sk, hq, hkv, d, masked in cases:
        gen = torch.Generator(device="cuda").manual_seed(sq + sk)
        q = torch.randn(bsz, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(bsz, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        weight = None
        mask = None
        if masked:
            keep = torch.ones(bsz, sk, dtype=torch.bool, device="cuda")
            keep[0, sk * 2 // 3:] = False
            weight = keep.float()
            mask = keep[:, None, None, :]
        for stages in (2, 3, 4):
            out, lse = run(q, k, v, weight, "ws", stages)
            torch.cuda.synchronize()
            out_t, lse_t = run(q, k, v, weight, "triton", 3)
            ref, _ = attention_reference(q, k, v, mask)
            line = (f"{bsz}x{sq}x{sk} h{hq}/{hkv} d{d} mask={masked} stages={stages}: vs triton rel-L1 "
                    f"{relative_l1(out, out_t):.2e}, lse max diff {(lse - lse_t).abs().max().item():.2e}; "
                    f"vs float64 cos {cosine_similarity(out, ref):.6f} rel-L1 {relative_l1(out, ref):.4f}")
            good = (relative_l1(out, out_t) < 5e-3 and (lse - lse_t).abs().max().item() < 2e-3
                    and cosine_similarity(out, ref) >= 0.999)
            ok &= good
            print(("ok   " if good else "FAIL ") + line, flush=True)
    return ok


def bench(path):
    shapes = {"wan13b_480p": (1, 32760, 12, 128), "wan14b_720p": (1, 75600, 40, 128),
              "cogvideox_d64": (2, 17776, 48, 64)}
    rows = []
    for name, (bsz, s, h, d) in shapes.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(bsz, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        flops = 4 * bsz * h * s * s * d
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        fns = {"sdpa_default": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
               "triton_s3": lambda: run(q, k, v, None, "triton", 3)}
        for stages in (2, 3, 4):
            fns[f"ws_pingpong_s{stages}"] = (lambda st=stages: run(q, k, v, None, "ws", st))
        rep = 300 if s < 50000 else 1500
        for label, fn in fns.items():
            ms = triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
            rows.append({"shape": name, "method": label, "ms": ms, "tflops": flops / ms * 1e-9})
            print(f"{name:14s} {label:14s} {ms:9.3f} ms {flops / ms * 1e-9:7.1f} TFLOP/s", flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "driver": os.popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader").read().strip()}
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", default=None)
    args = parser.parse_args()
    if args.check:
        raise SystemExit(0 if check() else 1)
    if args.bench:
        bench(args.bench)
