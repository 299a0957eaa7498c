"""benchmarks/pipe_probe.py: each probe loop compiles (for sm_90a, here) to the instruction it times.

Which SASS a probe becomes is one Triton release's code generation (its ptxas): the test runs the
probes under the release NOTES v9 measured with (tests/kernels/triton_releases.py fetches it once
into a per-user cache when another is installed).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))

import triton_releases  # noqa: E402

MEASURED_WITH = "3.6.0"


def _opcodes(*ops):
    done = triton_releases.run(MEASURED_WITH, [os.path.join("benchmarks", "pipe_probe.py"), "--sass", *ops])
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["op"]: row["opcodes"] for row in map(json.loads, filter(None, done.stdout.splitlines()))}


def test_each_probe_times_its_own_instruction():
    # 8 chains x 8 unrolled steps per loop iteration: 64 of the probed instruction, none folded away.
    ops = _opcodes("ex2", "i2f", "fmnmx", "ex2+i2f", "ex2_f16x2")
    assert ops["ex2"]["MUFU.EX2"] == 64
    assert ops["i2f"]["I2FP.F32.S32"] == 64
    assert ops["fmnmx"]["FMNMX"] == 64
    assert ops["ex2+i2f"]["MUFU.EX2"] == 64 and ops["ex2+i2f"]["I2FP.F32.S32"] == 64
    # NOTES v9: the packed half-precision exponential is two special-function instructions on sm_90.
    assert ops["ex2_f16x2"]["MUFU.EX2.F16"] == 128
