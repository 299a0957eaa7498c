"""Instruction counts of a kernel's inner loops from its SASS (NOTES v8-v11 quote them).

    python benchmarks/compile_check.py --gluon-ws --tiles 4,128,128 --sass

`loops` finds each wgmma-issuing loop as the span from a backward branch's target to the branch;
`common_path` drops the longest span that a predicated forward branch inside the loop skips (the speculative
max's correction, taken rarely), leaving what every tile runs. Counts are per warp and loop trip.
`control_of` reads the scheduling bits ptxas encodes in each instruction; `describe` sums their stall
counts over the common path (at head dim 64 the sum followed the measured time, NOTES v36).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

OPCODES = ("MUFU", "FMUL", "FFMA", "I2FP", "F2FP", "FMNMX", "SHFL", "BAR", "SYNCS", "LOP3", "REDUX", "STS", "LDS")
# "BRA `(.L_x_7)", and the forms with modifiers or a predicate operand ("BRA.U !UP0, `(.L_x_7)").
_BRANCH = re.compile(r"BRA(?:\.\w+)*\s+(?:[^`]*,\s*)?`\((\.L_x_\d+)\)")


def sass_of(cubin: bytes, *flags: str) -> str:
    """The SASS of a compiled kernel's cubin (``kernel.asm["cubin"]``: Triton's own ptxas and flags),
    disassembled with the nvdisasm of the Triton that built it (`flags`: more of its options)."""
    import triton  # here, so that reading SASS text (ncu_stalls.py) needs no Triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", *flags, path], check=True,
                              capture_output=True, text=True).stdout


Control = collections.namedtuple("Control", "stall yield_bit write_barrier read_barrier wait_mask")
NO_BARRIER = 7


def control_of(sass_hex: str) -> list:
    """Each instruction's scheduling control, in the order of :func:`_instructions`, from
    ``sass_of(cubin, "-hex")``. From Volta through Hopper ptxas encodes it in bits 105-121 of each
    128-bit instruction (122-125, operand reuse, are not read): the stall count (cycles before the
    warp may issue again), the yield bit (as encoded, not interpreted here), the scoreboard barrier
    the instruction sets for its result and for reading its operands (NO_BARRIER: none; a
    variable-latency instruction such as a global load sets one, though ptxas may leave it off one
    whose result a later one's barrier covers), and the mask of barriers it waits on."""
    controls = []
    for line in sass_hex.splitlines():
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;\s*/\*\s*(0x[0-9a-f]{16})\s*\*/", line)
        if ins:
            controls.append(None)  # the instruction's low word; its high word is on the next line
            continue
        high = re.match(r"\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$", line)
        if high and controls and controls[-1] is None:
            bits = int(high.group(1), 16) >> 41  # the high word is bits 64-127: bit 105 of the instruction
            controls[-1] = Control(bits & 0xF, (bits >> 4) & 1, (bits >> 5) & 7, (bits >> 8) & 7, (bits >> 11) & 0x3F)
    if None in controls:
        raise ValueError("nvdisasm -hex printed an instruction without its second word")
    return controls


def _instructions(sass: str):
    """The instruction texts in order, and each label's index."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            instructions.append(ins.group(1))
    return instructions, labels


def _unpredicated(ins: str) -> str:
    words = ins.split()
    return " ".join(words[1:] if words and words[0].startswith("@") else words)


def opcode(ins: str) -> str:
    """An instruction's opcode without its predicate and modifiers ("@!P0 MUFU.EX2 R1, R2" -> "MUFU")."""
    text = _unpredicated(ins)
    return text.split()[0].split(".")[0] if text else ""


def loops(sass: str, max_len: int = 8000):
    """(first, last) instruction indices of each loop (a backward branch and its target) that
    issues a wgmma: the consumers' key loops."""
    instructions, labels = _instructions(sass)
    spans = []
    for i, ins in enumerate(instructions):
        target = _BRANCH.search(ins)
        if target and labels.get(target.group(1), i) < i and i - labels[target.group(1)] < max_len:
            first = labels[target.group(1)]
            if any(x.startswith("WARPGROUP.ARRIVE") for x in instructions[first:i]):
                spans.append((first, i))
    # Shortest first; a span overlapping an accepted one is structure around the loops (the
    # partitions' dispatch), not a loop of its own.
    accepted = []
    for span in sorted(set(spans), key=lambda s: s[1] - s[0]):
        if all(span[1] < a[0] or a[1] < span[0] for a in accepted):
            accepted.append(span)
    return sorted(accepted)


def common_indices(sass: str, span) -> list:
    """The instruction indices of a loop without the longest block that a predicated forward
    branch inside it skips."""
    instructions, labels = _instructions(sass)
    first, last = span
    skip = (last, last)
    for i in range(first, last):
        target = _BRANCH.search(instructions[i])
        if target and instructions[i].startswith("@"):
            t = labels[target.group(1)]
            if i < t <= last and t - i > skip[1] - skip[0]:
                skip = (i + 1, t)
    return list(range(first, skip[0])) + list(range(skip[1], last + 1))


def common_path(sass: str, span):
    """Opcode counts, instructions and indices of a loop's common path (:func:`common_indices`)."""
    instructions, _ = _instructions(sass)
    indices = common_indices(sass, span)
    body = [instructions[i] for i in indices]
    counts = collections.Counter(opcode(ins) for ins in body)
    counts["total"] = len(body)
    return counts, body, indices


def positions(body, prefixes=("WARPGROUP.ARRIVE", "BAR.RED", "STS")) -> dict:
    """Where in a common path the instructions with each prefix are (indices), to check an order:
    the speculative max's vote on its saturation flag (BAR.RED) after the row-sum and PV GEMMs'
    issue (a WARPGROUP.ARRIVE each) and before the next score GEMM's; any shared-memory store."""
    texts = [_unpredicated(ins) for ins in body]
    return {p: [i for i, t in enumerate(texts) if t.startswith(p)] for p in prefixes}


def describe(cubin: bytes) -> str:
    """One line per inner loop of a compiled kernel: its length, and its common path's length,
    opcode counts and encoded stall cycles (:func:`control_of`)."""
    sass = sass_of(cubin, "-hex")  # the instruction texts as without it, and their control bits
    controls = control_of(sass)
    n_instructions = len(_instructions(sass)[0])
    if len(controls) != n_instructions:
        raise ValueError(f"{len(controls)} instructions with control bits, {n_instructions} in the SASS")
    lines = []
    for span in loops(sass):
        c, body, indices = common_path(sass, span)
        if c["MUFU"] < 16:  # a backward branch around the last tile and the epilogue, not a key loop
            continue
        at = positions(body)
        stalls = sum(controls[i].stall for i in indices)
        lines.append(f"  loop of {span[1] - span[0] + 1} instructions, common path {c['total']}: "
                     + ", ".join(f"{op} {c[op]}" for op in OPCODES) + f", encoded stall cycles {stalls}"
                     + "; at " + "; ".join(f"{op} {' '.join(map(str, i))}" for op, i in at.items()))
    # A build whose loop outgrew `loops`' span limit would otherwise print nothing at all.
    return "\n".join(lines) or "  no key loop found (a wgmma-issuing loop with 16 or more MUFU on its common path)"
