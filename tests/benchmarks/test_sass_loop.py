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
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")

pytestmark = pytest.mark.slow  # five Gluon compiles for sm_90a, ~30 s


def _consumer_loops(stages, block_n, sorted_keys=False):
    done = triton_releases.run(MEASURED_WITH, [os.path.join("benchmarks", "compile_check.py"), "--gluon-ws",
                                               "--tiles", f"{stages},128,{block_n}", "--sass"]
                               + (["--sorted-keys"] if sorted_keys else []))
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


@pytest.mark.parametrize("sorted_keys", [False, True], ids=["K scale per key", "K scale per tile, sorted keys"])
@pytest.mark.parametrize("block_n,consumers", [(128, 2), (64, 3)])
def test_each_consumer_issues_p_to_its_gemms_before_checking_it(block_n, consumers, sorted_keys):
    header, loops = _consumer_loops(4, block_n, sorted_keys)
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
        if sorted_keys:
            # What makes the long calls' build faster (NOTES v41): one K scale per tile folds into
            # the exponent's multiplier (no multiply per score), and every column of the row-sum
            # GEMM's tile holds the row sum (no shuffles to add the columns up).
            assert counts["FMUL"] < block_n // 16 and counts["SHFL"] == 0, counts


# Reads the control bits of the head-dim-128 build: were the fields read at other bit positions,
# the barriers would not fall on the variable-latency instructions alone, and the stall counts
# would not show the arithmetic latency between dependent instructions.
_CONTROL_CHECK = """
import sys
sys.path.insert(0, "benchmarks")
import compile_check, sass_loop
build = compile_check._main_build(compile_check.build_gluon_ws(4, 128, 128), "_fsattn_fwd_gluon_ws_kernel")
sass = sass_loop.sass_of(build.compiled.asm["cubin"], "-hex")
instructions, _ = sass_loop._instructions(sass)
controls = sass_loop.control_of(sass)
print("counts", len(instructions), len(controls))
for ins, control in zip(instructions, controls):
    print(*control, sass_loop._unpredicated(ins))
"""
FIXED_LATENCY = ("FFMA", "FMUL", "FADD", "I2FP")


def test_control_bits_read_at_their_positions():
    sys.path.insert(0, BENCHMARKS)
    from sass_loop import NO_BARRIER

    done = triton_releases.run(MEASURED_WITH, ["-c", _CONTROL_CHECK])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    counts = next(line for line in lines if line.startswith("counts")).split()
    assert counts[1] == counts[2], counts  # one control word per instruction
    rows = []
    for line in lines:
        if line and not line.startswith("counts"):
            stall, _yield, write_barrier, read_barrier, _wait, text = line.split(None, 5)
            rows.append((int(stall), int(write_barrier), int(read_barrier), text))
    ops = [text.split()[0].split(".")[0] for *_, text in rows]
    loads = [w for (_, w, _, _), op in zip(rows, ops) if op == "LDG"]
    fixed = [(w, r) for (_, w, r, _), op in zip(rows, ops) if op in FIXED_LATENCY]
    assert loads and fixed, "the build has global loads and FP32 arithmetic"
    # A global load reports its result late: each sets a write barrier; fixed-latency arithmetic
    # sets neither barrier.
    assert all(w != NO_BARRIER for w in loads), loads[:8]
    assert all(w == r == NO_BARRIER for w, r in fixed), fixed[:8]
    # The warp waits out an FP32 result's latency (4 cycles or more) before an instruction that
    # reads it, and the common case is one cycle between independent instructions; a four-bit
    # field holds the long waits (8 cycles and more) a three-bit one could not.
    dependent = []
    for (stall, _, _, text), (_, _, _, following), op in zip(rows, rows[1:], ops):
        dest = re.match(r"\S+\s+(R\d+),", text)
        sources = following.split(",")[1:]
        if op in FIXED_LATENCY and dest and any(re.search(rf"\b{dest.group(1)}\b", s) for s in sources):
            dependent.append(stall)
    assert dependent and min(dependent) >= 4, dependent
    stalls = [row[0] for row in rows]
    assert max(set(stalls), key=stalls.count) == 1 and max(stalls) >= 8, sorted(set(stalls))


def _sass_text(body):
    """nvdisasm-like text of `body`: instruction texts, and labels as ".L_x_N:" lines."""
    lines, address = [], 0
    for item in body:
        if item.endswith(":"):
            lines.append(item)
        else:
            lines.append(f"        /*{address:04x}*/                   {item} ;")
            address += 16
    return "\n".join(lines)


def test_loops_finds_a_key_loop_longer_than_two_thousand_instructions():
    # A consumer loop with a long correction branch inside (NOTES v38 (a): 3,000 instructions) is
    # still a key loop; the partitions' dispatch around it is longer and overlaps it.
    sys.path.insert(0, BENCHMARKS)
    import sass_loop

    loop = [".L_x_1:", "WARPGROUP.ARRIVE"] + ["FFMA R1, R2, R3, R4"] * 2997 + ["@P0 BRA `(.L_x_1)"]
    outer = [".L_x_0:"] + loop + ["FADD R1, R1, R2"] * 10 + ["@P1 BRA `(.L_x_0)"]
    spans = sass_loop.loops(_sass_text(["MOV R1, RZ"] + outer))
    assert spans == [(1, 2999)], spans
