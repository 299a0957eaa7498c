"""The recipe's fused feed-forward (``fuse_ffn``): which feed-forwards it takes, the op's numbers,
compilation, the way back.

torchao's float8 runs on the CPU through ``fp8_on_cpu`` (tests/integrations/conftest.py): torch's
CPU ``_scaled_mm`` computes the same float8 GEMMs. The op's GELU + scaling runs in PyTorch there,
or with ``FSATTN_CPU_PATH=interpreter`` as the Triton kernel in Triton's interpreter.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch._dynamo.utils import counters

from fsattn_diffusers import apply_recipe, fused_ffn, ops, recipe_summary, remove_recipe

from interpreter_only import requires_interpreter, skip_without_interpreter

from .conftest import BUILDERS, build_wan_pipeline, cosine, run

FP8 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _bf16(family):
    model, inputs = BUILDERS[family]()
    model.to(torch.bfloat16)
    return model, {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                   for k, v in inputs.items()}


def _fp8_feed_forward(width=64, hidden=256, activation="gelu-approximate", device="cpu", **kwargs):
    """A diffusers FeedForward in bf16 with its down projection in torchao's per-row float8."""
    from diffusers.models.attention import FeedForward
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    torch.manual_seed(0)
    ff = FeedForward(width, inner_dim=hidden, activation_fn=activation, **kwargs).to(device, torch.bfloat16).eval()
    quantize_(ff, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False),
              filter_fn=lambda module, fqn: fqn == "net.2")
    return ff


def _independent_fp8_ffn(ff, x):
    """down(gelu(up(x))) with the GELU's output quantized per row to e4m3, written from the definition
    (float64 GELU rounded to bf16, float32 scale |max| / 448), dequantized and multiplied in float64."""
    h = ff.net[0].proj(x).double()
    y = (0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))).to(torch.bfloat16)
    scale = (y.float().abs().amax(dim=-1, keepdim=True) / 448.0).double()
    q = (y.double() / scale).clamp(-448, 448).to(FP8).double() * scale
    weight = ff.net[2].weight
    w = weight.qdata.double() * weight.scale.double()
    bias = ff.net[2].bias
    return q @ w.t() + (0 if bias is None else bias.double())


# ----------------------------------------------------------------------------- the op

@pytest.mark.parametrize("cpu_path, layout", [
    ("emulation", {}), ("interpreter", {}),
    ("emulation", {"bias": False}), ("emulation", {"final_dropout": True, "dropout": 0.1}),
])
def test_fused_feed_forward_computes_the_fp8_feed_forward(fp8_gemms_on_cpu, monkeypatch, cpu_path, layout):
    if cpu_path == "interpreter":
        skip_without_interpreter()
    monkeypatch.setattr(ops, "CPU_PATH", cpu_path)
    ff = _fp8_feed_forward(**layout)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        unfused = ff(x)
        assert fused_ffn.fuse_feed_forwards(ff) == [""]
        fused = ff(x)
        expected = _independent_fp8_ffn(ff, x)
    assert fused.dtype == torch.bfloat16 and fused.shape == (2, 7, 64)
    # Against the definition: bf16 output rounding, rare rounding ties, float32 GEMM accumulation.
    assert (fused.double() - expected).abs().max() <= 0.02 * expected.abs().max()
    assert cosine(fused, expected) > 0.99999
    # torchao's eager path rounds its activation scale to bf16 first: close, not equal.
    assert cosine(fused, unfused) > 0.9999


@requires_interpreter
def test_kernel_and_cpu_emulation_give_the_same_fp8_rows(monkeypatch):
    h = (torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    monkeypatch.setattr(ops, "CPU_PATH", "emulation")
    q_torch, s_torch = fused_ffn.gelu_fp8_rows(h)
    monkeypatch.setattr(ops, "CPU_PATH", "interpreter")
    q_kernel, s_kernel = fused_ffn.gelu_fp8_rows(h)
    torch.testing.assert_close(s_kernel, s_torch, rtol=2e-7, atol=0)
    assert (q_kernel.float() == q_torch.float()).float().mean() >= 0.999


@pytest.mark.parametrize("cpu_path", ["emulation", "interpreter"])
def test_a_nan_in_the_hidden_makes_its_row_nan_as_torchao_does(fp8_gemms_on_cpu, monkeypatch, cpu_path):
    if cpu_path == "interpreter":
        skip_without_interpreter()
    monkeypatch.setattr(ops, "CPU_PATH", cpu_path)
    ff = _fp8_feed_forward()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x[1, 0] = float("nan")  # every hidden value of token 1 is NaN
    with torch.no_grad():
        unfused = ff(x)
        fused_ffn.fuse_feed_forwards(ff)
        fused = ff(x)
    assert fused[1].isnan().all() and fused[[0, 2]].isfinite().all()
    assert torch.equal(fused.isnan(), unfused.isnan())


@pytest.mark.parametrize("activation, reason", [
    ("gelu", "activation is not diffusers' tanh-approximate GELU"),
    ("geglu", "activation is not diffusers' tanh-approximate GELU"),
])
def test_other_activations_are_not_fused(fp8_on_cpu, activation, reason):
    ff = _fp8_feed_forward(activation=activation)
    assert fused_ffn.unfusable_reason(ff) == reason
    assert fused_ffn.fuse_feed_forwards(ff) == []


def test_no_tokens_give_an_empty_output(fp8_on_cpu):
    ff = _fp8_feed_forward()
    fused_ffn.fuse_feed_forwards(ff)
    with torch.no_grad():
        out = ff(torch.zeros(1, 0, 64, dtype=torch.bfloat16))
    assert out.shape == (1, 0, 64) and out.dtype == torch.bfloat16


def test_feed_forwards_under_sequential_offload_hooks_are_not_fused(fp8_on_cpu):
    ff = _fp8_feed_forward()
    ff.net[2]._hf_hook = object()  # what accelerate's sequential offload attaches to each layer
    assert "carries hooks" in fused_ffn.unfusable_reason(ff)
    assert fused_ffn.fuse_feed_forwards(ff) == []


def test_training_mode_and_layers_changed_after_fusing_run_the_class_forward(fp8_gemms_on_cpu):
    ff = _fp8_feed_forward()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        unfused = ff(x)
        fused_ffn.fuse_feed_forwards(ff)
        assert not torch.equal(ff(x), unfused)  # the fused path (torchao's eager scale differs)
        ff.train()  # dropout p=0 here, so the result must be torchao's path exactly
        assert torch.equal(ff(x), unfused)
        ff.eval()
        calls = []
        handle = ff.net[2].register_forward_pre_hook(lambda module, args: calls.append(1))
        assert torch.equal(ff(x), unfused) and calls == [1]  # a hook added later is honoured
        handle.remove()

        class Wrapper(torch.nn.Module):  # e.g. PEFT's LoRA layer around the down projection
            def __init__(self, base):
                super().__init__()
                self.base, self.weight = base, base.weight

            def forward(self, h):
                return self.base(h) + 1

        ff.net[2] = Wrapper(ff.net[2])
        assert torch.equal(ff(x), unfused + 1)


def test_a_deep_copy_runs_its_own_layers(fp8_gemms_on_cpu):
    ff = _fp8_feed_forward()
    fused_ffn.fuse_feed_forwards(ff)
    twin = copy.deepcopy(ff)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with torch.no_grad():
        before = twin(x)
        ff.net[2].bias.zero_()
        assert torch.equal(twin(x), before) and not torch.equal(ff(x), before)


def test_a_bf16_down_projection_is_not_fused():
    from diffusers.models.attention import FeedForward

    ff = FeedForward(64, inner_dim=256, activation_fn="gelu-approximate").to(torch.bfloat16)
    assert fused_ffn.unfusable_reason(ff) == "weight is Parameter, not torchao's Float8Tensor"


# ----------------------------------------------------------------------------- in the recipe

@pytest.mark.parametrize("family, expected", [
    ("wan_t2v", ["blocks.0.ffn", "blocks.1.ffn"]),
    ("hunyuan_video", ["transformer_blocks.0.ff"]),  # ff_context stays bf16 (the text stream)
    ("cogvideox", ["transformer_blocks.0.ff", "transformer_blocks.1.ff"]),
    ("ltx_video", ["transformer_blocks.0.ff", "transformer_blocks.1.ff"]),
    ("mochi", []),  # SwiGLU feed-forwards, and hidden widths that are not multiples of 16 stay bf16
])
def test_recipe_fuses_the_fp8_gelu_feed_forwards(fp8_gemms_on_cpu, family, expected):
    model, inputs = _bf16(family)
    # fuse_qkv=False: the second apply_recipe finds the weights in FP8 already.
    apply_recipe(model, fsattn=False, fuse_qkv=False, compile=False, fuse_ffn=False)
    with torch.no_grad():
        unfused = run(model, inputs)
    assert recipe_summary(model)["model"]["fused_ffn"] == []
    apply_recipe(model, fsattn=False, fuse_qkv=False, compile=False)
    assert recipe_summary(model)["model"]["fused_ffn"] == expected
    assert recipe_summary(model)["model"]["parts"]["fuse_ffn"] is True
    with torch.no_grad():
        fused = run(model, inputs)
    assert cosine(fused, unfused) > 0.9999
    if expected:
        assert not torch.equal(fused, unfused)  # the fused path ran
    remove_recipe(model)
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(run(model, inputs), unfused)  # torchao's own path again (the weights stay FP8)


def test_without_fp8_there_is_nothing_to_fuse():
    model, _ = _bf16("wan_t2v")
    apply_recipe(model, fsattn=False, fp8_linear=False, compile=False)
    summary = recipe_summary(model)["model"]
    assert summary["fused_ffn"] == [] and summary["parts"]["fuse_ffn"] is False


def test_fuse_ffn_must_be_a_bool():
    model, _ = _bf16("wan_t2v")
    with pytest.raises(TypeError, match=r"fuse_ffn='yes'; expected True or False"):
        apply_recipe(model, fuse_ffn="yes")


def test_compiled_fused_recipe_has_no_graph_break_and_matches_eager(fp8_gemms_on_cpu):
    model, inputs = _bf16("wan_t2v")
    apply_recipe(model, compile=False)
    with torch.no_grad():
        eager = run(model, inputs)
    apply_recipe(model, compile_options={"backend": "aot_eager"})  # the op's fake implementation is traced
    with torch.no_grad():
        compiled = run(model, inputs)
    assert sum(counters["graph_break"].values()) == 0
    assert recipe_summary(model)["model"]["fused_ffn"] == ["blocks.0.ffn", "blocks.1.ffn"]
    assert torch.equal(compiled, eager)


def test_both_transformers_of_wan22_are_fused(fp8_on_cpu):
    pipe = build_wan_pipeline(second_transformer=True)
    pipe.transformer.to(torch.bfloat16)
    pipe.transformer_2.to(torch.bfloat16)
    apply_recipe(pipe, fsattn=False, compile=False)
    summary = recipe_summary(pipe)
    assert summary["transformer"]["fused_ffn"] == summary["transformer_2"]["fused_ffn"] == [
        "blocks.0.ffn", "blocks.1.ffn"]
    assert all(vars(block.ffn)["forward"].__self__ is block.ffn
               for model in (pipe.transformer, pipe.transformer_2) for block in model.blocks)


@pytest.mark.gpu
def test_fused_feed_forward_on_the_gpu_matches_the_definition_and_torchao():
    ff = _fp8_feed_forward(width=1536, hidden=8960, device="cuda")
    x = torch.randn(4096, 1536, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    with torch.no_grad():
        unfused = ff(x)
        fused_ffn.fuse_feed_forwards(ff)
        fused = ff(x)
        expected = _independent_fp8_ffn(ff, x)
    assert cosine(fused, expected) > 0.99999
    assert cosine(fused, unfused) > 0.9999


def test_a_new_frame_count_recompiles_once_with_dynamic_shapes_and_matches_eager(fp8_gemms_on_cpu):
    model, inputs = _bf16("wan_t2v")
    longer = dict(inputs, hidden_states=torch.randn(2, 4, 5, 16, 16, generator=torch.Generator().manual_seed(5))
                  .to(torch.bfloat16))
    apply_recipe(model, compile=False)
    with torch.no_grad():
        eager = [run(model, inputs), run(model, longer)]
    apply_recipe(model, compile_options={"backend": "aot_eager"})  # dynamic=None: static, then dynamic
    with torch.no_grad():
        compiled = [run(model, inputs), run(model, longer)]
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 2
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
