"""Summarise Nsight Compute's per-instruction stall sampling (runs anywhere; NOTES v9).

    ncu ... --section SourceCounters -o src && ncu -i src.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/ncu_stalls.py src.csv --out summary.json

For every executed loop of the kernel's SASS (a backward branch over more than 100 instructions,
columns found by their header names) it prints
the stall reasons of the sampled warps and the opcodes they stalled on, keeping loops that contain no
other, so a consumer's loop reads apart from the producer's waiting.
"""

import argparse
import collections
import csv
import json

from sass_loop import opcode


def _num(text):
    try:
        return float(text)
    except ValueError:
        return 0.0


def loops(path, min_len=100):
    """Every executed loop of the CSV's SASS: a taken-at-least-once backward branch over more than
    `min_len` instructions, with the stall reasons of its samples overall and per opcode."""
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    col = {name: header.index(name) for name in ("Address", "Source", "Warp Stall Sampling (All Samples)",
                                                   "Instructions Executed")}
    stall_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "(Not Issued)" not in h]
    addr = [int(r[col["Address"]], 16) for r in data]
    index = {a: i for i, a in enumerate(addr)}
    found = []
    for i, row in enumerate(data):
        words = row[col["Source"]].split()
        if "BRA" not in " ".join(words[:2]) or _num(row[col["Instructions Executed"]]) == 0:
            continue
        target = next((int(w, 16) for w in words if w.startswith("0x")), None)
        start = index.get(target)
        if start is None or i - start < min_len:
            continue
        body = data[start:i + 1]
        reasons = collections.Counter()
        by_opcode = collections.defaultdict(collections.Counter)
        for r in body:
            op = opcode(r[col["Source"]])
            for c in stall_cols:
                reasons[header[c][len("stall_"):]] += _num(r[c])
                by_opcode[op][header[c][len("stall_"):]] += _num(r[c])
        total = sum(reasons.values()) or 1.0
        opcodes = sorted(by_opcode, key=lambda o: -sum(by_opcode[o].values()))[:12]
        found.append({
            "start": hex(target - addr[0]), "end": hex(addr[i] - addr[0]), "instructions": len(body),
            "samples": total, "branch_executions": _num(row[col["Instructions Executed"]]),
            "stall_share": {k: round(v / total, 4) for k, v in reasons.most_common()},
            "opcode_share": {o: round(sum(by_opcode[o].values()) / total, 4) for o in opcodes},
            # Which stalls each opcode's samples were: MUFU's "wait" and "mio" are the v9 finding.
            "opcode_stall_share": {o: {k: round(v / total, 4) for k, v in by_opcode[o].most_common(4)}
                                   for o in opcodes},
        })
    return sorted(found, key=lambda x: -x["samples"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--out")
    parser.add_argument("--top", type=int, default=4)
    args = parser.parse_args()
    found = loops(args.csv)
    span = {id(lp): (int(lp["start"], 16), int(lp["end"], 16)) for lp in found}
    inner = [lp for lp in found if not any(o is not lp and span[id(lp)][0] <= span[id(o)][0]
                                           and span[id(o)][1] <= span[id(lp)][1] for o in found)]
    for lp in inner[:args.top]:
        print(f"loop {lp['start']}..{lp['end']}: {lp['instructions']} instructions, {lp['samples']:.0f} samples")
        print("  stalls ", ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(lp["stall_share"].items())[:8]))
        print("  opcodes", ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(lp["opcode_share"].items())[:8]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"source": args.csv, "loops": inner}, f, indent=1)


if __name__ == "__main__":
    main()
