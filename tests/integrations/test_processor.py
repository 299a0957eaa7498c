"""FSAttnProcessor, the one-liner: per-module binding, keyword pass-through, strict mode, errors."""

from __future__ import annotations

import importlib
import inspect
import logging
import pkgutil

import pytest
import torch
import torch.nn.functional as F

import fsattn_diffusers
from fsattn_diffusers import FSAttnProcessor, UnsupportedInputError, apply_fsattn, remove_fsattn
from fsattn_diffusers.families import PROCESSOR_KEYWORDS, attention_modules

from .conftest import BUILDERS, cosine, emulation_calls, make_peaky, run

ONE_LINER_FAMILIES = ["wan_t2v", "wan_i2v", "hunyuan_video", "cogvideox", "ltx_video"]  # Mochi has no set_attn_processor


@pytest.mark.parametrize("family", ONE_LINER_FAMILIES)
def test_one_liner_gives_exactly_what_apply_fsattn_gives(family):
    # apply_fsattn binds each module's own processor object, so it sees every keyword; the
    # one-liner must reach the same processors with the same keywords (image_rotary_emb, masks).
    model, inputs = BUILDERS[family]()
    make_peaky(model)
    apply_fsattn(model)
    patched = run(model, inputs)
    calls = emulation_calls()
    remove_fsattn(model)

    model.set_attn_processor(FSAttnProcessor())
    assert torch.equal(run(model, inputs), patched)
    assert emulation_calls() == 2 * calls


def test_one_liner_as_a_dict_of_processors():
    model, inputs = BUILDERS["hunyuan_video"]()
    make_peaky(model)
    apply_fsattn(model)
    patched = run(model, inputs)
    remove_fsattn(model)
    model.set_attn_processor({name: FSAttnProcessor() for name in model.attn_processors})
    assert torch.equal(run(model, inputs), patched)


def test_remove_fsattn_undoes_the_one_liner():
    model, inputs = BUILDERS["hunyuan_video"]()
    reference = run(model, inputs)
    model.set_attn_processor(FSAttnProcessor())
    assert not torch.equal(run(model, inputs), reference)
    remove_fsattn(model)
    assert not any(isinstance(p, FSAttnProcessor) for p in model.attn_processors.values())
    assert torch.equal(run(model, inputs), reference)


def _all_processor_classes():
    import diffusers.models.attention_processor as processors
    import diffusers.models.transformers as transformers
    from diffusers.models.attention import AttentionModuleMixin

    for info in pkgutil.iter_modules(transformers.__path__):
        try:
            importlib.import_module(f"{transformers.__name__}.{info.name}")
        except Exception:  # a model whose optional dependency is missing here
            continue
    classes = {cls for name, cls in vars(processors).items() if inspect.isclass(cls) and "Processor" in name}
    pending = [AttentionModuleMixin]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if getattr(cls, "_default_processor_cls", None) is not None:
            classes.add(cls._default_processor_cls)
    return classes


def test_signature_names_every_keyword_any_diffusers_processor_takes():
    # Attention.forward (and ~20 module classes like it) drops keywords the processor does not name.
    named = set(inspect.signature(FSAttnProcessor().__call__).parameters)
    missing = {}
    for cls in _all_processor_classes():
        try:
            params = list(inspect.signature(cls.__call__).parameters.values())[3:]  # self, attn, hidden_states
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in named:
                missing.setdefault(p.name, cls.__qualname__)
    assert not missing, f"add these to families.PROCESSOR_KEYWORDS: {missing}"
    assert len(set(PROCESSOR_KEYWORDS)) == len(PROCESSOR_KEYWORDS)


def test_strict_raises_on_a_call_fsattn_cannot_take():
    # HunyuanVideo's token refiner masks text tokens pairwise: a mask that varies over queries.
    model, inputs = BUILDERS["hunyuan_video"]()
    model.set_attn_processor(FSAttnProcessor(strict=True))
    with pytest.raises(UnsupportedInputError, match="AttnProcessor2_0.*strict=True") as err:
        run(model, inputs)
    assert err.value.reason == "general_mask"
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {}


def test_logs_once_per_kind_of_attention_which_backend_it_ran_on(caplog):
    model, inputs = BUILDERS["hunyuan_video"]()
    model.set_attn_processor(FSAttnProcessor())
    with caplog.at_level(logging.INFO, logger="fsattn_diffusers"):
        run(model, inputs)
        run(model, inputs)
    lines = [r.getMessage() for r in caplog.records if r.name == "fsattn_diffusers"]
    assert lines == [
        "fsattn: Attention attention (AttnProcessor2_0) runs on SDPA instead of fsattn (reason: general_mask): "
        "attn_mask of shape (2, 2, 24, 24) has a row per head or per query; fsattn takes key-padding masks "
        "broadcastable to (B, 1, 1, Sk) (it does not read a mask to find out whether its rows agree)",
        "fsattn: Attention attention (HunyuanVideoAttnProcessor2_0) runs on fsattn",
    ]
    assert fsattn_diffusers.stats()["sdpa_fallbacks"] == {"general_mask": 2}  # counted per call


class _OwnSDPAProcessor:
    """A third-party processor: plain SDPA over Attention's projections."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, extra_scale=1.0):
        b = hidden_states.shape[0]
        q, k, v = (proj(hidden_states).view(b, -1, attn.heads, 16).transpose(1, 2)
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        out = F.scaled_dot_product_attention(q, k, v) * extra_scale
        return attn.to_out[0](out.transpose(1, 2).flatten(2))


class _NoAttentionCallProcessor(_OwnSDPAProcessor):
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, extra_scale=1.0):
        return attn.to_out[0](attn.to_v(hidden_states))


def _unknown_family_model(processor):
    from diffusers import ModelMixin
    from diffusers.models.attention_processor import Attention

    class UnknownVideoModel(ModelMixin):
        def __init__(self):
            super().__init__()
            self.attn = Attention(query_dim=32, heads=2, dim_head=16, processor=processor)

        def forward(self, x):
            return self.attn(x, extra_scale=2.0)

    torch.manual_seed(0)
    return UnknownVideoModel().eval()


def test_unknown_family_with_generic_attention_needs_apply_fsattn():
    model = _unknown_family_model(_OwnSDPAProcessor())
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        reference = model(x)
        apply_fsattn(model)  # sees the module's own processor and keeps its extra keyword
        patched = model(x)
        assert emulation_calls() == 1
        assert torch.nn.functional.cosine_similarity(patched.flatten(), reference.flatten(), dim=0) > 0.999
        remove_fsattn(model)
        model.attn.set_processor(FSAttnProcessor())
        with pytest.raises(RuntimeError, match="families table.*apply_fsattn"):
            model(x)


def test_generic_attention_called_outside_a_model_is_refused():
    from diffusers.models.attention_processor import Attention

    attn = Attention(query_dim=32, heads=2, dim_head=16, processor=FSAttnProcessor())
    with pytest.raises(RuntimeError, match="outside a diffusers model's forward"):
        attn(torch.randn(1, 4, 32))


def test_processor_without_a_visible_attention_call_is_kept_or_refused(caplog):
    model = _unknown_family_model(_NoAttentionCallProcessor())
    with caplog.at_level(logging.INFO, logger="fsattn_diffusers"):
        apply_fsattn(model)
    assert type(model.attn.processor) is _NoAttentionCallProcessor
    assert any("processor not swappable" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="strict=True forbids"):
        apply_fsattn(model, strict=True)


def test_bound_processor_keeps_class_state_and_signature():
    model, _ = BUILDERS["wan_t2v"]()
    original = model.blocks[0].attn1.processor
    original.custom_state = "kept"
    apply_fsattn(model)
    bound = model.blocks[0].attn1.processor
    assert isinstance(bound, type(original)) and bound is not original
    assert bound.custom_state == "kept"
    assert inspect.signature(bound.__call__) == inspect.signature(original.__call__)
    assert type(bound).fsattn_own_class is type(original)


def test_constructor_rejects_bad_arguments():
    with pytest.raises(TypeError, match="config must be an FSAttnConfig"):
        FSAttnProcessor(config="int8")
    with pytest.raises(TypeError, match="strict must be a bool"):
        FSAttnProcessor(strict=1)


def test_generic_attention_modules_bind_to_the_processor_their_block_installs():
    from fsattn_diffusers.processor import OWN_PROCESSOR_ATTR

    model, inputs = BUILDERS["hunyuan_video"]()
    originals = {path: type(module.processor) for path, module in attention_modules(model)}
    model.set_attn_processor(FSAttnProcessor())
    run(model, inputs)
    recorded = {path: getattr(module, OWN_PROCESSOR_ATTR) for path, module in attention_modules(model)}
    assert {path: own for path, (own, _) in recorded.items()} == originals
    assert {own.__name__ for own, _ in recorded.values()} == {"AttnProcessor2_0", "HunyuanVideoAttnProcessor2_0"}
    assert all(fused is None for _, fused in recorded.values())  # HunyuanVideo's own processors fuse nothing


def test_generic_modules_fused_before_the_one_liner_run_the_fused_processor_on_fsattn():
    # CogVideoX's fuse_qkv_projections() installs FusedCogVideoXAttnProcessor2_0: the one-liner must
    # run that one (one QKV GEMM), not the unfused processor, and still on fsattn.
    model, inputs = BUILDERS["cogvideox"]()
    reference = run(model, inputs)
    model.fuse_qkv_projections()
    model.set_attn_processor(FSAttnProcessor())
    attn = model.transformer_blocks[0].attn1
    projections = {"to_qkv": 0, "to_q": 0}
    for name in projections:
        getattr(attn, name).register_forward_hook(lambda *_, name=name: projections.__setitem__(name, projections[name] + 1))
    calls = emulation_calls()
    out = run(model, inputs)
    assert emulation_calls() > calls
    assert projections == {"to_qkv": 1, "to_q": 0}
    assert cosine(out, reference) > 0.999
