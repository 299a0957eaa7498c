"""Experiment (NOTES v37 (g)): stall reasons of the softmax stretch of a consumer loop in Nsight Compute's
per-instruction CSV (ncu_kernel.sh's src.csv): from the score wait to the turn's first wgmma fence.

    python3 benchmarks/experiments/ncu_softmax_stretch.py LOOP_START LOOP_END [--each]   (offsets, hex)
"""
import csv, collections, os, sys
rows = list(csv.reader(open(os.environ.get("NCU_CSV", "src.csv"))))
header, data = rows[1], rows[2:]
ci = {h: i for i, h in enumerate(header)}
sc = [i for i, h in enumerate(header) if h.startswith("stall_") and "(Not Issued)" not in h]
def num(x):
    try: return float(x)
    except: return 0.0
base = int(data[0][0], 16)
addr = [int(r[0], 16) - base for r in data]
lo, hi = int(sys.argv[1], 16), int(sys.argv[2], 16)
idx = [i for i, a in enumerate(addr) if lo <= a <= hi]
src = [data[i][1].strip() for i in idx]
start = next(k for k, s in enumerate(src) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in s)
end = next(k for k, s in enumerate(src) if k > start + 100 and s.startswith("WARPGROUP.ARRIVE"))
print("softmax stretch", hex(addr[idx[start]]), "->", hex(addr[idx[end]]), end - start, "instructions")
def agg(ks):
    tot = collections.Counter(); n = 0
    for k in ks:
        r = data[idx[k]]
        n += num(r[ci["Warp Stall Sampling (All Samples)"]])
        for c in sc: tot[header[c]] += num(r[c])
    return n, tot
for name, ks in (("loop", range(len(idx))), ("softmax stretch", range(start, end)),
                 ("rest", [k for k in range(len(idx)) if not start <= k < end])):
    n, tot = agg(ks); s = sum(tot.values())
    print(f"{name:16s} samples {int(n):7d}", {k[6:]: round(100*v/s,1) for k, v in tot.most_common(8)})
by = collections.defaultdict(collections.Counter)
for k in range(start, end):
    r = data[idx[k]]; w = r[1].split(); op = (w[1] if w[0].startswith("@") else w[0]).split(".")[0]
    for c in sc: by[op][header[c][6:]] += num(r[c])
tot = sum(sum(v.values()) for v in by.values())
for op, v in sorted(by.items(), key=lambda x: -sum(x[1].values()))[:9]:
    s = sum(v.values()); print(f"  {op:10s} {100*s/tot:5.1f}% of the stretch's samples", {k: round(100*x/s) for k, x in v.most_common(4)})
if len(sys.argv) > 3:
    for k in range(start, end):
        r = data[idx[k]]
        st = collections.Counter({header[c][6:]: num(r[c]) for c in sc})
        print(f"{k:4d} {int(num(r[ci['Warp Stall Sampling (All Samples)']])):6d} {r[1].strip()[:58]:58s} {[(a, int(b)) for a, b in st.most_common(3) if b]}")
