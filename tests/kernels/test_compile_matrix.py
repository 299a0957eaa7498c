"""Every kernel compiles for sm_90a (no GPU needed) on each Triton release users have, and spills no
more than it did when compile_baseline.json was measured.

Each release runs ``benchmarks/compile_check.py --matrix --json`` in a subprocess (triton_releases:
the installed Triton, or a copy pip fetches once into a per-user cache). The matrix compiles through
the launchers what the op launches on sm_90: the Triton kernel's variants at the launcher's tiles,
the Gluon kernel, the warp-specialised kernel (128- and 64-key tiles) and the quantisation kernels,
at head dims 128 and 64. After a deliberate change, refresh the baseline from the printed table or
from ``python benchmarks/compile_check.py --matrix --json`` under each release.
"""

import functools
import json
import os
import re

import pytest
from triton_releases import RELEASES, ROOT, run

from fsattn_diffusers.kernels.configs import gluon_ws_consumers, padded_head_dim

BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_baseline.json")

pytestmark = pytest.mark.slow  # 45-65 s of compiling per release on one core


def _kernels_in_sources():
    """(file, name) of every @triton.jit / @gluon.jit kernel (a ``_..._kernel``) in fsattn_diffusers/kernels/."""
    found = []
    folder = os.path.join(ROOT, "fsattn_diffusers", "kernels")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                found += [(name, k) for k in re.findall(r"@(?:triton|gluon)\.jit[^\n]*\ndef (_\w+_kernel)\(", f.read())]
    return found


@functools.lru_cache(maxsize=None)  # one subprocess per release for both tests
def _matrix(version):
    done = run(version, [os.path.join("benchmarks", "compile_check.py"), "--matrix", "--json"], timeout=1800)
    assert done.returncode == 0, f"compile_check --matrix under Triton {version} failed:\n{done.stderr[-4000:]}"
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows and {r["triton"] for r in rows} == {version}, done.stdout[-2000:]
    return tuple(rows)


@pytest.mark.parametrize("version", RELEASES)
def test_every_kernel_compiles_for_sm90_without_new_spills(version):
    rows = _matrix(version)
    with open(BASELINE) as f:
        baseline = json.load(f)[version]
    for r in rows:  # the table, shown when the test fails
        print(f"{r['key']:60s} " + (f"FAILED {r['error'][-300:]}" if "error" in r else
                                    f"regs {r['regs']} spill {r['spill']} smem {r['smem']}"))

    failed = [f"{r['key']}: {r['error']}" for r in rows if "error" in r]
    assert not failed, f"Triton {version}: compile errors:\n" + "\n".join(failed)
    unreported = [r["key"] for r in rows if r["spill"] is None]
    assert not unreported, f"Triton {version}: no ptxas report for {unreported}"
    grew = [f"{r['key']}: {r['spill']} bytes of spill stores, baseline {baseline.get(r['key'], 0)}"
            + ("" if r["key"] in baseline else " (not in compile_baseline.json: a new build)")
            for r in rows if r["spill"] > baseline.get(r["key"], 0)]
    assert not grew, f"Triton {version}: spills grew:\n" + "\n".join(grew)

    compiled = {r["key"].split(" / ")[-1] for r in rows}
    missing = [f"{k} (fsattn_diffusers/kernels/{file})" for file, k in _kernels_in_sources() if k not in compiled]
    assert not missing, ("no entry of compile_check.matrix_entries() launches " + ", ".join(missing)
                         + ": add one that calls its launcher")


@pytest.mark.parametrize("version", RELEASES)
def test_the_saturation_vote_has_named_barriers_of_its_own(version):
    # The warp-specialised kernel's vote (bar.red on barrier VOTE_BARRIER + consumer) must not
    # share an ID with a barrier Triton allocates: a shared ID would mix two barriers' arrivals.
    with open(os.path.join(ROOT, "fsattn_diffusers", "kernels", "fsattn_fwd_gluon_ws.py")) as f:
        first = int(re.search(r"^VOTE_BARRIER = (\d+)", f.read(), re.M).group(1))
    rows = [r for r in _matrix(version)
            if "error" not in r and r["key"].split(" / ")[1] == "_fsattn_fwd_gluon_ws_kernel"]
    assert rows, f"Triton {version}: no warp-specialised build in the matrix"
    for r in rows:
        head_dim, block_n = (int(x) for x in re.match(r"gluon_ws d(\d+) n(\d+)\b", r["key"]).groups())
        consumers = gluon_ws_consumers(block_n, padded_head_dim(head_dim), triton_version=version)
        assert r["vote_barriers"] == list(range(first, first + consumers)), (r["key"], r["vote_barriers"])
        # Triton's own: the partitions' (0 and 2 up) at least, or the regex no longer reads the PTX.
        assert 0 in r["named_barriers"], (r["key"], r["named_barriers"])
        clash = [i for i in r["named_barriers"] if i >= first]
        assert not clash, (f"Triton {version}, {r['key']}: Triton's own named barriers {r['named_barriers']} reach "
                           f"the vote's ({first} and up)")


@pytest.mark.parametrize("version", RELEASES)
def test_no_build_has_its_wgmmas_serialised(version):
    # ptxas serialises a build's wgmmas when it has too few registers to keep them in flight (its
    # C7512 note): each GEMM then waits for the one before, and the warp-specialised kernel's
    # GEMMs no longer run beside its softmax. Under Triton 3.8 and 3.9 the three-consumer builds
    # voting late did (configs.LAST_TRITON_WITH_THREE_CONSUMERS_VOTING_LATE); there they vote
    # early at head dim 64 and two consumers run with 64-key tiles at head dim 128.
    rows = _matrix(version)
    assert all("wgmma_serialized" in r for r in rows if "error" not in r), "compile_check no longer reports it"
    serialised = [r["key"] for r in rows if r.get("wgmma_serialized")]
    assert not serialised, f"Triton {version}: ptxas serialised the wgmmas of {serialised}"
