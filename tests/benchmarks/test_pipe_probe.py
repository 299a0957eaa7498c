"""benchmarks/pipe_probe.py: each probe loop compiles (for sm_90a, here) to the instruction it times."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _opcodes(*ops):
    script = os.path.join(ROOT, "benchmarks", "pipe_probe.py")
    out = subprocess.run([sys.executable, script, "--sass", *ops], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    return {row["op"]: row["opcodes"] for row in map(json.loads, filter(None, out.splitlines()))}


def test_each_probe_times_its_own_instruction():
    # 8 chains x 8 unrolled steps per loop iteration: 64 of the probed instruction, none folded away.
    ops = _opcodes("ex2", "i2f", "fmnmx", "ex2+i2f", "ex2_f16x2")
    assert ops["ex2"]["MUFU.EX2"] == 64
    assert ops["i2f"]["I2FP.F32.S32"] == 64
    assert ops["fmnmx"]["FMNMX"] == 64
    assert ops["ex2+i2f"]["MUFU.EX2"] == 64 and ops["ex2+i2f"]["I2FP.F32.S32"] == 64
    # NOTES v9: the packed half-precision exponential is two special-function instructions on sm_90.
    assert ops["ex2_f16x2"]["MUFU.EX2.F16"] == 128
