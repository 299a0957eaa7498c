"""Which ptxas builds this project's kernels for sm_90 (Hopper).

Triton 3.9 builds sm_90 code with the ptxas it ships for Blackwell (CUDA 13.4, Triton's knob
``nvidia.ptxas_blackwell``); 3.6-3.8 used their other ``ptxas`` (CUDA 12.8 or 12.9), which 3.9's
wheel still carries. On the H200, 3.9's PTX of the warp-specialised kernel built by CUDA 13.4
ran 8-10 % slower at head dim 64 and 1-3 % slower at head dim 128 than the same PTX built by
3.9's own CUDA 12.9 ptxas, at every shape timed (benchmarks/NOTES.md v33). So while one of this
project's kernels compiles for sm_90 (the first launch of each specialisation,
:class:`.launch.Relaunch`), :func:`sm90_ptxas` points that knob at the CUDA 12 ptxas, provided:

- the running Triton builds sm_90 with a ptxas other than its ``ptxas`` (3.9 on; earlier
  releases need nothing),
- that ``ptxas`` is from CUDA 12 (the one measured), and
- the user has not chosen the ptxas (``TRITON_PTXAS_BLACKWELL_PATH`` unset when this is first
  asked: their choice stands, for these kernels too).

Other launches, other targets, the interpreter, and a Triton whose compiler does not expose the
pieces named here, compile exactly as Triton would. The knob is set only for the duration of
the compile (``knobs.nvidia.scope()``): the user's own kernels keep Triton's choice. The PTX
version goes with it as a compile option: Triton caches the LLVM features it derives from the
ptxas version per set of options, and a cached PTX 9.0 target would not suit a CUDA 12 ptxas.
"""

from __future__ import annotations

import contextlib
import functools
import os

# The ptxas version that the choice above was measured with.
MEASURED_MAJOR = "12"


def choose(user_path: str | None, chosen, cuda12, ptx_version_of) -> tuple[str, int] | None:
    """The rule of the module docstring: `user_path` is ``TRITON_PTXAS_BLACKWELL_PATH``, `chosen`
    the ptxas Triton builds sm_90 with and `cuda12` its ``ptxas`` (each with ``path`` and
    ``version``, "12.9"), `ptx_version_of` Triton's PTX version of a CUDA version; returns (path,
    PTX version) of the ptxas to build with, or None to leave Triton's choice."""
    if user_path or chosen.path == cuda12.path or cuda12.version.split(".")[0] != MEASURED_MAJOR:
        return None
    return cuda12.path, ptx_version_of(cuda12.version)


@functools.lru_cache(maxsize=1)
def cuda12_ptxas_for_sm90() -> tuple[str, int] | None:
    """:func:`choose` for the running Triton, decided once per process."""
    try:
        from triton import knobs
        from triton.backends.nvidia import compiler

        return choose(os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"), compiler.get_ptxas(90), knobs.nvidia.ptxas,
                      compiler.ptx_get_version)
    except Exception:  # noqa: BLE001 - a release without these pieces (or without a ptxas): Triton decides
        return None


def _compiles_for_sm90() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no GPU driver: nothing compiles for a GPU
        return False
    return getattr(target, "backend", None) == "cuda" and getattr(target, "arch", None) == 90


@contextlib.contextmanager
def sm90_ptxas():
    """Within the block, a kernel that compiles for sm_90 is built by :func:`cuda12_ptxas_for_sm90`'s
    ptxas where that is not None; yields the compile options that go with it (its PTX version;
    empty where nothing changes)."""
    choice = cuda12_ptxas_for_sm90() if _compiles_for_sm90() else None
    if choice is None:
        yield {}
        return
    from triton import knobs

    path, ptx_version = choice
    with knobs.nvidia.scope():
        knobs.nvidia.ptxas_blackwell = path
        yield {"ptx_version": ptx_version}
