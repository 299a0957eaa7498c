"""Tests that hand CPU tensors to the real kernels need Triton's interpreter, which tests/conftest.py
turns on only where there is no GPU: on a GPU machine the kernels are compiled, and a CPU tensor
cannot reach them ("cannot be accessed from Triton (cpu tensor?)")."""

import pytest

from fsattn_diffusers.kernels.lowp import IN_INTERPRETER

REASON = "hands CPU tensors to the kernels through Triton's interpreter, which is off where a GPU is (tests/conftest.py)"
requires_interpreter = pytest.mark.skipif(not IN_INTERPRETER, reason=REASON)


def skip_without_interpreter():
    """Skip the calling test where Triton's interpreter is off."""
    if not IN_INTERPRETER:
        pytest.skip(REASON)
