"""torchao's float8 linear layers on the CPU, for tests of the FP8 recipe without a GPU.

torchao refuses a CPU (and so does the recipe's own check); with both checks lifted, torch's CPU
``_scaled_mm`` computes the same float8 GEMMs, emulated, so the FP8 path runs for real at CPU
speed. The GEMMs need a torch whose CPU ``_scaled_mm`` takes per-row scales (torchao's
``PerRow``): torch 2.11's takes one scale per tensor only, and there the tests that multiply skip
(those that only quantize still run).
"""

import functools

import pytest
import torch

from fsattn_diffusers import recipe


@functools.cache
def cpu_scaled_mm_problem() -> str | None:
    """Why this torch's CPU ``_scaled_mm`` cannot stand in for per-row float8 GEMMs, or None."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 3).t().contiguous().t().to(torch.float8_e4m3fn)
    row_scales, column_scales = torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0, 0.5, 4.0]])
    try:
        out = torch._scaled_mm(a, b, scale_a=row_scales, scale_b=column_scales, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "per-tensor" in first_line:
            return f"torch {torch.__version__}'s CPU _scaled_mm takes one scale per tensor only"
        return f"torch {torch.__version__}'s CPU _scaled_mm fails on per-row scales: {first_line[:160]}"
    if not torch.equal(out, 16.0 * row_scales * column_scales):
        return f"torch {torch.__version__}'s CPU _scaled_mm applies per-row scales wrongly"
    return None


def lift_fp8_hardware_checks(monkeypatch, runs_gemms: bool = False) -> None:
    """Let torchao's float8 layers and the recipe run on the CPU, or skip the calling test with the
    reason; `runs_gemms`: the test multiplies with them (and skips where the CPU cannot)."""
    inference = pytest.importorskip("torchao.float8.inference")
    if not hasattr(inference, "is_MI300"):
        pytest.skip("this torchao checks FP8 hardware some other way; the CPU stand-in does not apply")
    problem = cpu_scaled_mm_problem() if runs_gemms else None
    if problem is not None:
        pytest.skip(problem)
    monkeypatch.setattr(inference, "is_MI300", lambda: True)
    monkeypatch.setattr(recipe, "fp8_unavailable_reason", lambda device: None)
