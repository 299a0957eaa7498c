"""Run a command under a given Triton release: the installed one when it is that release, else a copy
that pip puts in a per-user cache on first use (reused by later runs).

The compile tests run each kernel build in a subprocess with the release's folder first on
PYTHONPATH (the installed torch stays: compiling for sm_90a uses none of torch's CUDA parts).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# The releases the kernels must compile on: the pins of torch 2.11, 2.13, 2.14 and 2.15 (the newest).
RELEASES = ("3.6.0", "3.7.1", "3.8.0", "3.9.0")
# Where copies go; FSATTN_TRITON_CACHE overrides (e.g. a CI cache folder).
CACHE = os.environ.get("FSATTN_TRITON_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fsattn-diffusers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Unavailable(Exception):
    """The release is not installed and pip could not fetch it."""


def installed_version() -> str | None:
    """The Triton version this interpreter imports (what a subprocess imports without a copy first)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def release_folder(version: str) -> str | None:
    """The folder to put first on PYTHONPATH so that Python imports Triton `version`: None when the
    installed Triton is that version, else ``<cache>/triton-<version>``, filled by
    ``pip install --no-deps --target`` if it is not there yet. Raises `Unavailable` with pip's
    error when that fails (no network, no wheel for this platform or Python)."""
    if version not in RELEASES:
        raise ValueError(f"version must be one of {RELEASES}, got {version!r}")
    if installed_version() == version:
        return None
    folder = os.path.join(CACHE, f"triton-{version}")
    if os.path.isdir(os.path.join(folder, f"triton-{version}.dist-info")):
        return folder
    os.makedirs(CACHE, exist_ok=True)
    # Into a private folder first, then renamed: a run interrupted midway or a concurrent run
    # never leaves a half-filled cache entry behind.
    staging = tempfile.mkdtemp(prefix=f"triton-{version}.", dir=CACHE)
    try:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:",
                              "--disable-pip-version-check", "--no-input", "--quiet", "--retries", "2",
                              "--timeout", "30", "--target", staging, f"triton=={version}"],
                             capture_output=True, text=True, timeout=900)
        if pip.returncode != 0:
            error = (pip.stderr.strip() or pip.stdout.strip() or f"exit status {pip.returncode}").splitlines()
            raise Unavailable(f"pip could not install triton=={version} into {CACHE}: {error[-1]}")
        try:
            os.rename(staging, folder)
        except OSError:  # a concurrent run got there first
            if not os.path.isdir(os.path.join(folder, f"triton-{version}.dist-info")):
                raise
        return folder
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"pip install triton=={version} took over {exc.timeout:.0f} s") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _environment(version: str):
    """(os.environ for a subprocess that imports Triton `version` and compiles, None) or (None,
    why not); once per release and test session, so that an offline run asks pip once."""
    try:
        folder = release_folder(version)
    except Unavailable as exc:
        return None, f"Triton {version} unavailable: {exc}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
    imported = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                              capture_output=True, text=True, cwd=ROOT)
    if imported.stdout.strip() != version:
        raise AssertionError(f"PYTHONPATH={env.get('PYTHONPATH')} imports Triton "
                             f"{imported.stdout.strip() or imported.stderr[-500:]}, not {version}")
    return env, None


def run(version: str, args, **kwargs) -> subprocess.CompletedProcess:
    """`python <args>` in the repository root under Triton `version`, stdout and stderr captured;
    skips the calling test, naming the release and pip's error, when the release cannot be had."""
    env, unavailable = _environment(version)
    if unavailable:
        pytest.skip(unavailable)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=ROOT, **kwargs)
