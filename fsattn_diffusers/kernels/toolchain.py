"""Which ptxas builds this project's kernels for sm_90 (Hopper).

Triton 3.9 builds sm_90 code with the ptxas it ships for Blackwell (CUDA 13.4, Triton's knob
``nvidia.ptxas_blackwell``); 3.6-3.8 used their other ``ptxas`` (CUDA 12.8 or 12.9), which 3.9's
wheel still carries. On the H200, 3.9's PTX of the warp-specialised kernel built by CUDA 13.4
ran 8-10 % slower at head dim 64 and 1-3 % slower at head dim 128 than the same PTX built by
3.9's own CUDA 12.9 ptxas, at every shape timed (benchmarks/NOTES.md v33). So while one of this
project's kernels compiles for sm_90 (the first launch of each specialisation,
:class:`.launch.Relaunch`), :func:`building_with_sm90_ptxas` points that knob at the CUDA 12
ptxas, provided:

- the running Triton builds sm_90 with a ptxas other than its ``ptxas`` (3.9 on; earlier
  releases need nothing),
- that ``ptxas`` is CUDA 12.8 or a later 12.x (12.8 and 12.9 measured alike; with
  ``TRITON_PTXAS_PATH`` it may be another), and
- the user has not chosen the sm_90 ptxas (``TRITON_PTXAS_BLACKWELL_PATH``, or
  ``triton.knobs.nvidia.ptxas_blackwell`` set in code; checked at every compile): their choice
  stands, for these kernels too.

Other launches, other targets, the interpreter, Triton's asynchronous compile mode (which
compiles after the launch call returns, outside the block), and a Triton whose compiler does not
expose the pieces named here, compile exactly as Triton would. The knob is set only for the
duration of the block, in Triton's knob object alone (not in the environment, so no subprocess
inherits it), one block at a time across threads: the user's own kernels keep Triton's choice,
unless another thread compiles one at that very moment (the knob object is the process's).
The PTX version goes with the ptxas as a compile option: Triton caches the LLVM features it
derives from the ptxas version per set of options, and a cached PTX 9.0 target would not suit a
CUDA 12 ptxas. Being an option, it is part of Triton's on-disk cache key too, so these kernels'
cache entries under 3.9 are their own and never mix with ones built by the CUDA 13 ptxas. (Triton
also keys every build on the version string of the first sm_90 ptxas it asked in the process, so
which kernel compiles first changes the keys of the others, never what they are built with.)
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

# The CUDA 12 ptxas releases the choice above was measured with start here.
MEASURED_FROM = (12, 8)
# One block at a time across threads: the knob is the process's, and a block ends by removing it.
# Reentrant, with the options of the block a thread is in kept per thread: a launch inside a
# launch's block builds as the outer one does (the knob it finds set is this module's, not the user's).
_ONE_COMPILE_AT_A_TIME = threading.RLock()
_inside = threading.local()


def choose(chosen, cuda12, ptx_version_of) -> tuple[str, int] | None:
    """The rule of the module docstring, past the user's choice: `chosen` is the ptxas Triton builds
    sm_90 with and `cuda12` its ``ptxas`` (each with ``path`` and ``version``, "12.9"),
    `ptx_version_of` Triton's PTX version of a CUDA version; returns (path, PTX version) of the
    ptxas to build with, or None to leave Triton's choice."""
    if chosen.path == cuda12.path:
        return None
    try:
        major, minor = (int(part) for part in cuda12.version.split(".")[:2])
    except ValueError:
        return None
    if major != MEASURED_FROM[0] or minor < MEASURED_FROM[1]:
        return None
    return cuda12.path, ptx_version_of(cuda12.version)


@functools.lru_cache(maxsize=1)
def tritons_cuda12_ptxas_for_sm90() -> tuple[str, int] | None:
    """:func:`choose` for the running Triton's own tools, decided once per process (a failure, such
    as a wheel without a ptxas, raises and is not remembered)."""
    from triton import knobs
    from triton.backends.nvidia import compiler

    return choose(compiler.get_ptxas(90), knobs.nvidia.ptxas, compiler.ptx_get_version)


def user_chose_sm90_ptxas() -> bool:
    from triton import knobs

    return bool(os.environ.get("TRITON_PTXAS_BLACKWELL_PATH")) or "ptxas_blackwell" in vars(knobs.nvidia)


def cuda12_ptxas_for_sm90() -> tuple[str, int] | None:
    """(path, PTX version) of the ptxas these kernels build sm_90 with, or None for Triton's choice."""
    try:
        return None if user_chose_sm90_ptxas() else tritons_cuda12_ptxas_for_sm90()
    except Exception:  # noqa: BLE001 - a release without these pieces (or without a ptxas): Triton decides
        return None


def _current_target():
    from triton.runtime import driver

    return driver.active.get_current_target()


def _compiles_for_sm90() -> bool:
    try:
        from triton import knobs

        if knobs.runtime.interpret or _compiling_asynchronously():
            return False
        target = _current_target()
    except Exception:  # noqa: BLE001 - no GPU driver: nothing compiles for a GPU
        return False
    return getattr(target, "backend", None) == "cuda" and getattr(target, "arch", None) == 90


def _compiling_asynchronously() -> bool:
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:  # a release without the mode
        return False
    return active_mode.get() is not None


@contextlib.contextmanager
def building_with_sm90_ptxas():
    """Within the block, a kernel that compiles for sm_90 is built by :func:`cuda12_ptxas_for_sm90`'s
    ptxas where that is not None; yields the compile options that go with it (its PTX version;
    empty where nothing changes)."""
    outer = getattr(_inside, "options", None)
    if outer is not None:
        yield dict(outer)
        return
    if _compiles_for_sm90():
        with _ONE_COMPILE_AT_A_TIME:  # the check and the knob together: another thread's block sets it
            cuda12 = cuda12_ptxas_for_sm90()
            if cuda12 is not None:
                from triton import knobs

                # Set as Triton's setter would, without its environment variable; removed after.
                vars(knobs.nvidia)["ptxas_blackwell"] = cuda12[0]
                _inside.options = {"ptx_version": cuda12[1]}
                try:
                    yield dict(_inside.options)
                finally:
                    _inside.options = None
                    vars(knobs.nvidia).pop("ptxas_blackwell", None)
                return
    yield {}
