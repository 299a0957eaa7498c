"""fsattn-diffusers: fused-softmax 8-bit attention for video diffusion transformers.

    from fsattn_diffusers import FSAttnProcessor, apply_fsattn, fsattn
    pipe.transformer.set_attn_processor(FSAttnProcessor())   # or: apply_fsattn(pipe)
"""

from .attention import UnsupportedInputError, fsattn
from .config import DEFAULT_CONFIG, FSAttnConfig
from .stats import reset_stats, stats

__version__ = "0.1.0"

# The diffusers integration is imported on first use, so that `import fsattn_diffusers` stays
# light and the op works where diffusers is absent.
_LAZY = {
    "FSAttnProcessor": "processor",
    "apply_fsattn": "patch",
    "remove_fsattn": "patch",
    "register_fsattn_backend": "diffusers_backend",
    "apply_recipe": "recipe",
    "remove_recipe": "recipe",
    "recipe_summary": "recipe",
    "fp8_linear_names": "recipe",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_CONFIG",
    "FSAttnConfig",
    "FSAttnProcessor",
    "UnsupportedInputError",
    "apply_fsattn",
    "apply_recipe",
    "fp8_linear_names",
    "fsattn",
    "recipe_summary",
    "register_fsattn_backend",
    "remove_fsattn",
    "remove_recipe",
    "reset_stats",
    "stats",
]
