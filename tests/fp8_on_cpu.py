"""torchao's float8 linear layers on the CPU, for tests of the FP8 recipe without a GPU.

torchao refuses a CPU (and so does the recipe's own check); with both checks lifted, torch's CPU
``_scaled_mm`` computes the same float8 GEMMs, emulated, so the FP8 path runs for real at CPU
speed. That needs a torch whose CPU ``_scaled_mm`` takes per-row scales (torchao's ``PerRow``):
torch 2.11's takes one scale per tensor only, and there these tests skip.
"""

import functools

import pytest
import torch

from fsattn_diffusers import recipe


@functools.cache
def cpu_scaled_mm_problem() -> str | None:
    """Why this torch's CPU ``_scaled_mm`` cannot stand in for per-row float8 GEMMs, or None."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        out = torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:
        return f"torch {torch.__version__}'s CPU _scaled_mm takes one scale per tensor only ({type(err).__name__})"
    if not torch.equal(out.float(), torch.full((2, 16), 16.0)):
        return f"torch {torch.__version__}'s CPU _scaled_mm gives wrong per-row products"
    return None


def lift_fp8_hardware_checks(monkeypatch) -> None:
    """Let torchao's float8 layers and the recipe run on the CPU, or skip the calling test with the reason."""
    inference = pytest.importorskip("torchao.float8.inference")
    if not hasattr(inference, "is_MI300"):
        pytest.skip("this torchao checks FP8 hardware some other way; the CPU stand-in does not apply")
    problem = cpu_scaled_mm_problem()
    if problem is not None:
        pytest.skip(problem)
    monkeypatch.setattr(inference, "is_MI300", lambda: True)
    monkeypatch.setattr(recipe, "fp8_unavailable_reason", lambda device: None)
