"""apply_recipe / remove_recipe: layer selection, fusion, fsattn, compilation, FP8 where torchao allows it.

torchao's float8 linear layers cannot run on a CPU (torchao refuses), so:

* the FP8 layer selection is checked by the exact set of module names on tiny Wan (T2V, I2V,
  Wan 2.2's two transformers), HunyuanVideo and CogVideoX models;
* the refusal on a CPU is checked to come before any change;
* the FP8 path itself runs through ``fp8_on_cpu``, which lifts torchao's hardware check and the
  recipe's own: torch's CPU ``_scaled_mm`` then computes the same float8 GEMMs (emulated), so
  the recipe's whole path (quantize_, the Float8Tensor weights inside the compiled graph, the
  undo) runs for real, at CPU speed.

Compilation uses Dynamo's "eager" backend: graph breaks and recompiles come from Dynamo's
tracing and guards, which every backend shares; the backend only turns the graph into code.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fsattn_diffusers
from fsattn_diffusers import apply_fsattn, apply_recipe, fp8_linear_names, recipe, recipe_summary, remove_recipe
from fsattn_diffusers.families import attention_modules

from .conftest import BUILDERS, build_wan_pipeline, cosine, emulation_calls, make_peaky, run, run_wan_pipeline

EAGER = {"backend": "eager"}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _bf16(model, inputs):
    model.to(torch.bfloat16)
    return model, {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                   for k, v in inputs.items()}


def _snapshot(model):
    """Everything the recipe may change, by identity: processors, children, parameters, compiled calls."""
    return {
        "processors": {path: m.processor for path, m in attention_modules(model)},
        "children": {name: m for name, m in model.named_modules()},
        "params": {name: p for name, p in model.named_parameters()},
        "compiled": [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None],
        "state": "_fsattn_recipe" in vars(model),
    }


def _assert_unchanged(model, before):
    after = _snapshot(model)
    assert after["processors"].keys() == before["processors"].keys()
    assert all(after["processors"][k] is v for k, v in before["processors"].items())
    assert after["children"].keys() == before["children"].keys()
    assert after["params"].keys() == before["params"].keys()
    assert all(after["params"][k] is v for k, v in before["params"].items())
    assert after["compiled"] == before["compiled"] == [] and not after["state"]


def _float8_layers(model):
    return {name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m.weight).__module__.startswith("torchao.")}


def _wan_block(i):
    # Of the cross-attention (attn2) only the query projection of the video tokens: not to_k,
    # to_v, to_out (in I2V also the image tokens' add_k_proj, add_v_proj), the prompt's own path.
    names = [f"blocks.{i}.attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0")] + [f"blocks.{i}.attn2.to_q"]
    names += [f"blocks.{i}.ffn.net.0.proj", f"blocks.{i}.ffn.net.2"]
    return names


WAN_T2V = _wan_block(0) + _wan_block(1)
# Written out, not derived: the adaLN modulation (norm1.linear, norm1_context.linear, norm.linear),
# the text stream's layers (add_q/k/v_proj, to_add_out, ff_context), the token refiner, the
# embedders, norm_out and proj_out are absent.
HUNYUAN = [f"transformer_blocks.0.{n}" for n in (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")] + [
    f"single_transformer_blocks.0.{n}" for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")]
LTX = [f"transformer_blocks.{i}.{n}" for i in (0, 1) for n in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "ff.net.0.proj", "ff.net.2")]
# The tiny Mochi's feed-forward hidden sizes (170 for video, 42 for text) are not multiples of 16,
# and its text stream (add_*_proj, to_add_out) is the conditioning's path.
# Wan VACE's control block (run first) gets FP8 like the main blocks, with its input and output projections.
WAN_VACE = [f"vace_blocks.0.{n}" for n in (
    "proj_in", "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "ffn.net.0.proj", "ffn.net.2",
    "proj_out")] + WAN_T2V
MOCHI = [f"transformer_blocks.{i}.attn1.{p}" for i in (0, 1) for p in ("to_q", "to_k", "to_v", "to_out.0")]
COGVIDEOX = [f"transformer_blocks.{i}.{n}" for i in (0, 1) for n in (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2")]


# ----------------------------------------------------------------------------- which layers get FP8

@pytest.mark.parametrize("family, expected", [
    ("wan_t2v", WAN_T2V),
    ("wan_i2v", WAN_T2V),
    ("wan_vace", WAN_VACE),
    ("hunyuan_video", HUNYUAN),
    ("cogvideox", COGVIDEOX),
    ("ltx_video", LTX),
    ("mochi", MOCHI),
])
def test_fp8_selection_is_the_block_linears_without_the_modulation(family, expected):
    model, _ = BUILDERS[family]()
    names = fp8_linear_names(model)
    assert set(names) == {"model"}
    assert sorted(names["model"]) == sorted(expected)


def test_an_unfused_lora_wraps_layers_without_changing_which_are_fp8():
    # PEFT wraps each adapted layer (its weights in ``base_layer``); a cross-attention's query
    # projection must stay in the selection, its K/V out of it, like the plain layers.
    from peft import LoraConfig

    model, _ = BUILDERS["wan_t2v"]()
    plain = fp8_linear_names(model)["model"]
    model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))
    wrapped = fp8_linear_names(model)["model"]
    assert "blocks.0.attn2.to_q.base_layer" in wrapped and "blocks.0.attn2.to_k.base_layer" not in wrapped
    assert sorted(n.removesuffix(".base_layer") for n in wrapped) == sorted(plain)


def test_fp8_conditioning_adds_the_cross_attention_and_the_text_stream():
    wan, _ = BUILDERS["wan_i2v"]()
    conditioning = [f"blocks.{i}.attn2.{p}" for i in (0, 1)
                    for p in ("to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj")]
    assert sorted(fp8_linear_names(wan, fp8_conditioning=True)["model"]) == sorted(WAN_T2V + conditioning)
    hunyuan, _ = BUILDERS["hunyuan_video"]()
    text_stream = [f"transformer_blocks.0.{n}" for n in (
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff_context.net.0.proj",
        "ff_context.net.2")]
    assert sorted(fp8_linear_names(hunyuan, fp8_conditioning=True)["model"]) == sorted(HUNYUAN + text_stream)
    ltx, _ = BUILDERS["ltx_video"]()
    cross = [f"transformer_blocks.{i}.attn2.{p}" for i in (0, 1) for p in ("to_k", "to_v", "to_out.0")]
    assert sorted(fp8_linear_names(ltx, fp8_conditioning=True)["model"]) == sorted(LTX + cross)
    mochi, _ = BUILDERS["mochi"]()
    # Mochi's last block keeps no text output (context_pre_only): no to_add_out there.
    text = [f"transformer_blocks.{i}.attn1.add_{p}_proj" for i in (0, 1) for p in "qkv"]
    text += ["transformer_blocks.0.attn1.to_add_out"]
    assert sorted(fp8_linear_names(mochi, fp8_conditioning=True)["model"]) == sorted(MOCHI + text)


def test_fp8_selection_covers_both_transformers_of_wan22():
    pipe = build_wan_pipeline(second_transformer=True)
    assert {k: sorted(v) for k, v in fp8_linear_names(pipe).items()} == {"transformer": sorted(WAN_T2V),
                                                                          "transformer_2": sorted(WAN_T2V)}


@pytest.mark.parametrize("family, fused_layers", [
    ("wan_t2v", [f"blocks.{i}.attn1.to_qkv" for i in (0, 1)]),
    ("cogvideox", [f"transformer_blocks.{i}.attn1.to_qkv" for i in (0, 1)]),
    ("hunyuan_video", []),  # its processor reads separate projections: nothing to fuse
])
def test_fp8_quantizes_exactly_the_selection_and_the_fused_layers(fp8_on_cpu, family, fused_layers):
    model, _ = _bf16(*BUILDERS[family]())
    expected = {"wan_t2v": WAN_T2V, "cogvideox": COGVIDEOX, "hunyuan_video": HUNYUAN}[family]
    apply_recipe(model, fsattn=False, compile=False)
    assert _float8_layers(model) == set(expected) | set(fused_layers)
    assert sorted(recipe_summary(model)["model"]["fp8_linear"]) == sorted(set(expected) | set(fused_layers))


@pytest.mark.parametrize("family", ["wan_t2v", "cogvideox"])
def test_fused_projections_in_fp8_are_row_slices_of_the_fused_weight(fp8_gemms_on_cpu, family):
    model, inputs = _bf16(*BUILDERS[family]())
    apply_recipe(model, fsattn=False, compile=False)
    fused_out = run(model, inputs)
    fused_modules = [m for _, m in attention_modules(model) if hasattr(m, "to_qkv")]
    assert len(fused_modules) == 2
    for module in fused_modules:
        whole, start = module.to_qkv.weight, 0
        for name in ("to_q", "to_k", "to_v"):
            part = getattr(module, name).weight
            rows = slice(start, start + part.shape[0])
            assert type(part) is type(whole) and part.qdata.untyped_storage().data_ptr() == \
                whole.qdata.untyped_storage().data_ptr()  # no second copy of the float8 bytes
            assert torch.equal(part.qdata.view(torch.uint8), whole.qdata[rows].view(torch.uint8))
            assert torch.equal(part.scale, whole.scale[rows])
            start += part.shape[0]
        assert start == whole.shape[0]
    remove_recipe(model)  # unfused: the separate projections run on those slices
    assert not any(hasattr(m, "to_qkv") for m in fused_modules)
    torch.testing.assert_close(run(model, inputs), fused_out, rtol=2e-2, atol=2e-2)


def test_a_torchao_that_cannot_slice_float8_weights_quantizes_the_projections_on_their_own(fp8_on_cpu,
                                                                                            monkeypatch):
    from torchao.quantization import quantize_

    model, _ = _bf16(*BUILDERS["wan_t2v"]())
    probe = torch.nn.Sequential(torch.nn.Linear(32, 32).to(torch.bfloat16))
    quantize_(probe, recipe._fp8_config())

    def refuse(self, index):
        raise NotImplementedError("no slicing here")

    monkeypatch.setattr(type(probe[0].weight), "__getitem__", refuse)
    apply_recipe(model, fsattn=False, compile=False)
    assert _float8_layers(model) == set(WAN_T2V) | {"blocks.0.attn1.to_qkv", "blocks.1.attn1.to_qkv"}
    attn = model.blocks[0].attn1
    assert attn.to_q.weight.qdata.untyped_storage().data_ptr() != attn.to_qkv.weight.qdata.untyped_storage().data_ptr()


def test_applying_again_after_fp8_leaves_cogvideox_unfused_instead_of_failing(fp8_gemms_on_cpu):
    # FP8 is not undone, and diffusers' generic fuse_projections cannot concatenate float8 weights.
    model, inputs = _bf16(*BUILDERS["cogvideox"]())
    apply_recipe(model, fsattn=False, compile=False)
    assert recipe_summary(model)["model"]["fused_modules"] == 2
    first = run(model, inputs)
    apply_recipe(model, fsattn=False, compile=False)
    summary = recipe_summary(model)["model"]
    assert summary["fused_modules"] == 0 and summary["fp8_linear"] == []  # nothing more to quantize
    assert not any(hasattr(m, "to_qkv") for _, m in attention_modules(model))
    assert _float8_layers(model) == set(COGVIDEOX)
    assert cosine(run(model, inputs), first) > 0.9999


def test_fp8_conditioning_quantizes_the_cross_attention_too(fp8_on_cpu):
    model, _ = _bf16(*BUILDERS["wan_t2v"]())
    apply_recipe(model, fsattn=False, compile=False, fp8_conditioning=True)
    cross = {f"blocks.{i}.attn2.{p}" for i in (0, 1) for p in ("to_q", "to_k", "to_v", "to_out.0", "to_kv")}
    fused = {f"blocks.{i}.attn1.to_qkv" for i in (0, 1)}
    assert _float8_layers(model) == set(WAN_T2V) | cross | fused
    assert recipe_summary(model)["model"]["parts"]["fp8_conditioning"] is True


# ----------------------------------------------------------------------------- refusals before any change

def test_fp8_on_the_cpu_is_refused_before_anything_changes():
    model, inputs = _bf16(*BUILDERS["wan_t2v"]())
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"fp8_linear=True cannot run here: the transformer runs on cpu.*"
                                           r"fp8_linear=False"):
        apply_recipe(model)
    _assert_unchanged(model, before)


def test_fp8_needs_bf16_weights(fp8_on_cpu):
    model, _ = BUILDERS["wan_t2v"]()  # float32
    before = _snapshot(model)
    with pytest.raises(TypeError, match=r"needs bfloat16 weights .* model\.blocks\.0\.attn1\.to_q is torch\.float32 "
                                        r"\(14 such layers\)"):
        apply_recipe(model)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("capability, refused", [((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_device_check_names_the_gpu_and_its_capability(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Some GPU")
    reason = recipe.fp8_unavailable_reason("cuda:0")
    if refused:
        assert reason == "Some GPU has compute capability 8.6; float8 GEMMs need 8.9 or newer (Ada, Hopper, Blackwell)"
    else:
        assert reason is None
    assert "runs on cpu" in recipe.fp8_unavailable_reason("cpu")


def test_an_error_midway_puts_everything_back(fp8_on_cpu, monkeypatch):
    model, inputs = _bf16(*BUILDERS["wan_t2v"]())
    reference = run(model, inputs)
    before = _snapshot(model)

    def fail(*args, **kwargs):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(recipe, "_compile", fail)  # after fusion, fsattn and FP8 are in place
    with pytest.raises(RuntimeError, match="compile failed"):
        apply_recipe(model, keep_original_weights=False)
    _assert_unchanged(model, before)
    assert not _float8_layers(model)
    assert torch.equal(run(model, inputs), reference)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fsattn="yes"), TypeError, r"fsattn='yes'; expected True or False"),
    (dict(compile=1), TypeError, r"compile=1; expected True or False"),
    (dict(dynamic="auto"), TypeError, r"dynamic='auto'; expected None .*True or False"),
    (dict(fsattn_options={"skip_block": [0]}), TypeError, r"fsattn_options has \['skip_block'\].*skip_blocks"),
    (dict(fsattn=False, fsattn_options={"strict": True}), ValueError, "with fsattn=False"),
    (dict(compile_options={"fullgraph": False}), ValueError, r"compile_options sets \['fullgraph'\]"),
    (dict(compile=False, compile_options={"backend": "eager"}), ValueError, "with compile=False"),
    (dict(fp8_conditioning=1), TypeError, r"fp8_conditioning=1; expected True or False"),
    (dict(fp8_linear=False, fp8_conditioning=True), ValueError, r"fp8_conditioning=True .* fp8_linear is False"),
    (dict(fp8_linear=False, keep_original_weights=True), ValueError, "fp8_linear is False"),
    (dict(fsattn_options=[("strict", True)]), TypeError, "fsattn_options=.*expected a dict"),
    (dict(fsattn_options={"config": 1}), TypeError, "apply_recipe: fsattn_options: config must be an FSAttnConfig"),
    (dict(fsattn_options={"skip_last_steps": -1}), ValueError, "apply_recipe: fsattn_options: skip_last_steps"),
    (dict(compile_options={"modee": "max-autotune"}), TypeError, r"compile_options has \['modee'\].*torch.compile"),
])
def test_bad_options_name_the_argument_and_change_nothing(kwargs, error, match):
    model, inputs = BUILDERS["wan_t2v"]()
    apply_fsattn(model)  # an earlier patch, which a refused recipe must leave in place
    fsattn_diffusers.reset_stats()
    with pytest.raises(error, match=match):
        apply_recipe(model, **{"fp8_linear": False, **kwargs})  # FP8 would be refused on the CPU first
    run(model, inputs)
    assert emulation_calls() > 0
    with pytest.raises(TypeError, match="apply_recipe: pipe_or_model must be"):
        apply_recipe("pipe")


def test_lora_must_be_fused_into_the_weights_first():
    from peft import LoraConfig

    model, inputs = BUILDERS["wan_t2v"]()
    make_peaky(model)
    plain = run(model, inputs)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"]))
    apply_fsattn(model)
    with_lora = run(model, inputs)
    assert cosine(with_lora, plain) < 0.999  # the adapter matters
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"carries PEFT \(LoRA\) layers.*pipe\.fuse_lora\(\); "
                                         r"pipe\.unload_lora_weights\(\)"):
        apply_recipe(model, fp8_linear=False)
    assert _snapshot(model)["processors"] == before["processors"]
    model.fuse_lora()
    model.unload_lora()
    apply_recipe(model, fp8_linear=False, compile_options=EAGER)  # the supported order: LoRA fused, then the recipe
    assert cosine(run(model, inputs), with_lora) > 0.99999


def test_fp8_after_a_fused_lora_quantizes_the_weights_with_the_adapter(fp8_gemms_on_cpu):
    from peft import LoraConfig

    model, inputs = _bf16(*BUILDERS["wan_t2v"]())
    base = model.blocks[0].attn1.to_q.weight.detach().float().clone()
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v"]))
    model.fuse_lora()
    model.unload_lora()
    fused = model.blocks[0].attn1.to_q.weight.detach().float().clone()
    with_lora = run(model, inputs)
    apply_recipe(model, fuse_qkv=False, compile_options=EAGER)  # the supported order: LoRA fused, then FP8

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    weight = model.blocks[0].attn1.to_q.weight
    assert type(weight).__module__.startswith("torchao.")
    dequantized = weight.dequantize().float()
    assert rel(fused, base) > 0.5  # the adapter moved the weight far beyond FP8's rounding
    assert rel(dequantized, fused) < 0.05 < rel(dequantized, base)
    assert cosine(run(model, inputs), with_lora) > 0.99


# ----------------------------------------------------------------------------- attention, fusion, compilation for real

# One graph per compiled block class, shared by all its blocks (HunyuanVideo: double- and single-stream
# blocks, the token refiner and the patch embedding). CogVideoX's first block gets strided slices of
# the joint sequence and the others whole tensors: the recipe makes them row-major (one graph, not two).
@pytest.mark.parametrize("family, graphs", [("wan_t2v", 1), ("hunyuan_video", 4), ("cogvideox", 1)])
def test_recipe_matches_fsattn_runs_every_call_on_it_and_compiles_without_breaks(family, graphs):
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    apply_fsattn(model)
    eager = run(model, inputs)
    calls = emulation_calls()
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    apply_recipe(model, fp8_linear=False, compile_options=EAGER)
    out = run(model, inputs)
    assert emulation_calls() == 2 * calls  # every call that ran on fsattn before still does, compiled
    assert counters["graph_break"] == {}  # fullgraph=True would have raised anyway
    assert counters["stats"]["unique_graphs"] == graphs
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)  # fused GEMMs: float32 rounding only


def test_hunyuanvideo_single_blocks_share_one_graph_at_batch_one():
    # At batch one the single-stream blocks' inputs are slices of the joint sequence along the
    # token axis: contiguous, but with the batch stride of the whole sequence, on which Dynamo
    # guards. Before they were given row-major strides, blocks 1 and on compiled a second graph.
    from .conftest import build_hunyuan_video

    model, inputs = build_hunyuan_video(layers=2, single_layers=3)
    inputs = {k: v[:1] for k, v in inputs.items()}
    apply_recipe(model, fp8_linear=False, compile_options=EAGER)
    run(model, inputs)
    assert counters["graph_break"] == {}
    assert counters["stats"]["unique_graphs"] == 4  # patch embedding, token refiner, double, single blocks


def test_block_inputs_get_row_major_strides_without_copying_contiguous_ones():
    joint = torch.randn(1, 10, 4)
    video, text = joint[:, :-3], joint[:, -3:]  # contiguous, batch stride 40 instead of 28 / 12
    assert video.is_contiguous() and video.stride() == (40, 4, 1)
    seen = []
    call = recipe._with_contiguous_inputs(lambda *a, **k: seen.append((a, k)))
    broadcast = torch.randn(4).expand(2, 4)
    transposed = torch.randn(4, 5).t()
    call(video, text=text, b=broadcast, t=transposed)
    (out_video,), kw = seen[0]
    assert out_video.stride() == (28, 4, 1) and kw["text"].stride() == (12, 4, 1)
    assert out_video.data_ptr() == video.data_ptr() and kw["text"].data_ptr() == text.data_ptr()  # views
    assert torch.equal(out_video, video) and torch.equal(kw["text"], text)
    assert kw["b"] is broadcast  # every block gets a broadcast alike: left as it is
    assert kw["t"].stride() == (4, 1) and kw["t"].data_ptr() != transposed.data_ptr()
    assert torch.equal(kw["t"], transposed)


def test_fused_projections_share_the_fused_weight():
    model, _ = BUILDERS["wan_t2v"]()
    apply_recipe(model, fsattn=False, fp8_linear=False, compile=False)
    attn = model.blocks[0].attn1
    storage = attn.to_qkv.weight.untyped_storage().data_ptr()
    assert all(getattr(attn, n).weight.untyped_storage().data_ptr() == storage for n in ("to_q", "to_k", "to_v"))
    assert recipe_summary(model)["model"]["fused_modules"] == 4
    hunyuan, _ = BUILDERS["hunyuan_video"]()
    apply_recipe(hunyuan, fsattn=False, fp8_linear=False, compile=False)
    assert not any(hasattr(m, "to_qkv") for _, m in attention_modules(hunyuan))  # nothing fused, nothing allocated


def test_a_model_whose_fusion_diffusers_refuses_keeps_separate_projections():
    # diffusers' fuse_qkv_projections() raises ValueError for models with added KV projections;
    # here it fuses one module before raising, which must be undone too.
    model, inputs = BUILDERS["wan_t2v"]()
    reference = run(model, inputs)

    def refuse():
        model.blocks[0].attn1.fuse_projections()
        raise ValueError("`fuse_qkv_projections()` is not supported for models having added KV projections.")

    model.fuse_qkv_projections = refuse
    apply_recipe(model, fsattn=False, fp8_linear=False, compile=False)
    assert recipe_summary(model)["model"]["fused_modules"] == 0
    assert not any(hasattr(m, "to_qkv") or getattr(m, "fused_projections", False) for _, m in attention_modules(model))
    assert torch.equal(run(model, inputs), reference)


@pytest.mark.parametrize("dynamic, graphs", [(None, 2), (False, 3), (True, 2)])
def test_recompiles_at_new_resolutions_are_bounded_by_dynamic(dynamic, graphs):
    # Three latent sizes: None compiles the first statically and the second with dynamic shapes, which
    # then serves the third; False compiles each; True starts dynamic, and still recompiles once at the
    # second size (a size equal by chance at the first, 8 == 8, got specialised: duck sizing).
    model, inputs = BUILDERS["wan_t2v"]()
    apply_recipe(model, fp8_linear=False, dynamic=dynamic, compile_options=EAGER)
    g = torch.Generator().manual_seed(3)
    for frames, height, width in ((3, 16, 16), (3, 24, 32), (5, 32, 16), (3, 24, 32)):
        run(model, dict(inputs, hidden_states=torch.randn(2, 4, frames, height, width, generator=g)))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("family", ["wan_i2v", "cogvideox", "hunyuan_video"])
def test_remove_recipe_restores_the_model_bit_for_bit(family):
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    reference = run(model, inputs)
    before = _snapshot(model)
    apply_recipe(model, fp8_linear=False, compile_options=EAGER)
    apply_recipe(model, fp8_linear=False, compile_options=EAGER)  # again: replaces, never stacks
    assert cosine(run(model, inputs), reference) > 0.999
    remove_recipe(model)
    remove_recipe(model)  # harmless when nothing is applied
    after = _snapshot(model)
    assert all(after["processors"][k] is v for k, v in before["processors"].items())  # CogVideoX: unfused processors
    assert after["children"].keys() == before["children"].keys() and after["compiled"] == []
    assert recipe_summary(model) == {"model": None}
    assert torch.equal(run(model, inputs), reference)


def test_fp8_recipe_runs_and_is_undone_with_keep_original_weights(fp8_gemms_on_cpu):
    model, inputs = _bf16(*BUILDERS["wan_t2v"]())
    make_peaky(model)
    reference = run(model, inputs)
    apply_fsattn(model)
    fsattn_only = run(model, inputs)
    calls = emulation_calls()
    apply_recipe(model, keep_original_weights=True, compile_options=EAGER)
    out = run(model, inputs)
    assert emulation_calls() == 2 * calls and counters["graph_break"] == {}
    assert counters["stats"]["unique_graphs"] == 1  # the float8 weights are graph inputs of one shared graph
    assert not torch.equal(out, fsattn_only) and cosine(out, fsattn_only) > 0.999
    assert recipe_summary(model)["model"]["fp8_reversible"]
    remove_recipe(model)
    assert not _float8_layers(model)
    assert torch.equal(run(model, inputs), reference)


def test_fp8_without_kept_weights_stays_after_removal(fp8_on_cpu):
    model, inputs = _bf16(*BUILDERS["wan_t2v"]())
    apply_recipe(model, compile_options=EAGER)
    assert not recipe_summary(model)["model"]["fp8_reversible"]
    remove_recipe(model)
    # Unfused again, the separate projections run, quantized like the rest.
    assert _float8_layers(model) == set(WAN_T2V) and not hasattr(model.blocks[0].attn1, "to_qkv")
    assert recipe_summary(model) == {"model": None}
    assert fp8_linear_names(model) == {"model": []}  # nothing left to quantize: applying again keeps them
    apply_recipe(model, compile=False)
    assert _float8_layers(model) == set(WAN_T2V) | {"blocks.0.attn1.to_qkv", "blocks.1.attn1.to_qkv"}


def test_wan22_pipeline_gets_the_recipe_on_both_transformers():
    pipe = build_wan_pipeline(second_transformer=True)
    apply_fsattn(pipe)
    eager = run_wan_pipeline(pipe, steps=2)
    calls = emulation_calls()
    apply_recipe(pipe, fp8_linear=False, compile_options=EAGER)
    summary = recipe_summary(pipe)
    assert set(summary) == {"transformer", "transformer_2"}
    assert all(s["fused_modules"] == 4 and s["compiled_modules"] == 2 for s in summary.values())
    compiled = run_wan_pipeline(pipe, steps=2)
    assert emulation_calls() == 2 * calls
    # One graph per transformer at most: apply_fsattn gives each model its own bound processor
    # classes, and Dynamo guards on the processor's type.
    assert counters["stats"]["unique_graphs"] in (1, 2)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    remove_recipe(pipe)
    assert recipe_summary(pipe) == {"transformer": None, "transformer_2": None}


KEEP_ROUNDINGS = {"emulate_precision_casts": True}


def _eager_backend(gm, example_inputs):
    return gm


@pytest.mark.parametrize("given, expected", [
    (None, {"options": KEEP_ROUNDINGS}),
    ({"backend": None}, {"backend": None, "options": KEEP_ROUNDINGS}),  # torch's default backend: inductor
    ({"options": {"coordinate_descent_tuning": True}}, {"options": {**KEEP_ROUNDINGS, "coordinate_descent_tuning": True}}),
    ({"options": {"emulate_precision_casts": False}}, {"options": {"emulate_precision_casts": False}}),
    ({"options": {"emulate-precision-casts": False}}, {"options": {"emulate_precision_casts": False}}),
    ({"mode": None, "options": {"max_autotune": True}}, {"options": {**KEEP_ROUNDINGS, "max_autotune": True}}),
    ({"mode": "max-autotune-no-cudagraphs"}, "mode"),
    (EAGER, EAGER),  # inductor's options go to inductor only
    ({"backend": _eager_backend}, {"backend": _eager_backend}),
])
def test_compile_options_reach_torch_compile_under_the_recipes_inductor_options(monkeypatch, given, expected):
    if expected == "mode":  # what torch.compile makes of the mode, under the recipe's options
        from torch._inductor import list_mode_options

        expected = {"options": {**KEEP_ROUNDINGS, **list_mode_options(given["mode"], False)}}
        assert expected["options"]["max_autotune"] is True
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    model, _ = BUILDERS["wan_t2v"]()
    apply_recipe(model, fsattn=False, fp8_linear=False, compile_options=given, dynamic=False)
    assert seen == [dict(expected, fullgraph=True, dynamic=False)] * len(model.blocks)
    assert all(a["options"] is not b["options"] for a, b in zip(seen, seen[1:]) if "options" in a)


@pytest.mark.parametrize("options, match", [
    ({"mode": "max-autotune", "options": {"max_autotune": True}}, "both mode and options"),
    ({"mode": "max-autotun"}, "compile_options: .*mode=max-autotun"),
])
def test_compile_options_torch_compile_would_refuse_are_refused_before_anything_changes(options, match):
    model, _ = BUILDERS["wan_t2v"]()
    with pytest.raises(ValueError, match=match):
        apply_recipe(model, fsattn=False, fp8_linear=False, compile_options=options)
    assert recipe_summary(model) == {"model": None}


@pytest.mark.slow
@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.13.0a0",
                    reason="this torch's C++ (CPU) inductor backend ignores emulate_precision_casts: under 2.11 "
                           "and 2.12 the compiled model drifts from eager as far with it as without (its Triton "
                           "backend, which the recipe's GPU runs use, honours it)")
def test_inductor_keeps_eagers_bf16_roundings_under_the_recipe():
    # Inductor (the real backend, on the CPU): without the recipe's options a fused chain of bf16
    # ops stays in float32 and the compiled model drifts from eager (~17x further on this model).
    from fsattn_diffusers import builtin_models

    model = builtin_models.build_transformer("tiny", "cpu", torch.bfloat16, seed=0)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 3, 32, 32, generator=g).bfloat16(),
                  timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 64, model.config.text_dim, generator=g).bfloat16())
    eager = run(model, inputs).double()

    def drift(compile_options):
        torch._dynamo.reset()
        apply_recipe(model, fsattn=False, fuse_qkv=False, fp8_linear=False, compile_options=compile_options)
        out = run(model, inputs).double()
        remove_recipe(model)
        return ((out - eager).norm() / eager.norm()).item()

    kept, fused = drift(None), drift({"options": {"emulate_precision_casts": False}})
    assert kept < fused / 4, (kept, fused)


# ----------------------------------------------------------------------------- context parallelism

def _context_parallel_worker(rank, world_size, init_file, out_file):
    """Ulysses over two CPU ranks (gloo): parallelism enabled first, then the recipe (the supported order)."""
    import os

    os.environ["FSATTN_CPU_PATH"] = "emulation"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fsattn_diffusers import builtin_models

    from .cp_worker import enable_context_parallelism

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        g = torch.Generator().manual_seed(1)
        inputs = dict(hidden_states=torch.randn(1, 16, 3, 16, 16, generator=g), timestep=torch.tensor([700]),
                      encoder_hidden_states=torch.randn(1, 16, 32, generator=g))
        single = apply_fsattn(builtin_models.build_transformer("tiny", "cpu", torch.float32, seed=0))
        reference = run(single, inputs)
        model = builtin_models.build_transformer("tiny", "cpu", torch.float32, seed=0)
        enable_context_parallelism(model, ulysses=2, ring=1)
        apply_recipe(model, fp8_linear=False, compile_options=EAGER)
        fsattn_diffusers.reset_stats()
        out = run(model, inputs)
        result = {"reference": reference, "out": out, "calls": fsattn_diffusers.stats()["calls"],
                  "compiled": [getattr(b, "_compiled_call_impl", None) is not None for b in model.blocks],
                  "graph_breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}
        if rank == 0:
            torch.save(result, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_context_parallelism_then_recipe_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    out_file = str(tmp_path / "result.pt")
    mp.spawn(_context_parallel_worker, args=(2, str(tmp_path / "rendezvous"), out_file), nprocs=2, join=True)
    result = torch.load(out_file)
    # Ulysses moves heads between ranks and changes no attention arithmetic; fusion only GEMM rounding.
    assert cosine(result["out"], result["reference"]) > 0.99999
    assert (result["out"] - result["reference"]).abs().max() <= 1e-5 * result["reference"].abs().max()
    assert result["calls"] == {"emulation": 4}  # this rank's share of the heads, every module on fsattn
    # blocks.0 carries the input-splitting hook that fullgraph cannot trace: it stays eager.
    assert result["compiled"] == [False, True]
    assert result["graph_breaks"] == {} and result["graphs"] == 1
