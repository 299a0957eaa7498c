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


# Reads the control bits of the head-dim-128 build: were the bit positions wrong, the barriers
# would not fall on the variable-latency instructions alone.
_CONTROL_CHECK = """
import sys
sys.path.insert(0, "benchmarks")
import compile_check, sass_loop
build = compile_check._main_build(compile_check.build_gluon_ws(4, 128, 128), "_fsattn_fwd_gluon_ws_kernel")
cubin = build.compiled.asm["cubin"]
instructions, _ = sass_loop._instructions(sass_loop.sass_of(cubin))
controls = sass_loop.control_of(cubin)
print("counts", len(instructions), len(controls))
for ins, control in zip(instructions, controls):
    print(sass_loop.opcode(ins), *control)
"""


def test_control_bits_mark_variable_latency_instructions_only():
    done = triton_releases.run(MEASURED_WITH, ["-c", _CONTROL_CHECK])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    counts = next(line for line in lines if line.startswith("counts")).split()
    assert counts[1] == counts[2], counts  # one control word per instruction
    rows = [line.split() for line in lines if line and not line.startswith("counts")]
    by_opcode = {}
    for op, stall, _yield, write_barrier, read_barrier, _wait in rows:
        by_opcode.setdefault(op, []).append((int(stall), int(write_barrier), int(read_barrier)))
    no_barrier = 7
    # Global loads report their results late: each sets a write barrier. The exponential unit
    # does too, but ptxas may leave a barrier off a MUFU whose result a later one's covers.
    assert by_opcode["LDG"] and all(w != no_barrier for _, w, _ in by_opcode["LDG"]), by_opcode["LDG"][:8]
    assert any(w != no_barrier for _, w, _ in by_opcode["MUFU"]), by_opcode["MUFU"][:8]
    # Fixed-latency arithmetic sets neither barrier.
    for op in ("FFMA", "FMUL", "I2FP"):
        assert by_opcode[op] and all(w == r == no_barrier for _, w, r in by_opcode[op]), (op, by_opcode[op][:8])
    assert all(0 <= int(row[1]) <= 15 for row in rows)
