"""The query/key RMSNorm + RoPE pass against diffusers' own code (``WanAttnProcessor``'s norm and rotation).

On CPU the kernel runs in Triton's interpreter (tests/conftest.py), rounding to bf16 by the soft
rounding of fsattn_diffusers/kernels/lowp.py. The pass and PyTorch sum each row's squares in
different orders (and on a GPU, with float32 angles, the pass may fuse a product into the
rotation's subtraction), so a normalised value may land on the neighbouring bf16 step before the
rotation. The rotation carries that step into both
outputs of the pair at the size of the pair, not of each output: where x1 cos - x2 sin nearly
cancels, one step of x1 is many steps of the result. So an output may differ from PyTorch's by a
few steps of its pair's norm (the rotation keeps the norm), and nearly every value is equal. (The
first GPU run held each output to one step of its own size and failed three cases, 2026-12-03.)
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


def assert_within_steps_of_the_pair(out, ref, equal=0.999, steps=3):
    """`out` equal to `ref` in a share `equal` of values, and every value within `steps` bf16 steps of
    its pair's norm: one for each of the pair's normalised inputs, one for the output's rounding."""
    ref = ref.float()
    pair_norm = ref.unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, dim=-1)
    diff = (out.float() - ref).abs()
    assert (diff <= steps * 2.0 ** -7 * pair_norm + 1e-6).all(), diff.max()
    assert (out == ref).float().mean() >= equal


def test_the_bound_tells_a_rounding_step_from_a_wrong_rotation():
    # What the GPU shows (a scale one float32 bit off, so some normalised values one bf16 step off)
    # passes the bound; the rotation's sign flipped, or the pairs taken from the wrong channels, fails it.
    q, k, wq, wk, cos, sin = inputs(1, 64, 12, 128, device="cpu")
    ref, _ = norm_rope_torch(q, k, wq, wk, 1e-6, cos, sin, 12)
    # eps raised so that every row's scale moves by ~2e-4: a few % of the normalised values step over
    off_by_a_step, _ = norm_rope_torch(q, k, wq, wk, 4e-3, cos, sin, 12)
    assert 0.001 < (off_by_a_step != ref).float().mean() < 0.5
    assert_within_steps_of_the_pair(off_by_a_step, ref, equal=0.5)
    flipped, _ = norm_rope_torch(q, k, wq, wk, 1e-6, cos, -sin, 12)
    shifted, _ = norm_rope_torch(q, k, wq, wk, 1e-6, cos.roll(2, -1), sin.roll(2, -1), 12)
    for wrong in (flipped, shifted):
        with pytest.raises(AssertionError):
            assert_within_steps_of_the_pair(wrong, ref, equal=0.0)


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
        assert_within_steps_of_the_pair(out, ref)


def test_angles_in_the_models_dtype_round_each_product_as_eager_does():
    q, k, wq, wk, cos, sin = inputs(2, 5, 12, 64)
    cos, sin = cos.bfloat16(), sin.bfloat16()
    ref_q, ref_k = norm_rope_torch(q, k, wq, wk, 1e-6, cos, sin, 12)
    out_q, out_k = qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, 12)
    for out, ref in ((out_q, ref_q), (out_k, ref_k)):
        assert_within_steps_of_the_pair(out, ref)
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
    (lambda a: {**a, "freqs_cos": a["freqs_cos"].reshape(3, 128)}, "freqs_cos must be (1, 3, 1, 128)"),
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
        assert_within_steps_of_the_pair(out, ref, equal=0.9999)
