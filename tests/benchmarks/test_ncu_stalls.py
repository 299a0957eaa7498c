"""benchmarks/ncu_stalls.py: stall reasons per innermost SASS loop from an Nsight Compute source CSV."""

import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ncu_stalls  # noqa: E402

STALLS = ["stall_wait", "stall_barrier", "stall_long_sb"]


def _write(path, body, executed=7):
    """body: (address, sass, samples, {stall: samples}); the header names of `ncu --page source --csv`,
    in another column order than ncu's, since the parser must find them by name."""
    header = (["Instructions Executed", "Address", "x", "Source", "Warp Stall Sampling (All Samples)"]
              + STALLS + [s + " (Not Issued)" for s in STALLS])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        for addr, sass, samples, stalls in body:
            w.writerow([executed, hex(addr), 0, sass, samples] + [stalls.get(s, 0) for s in STALLS]
                       + [0] * len(STALLS))


def test_innermost_loop_and_its_shares(tmp_path):
    base = 0x1000
    body = [(base, "MOV R1, R2", 5, {"stall_wait": 5})]
    # An outer loop (0x1010 .. end) around an inner one of 120 instructions at 0x1020.
    body.append((base + 0x10, "NOP", 1, {"stall_wait": 1}))
    inner = [(base + 0x20 + 0x10 * i, "MUFU.EX2 R3, R3" if i % 2 else "FFMA R4, R4, R5, R6", 2,
              {"stall_wait": 1, "stall_barrier": 1}) for i in range(119)]
    inner.append((base + 0x20 + 0x10 * 119, f"@P0 BRA {hex(base + 0x20)}", 4, {"stall_long_sb": 4}))
    body += inner
    body += [(base + 0x20 + 0x10 * (120 + i), "FADD R1, R1, R1", 1, {"stall_wait": 1}) for i in range(3)]
    body.append((base + 0x20 + 0x10 * 123, f"BRA {hex(base + 0x10)}", 1, {"stall_barrier": 1}))
    path = tmp_path / "src.csv"
    _write(path, body)

    loops = ncu_stalls.loops(str(path))
    assert len(loops) == 2  # both loops are found ...
    inner_loop = [lp for lp in loops if lp["start"] == hex(0x20)][0]
    assert inner_loop["instructions"] == 120
    total = 119 * 2 + 4
    assert inner_loop["samples"] == total
    assert inner_loop["stall_share"]["wait"] == pytest.approx(round(119 / total, 4))
    assert inner_loop["stall_share"]["long_sb"] == pytest.approx(round(4 / total, 4))
    assert inner_loop["opcode_share"]["MUFU"] == pytest.approx(round(59 * 2 / total, 4))
    assert inner_loop["opcode_stall_share"]["MUFU"]["barrier"] == pytest.approx(round(59 / total, 4))


def test_loops_never_taken_are_left_out(tmp_path):
    body = [(0x10 * i, "FFMA R1, R1, R1, R1", 1, {"stall_wait": 1}) for i in range(130)]
    body.append((0x10 * 130, "@P0 BRA 0x0", 1, {}))
    path = tmp_path / "src.csv"
    _write(path, body, executed=0)
    assert ncu_stalls.loops(str(path)) == []
    _write(path, body, executed=3)
    assert len(ncu_stalls.loops(str(path))) == 1


def test_main_keeps_only_loops_without_an_inner_loop(tmp_path, capsys, monkeypatch):
    base = 0x0
    body = [(base + 0x10 * i, "FFMA R1, R1, R1, R1", 1, {"stall_wait": 1}) for i in range(130)]
    body.append((base + 0x10 * 130, f"@P0 BRA {hex(base + 0x10 * 5)}", 1, {}))
    body += [(base + 0x10 * (131 + i), "NOP", 1, {"stall_wait": 1}) for i in range(2)]
    body.append((base + 0x10 * 133, f"BRA {hex(base)}", 1, {}))
    path = tmp_path / "src.csv"
    _write(path, body)
    monkeypatch.setattr(sys, "argv", ["ncu_stalls.py", str(path)])
    ncu_stalls.main()
    printed = capsys.readouterr().out
    assert "loop 0x50..0x820" in printed and "loop 0x0.." not in printed
