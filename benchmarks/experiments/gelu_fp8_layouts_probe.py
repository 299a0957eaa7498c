"""Variants of the one-pass GELU + per-row FP8 kernel, timed against inductor's."""
import argparse, json, os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks/experiments")  # gelu_fp8_probe.py from 3d75318 copied there
from gelu_fp8_probe import reference, gelu_fp8_rows as onerow
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERP:
    from triton.language.extra import libdevice


@triton.jit
def _gelu(x, LIBDEVICE_TANH: tl.constexpr):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    if LIBDEVICE_TANH:
        t = libdevice.tanh(inner)
    else:
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    return (0.5 * x * (1.0 + t)).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _part(x_ptr, q_ptr, row, x_stride, q_stride, start, n_cols, SIZE: tl.constexpr, LT: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    return _gelu(x, LT)


@triton.jit
def _split_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride, A: tl.constexpr, B: tl.constexpr,
                  C: tl.constexpr, LT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ya = _part(x_ptr, q_ptr, row, x_stride, q_stride, 0, n_cols, A, LT)
    amax = tl.max(tl.abs(ya), axis=0)
    if B > 0:
        yb = _part(x_ptr, q_ptr, row, x_stride, q_stride, A, n_cols, B, LT)
        amax = tl.maximum(amax, tl.max(tl.abs(yb), axis=0))
    if C > 0:
        yc = _part(x_ptr, q_ptr, row, x_stride, q_stride, A + B, n_cols, C, LT)
        amax = tl.maximum(amax, tl.max(tl.abs(yc), axis=0))
    scale = amax / 448.0
    inv = 1.0 / scale
    ca = tl.arange(0, A)
    tl.store(q_ptr + row * q_stride + ca, tl.clamp(ya * inv, -448.0, 448.0).to(tl.float8e4nv), mask=ca < n_cols)
    if B > 0:
        cb = A + tl.arange(0, B)
        tl.store(q_ptr + row * q_stride + cb, tl.clamp(yb * inv, -448.0, 448.0).to(tl.float8e4nv), mask=cb < n_cols)
    if C > 0:
        cc = A + B + tl.arange(0, C)
        tl.store(q_ptr + row * q_stride + cc, tl.clamp(yc * inv, -448.0, 448.0).to(tl.float8e4nv), mask=cc < n_cols)
    tl.store(s_ptr + row, scale)


def split_sizes(cols, min_part=512):
    parts, left = [], cols
    while left > 0 and len(parts) < 2:
        p = 1 << (left.bit_length() - 1)
        if p < min_part:
            break
        parts.append(p); left -= p
    if left > 0:
        parts.append(max(min_part, triton.next_power_of_2(left)))
    parts += [0] * (3 - len(parts))
    return parts


def split(x, num_warps=16, divide=False):
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    a, b, c = split_sizes(cols)
    _split_kernel[(rows,)](x, q, s, cols, x.stride(0), q.stride(0), A=a, B=b, C=c, LT=not INTERP,
                           num_warps=num_warps)
    return q, s


@triton.jit
def _twoloop_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride, CHUNK: tl.constexpr, LT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, n_cols, CHUNK):
        cols = start + offs
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(_gelu(x, LT)))
    scale = tl.max(amax, axis=0) / 448.0
    inv = 1.0 / scale
    for start in range(0, n_cols, CHUNK):
        cols = start + offs
        m = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
        y = _gelu(x, LT)
        tl.store(q_ptr + row * q_stride + cols, tl.clamp(y * inv, -448.0, 448.0).to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + row, scale)


def twoloop(x, chunk=2048, num_warps=4):
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    _twoloop_kernel[(rows,)](x, q, s, cols, x.stride(0), q.stride(0), CHUNK=chunk, LT=not INTERP, num_warps=num_warps)
    return q, s


def check(fn, x):
    q, s = fn(x)
    rq, rs = reference(x)
    step = torch.exp2(torch.floor(torch.log2(rq.float().abs().clamp_min(2.0 ** -6))) - 3)
    return {"scale_rel": ((s - rs).abs() / rs).max().item(),
            "bytes_equal": (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item(),
            "within_step": ((q.float() - rq.float()).abs() <= step).float().mean().item()}


VARIANTS = {
    "onerow": onerow,
    "split_w8": lambda x: split(x, 8), "split_w16": lambda x: split(x, 16), "split_w32": lambda x: split(x, 32),
    "twoloop_c1024_w4": lambda x: twoloop(x, 1024, 4), "twoloop_c2048_w4": lambda x: twoloop(x, 2048, 4),
    "twoloop_c2048_w8": lambda x: twoloop(x, 2048, 8), "twoloop_c4096_w8": lambda x: twoloop(x, 4096, 8),
}

if __name__ == "__main__":
    p = argparse.ArgumentParser(); p.add_argument("--check", action="store_true"); p.add_argument("--out")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    if args.check:
        for rows, cols in ((3, 600), (2, 1700)):
            x = (torch.randn(rows, cols, generator=g) * 3).to(torch.bfloat16)
            for k in ("split_w8", "twoloop_c1024_w4"):
                print(k, (rows, cols), split_sizes(cols), check(VARIANTS[k], x))
        sys.exit()
    from triton.testing import do_bench
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    compiled = torch.compile(reference, fullgraph=True)
    for name, (rows, cols) in {"wan13b_ffn": (32760, 8960), "wan14b_ffn": (75600, 13824)}.items():
        x = (torch.randn(rows, cols, generator=g) * 2).to("cuda", torch.bfloat16)
        floor = rows * cols * 3 + rows * 4
        row = {"split_sizes": split_sizes(cols)}
        for label, fn in [("inductor", compiled)] + list(VARIANTS.items()):
            try:
                ms = do_bench(lambda: fn(x), warmup=50, rep=300)
                row[label] = {"ms": ms, "tb_s": floor / ms / 1e9}
                if label != "inductor":
                    row[label].update(check(fn, x))
            except Exception as e:
                row[label] = {"error": repr(e)[:300]}
            print(name, label, json.dumps(row[label]), flush=True)
        res[name] = row
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)
