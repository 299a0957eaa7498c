"""The warp-specialised kernel compiled for sm_90a here (no GPU), read through benchmarks/sass_loop.py:
each consumer's key loop keeps the shape NOTES v11 measured."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _consumer_loops(stages, block_n):
    # compile_check drops TRITON_INTERPRET when imported, so it runs in its own process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join("benchmarks", "compile_check.py"), "--gluon-ws", "--tiles",
                          f"{stages},128,{block_n}", "--sass"], capture_output=True, text=True, check=True, cwd=ROOT,
                         env=env).stdout
    header = next(line for line in out.splitlines() if line.startswith("stages"))
    loops = []
    for line in out.splitlines():
        if line.startswith("  loop of"):
            counts = {op: int(n) for op, n in re.findall(r"([A-Z0-9]+) (\d+)", line.split(";")[0].split(":", 1)[1])}
            first = {op: int(n) for op, n in re.findall(r"([A-Z0-9.]+) (\d+)", line.split("first at")[1])}
            loops.append((counts, first))
    return header, loops


@pytest.mark.parametrize("block_n,consumers", [(128, 2), (64, 3)])
def test_each_consumer_converts_p_issues_its_gemms_then_checks_it(block_n, consumers):
    header, loops = _consumer_loops(4, block_n)
    assert re.search(r"spill\s+0\b", header), header
    assert len(loops) == consumers
    for counts, first in loops:
        # One exponential per score (64 rows x block_n keys over 128 threads) and no row max: the
        # speculative max's common path.
        assert counts["MUFU"] == block_n // 2 and counts["FMNMX"] == 0
        # The saturation flag is exchanged between warps (STS) only after the GEMMs are issued.
        assert first["MUFU"] < first["WARPGROUP.ARRIVE"] < first["STS"]
