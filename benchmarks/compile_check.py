"""Compile the kernels for sm_90a without a GPU and report registers, spills, shared memory and instruction counts.

    python benchmarks/compile_check.py                        # the Triton kernel's variants at its sm_90 tiles
    python benchmarks/compile_check.py --tiles 128,64,4,3     # BLOCK_M,BLOCK_N,num_warps,num_stages
    python benchmarks/compile_check.py --gluon                # the Gluon kernel (--tiles and --head-dim as above)
    python benchmarks/compile_check.py --gluon-ws --tiles 4,128,64   # warp-specialised: stages,D_PAD[,BLOCK_N]
    python benchmarks/compile_check.py --gluon-ws --sorted-keys --sass  # its long-call build, consumer loops
    python benchmarks/compile_check.py --matrix [--json]      # every kernel the op launches, at the configs it runs

Every kernel is compiled through its own launcher (fsattn_diffusers/kernels/*.py), called with CPU
tensors of a model-like shape: inside `sm90_builds` a launch compiles for sm_90a instead of
running, with Triton's own argument specialisation, ptxas and ptxas flags, so each build is the one an H100 or
H200 would run, and a parameter or kernel added to a launcher needs no change here. Registers and
spills are ptxas's report of that build. Costs no device time: compile errors, spills and missing
wgmma instructions show before a lease. To check another Triton release, put it first on
PYTHONPATH (``pip install --no-deps --target DIR triton==X``; tests/kernels/triton_releases.py
does this for the compile tests).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from fsattn_diffusers.kernels import fsattn_fwd as fwd  # noqa: E402
from fsattn_diffusers.kernels import quantize  # noqa: E402
from fsattn_diffusers.kernels.configs import (GLUON_WS_BLOCK_N, GLUON_WS_STAGES, LaunchConfig,  # noqa: E402
                                              default_launch_config, padded_head_dim)

TARGET = GPUTarget("cuda", 90, 32)
SM90 = (9, 0)
# Lengths that Triton specialises as the models' are (Wan 2.1 at 480p has 32760 tokens: not a
# multiple of 16; 12 heads), short enough that the launchers' CPU-side work takes milliseconds.
SEQ_LEN, HEADS = 1000, 12

_BASE_VARIANT = dict(frozen=fwd.FROZEN_RESCALE, exp_mode=fwd.EXP_MODE_SFU, k_per_token=True, sort_keys=False,
                     v_dtype=torch.float8_e4m3fn, pv_fp32=True, rowsum_mma=True, bias=False)
# The Triton kernel's variants: arguments of quantize_kv (k_per_token, sort_keys, v_dtype) and
# fsattn_fwd (the rest).
VARIANTS = {name: {**_BASE_VARIANT, **changes} for name, changes in {
    "default": {},
    "online": dict(frozen=fwd.FROZEN_OFF),
    "recompute": dict(frozen=fwd.FROZEN_RECOMPUTE),
    "pv16": dict(v_dtype=torch.bfloat16),
    "exp_half": dict(exp_mode=fwd.EXP_MODE_HALF),
    "exp_bits": dict(exp_mode=fwd.EXP_MODE_BITS),
    "k_block": dict(k_per_token=False),
    "k_sorted": dict(k_per_token=False, sort_keys=True),
    "rowsum_fma": dict(rowsum_mma=False),
    "pv_hw_acc": dict(pv_fp32=False),
    "bias": dict(bias=True),
    "online_hw": dict(frozen=fwd.FROZEN_OFF, pv_fp32=False),
    "online_hw_kblock": dict(frozen=fwd.FROZEN_OFF, pv_fp32=False, k_per_token=False),
    "rescale_hw_kblock": dict(pv_fp32=False, k_per_token=False),
    "pv16_hw": dict(v_dtype=torch.bfloat16, pv_fp32=False),
    "online_pv16_hw": dict(frozen=fwd.FROZEN_OFF, v_dtype=torch.bfloat16, pv_fp32=False),
}.items()}


@dataclass
class Build:
    """One kernel compiled for sm_90a: the @jit function's name, its compiled form and ptxas's
    report of this build ("" when Triton reused a build of the same process)."""
    kernel: str
    compiled: object
    ptxas_log: str

    def _reported(self, pattern):
        found = re.search(pattern, self.ptxas_log)
        return int(found.group(1)) if found else None

    @property
    def regs(self):
        return self._reported(r"Used (\d+) registers")

    @property
    def spill(self):
        """Bytes of spill stores."""
        return self._reported(r"(\d+) bytes spill stores")

    @property
    def wgmma_serialized(self) -> bool:
        """Whether ptxas serialised the build's wgmma instructions (its C75xx "Potential Performance
        Loss: wgmma..." notes: each then waits for the one before, and a warp-specialised kernel's
        GEMMs no longer overlap anything)."""
        return bool(re.search(r"\(C75\d\d\) Potential Performance Loss: wgmma", self.ptxas_log))

    @property
    def ptx(self) -> str:
        return self.compiled.asm["ptx"]

    @property
    def named_barriers(self) -> list[int]:
        """IDs of the named barriers the build syncs or arrives on (Triton's own and explicit ones)."""
        found = re.findall(r"\b(?:bar|barrier)(?:\.cta)?\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)", self.ptx)
        return sorted({int(i) for i in found})

    @property
    def vote_barriers(self) -> list[int]:
        """IDs of the named barriers of `bar.red` reductions (the warp-specialised kernel's vote)."""
        return sorted({int(i) for i in re.findall(r"\bbar(?:rier)?\.red\.\w+(?:\.\w+)*\s+[%\w]+,\s*(\d+)", self.ptx)})


class BuildError(RuntimeError):
    """A kernel that did not compile for sm_90a; `kernel` names it."""

    def __init__(self, kernel, cause):
        super().__init__(f"{kernel}: {type(cause).__name__}: {cause}")
        self.kernel = kernel


class _Sm90Driver:
    """Stands in for Triton's GPU driver inside `sm90_builds`, where every launch is a warm-up
    (compile, never run): the JIT asks the driver only for the target, the device and the stream."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def sm90_builds():
    """Within the block, launching a @triton.jit or @gluon.jit kernel compiles it for sm_90a and
    returns without running it (the outputs stay unwritten); yields the list of `Build`s, one per
    launch, in order. A compile error raises `BuildError` from the launch.

    Builds are fresh (not from Triton's disk cache), so that each comes with ptxas's report.
    FP fusion is asked for explicitly unless the launcher says otherwise: Triton 3.9 warns that its
    default turns off in 3.10, and these figures must not change with that default.
    """
    knobs = triton.knobs
    builds = []
    jit_run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("enable_fp_fusion", True)
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):  # Triton prints the ptxas report (dump_ptxas_log)
                compiled = jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:
            raise BuildError(self.fn.__name__, exc) from exc
        builds.append(Build(self.fn.__name__, compiled, log.getvalue()))
        return compiled

    saved = (knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log, getattr(driver, "_active", None))
    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    driver.set_active(_Sm90Driver())
    JITFunction.run = compile_instead
    try:
        yield builds
    finally:
        JITFunction.run = jit_run
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log, active = saved
        driver.set_active(active)


def _attention_inputs(head_dim):
    """q, k, v (1, SEQ_LEN, HEADS, head_dim) bf16, an output like q and the LSE buffer."""
    q, k, v = (torch.randn(1, SEQ_LEN, HEADS, head_dim, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, torch.empty_like(q), torch.empty(1, HEADS, SEQ_LEN)


def _padding_weights():
    """Boolean key weights (1, SEQ_LEN) of a key-padding mask: the last 100 keys masked, as text
    padding gives."""
    return (torch.arange(SEQ_LEN) < SEQ_LEN - 100)[None]


def build_triton(variant="default", tiles: LaunchConfig | None = None, head_dim=128, masked=None):
    """The builds of one Triton-kernel call: quantize_kv's kernel, quantize_q's, the forward kernel.

    `tiles` default to the launcher's sm_90 tiles for `head_dim`; `masked` adds key weights of a
    key-padding mask: ``"bool"`` (a boolean mask, read as it is) or ``"float"`` (a float mask's
    0/1 weights); Triton builds the pre-pass once per pointer type."""
    if masked not in (None, "bool", "float"):
        raise ValueError(f"masked={masked!r}: expected None, 'bool' or 'float'")
    v = VARIANTS[variant]
    tiles = tiles or default_launch_config(SM90, head_dim)
    q, k, val, out, lse = _attention_inputs(head_dim)
    key_weight = None if masked is None else _padding_weights()
    if masked == "float":
        key_weight = key_weight.float()
    with sm90_builds() as builds:
        kv = quantize.quantize_kv(k, val, key_weight, block_n=tiles.block_n, d_pad=padded_head_dim(head_dim),
                                  k_per_token=v["k_per_token"], sort_keys=v["sort_keys"], v_dtype=v["v_dtype"])
        bias = torch.zeros(1, kv.k_q.shape[2]) if v["bias"] else None
        fwd.fsattn_fwd(q, kv, out, lse, torch.zeros(1, dtype=torch.int32), sm_scale=head_dim ** -0.5, bias=bias,
                       frozen=v["frozen"], exp_mode=v["exp_mode"], pv_fp32=v["pv_fp32"], rowsum_mma=v["rowsum_mma"],
                       block_m=tiles.block_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return builds


def build_gluon(tiles: LaunchConfig | None = None, head_dim=128):
    """The builds of one Gluon-kernel call (``fsattn_diffusers.kernels.fsattn_fwd_gluon``), at the op's
    tiles by default."""
    from fsattn_diffusers.kernels import fsattn_fwd_gluon as gk

    tiles = tiles or default_launch_config(SM90, head_dim)
    q, k, v, out, lse = _attention_inputs(head_dim)
    with sm90_builds() as builds:
        kv = quantize.quantize_kv(k, v, block_n=tiles.block_n, d_pad=padded_head_dim(head_dim))
        gk.fsattn_fwd_gluon(q, kv, out, lse, sm_scale=head_dim ** -0.5, block_m=tiles.block_m,
                            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return builds


def build_gluon_ws(stages=GLUON_WS_STAGES, head_dim=128, block_n=GLUON_WS_BLOCK_N, speculative=None,
                   bool_mask=False, sorted_keys=False):
    """The builds of one warp-specialised Gluon-kernel call
    (``fsattn_diffusers.kernels.fsattn_fwd_gluon_ws``); the defaults are the op's. `bool_mask`:
    with a boolean key-padding mask (HunyuanVideo's calls); `sorted_keys`: keys sorted by size,
    one K scale per tile (``k_granularity="sorted_block"``, and "auto" on long calls)."""
    from fsattn_diffusers.kernels import fsattn_fwd_gluon_ws as wk

    q, k, v, out, lse = _attention_inputs(head_dim)
    options = {} if speculative is None else {"speculative": bool(speculative)}
    key_weight = _padding_weights() if bool_mask else None
    with sm90_builds() as builds:
        kv = quantize.quantize_kv(k, v, key_weight, block_n=block_n, d_pad=padded_head_dim(head_dim),
                                  pv_key_order="wgmma", k_per_token=not sorted_keys, sort_keys=sorted_keys)
        wk.fsattn_fwd_gluon_ws(q, kv, out, lse, sm_scale=head_dim ** -0.5, num_stages=stages, **options)
    return builds


def build_gelu_fp8(n_cols):
    """The build of the recipe's feed-forward pass (``fsattn_diffusers.kernels.gelu_fp8``) for rows
    of `n_cols`."""
    from fsattn_diffusers.kernels import gelu_fp8

    with sm90_builds() as builds:
        gelu_fp8.gelu_tanh_fp8_rows(torch.empty(64, n_cols, dtype=torch.bfloat16))
    return builds


def build_qk_norm_rope(heads, head_dim=128, freqs_dtype=torch.float32):
    """The build of the recipe's query/key RMSNorm + RoPE pass
    (``fsattn_diffusers.kernels.qk_norm_rope``) for rows of `heads` heads, the query and key as
    views of a fused QKV projection's output, the angles in `freqs_dtype` (float32, or the
    model's dtype where the model was cast: another build)."""
    from fsattn_diffusers.kernels import qk_norm_rope

    n = heads * head_dim
    qkv = torch.empty(1, 64, 3 * n, dtype=torch.bfloat16)
    freqs = torch.empty(1, 64, 1, head_dim, dtype=freqs_dtype)
    weight = torch.empty(n, dtype=torch.bfloat16)
    with sm90_builds() as builds:
        qk_norm_rope.qk_norm_rope(qkv[..., :n], qkv[..., n:2 * n], weight, weight, 1e-6, freqs, freqs, heads)
    return builds


def matrix_entries():
    """(name, build function) for each call the op makes on sm_90, at the configs it runs: the
    Triton kernel's variants at the launcher's tiles, the Gluon kernel at the same tiles, the
    warp-specialised kernel at its stages with 128- and 64-key tiles, each at head dims 128 and 64;
    the recipe's feed-forward pass at the hidden widths of Wan2.1-1.3B, HunyuanVideo /
    CogVideoX and Wan2.1-14B, and its query/key norm + RoPE pass at Wan2.1-1.3B's and 14B's
    heads. The quantisation kernels are compiled by the calls that launch them.
    A new kernel or configuration is one more entry here."""
    entries = []
    for head_dim in (128, 64):
        entries += [(f"triton {name} d{head_dim}", functools.partial(build_triton, name, head_dim=head_dim))
                    for name in VARIANTS]
    entries.append(("triton default d128 masked", functools.partial(build_triton, masked="float")))
    entries.append(("triton default d128 boolean mask", functools.partial(build_triton, masked="bool")))
    for head_dim in (128, 64):
        entries.append((f"gluon d{head_dim}", functools.partial(build_gluon, head_dim=head_dim)))
        entries += [(f"gluon_ws d{head_dim} n{block_n}", functools.partial(build_gluon_ws, head_dim=head_dim,
                                                                            block_n=block_n))
                    for block_n in (128, 64)]
    entries.append(("gluon_ws d128 n128 boolean mask", functools.partial(build_gluon_ws, bool_mask=True)))
    entries += [(f"gluon_ws d{head_dim} n128 sorted keys", functools.partial(build_gluon_ws, head_dim=head_dim,
                                                                            sorted_keys=True))
                for head_dim in (128, 64)]
    entries += [(f"gelu_fp8 n{n_cols}", functools.partial(build_gelu_fp8, n_cols)) for n_cols in (8960, 12288, 13824)]
    entries += [(f"qk_norm_rope h{heads}", functools.partial(build_qk_norm_rope, heads)) for heads in (12, 40)]
    return entries


def run_matrix(entries=None):
    """One row per distinct build of `entries` (default: `matrix_entries()`), keyed "<entry> / <kernel>"
    by the first entry that launched it: registers, spill bytes, shared memory and the named barriers
    it uses (`bar.sync`/`bar.arrive` IDs, and those of `bar.red` votes), or the error."""
    rows, seen = [], set()
    for entry, build in entries or matrix_entries():
        try:
            builds = build()
        except Exception as exc:  # noqa: BLE001 - a failure is a result here, reported per entry
            kernel = exc.kernel if isinstance(exc, BuildError) else "launcher"
            rows.append({"key": f"{entry} / {kernel}", "error": f"{type(exc).__name__}: {exc}"[-3000:]})
            continue
        for b in builds:
            if b.compiled.hash in seen:
                continue
            seen.add(b.compiled.hash)
            rows.append({"key": f"{entry} / {b.kernel}", "regs": b.regs, "spill": b.spill,
                         "smem": b.compiled.metadata.shared, "named_barriers": b.named_barriers,
                         "vote_barriers": b.vote_barriers, "wgmma_serialized": b.wgmma_serialized})
    return rows


def _counts(ptx, names):
    return " ".join(f"{label} {ptx.count(pattern):3d}" for label, pattern in names)


def _report(b: Build) -> str:
    regs, spill = b.regs, b.spill
    return (f"regs {'?' if regs is None else regs:>4} spill {'?' if spill is None else spill:>5} "
            f"smem {b.compiled.metadata.shared:6d}" + (" WGMMA SERIALISED" if b.wgmma_serialized else ""))


def _main_build(builds, kernel):
    return next(b for b in builds if b.kernel == kernel)


def _dump(folder, name, ptx):
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.ptx"), "w") as f:
            f.write(ptx)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="BLOCK_M,BLOCK_N,num_warps,num_stages (default: the launcher's sm_90 tiles for "
                             "--head-dim); with --gluon-ws: stages,D_PAD[,BLOCK_N]")
    parser.add_argument("--head-dim", type=int, default=128, help="for the Triton and Gluon kernels")
    parser.add_argument("--gluon", action="store_true", help="compile the Gluon kernel instead")
    parser.add_argument("--gluon-ws", action="store_true", help="compile the warp-specialised Gluon kernel instead")
    parser.add_argument("--matrix", action="store_true",
                        help="compile every kernel the op launches at the configs it runs (matrix_entries)")
    parser.add_argument("--json", action="store_true", help="with --matrix: one JSON row per build")
    parser.add_argument("--dump", default=None, help="folder to write each build's PTX into")
    parser.add_argument("--sass", action="store_true",
                        help="with --gluon-ws: each consumer loop's instruction counts (benchmarks/sass_loop.py)")
    parser.add_argument("--sorted-keys", action="store_true",
                        help="with --gluon-ws: the build for keys sorted by size, one K scale per tile (what "
                             "k_granularity=\"auto\" runs on long calls); default: a K scale per key")
    args = parser.parse_args()
    if args.sass and not args.gluon_ws:
        parser.error("--sass reads the warp-specialised kernel's consumer loops: use it with --gluon-ws")
    if args.sorted_keys and not args.gluon_ws:
        parser.error("--sorted-keys picks a build of the warp-specialised kernel: use it with --gluon-ws")
    if args.matrix:
        if not args.json:
            print(f"Triton {triton.__version__}, sm_90a")
        for row in run_matrix():
            if args.json:
                print(json.dumps({"triton": triton.__version__, **row}), flush=True)
            elif "error" in row:
                print(f"{row['key']:60s} FAILED: {row['error'][-400:]}", flush=True)
            else:
                print(f"{row['key']:60s} regs {row['regs']!s:>4} spill {row['spill']!s:>5} smem {row['smem']:6d}",
                      flush=True)
        return
    if args.gluon_ws:
        for spec in args.tiles or [f"{GLUON_WS_STAGES},128"]:
            stages, d_pad, *block_n = (int(x) for x in spec.split(","))
            block_n = block_n[0] if block_n else GLUON_WS_BLOCK_N
            b = _main_build(build_gluon_ws(stages, d_pad, block_n, sorted_keys=args.sorted_keys),
                            "_fsattn_fwd_gluon_ws_kernel")
            k_scales = "per tile" if args.sorted_keys else "per key"
            print(f"stages {stages} d_pad {d_pad:3d} block_n {block_n} K scales {k_scales} gluon_ws {_report(b)} "
                  + _counts(b.ptx, [("wgmma", "wgmma.mma_async"), ("setmaxnreg", "setmaxnreg"),
                                    ("bar.sync", "bar.sync")]), flush=True)
            _dump(args.dump, f"gluon_ws_{stages}_{d_pad}_{block_n}" + ("_sorted" if args.sorted_keys else ""), b.ptx)
            if args.sass:
                from sass_loop import describe

                print(describe(b.compiled.asm["cubin"]))
        return
    for spec in args.tiles or [None]:
        tiles = LaunchConfig(*(int(x) for x in spec.split(","))) if spec else default_launch_config(SM90, args.head_dim)
        label = f"{tiles.block_m},{tiles.block_n},{tiles.num_warps},{tiles.num_stages}"
        if args.gluon:
            b = _main_build(build_gluon(tiles, args.head_dim), "_fsattn_fwd_gluon_kernel")
            print(f"{label:12s} gluon        {_report(b)} " + _counts(b.ptx, [
                ("wgmma", "wgmma.mma_async"), ("wait", "wgmma.wait_group"), ("ex2", "ex2.approx"),
                ("cvt.e4m3", "e4m3x2"), ("bar", "bar.sync")]), flush=True)
            _dump(args.dump, f"gluon_{label.replace(',', '_')}_d{args.head_dim}", b.ptx)
            continue
        for name in args.variants:
            try:
                b = _main_build(build_triton(name, tiles, args.head_dim), "_fsattn_fwd_kernel")
            except Exception as exc:  # noqa: BLE001 - one variant's compile error must not hide the others'
                print(f"{label:12s} {name:12s} FAILED: {type(exc).__name__}: {str(exc)[:400]}")
                continue
            print(f"{label:12s} {name:12s} {_report(b)} " + _counts(b.ptx, [
                ("wgmma", "wgmma.mma_async"), ("ex2", "ex2.approx"), ("cvt.e4m3", "e4m3x2"), ("bar", "bar.sync")]),
                flush=True)
            _dump(args.dump, f"{name}_{label.replace(',', '_')}_d{args.head_dim}", b.ptx)


if __name__ == "__main__":
    main()
