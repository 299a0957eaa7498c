"""fsattn_diffusers/kernels/toolchain.py: which ptxas builds the kernels for sm_90.

CPU only. The rule is checked on stand-in tools; what it decides for the installed Triton, and the
knob's scope, on that Triton's own binaries (the compile tests, tests/kernels/test_compile_matrix.py,
build through it for sm_90a).
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from fsattn_diffusers.kernels import toolchain

BLACKWELL = SimpleNamespace(path="/t/bin/ptxas-blackwell", version="13.4")
CUDA12 = SimpleNamespace(path="/t/bin/ptxas", version="12.9")


def _ptx(version):
    major, minor = map(int, version.split("."))
    return 80 + minor - 1 if major == 12 else 90 + minor


def _triton_knobs():
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.nvidia, "scope"):
        pytest.skip(f"Triton {triton.__version__} has no knobs scope (the rule never applies there)")
    return triton, knobs


def test_a_release_that_builds_sm90_with_its_blackwell_ptxas_gets_its_cuda12_one():
    assert toolchain.choose(BLACKWELL, CUDA12, _ptx) == ("/t/bin/ptxas", 88)
    cuda128 = SimpleNamespace(path="/t/bin/ptxas", version="12.8")
    assert toolchain.choose(BLACKWELL, cuda128, _ptx) == ("/t/bin/ptxas", 87)


@pytest.mark.parametrize("chosen,cuda12", [
    (CUDA12, CUDA12),  # Triton 3.6-3.8 already build sm_90 with their CUDA 12 ptxas
    (BLACKWELL, SimpleNamespace(path="/t/bin/ptxas", version="13.0")),  # not a version measured
    (BLACKWELL, SimpleNamespace(path="/opt/cuda-12.4/bin/ptxas", version="12.4")),  # TRITON_PTXAS_PATH, older
    (BLACKWELL, SimpleNamespace(path="/t/bin/ptxas", version="unknown")),
])
def test_otherwise_tritons_choice_stands(chosen, cuda12):
    assert toolchain.choose(chosen, cuda12, _ptx) is None


def test_the_users_choice_stands_even_when_made_after_the_first_compile(monkeypatch):
    _, knobs = _triton_knobs()
    monkeypatch.setattr(toolchain, "tritons_cuda12_ptxas_for_sm90", lambda: ("/t/bin/ptxas", 88))
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    assert toolchain.cuda12_ptxas_for_sm90() == ("/t/bin/ptxas", 88)
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/opt/cuda/bin/ptxas")
    assert toolchain.cuda12_ptxas_for_sm90() is None
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH")
    monkeypatch.setitem(vars(knobs.nvidia), "ptxas_blackwell", "/opt/cuda/bin/ptxas")  # set in code
    assert toolchain.cuda12_ptxas_for_sm90() is None


def test_a_release_without_the_pieces_leaves_tritons_choice(monkeypatch):
    def missing():
        raise AttributeError("module 'triton.backends.nvidia.compiler' has no attribute 'get_ptxas'")

    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    monkeypatch.setattr(toolchain, "tritons_cuda12_ptxas_for_sm90", missing)
    assert toolchain.cuda12_ptxas_for_sm90() is None


def test_what_the_rule_decides_for_the_installed_triton(monkeypatch):
    # 3.9.0 builds sm_90 with its CUDA 13 ptxas and carries CUDA 12.9's (PTX 8.8): the rule swaps;
    # 3.6-3.8 build sm_90 with their CUDA 12 ptxas already: nothing to do.
    triton, knobs = _triton_knobs()
    for name in ("TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH"):
        monkeypatch.delenv(name, raising=False)
    release = tuple(int(part) for part in triton.__version__.split(".")[:2])
    try:
        cuda12 = knobs.nvidia.ptxas.path
        decided = toolchain.tritons_cuda12_ptxas_for_sm90.__wrapped__()
    except RuntimeError as exc:
        pytest.skip(f"this Triton wheel lacks a ptxas: {exc}")
    if release <= (3, 8):
        assert decided is None
    elif release == (3, 9):
        from triton.backends.nvidia import compiler

        assert os.path.basename(compiler.get_ptxas(90).path) == "ptxas-blackwell"  # Triton's own choice
        assert decided == (cuda12, 88) and os.path.basename(decided[0]) == "ptxas"
        assert decided[0] != knobs.nvidia.ptxas_blackwell.path
    else:  # a newer release: whatever it chose, never a ptxas outside the measured CUDA 12 range
        assert decided is None or (decided[0] == cuda12 and 87 <= decided[1] < 90)


def test_the_knob_points_at_the_chosen_ptxas_inside_the_block_only(monkeypatch):
    _, knobs = _triton_knobs()
    try:
        blackwell, cuda12 = knobs.nvidia.ptxas_blackwell.path, knobs.nvidia.ptxas.path
    except RuntimeError as exc:
        pytest.skip(f"this Triton wheel lacks a ptxas: {exc}")
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_compiles_for_sm90", lambda: True)
    monkeypatch.setattr(toolchain, "tritons_cuda12_ptxas_for_sm90", lambda: (cuda12, 88))
    with toolchain.building_with_sm90_ptxas() as options:
        assert options == {"ptx_version": 88}
        assert knobs.nvidia.ptxas_blackwell.path == cuda12
        assert "TRITON_PTXAS_BLACKWELL_PATH" not in os.environ  # no subprocess inherits it
        with toolchain.building_with_sm90_ptxas() as inner:  # a launch inside a launch's block
            assert inner == {"ptx_version": 88} and knobs.nvidia.ptxas_blackwell.path == cuda12
        assert knobs.nvidia.ptxas_blackwell.path == cuda12
    assert knobs.nvidia.ptxas_blackwell.path == blackwell
    assert "ptxas_blackwell" not in vars(knobs.nvidia) and "TRITON_PTXAS_BLACKWELL_PATH" not in os.environ


def test_two_threads_compiling_at_once_leave_the_knob_as_they_found_it(monkeypatch):
    # Each block restores what it found on entry: interleaved, the second would find the first's
    # setting and put it back after both. The blocks take turns instead.
    _, knobs = _triton_knobs()
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    monkeypatch.setattr(toolchain, "_compiles_for_sm90", lambda: True)
    monkeypatch.setattr(toolchain, "tritons_cuda12_ptxas_for_sm90", lambda: ("/t/bin/ptxas", 88))
    events, first_inside = [], threading.Event()

    def compile_in_block(name, hold):
        with toolchain.building_with_sm90_ptxas() as options:
            events.append((name, "in", options))
            first_inside.set()
            time.sleep(hold)
            events.append((name, "out"))

    first = threading.Thread(target=compile_in_block, args=("first", 0.3))
    first.start()
    first_inside.wait(5)
    second = threading.Thread(target=compile_in_block, args=("second", 0.0))
    second.start()
    first.join(5)
    second.join(5)
    assert [e[:2] for e in events] == [("first", "in"), ("first", "out"), ("second", "in"), ("second", "out")]
    assert events[2][2] == {"ptx_version": 88}  # the second block still found no choice of the user's
    assert "ptxas_blackwell" not in vars(knobs.nvidia) and "TRITON_PTXAS_BLACKWELL_PATH" not in os.environ


def test_nothing_changes_where_nothing_compiles_for_sm90(monkeypatch):
    monkeypatch.setattr(toolchain, "tritons_cuda12_ptxas_for_sm90", lambda: ("/t/bin/ptxas", 88))
    monkeypatch.setattr(toolchain, "_compiles_for_sm90", lambda: False)
    with toolchain.building_with_sm90_ptxas() as options:
        assert options == {}


@pytest.mark.parametrize("interpret,backend,arch,expected", [
    ("0", "cuda", 90, True),
    ("1", "cuda", 90, False),  # the interpreter compiles nothing, whatever GPU is there
    ("true", "cuda", 90, False),
    ("0", "cuda", 100, False),  # another target (Blackwell): Triton decides
    ("0", "hip", 90, False),
])
def test_only_a_compile_for_sm90_outside_the_interpreter_counts(monkeypatch, interpret, backend, arch, expected):
    _triton_knobs()
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(toolchain, "_current_target", lambda: SimpleNamespace(backend=backend, arch=arch))
    assert toolchain._compiles_for_sm90() is expected


def test_an_asynchronous_compile_is_left_to_triton(monkeypatch):
    # Under Triton's asynchronous compile mode the build runs after the launch returns, outside the block.
    _triton_knobs()
    async_compile = pytest.importorskip("triton.runtime._async_compile")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(toolchain, "_current_target", lambda: SimpleNamespace(backend="cuda", arch=90))
    assert toolchain._compiles_for_sm90() is True
    token = async_compile.active_mode.set(object())
    try:
        assert toolchain._compiles_for_sm90() is False
    finally:
        async_compile.active_mode.reset(token)
