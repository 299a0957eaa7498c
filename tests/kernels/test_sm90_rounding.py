"""The two recipe passes that promise PyTorch's rounding keep it when compiled for sm_90a.

Triton's interpreter computes every float32 operation correctly rounded and fuses nothing, so the
CPU tests of these passes cannot see what the compiler does to them. On an H100 two things showed
(NOTES v46): with FP fusion, the query/key rotation's products, rounded to bf16 on their way into
the sum as eager rounds them, went into bf16 FMAs (one product of each output fused with the sum:
two roundings for eager's three; a quarter of the outputs one to three steps off eager's), and
the feed-forward pass's ``448 / amax`` compiled to an approximate division (0.4-0.6 % of its e4m3
values a step off the exact quotient's). Here each release compiles both passes for sm_90a in a
subprocess with benchmarks/compile_check.py's builders (as the compile matrix does; no GPU
needed) and the PTX is read.
"""

import json

import pytest
from triton_releases import RELEASES, run

pytestmark = pytest.mark.slow  # ~15 s of compiling per release on one core

# Builds, in order: the feed-forward pass; the rotation with bf16 angles, then with float32 angles.
BUILD = r"""
import json, sys
import torch
sys.path.insert(0, "benchmarks")
import compile_check as cc

builds = (cc.build_gelu_fp8(600) + cc.build_qk_norm_rope(4, 64, torch.bfloat16)
          + cc.build_qk_norm_rope(4, 64, torch.float32))
print(json.dumps([build.compiled.asm["ptx"] for build in builds]))
"""


@pytest.mark.parametrize("version", RELEASES)
def test_products_round_as_eager_and_the_fp8_scales_divide_exactly(version):
    done = run(version, ["-c", BUILD], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    gelu, rope_bf16, rope_f32 = json.loads(done.stdout.strip().splitlines()[-1])
    # The scale and its reciprocal: correctly rounded divisions, once a row.
    assert gelu.count("div.rn.f32") == 2
    # bf16 angles: each product and each sum rounded to bf16 on its own, no FMA of either width.
    assert "fma.rn.bf16" not in rope_bf16 and "fma.rn.f32" not in rope_bf16 and "mul.rn.bf16" in rope_bf16
    # float32 angles keep FP fusion (the rotation in float32, rounded once): the PTX shows it, so
    # the check above can tell a fused build from an unfused one.
    assert "fma.rn.f32" in rope_f32
