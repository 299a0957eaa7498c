"""The recipe's fused query/key norm and RoPE (fsattn_diffusers.fused_norm_rope) on tiny Wan models.

On a CPU the processor's op computes the norm and rotation in PyTorch, as diffusers' own processor
does, so outputs must equal the unfused model's bit for bit; with ``ops.CPU_PATH = "interpreter"``
the op runs the Triton pass (tests/kernels/test_qk_norm_rope.py checks it value by value).
"""

from __future__ import annotations

import pytest
import torch

import fsattn_diffusers
from fsattn_diffusers import apply_recipe, fused_norm_rope, ops, recipe_summary, remove_recipe
from fsattn_diffusers.families import attention_modules
from interpreter_only import requires_interpreter

from .conftest import BUILDERS, build_wan_pipeline, emulation_calls, run, run_wan_pipeline

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

PARTS_OFF = dict(fsattn=False, fuse_qkv=False, fp8_linear=False, compile=False)


def _wan_processor():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return WanAttnProcessor


def _fused_paths(model):
    return [path for path, m in attention_modules(model) if isinstance(m.processor, fused_norm_rope.processor_class())]


@pytest.mark.parametrize("builder", ["wan_t2v", "wan_i2v", "wan_vace"])
def test_self_attention_gets_the_fused_processor_and_the_same_output(builder):
    model, inputs = BUILDERS[builder]()
    expected = run(model, inputs)
    before = {path: m.processor for path, m in attention_modules(model)}
    apply_recipe(model, **PARTS_OFF)
    fused = _fused_paths(model)
    self_attention = [p for p in before if p.endswith("attn1")]
    assert sorted(fused) == sorted(self_attention) and fused
    assert recipe_summary(model)["model"]["fused_norm_rope"] == len(fused)
    assert all(m.processor is before[p] for p, m in attention_modules(model) if p not in fused)  # attn2 untouched
    assert torch.equal(run(model, inputs), expected)
    remove_recipe(model)
    assert all(m.processor is before[p] for p, m in attention_modules(model))
    assert torch.equal(run(model, inputs), expected)


def test_off_switch_and_other_families_leave_processors_alone():
    model, _ = BUILDERS["wan_t2v"]()
    apply_recipe(model, fuse_norm_rope=False, **PARTS_OFF)
    assert _fused_paths(model) == [] and recipe_summary(model)["model"]["fused_norm_rope"] == 0
    for builder in ("cogvideox", "hunyuan_video"):
        other, _ = BUILDERS[builder]()
        before = {path: m.processor for path, m in attention_modules(other)}
        apply_recipe(other, **PARTS_OFF)
        assert all(m.processor is before[p] for p, m in attention_modules(other))


def test_norms_the_pass_does_not_compute_keep_diffusers_processor():
    model, inputs = BUILDERS["wan_t2v"]()
    model.blocks[0].attn1.norm_q = torch.nn.RMSNorm(64, eps=1e-6, elementwise_affine=False)
    model.blocks[1].attn1.norm_k.eps = 1e-3  # not the query norm's eps
    expected = run(model, inputs)
    apply_recipe(model, **PARTS_OFF)
    assert _fused_paths(model) == []
    assert torch.equal(run(model, inputs), expected)


def test_fsattn_routes_the_fused_processors_attention(monkeypatch):
    model, inputs = BUILDERS["wan_t2v"]()
    apply_recipe(model, fuse_norm_rope=False, **{**PARTS_OFF, "fsattn": True, "fuse_qkv": True})
    fsattn_diffusers.reset_stats()
    expected = run(model, inputs)
    unfused_calls = emulation_calls()
    apply_recipe(model, **{**PARTS_OFF, "fsattn": True, "fuse_qkv": True})
    assert isinstance(model.blocks[0].attn1.processor, fused_norm_rope.processor_class())
    assert type(model.blocks[0].attn1.processor).__name__.startswith("FSAttn")  # fsattn's binding of it
    fsattn_diffusers.reset_stats()
    assert torch.equal(run(model, inputs), expected)
    assert emulation_calls() == unfused_calls > 0


@requires_interpreter
def test_the_op_runs_the_pass_in_the_interpreter(monkeypatch):
    from fsattn_diffusers.kernels import qk_norm_rope as kernel

    model, inputs = BUILDERS["wan_t2v"]()
    model.to(torch.bfloat16)
    inputs = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in inputs.items()}
    expected = run(model, inputs)
    calls = []
    real = kernel.launch
    monkeypatch.setattr(kernel, "launch", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "CPU_PATH", "interpreter")
    apply_recipe(model, **PARTS_OFF)
    out = run(model, inputs)
    assert len(calls) == len(model.blocks)
    # One bf16 step here and there (tests/kernels/test_qk_norm_rope.py), carried through two blocks.
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), expected.double().flatten(), dim=0)
    assert cos > 0.99999


def test_compiled_recipe_keeps_one_graph_without_breaks():
    from torch._dynamo.utils import counters

    model, inputs = BUILDERS["wan_t2v"]()
    expected = run(model, inputs)
    apply_recipe(model, **{**PARTS_OFF, "compile": True}, compile_options={"backend": "eager"})
    assert _fused_paths(model)
    out = run(model, inputs)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    assert torch.equal(out, expected)


def test_wan22_pipeline_both_transformers():
    pipe = build_wan_pipeline(second_transformer=True)
    expected = run_wan_pipeline(pipe, steps=2)
    apply_recipe(pipe, **PARTS_OFF)
    assert _fused_paths(pipe.transformer) and _fused_paths(pipe.transformer_2)
    assert torch.equal(run_wan_pipeline(pipe, steps=2), expected)
    remove_recipe(pipe)
    assert not _fused_paths(pipe.transformer) and not _fused_paths(pipe.transformer_2)


def test_a_call_with_text_keys_takes_diffusers_processor():
    model, inputs = BUILDERS["wan_t2v"]()
    apply_recipe(model, **PARTS_OFF)
    attn = model.blocks[0].attn1
    x = torch.randn(1, 8, 64)
    text = torch.randn(1, 5, 64)
    with torch.no_grad():
        fused = attn.processor(attn, x, text)
        own = _wan_processor()()(attn, x, text)
    assert torch.equal(fused, own)


@pytest.mark.parametrize("with_fsattn", [False, True])
def test_removal_carries_back_what_diffusers_set_after_the_recipe(with_fsattn):
    # enable_parallelism() / set_attention_backend() after apply_recipe set these on the processors
    # then in place; the processors put back must keep them, or a context-parallel rank would attend
    # over its own tokens only.
    model, _ = BUILDERS["wan_t2v"]()
    originals = {p: m.processor for p, m in attention_modules(model)}
    apply_recipe(model, **{**PARTS_OFF, "fsattn": with_fsattn})
    config = object()
    for _, m in attention_modules(model):
        m.processor._parallel_config = config
        m.processor._attention_backend = "native"
    remove_recipe(model)
    for path, m in attention_modules(model):
        assert m.processor is originals[path]
        assert m.processor._parallel_config is config, path
        if not with_fsattn:  # remove_fsattn carries back the parallel config only (patch.remove_fsattn)
            assert m.processor._attention_backend == "native", path
