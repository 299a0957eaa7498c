"""What fsattn needs to know about each family of video transformers in diffusers, in one table.

Everything model-specific that the integration relies on lives here: which attributes of a
transformer hold its blocks (for ``skip_blocks``), which attention modules are cross-attention
(for ``self_attention_only``), and which processor a module built from diffusers' generic
``Attention`` class runs (``FSAttnProcessor`` must delegate to it, but the one-liner
``set_attn_processor(FSAttnProcessor())`` has replaced it before fsattn ever sees it).

Classes are named by strings and imported on use, so this module imports nothing from diffusers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# Keyword arguments that diffusers' attention modules pass to their processors. Many modules
# (``Attention.forward``, ``LTXAttention.forward``, ...) drop every keyword that the processor's
# ``__call__`` signature does not name, so ``FSAttnProcessor.__call__`` must name each of them:
# a missing name would silently lose, say, ``image_rotary_emb``. tests/integrations checks that
# this list covers every processor of the installed diffusers.
PROCESSOR_KEYWORDS = (
    "encoder_hidden_states", "attention_mask", "image_rotary_emb", "temb", "rotary_emb",
    "query_rotary_emb", "key_rotary_emb", "rotary_emb_kv", "reference_rotary_emb", "freqs_cis", "rope",
    "rope_stride", "reference_rope_stride", "grid_sizes", "reference_grid_sizes", "scale",
    "ip_adapter_masks", "ip_hidden_states", "encoder_attention_mask", "attn_mask", "mask", "block_mask", "key_valid",
    "context", "context_mask", "kv_cache", "kv_cache_mode", "kv_cache_flag", "layer_cache",
    "cache_write_slice", "sparse_params", "segments", "pairs", "gen_seq", "base_sequence_length",
    "original_context_length", "image_embed_seq_len", "origin_latent_frames", "origin_latent_hw",
)

# Where attention blocks live when a transformer is not in the table (first match wins).
_COMMON_BLOCK_LISTS = (("transformer_blocks", "single_transformer_blocks"), ("blocks",), ("layers",))


@dataclass(frozen=True)
class Family:
    """How one family of transformers is laid out.

    Attributes
    ----------
    name : str
    model_classes : tuple of str
        Class names of the transformers (``type(model).__name__``) in this family.
    block_lists : tuple of str
        Attributes holding the ``nn.ModuleList`` s of blocks, in the order the forward runs them;
        ``skip_blocks`` counts through them in this order.
    cross_attention : tuple of str
        Attribute names, inside a block, of the attention modules that attend to text or image
        conditioning (``self_attention_only`` leaves these alone). Empty for joint attention.
    generic_processors : tuple of (str, str)
        For modules of diffusers' generic ``Attention``/``MochiAttention`` classes, which carry no
        default processor of their own: ``(module path prefix, "module:Class")`` pairs; the
        longest matching prefix wins.
    fused_processors : tuple of (str, str)
        ``("module:Class", "module:FusedClass")``: the processor the model's
        ``fuse_qkv_projections()`` installs in place of a generic module's own processor.
    has_set_attn_processor : bool
        Whether the model has ``set_attn_processor`` (Mochi's has not).
    """

    name: str
    model_classes: tuple[str, ...]
    block_lists: tuple[str, ...]
    cross_attention: tuple[str, ...] = ()
    generic_processors: tuple[tuple[str, str], ...] = ()
    fused_processors: tuple[tuple[str, str], ...] = ()
    has_set_attn_processor: bool = True


_AP = "diffusers.models.attention_processor"

FAMILIES = (
    Family("wan", ("WanTransformer3DModel",), ("blocks",), cross_attention=("attn2",)),
    # VACE runs its control blocks first, then the main blocks (adding the control hints).
    Family("wan_vace", ("WanVACETransformer3DModel",), ("vace_blocks", "blocks"), cross_attention=("attn2",)),
    Family(
        "hunyuan_video",
        ("HunyuanVideoTransformer3DModel", "HunyuanVideoFramepackTransformer3DModel"),
        ("transformer_blocks", "single_transformer_blocks"),
        # The joint (double- and single-stream) blocks run HunyuanVideo's processor; the text token
        # refiner inside context_embedder builds plain Attention modules, whose default is AttnProcessor2_0.
        generic_processors=(
            ("", "diffusers.models.transformers.transformer_hunyuan_video:HunyuanVideoAttnProcessor2_0"),
            ("context_embedder.", f"{_AP}:AttnProcessor2_0"),
        ),
    ),
    Family(
        "cogvideox", ("CogVideoXTransformer3DModel",), ("transformer_blocks",),
        generic_processors=(("", f"{_AP}:CogVideoXAttnProcessor2_0"),),
        fused_processors=((f"{_AP}:CogVideoXAttnProcessor2_0", f"{_AP}:FusedCogVideoXAttnProcessor2_0"),),
    ),
    Family("ltx_video", ("LTXVideoTransformer3DModel",), ("transformer_blocks",), cross_attention=("attn2",)),
    Family(
        "mochi", ("MochiTransformer3DModel",), ("transformer_blocks",),
        generic_processors=(("", f"{_AP}:MochiAttnProcessor2_0"),), has_set_attn_processor=False,
    ),
)


def family_of(model) -> Family | None:
    """The family of a transformer instance, or None for one not in the table."""
    names = {cls.__name__ for cls in type(model).__mro__}
    for family in FAMILIES:
        if names.intersection(family.model_classes):
            return family
    return None


def is_attention_module(module) -> bool:
    """Whether `module` is a diffusers attention module that runs a processor."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    return isinstance(module, (Attention, MochiAttention, AttentionModuleMixin))


def attention_modules(model):
    """``(path, module)`` for every attention module of `model`, in ``named_modules`` order."""
    return [(name, module) for name, module in model.named_modules() if is_attention_module(module)]


def block_lists(model) -> list[tuple[str, object]]:
    """``(attribute, ModuleList)`` of the blocks of `model`, in the order its forward runs them."""
    family = family_of(model)
    candidates = (family.block_lists,) if family is not None else _COMMON_BLOCK_LISTS
    for names in candidates:
        found = [(name, getattr(model, name)) for name in names if getattr(model, name, None) is not None]
        if found:
            return found
    return []


def block_index_of(path: str, model) -> int | None:
    """Index of the block that holds the module at `path`, counted across all block lists."""
    offset = 0
    for name, blocks in block_lists(model):
        prefix = name + "."
        if path.startswith(prefix):
            return offset + int(path[len(prefix):].split(".", 1)[0])
        offset += len(blocks)
    return None


def count_blocks(model) -> int:
    return sum(len(blocks) for _, blocks in block_lists(model))


def is_cross_attention(path: str, module, model) -> bool:
    """Whether the attention module at `path` attends to conditioning (text, image) rather than itself."""
    family = family_of(model)
    if family is not None:
        return path.rsplit(".", 1)[-1] in family.cross_attention
    # Outside the table, trust the module's own flag (diffusers' Attention and WanAttention set it).
    return bool(getattr(module, "is_cross_attention", False))


# Layers of joint attention that carry only the conditioning (text) tokens: the added
# projections and the context feed-forward (diffusers names them so in every family).
_CONDITIONING_LINEARS = ("add_q_proj", "add_k_proj", "add_v_proj", "to_added_qkv", "to_added_kv", "to_add_out")
_CONDITIONING_SUBMODULES = ("ff_context",)
# A cross-attention's projection of the video tokens into queries (diffusers' name in every family).
_CROSS_QUERY_LINEARS = ("to_q",)


def carries_conditioning(path: str, model) -> bool:
    """Whether the layer at `path` (inside a block) is on the conditioning's path into the video tokens.

    True for the layers of a cross-attention module (:func:`is_cross_attention`) that the
    conditioning passes through: its K and V projections (fused or not, and Wan I2V's image
    projections; a ``to_qkv`` fused across Q, K and V counts as K and V) and its output
    projection; for joint attention's added projections (``add_q_proj``, ..., ``to_add_out``)
    and for anything under ``ff_context``. In
    cross-attention models (Wan, LTX-Video) the prompt reaches the video tokens only through the
    former, so the error made there is what classifier-free guidance multiplies. Not included:
    a cross-attention's query projection (``to_q``: it projects the video tokens, before any
    conditioning is mixed in), and the layers that joint attention shares between text and
    video tokens (CogVideoX's, HunyuanVideo's single-stream blocks, the video side's own
    projections).
    """
    parts = path.split(".")
    if parts[-1] in _CONDITIONING_LINEARS or any(p in _CONDITIONING_SUBMODULES for p in parts[:-1]):
        return True
    for end in range(len(parts) - 1, 0, -1):
        ancestor = ".".join(parts[:end])
        module = model.get_submodule(ancestor)
        if is_attention_module(module):
            # parts[end]: the attention's own child, so that a wrapped layer (an unfused LoRA's
            # ``to_q.base_layer``) is told apart like the plain one.
            return is_cross_attention(ancestor, module, model) and parts[end] not in _CROSS_QUERY_LINEARS
    return False


def own_processor_class(path: str, module, model):
    """The processor class that diffusers' own code gives the attention module at `path`.

    Modules built on ``AttentionModuleMixin`` name it themselves (``_default_processor_cls``); for
    the generic classes the family table says which processor the model's blocks install.
    Returns None when neither knows.
    """
    default = getattr(type(module), "_default_processor_cls", None)
    if default is not None:
        return default
    family = family_of(model)
    if family is None:
        return None
    best = None
    for prefix, target in family.generic_processors:
        if path.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, target)
    return None if best is None else load_class(best[1])


def generic_processor_classes() -> list[type]:
    """Every processor class the table gives generic attention modules, fused variants included."""
    targets = [t for f in FAMILIES for _, t in f.generic_processors]
    targets += [t for f in FAMILIES for pair in f.fused_processors for t in pair]
    return [load_class(t) for t in dict.fromkeys(targets)]


def fused_processor_class(own_cls, model):
    """The processor that `model`'s ``fuse_qkv_projections()`` installs instead of `own_cls`, or None."""
    family = family_of(model)
    for plain, fused in family.fused_processors if family is not None else ():
        if load_class(plain) is own_cls:
            return load_class(fused)
    return None


def load_class(target: str):
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
