"""Compile the forward kernel for sm_90 without a GPU and report registers, spills, wgmma and shared memory.

    python benchmarks/compile_check.py                       # every variant at the default tiles
    python benchmarks/compile_check.py --tiles 128,64,4,3    # BLOCK_M,BLOCK_N,num_warps,num_stages
    python benchmarks/compile_check.py --gluon-ws --tiles 4,128   # the warp-specialised kernel: stages,D_PAD

Costs no device time: Triton's bundled ptxas assembles for sm_90a here, so compile errors, spills
and missing wgmma instructions show before a lease.
"""

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fsattn_diffusers.kernels import fsattn_fwd as fwd  # noqa: E402

# (FROZEN, EXP_MODE, K_PER_TOKEN, PV dtype, PV_FP32, ROWSUM_MMA, HAS_BIAS)
VARIANTS = {
    "default": (2, 0, True, "fp8e4nv", True, True, False),
    "online": (0, 0, True, "fp8e4nv", True, True, False),
    "recompute": (1, 0, True, "fp8e4nv", True, True, False),
    "pv16": (2, 0, True, "bf16", True, True, False),
    "exp_half": (2, 1, True, "fp8e4nv", True, True, False),
    "exp_bits": (2, 2, True, "fp8e4nv", True, True, False),
    "k_block": (2, 0, False, "fp8e4nv", True, True, False),
    "rowsum_fma": (2, 0, True, "fp8e4nv", True, False, False),
    "pv_hw_acc": (2, 0, True, "fp8e4nv", False, True, False),
    "bias": (2, 0, True, "fp8e4nv", True, True, True),
    "online_hw": (0, 0, True, "fp8e4nv", False, True, False),
    "online_hw_kblock": (0, 0, False, "fp8e4nv", False, True, False),
    "rescale_hw_kblock": (2, 0, False, "fp8e4nv", False, True, False),
    "pv16_hw": (2, 0, True, "bf16", False, True, False),
    "online_pv16_hw": (0, 0, True, "bf16", False, True, False),
}


def compile_variant(frozen, exp_mode, k_per_token, pv, pv_fp32, rowsum_mma, has_bias, block_m, block_n, warps,
                    stages, d_pad=128):
    kernel = fwd._fsattn_fwd_kernel
    sig = {
        "q8_ptr": "*i8", "qs_ptr": "*fp32", "qkm_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "kq_ptr": "*i8", "ks_ptr": "*fp32",
        "k_mean_ptr": "*fp32", "vt_ptr": f"*{pv}", "v_scale_ptr": "*fp32", "v_mean_ptr": "*fp32",
        "w_ptr": f"*{pv}", "bias_ptr": "*fp32", "fallback_ptr": "*i32",
        "seq_q": "i32", "q_pad": "i32", "head_dim": "i32", "n_q_heads": "i32", "group": "i32", "n_tiles": "i32", "s_pad": "i32",
        "max_threshold": "fp32",
        "stride_ob": "i32", "stride_os": "i32", "stride_oh": "i32", "stride_od": "constexpr",
        "stride_wb": "i32", "stride_biasb": "i32",
    }
    constexprs = {"stride_od": 1, "FROZEN": frozen, "EXP_MODE": exp_mode, "HAS_BIAS": has_bias,
                  "K_PER_TOKEN": k_per_token, "PV_FP32": pv_fp32, "ROWSUM_MMA": rowsum_mma, "BLOCK_M": block_m,
                  "BLOCK_N": block_n, "D_PAD": d_pad, "ROWSUM_COLS": 16, "SOFT_ROUND": False}
    for name in kernel.arg_names:
        if name in constexprs and name not in sig:
            sig[name] = "constexpr"
    # 16-byte alignment of every pointer and of the strides that are multiples of 16, as at run time.
    aligned = [[i] for i, n in enumerate(kernel.arg_names)
               if n.endswith("_ptr") or n in ("s_pad", "q_pad", "stride_wb", "stride_biasb")]
    src = ASTSource(kernel, sig, constexprs, attrs={(i[0],): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def _gluon_source(kernel, descs, constexprs):
    """A Gluon kernel's source for triton.compile: signature from CPU tensors' descriptors."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {name: mangle_type(d) for name, d in descs.items()}
    sig.update({n: "*fp32" for n in ("qs_ptr", "qkm_ptr", "ks_ptr", "v_scale_ptr", "v_mean_ptr", "lse_ptr")})
    sig["out_ptr"] = "*bf16"
    for n in ("seq_q", "q_pad", "head_dim", "n_q_heads", "group", "n_tiles", "s_pad", "w_rows_per_batch",
              "stride_ob", "stride_os", "stride_oh"):
        sig[n] = "i32"
    for n in constexprs:
        sig[n] = "constexpr"
    sig = {n: sig[n] for n in kernel.arg_names}
    aligned = [i for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr") or n in ("s_pad", "q_pad", "stride_os")]
    return GluonASTSource(kernel, sig, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})


def _operand_descriptors(rows, block_n, d_pad):
    import torch

    from fsattn_diffusers.kernels import fsattn_fwd_gluon as gk

    return {
        "q_desc": gk._descriptor(torch.zeros(4 * rows, d_pad, dtype=torch.int8), [rows, d_pad], gk.gl.int8),
        "k_desc": gk._descriptor(torch.zeros(4 * block_n, d_pad, dtype=torch.int8), [block_n, d_pad], gk.gl.int8),
        "vt_desc": gk._descriptor(torch.zeros(d_pad, 4 * block_n, dtype=torch.float8_e4m3fn), [d_pad, block_n],
                                  gk.gl.float8e4nv),
        "w_desc": gk._descriptor(torch.zeros(16, 4 * block_n, dtype=torch.float8_e4m3fn), [16, block_n],
                                 gk.gl.float8e4nv),
    }


def compile_gluon_ws(stages, d_pad=128, block_n=None, speculative=None):
    """The warp-specialised Gluon kernel (kernels/fsattn_fwd_gluon_ws.py); defaults as the op runs it."""
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as wk
    from fsattn_diffusers.kernels.configs import GLUON_WS_BLOCK_N

    block_n = block_n or GLUON_WS_BLOCK_N
    consumers = wk.CONSUMERS[block_n]
    constexprs = {"BLOCK_N": block_n, "D_PAD": d_pad, "STAGES": stages, "N_CONSUMERS": consumers,
                  "CONSUMER_REGS": wk.CONSUMER_REGS[consumers], "PRODUCER_REGS": wk.PRODUCER_REGS,
                  "SPECULATIVE": wk.SPECULATIVE_MAX if speculative is None else bool(speculative)}
    src = _gluon_source(wk._fsattn_fwd_gluon_ws_kernel, _operand_descriptors(wk.CONSUMER_ROWS, block_n, d_pad),
                        constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})


def compile_gluon(block_m, block_n, warps, stages, d_pad=128):
    """The Gluon kernel (kernels/fsattn_fwd_gluon.py)."""
    from fsattn_diffusers.kernels import fsattn_fwd_gluon as gk

    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "D_PAD": d_pad, "STAGES": stages, "num_warps": warps}
    src = _gluon_source(gk._fsattn_fwd_gluon_kernel, _operand_descriptors(block_m, block_n, d_pad), constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def ptxas_report(ptx: str) -> str:
    """Registers and spill bytes as ptxas reports them (the compiled kernel fills n_regs only on a GPU)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return f"regs {regs.group(1) if regs else '?':>4s} spill {spill.group(1) if spill else '?':>5s}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiles", nargs="+", default=["128,128,8,2"])
    parser.add_argument("--gluon", action="store_true", help="compile the Gluon kernel instead")
    parser.add_argument("--gluon-ws", action="store_true",
                        help="compile the warp-specialised Gluon kernel instead (--tiles: its stages, D_PAD and "
                             "optionally BLOCK_N as 'stages,d_pad[,block_n]')")
    parser.add_argument("--dump", default=None, help="folder to write each variant's PTX and SASS into")
    parser.add_argument("--sass", action="store_true",
                        help="with --gluon-ws: each consumer loop's instruction counts (benchmarks/sass_loop.py)")
    args = parser.parse_args()
    if args.sass and not args.gluon_ws:
        parser.error("--sass reads the warp-specialised kernel's consumer loops: use it with --gluon-ws")
    if args.gluon_ws:
        for spec in args.tiles if args.tiles != parser.get_default("tiles") else ["4,128"]:
            stages, d_pad, *block_n = (int(x) for x in spec.split(","))
            k = compile_gluon_ws(stages, d_pad, block_n[0] if block_n else None)
            ptx = k.asm["ptx"]
            print(f"stages {stages} d_pad {d_pad:3d} block_n {block_n[0] if block_n else 'default'} gluon_ws {ptxas_report(ptx)} smem {k.metadata.shared:6d} "
                  f"wgmma {ptx.count('wgmma.mma_async'):3d} setmaxnreg {ptx.count('setmaxnreg'):2d} "
                  f"bar.sync {ptx.count('bar.sync'):3d}")
            if args.sass:
                from sass_loop import describe

                print(describe(ptx))
        return
    if args.gluon:
        for tiles in args.tiles:
            block_m, block_n, warps, stages = (int(x) for x in tiles.split(","))
            k = compile_gluon(block_m, block_n, warps, stages)
            ptx = k.asm["ptx"]
            print(f"{tiles:12s} gluon        {ptxas_report(ptx)} smem {k.metadata.shared:6d} "
                  f"wgmma {ptx.count('wgmma.mma_async'):3d} wait {ptx.count('wgmma.wait_group'):3d} "
                  f"ex2 {ptx.count('ex2.approx'):4d} cvt.e4m3 {ptx.count('e4m3x2'):3d} bar {ptx.count('bar.sync'):3d}")
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"gluon_{tiles.replace(',', '_')}.ptx"), "w") as f:
                    f.write(ptx)
        return
    for tiles in args.tiles:
        block_m, block_n, warps, stages = (int(x) for x in tiles.split(","))
        for name in args.variants:
            try:
                k = compile_variant(*VARIANTS[name], block_m, block_n, warps, stages)
            except Exception as exc:
                print(f"{tiles:12s} {name:12s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
                continue
            ptx = k.asm["ptx"]
            print(f"{tiles:12s} {name:12s} {ptxas_report(ptx)} smem {k.metadata.shared:6d} "
                  f"wgmma {ptx.count('wgmma.mma_async'):3d} ex2 {ptx.count('ex2.approx'):4d} "
                  f"cvt.e4m3 {ptx.count('e4m3x2'):3d} bar {ptx.count('bar.sync'):3d}", flush=True)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{name}_{tiles.replace(',', '_')}.ptx"), "w") as f:
                    f.write(ptx)


if __name__ == "__main__":
    main()
