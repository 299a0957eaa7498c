"""torch.compile of a patched transformer: one graph (fullgraph=True), fsattn's op inside it.

The "eager" and "aot_eager" backends keep CPU time low; graph breaks come from Dynamo's tracing,
which every backend shares. Outputs are compared with the unpatched model (SDPA), not with eager
fsattn: a compiled graph that dropped an argument (RoPE, a mask) or the op itself would still match
eager fsattn's call count but not the reference.
"""

from __future__ import annotations

import pytest
import torch

from fsattn_diffusers import FSAttnConfig, FSAttnProcessor, apply_fsattn

from .conftest import BUILDERS, build_wan_pipeline, cosine, emulation_calls, make_peaky, run, run_wan_pipeline


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family, how, backend", [
    ("wan_t2v", "apply", "aot_eager"),
    ("wan_t2v", "apply_with_config", "eager"),  # the config reaches the op as a constant
    ("wan_t2v", "one_liner", "eager"),
    ("hunyuan_video", "apply", "eager"),  # key-padding mask, and the token refiner's fallback to SDPA
    ("ltx_video", "one_liner", "eager"),
])
def test_patched_transformer_compiles_to_one_graph(family, how, backend):
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    reference = run(model, inputs)
    if how == "apply":
        apply_fsattn(model)
    elif how == "apply_with_config":
        apply_fsattn(model, config=FSAttnConfig(pv_format="16bit", k_granularity="block"))
    else:
        model.set_attn_processor(FSAttnProcessor())
    eager = run(model, inputs)
    calls = emulation_calls()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = run(compiled, inputs)
    assert emulation_calls() == 2 * calls  # the compiled graph calls the fsattn op too
    # As close to the SDPA reference as eager fsattn is (8-bit attention: not bit-equal to it).
    assert cosine(out, reference) >= min(cosine(eager, reference), 0.9999) - 1e-6
    assert cosine(out, reference) > 0.999


@pytest.mark.parametrize("family", ["hunyuan_video", "cogvideox"])
def test_one_liner_on_generic_attention_compiles_without_an_eager_call_first(family):
    # These modules are diffusers' generic Attention: the one-liner finds their processor by looking
    # up the calling model, which must work while torch.compile traces (diffusers' own compile tests
    # run no eager forward first).
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    reference = run(model, inputs)
    model.set_attn_processor(FSAttnProcessor())
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = run(compiled, inputs)
        calls = emulation_calls()
        again = run(compiled, inputs)  # no recompilation
    assert calls > 0 and emulation_calls() == 2 * calls
    assert torch.equal(out, again)
    assert cosine(out, reference) > 0.999


def test_one_liner_on_generic_attention_compiles_inside_a_function_that_calls_the_model():
    # Traced from a function that calls the model, neither the function's frame nor the model's
    # runs as Python: the lookup must find the model where dynamo holds it. It is kept out of
    # this test's own locals, which the lookup would otherwise find.
    model, inputs = BUILDERS["hunyuan_video"]()
    make_peaky(model)
    reference = run(model, inputs)
    model.set_attn_processor(FSAttnProcessor())
    holder = [model]
    del model
    compiled = torch.compile(lambda m, kwargs: run(m, kwargs), fullgraph=True, backend="eager")
    out = compiled(holder.pop(), inputs)
    assert emulation_calls() > 0
    assert cosine(out, reference) > 0.999


def test_one_liner_survives_regional_compilation_of_generic_attention():
    model, inputs = BUILDERS["hunyuan_video"]()
    make_peaky(model)
    reference = run(model, inputs)
    model.set_attn_processor(FSAttnProcessor())
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    out = run(model, inputs)
    assert emulation_calls() > 0
    assert cosine(out, reference) > 0.999


def test_compiled_pipeline_honours_skipped_steps():
    pipe = build_wan_pipeline()
    apply_fsattn(pipe, skip_first_steps=1, skip_last_steps=1)
    eager = run_wan_pipeline(pipe, steps=4)
    eager_calls = emulation_calls()
    pipe.transformer.compile(fullgraph=True, backend="eager")
    compiled = run_wan_pipeline(pipe, steps=4)
    assert emulation_calls() == 2 * eager_calls
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
