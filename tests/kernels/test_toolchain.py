"""fsattn_diffusers/kernels/toolchain.py: which ptxas builds the kernels for sm_90.

CPU only. The rule is checked on stand-in tools; the knob's scope on the installed Triton's own
binaries (the compile tests, tests/kernels/test_compile_matrix.py, build through it for sm_90a).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from fsattn_diffusers.kernels import toolchain

BLACKWELL = SimpleNamespace(path="/t/bin/ptxas-blackwell", version="13.4")
CUDA12 = SimpleNamespace(path="/t/bin/ptxas", version="12.9")


def _ptx(version):
    major, minor = map(int, version.split("."))
    return 80 + minor - 1 if major == 12 else 90 + minor


def test_a_release_that_builds_sm90_with_its_blackwell_ptxas_gets_its_cuda12_one():
    assert toolchain.choose(None, BLACKWELL, CUDA12, _ptx) == ("/t/bin/ptxas", 88)


@pytest.mark.parametrize("user_path,chosen,cuda12", [
    ("/opt/cuda/bin/ptxas", BLACKWELL, CUDA12),  # the user chose: their choice stands
    (None, CUDA12, CUDA12),  # Triton 3.6-3.8 already build sm_90 with their CUDA 12 ptxas
    (None, BLACKWELL, SimpleNamespace(path="/t/bin/ptxas", version="13.0")),  # not the version measured
])
def test_otherwise_tritons_choice_stands(user_path, chosen, cuda12):
    assert toolchain.choose(user_path, chosen, cuda12, _ptx) is None


def test_the_knob_points_at_the_chosen_ptxas_inside_the_block_only(monkeypatch):
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.nvidia, "scope"):
        pytest.skip(f"Triton {triton.__version__} has no knobs scope (the rule never applies there)")
    try:
        blackwell, cuda12 = knobs.nvidia.ptxas_blackwell.path, knobs.nvidia.ptxas.path
    except RuntimeError as exc:
        pytest.skip(f"this Triton wheel lacks a ptxas: {exc}")
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_compiles_for_sm90", lambda: True)
    monkeypatch.setattr(toolchain, "cuda12_ptxas_for_sm90", lambda: (cuda12, 88))
    with toolchain.sm90_ptxas() as options:
        assert options == {"ptx_version": 88}
        assert knobs.nvidia.ptxas_blackwell.path == cuda12
    assert knobs.nvidia.ptxas_blackwell.path == blackwell
    assert "TRITON_PTXAS_BLACKWELL_PATH" not in os.environ


def test_nothing_changes_where_nothing_compiles_for_sm90(monkeypatch):
    monkeypatch.setattr(toolchain, "cuda12_ptxas_for_sm90", lambda: ("/t/bin/ptxas", 88))
    monkeypatch.setattr(toolchain, "_compiles_for_sm90", lambda: False)
    with toolchain.sm90_ptxas() as options:
        assert options == {}


def test_the_interpreter_compiles_nothing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert toolchain._compiles_for_sm90() is False
