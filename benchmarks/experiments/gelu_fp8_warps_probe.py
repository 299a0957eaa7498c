"""Times the product's gelu_tanh_fp8_rows at warps 4/8/16 against inductor's compile of torchao's path."""
import json, sys
import torch, triton
from triton.testing import do_bench
from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8
from fsattn_diffusers.kernels import gelu_fp8

def torchao_path(h):
    y = torch.nn.functional.gelu(h, approximate="tanh")
    s = _choose_scale_float8(y, [1, h.shape[-1]]); return _quantize_affine_float8(y, s), s

res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
compiled = torch.compile(torchao_path, fullgraph=True)
g = torch.Generator().manual_seed(0)
default_warps = gelu_fp8.num_warps_for
for name, (rows, cols) in {"wan13b_ffn": (32760, 8960), "hunyuan_ffn": (119056 // 2, 12288), "wan14b_ffn": (75600, 13824)}.items():
    x = (torch.randn(rows, cols, generator=g) * 2).to("cuda", torch.bfloat16)
    floor = rows * cols * 3 + rows * 4
    row = {"parts": gelu_fp8.row_parts(cols), "default_warps": default_warps(cols)}
    ms = do_bench(lambda: compiled(x), warmup=50, rep=300); row["inductor_torchao"] = {"ms": ms, "tb_s": floor / ms / 1e9}
    qc, sc = compiled(x)
    for w in (4, 8, 16, 32):
        gelu_fp8.num_warps_for = lambda n, w=w: w
        ms = do_bench(lambda: gelu_fp8.gelu_tanh_fp8_rows(x), warmup=50, rep=300)
        q, s = gelu_fp8.gelu_tanh_fp8_rows(x)
        row[f"w{w}"] = {"ms": ms, "tb_s": floor / ms / 1e9, "q_equal_to_inductor": (q.float() == qc.float()).float().mean().item(),
                        "scale_equal_to_inductor": (s.flatten() == sc.flatten().float()).float().mean().item()}
    gelu_fp8.num_warps_for = default_warps
    res[name] = row
    print(name, json.dumps(row), flush=True)
    del x
json.dump(res, open(sys.argv[1], "w"), indent=1)
