"""torch.compile of a patched transformer: one graph (fullgraph=True), the eager output.

The "eager" and "aot_eager" backends keep CPU time low; graph breaks come from Dynamo's tracing,
which every backend shares.
"""

from __future__ import annotations

import pytest
import torch

from fsattn_diffusers import FSAttnConfig, FSAttnProcessor, apply_fsattn

from .conftest import BUILDERS, build_wan_pipeline, emulation_calls, make_peaky, run, run_wan_pipeline


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
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_one_liner_on_generic_attention_binds_in_eager_mode_first():
    # HunyuanVideo's modules are diffusers' generic Attention: the one-liner finds their processor on
    # the first eager call; after it the model compiles to one graph.
    model, inputs = BUILDERS["hunyuan_video"]()
    model.set_attn_processor(FSAttnProcessor())
    eager = run(model, inputs)
    out = run(torch.compile(model, fullgraph=True, backend="eager"), inputs)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_compiled_pipeline_honours_skipped_steps():
    pipe = build_wan_pipeline()
    apply_fsattn(pipe, skip_first_steps=1, skip_last_steps=1)
    eager = run_wan_pipeline(pipe, steps=4)
    eager_calls = emulation_calls()
    pipe.transformer.compile(fullgraph=True, backend="eager")
    compiled = run_wan_pipeline(pipe, steps=4)
    assert emulation_calls() == 2 * eager_calls
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
