"""The query/key RMSNorm + RoPE pass against diffusers' own code (``WanAttnProcessor``'s norm and rotation).

On CPU the kernel runs in Triton's interpreter (tests/conftest.py), rounding to bf16 by the soft
rounding of kernels/lowp.py. The pass and PyTorch sum each row's squares in different orders, so a
row's scale may differ in its last float32 bit and a value then rounds to the neighbouring bf16
step: nearly every value is equal, none is more than one step away.
"""

import pytest
import torch

from fsattn_diffusers.fused_norm_rope import norm_rope_torch
from fsattn_diffusers.kernels.qk_norm_rope import head_chunks, qk_norm_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(batch, tokens, heads, head_dim, dtype=torch.bfloat16, seed=0, device=DEVICE):
    """Q and K as views of a fused QKV projection's (B, S, 3 * H * D) output, norm weights near 1,
    and Wan-style angles (each pair's cosine and sine repeated at channels 2i and 2i + 1)."""
    g = torch.Generator().manual_seed(seed)
    n = heads * head_dim
    qkv = (3 * torch.randn(batch, tokens, 3 * n, generator=g)).to(dtype)
    wq, wk = ((1 + 0.2 * torch.randn(n, generator=g)).to(dtype) for _ in range(2))
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.3
    cos = angles.cos().repeat_interleave(2, -1).reshape(1, tokens, 1, head_dim)
    sin = angles.sin().repeat_interleave(2, -1).reshape(1, tokens, 1, head_dim)
    qkv, wq, wk, cos, sin = (t.to(device) for t in (qkv, wq, wk, cos, sin))
    return qkv[..., :n], qkv[..., n:2 * n], wq, wk, cos, sin


@pytest.mark.parametrize("heads, chunks", [(1, (1, 0)), (12, (8, 4)), (24, (16, 8)), (40, (32, 8)), (5, (4, 1)),
                                           (48, (32, 16))])
def test_head_chunks_cover_the_row(heads, chunks):
    first, second = head_chunks(heads)
    assert (first, second) == chunks
    assert first & (first - 1) == 0 and first <= heads
    # the second chunk is the smallest power of two holding the rest, and absent when there is none
    assert (second == 0) == (heads == first)
    assert second == 0 or (second & (second - 1) == 0 and second // 2 < heads - first <= second)


@pytest.mark.parametrize("batch, tokens, heads, head_dim", [(1, 5, 3, 128), (2, 4, 12, 64), (1, 3, 40, 128),
                                                            (2, 3, 5, 32), (1, 2, 1, 16)])
def test_matches_diffusers_norm_and_rotation(batch, tokens, heads, head_dim):
    q, k, wq, wk, cos, sin = inputs(batch, tokens, heads, head_dim)
    ref_q, ref_k = norm_rope_torch(q, k, wq, wk, 1e-6, cos, sin, heads)
    out_q, out_k = qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, heads)
    assert out_q.shape == (batch, tokens, heads, head_dim) and out_q.is_contiguous()
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        diff = (out.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2.0 ** -7 + 1e-6).all()
        assert (out == ref).float().mean() >= 0.999


def test_angles_in_the_models_dtype_round_each_product_as_eager_does():
    q, k, wq, wk, cos, sin = inputs(2, 5, 12, 64)
    cos, sin = cos.bfloat16(), sin.bfloat16()
    ref_q, ref_k = norm_rope_torch(q, k, wq, wk, 1e-6, cos, sin, 12)
    out_q, out_k = qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, 12)
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        diff = (out.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2.0 ** -6 + 1e-6).all()
        assert (out == ref).float().mean() >= 0.999
    # The float32 rotation of the same bf16 angles rounds differently: the test can tell them apart.
    f32_q, _ = norm_rope_torch(q, k, wq, wk, 1e-6, cos.float(), sin.float(), 12)
    assert (f32_q != ref_q).float().mean() > 0.01


def test_float16_and_a_different_eps():
    q, k, wq, wk, cos, sin = inputs(2, 3, 6, 64, dtype=torch.float16)
    ref_q, ref_k = norm_rope_torch(q, k, wq, wk, 1e-2, cos, sin, 6)
    out_q, out_k = qk_norm_rope(q, k, wq, wk, 1e-2, cos, sin, 6)
    tol = dict(rtol=2.0 ** -10, atol=1e-3)
    torch.testing.assert_close(out_q, ref_q, **tol)
    torch.testing.assert_close(out_k, ref_k, **tol)
    assert not torch.allclose(out_q, norm_rope_torch(q, k, wq, wk, 1e-6, cos, sin, 6)[0], rtol=1e-3, atol=0)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "heads": 7}, "do not split into 7 heads"),
    (lambda a: {**a, "query": a["query"].float(), "key": a["key"].float()}, "expected both bfloat16"),
    (lambda a: {**a, "query": a["query"][:, :2]}, "(B, S, H*D) of one shape"),
    (lambda a: {**a, "weight_q": a["weight_q"][:-1]}, "weight_q must be a contiguous"),
    (lambda a: {**a, "freqs_cos": a["freqs_cos"].double()}, "freqs_cos must be float32 or torch.bfloat16"),
    (lambda a: {**a, "freqs_sin": a["freqs_sin"].bfloat16()}, "freqs_cos is torch.float32 and freqs_sin torch.bfloat16"),
    (lambda a: {**a, "heads": 4}, "head dim 96 is not a power of two"),
])
def test_bad_arguments_name_the_problem(change, message):
    q, k, wq, wk, cos, sin = inputs(1, 3, 3, 128)
    args = dict(query=q, key=k, weight_q=wq, weight_k=wk, eps=1e-6, freqs_cos=cos, freqs_sin=sin, heads=3)
    with pytest.raises(ValueError, match="qk_norm_rope: .*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*")):
        qk_norm_rope(**change(args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens, heads", [(32760, 12), (4096, 40)])
def test_gpu_at_wan_widths(tokens, heads):
    q, k, wq, wk, cos, sin = inputs(1, tokens, heads, 128)
    ref_q, ref_k = norm_rope_torch(q, k, wq, wk, 1e-6, cos, sin, heads)
    out_q, out_k = qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, heads)
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        diff = (out.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2.0 ** -7 + 1e-6).all()
        assert (out == ref).float().mean() >= 0.9999
