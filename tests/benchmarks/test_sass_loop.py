"""The warp-specialised kernel compiled for sm_90a here (no GPU), read through benchmarks/sass_loop.py:
each consumer's key loop keeps the shape NOTES v11 measured.

The SASS is one Triton release's code generation (its front end and its ptxas): the test runs
compile_check under the release NOTES v11 measured with (tests/kernels/triton_releases.py fetches
it once into a per-user cache when another is installed); test_compile_matrix covers the others.
"""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))

import triton_releases  # noqa: E402

MEASURED_WITH = "3.6.0"

pytestmark = pytest.mark.slow  # two Gluon compiles for sm_90a, ~10 s


def _consumer_loops(stages, block_n):
    done = triton_releases.run(MEASURED_WITH, [os.path.join("benchmarks", "compile_check.py"), "--gluon-ws",
                                               "--tiles", f"{stages},128,{block_n}", "--sass"])
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("stages"))
    loops = []
    for line in done.stdout.splitlines():
        if line.startswith("  loop of"):
            counts_text, at_text = line.split("; at ")
            counts = {op: int(n) for op, n in re.findall(r"([A-Z0-9]+) (\d+)", counts_text.split(":", 1)[1])}
            at = {m.group(1): [int(i) for i in m.group(2).split()]
                  for m in re.finditer(r"([A-Z.]+) ([\d ]*)", at_text)}
            loops.append((counts, at))
    return header, loops


@pytest.mark.parametrize("block_n,consumers", [(128, 2), (64, 3)])
def test_each_consumer_issues_p_to_its_gemms_before_checking_it(block_n, consumers):
    header, loops = _consumer_loops(4, block_n)
    assert re.search(r"spill\s+0\b", header), header
    assert len(loops) == consumers, loops
    for counts, at in loops:
        # One exponential per score (64 rows x block_n keys over 128 threads) and no row max: the
        # speculative max's common path.
        assert counts["MUFU"] == block_n // 2 and counts["FMNMX"] == 0, counts
        # Three GEMM groups per tile (row sum, PV, next scores); the warpgroup votes on the
        # saturation flag (one BAR.RED, no exchange through shared memory) after the first two are
        # issued and before the third.
        arrives, (vote,) = at["WARPGROUP.ARRIVE"], at["BAR.RED"]
        assert len(arrives) == 3, at
        assert arrives[1] < vote < arrives[2], at
        assert counts["STS"] == 0 and not at["STS"], (counts, at)
