#!/usr/bin/env bash
# NOTES v37 (g): Nsight Compute on the warp-specialised kernel at the Wan2.1-1.3B shape (one launch
# after a warm-up): warp-state and scheduler statistics, then per-instruction stall sampling as CSV
# ($OUT/src.csv) and its summary by benchmarks/ncu_stalls.py. Run through benchmarks/lease/run.sh.
set -uo pipefail
cat > /tmp/ncu_one.py <<'PY'
import torch
from fsattn_diffusers import fsattn
q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    fsattn(q, k, v)
torch.cuda.synchronize()
PY
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 200 "$NCU" --kernel-name regex:gluon_ws --launch-skip 1 --launch-count 1 --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis python3 /tmp/ncu_one.py 2>&1 \
  | grep -v Warning | tail -90 | tee "$OUT/ncu_sections.log"
timeout 200 "$NCU" --kernel-name regex:gluon_ws --launch-skip 1 --launch-count 1 --section SourceCounters \
  --import-source no -o "$OUT/src" python3 /tmp/ncu_one.py >/dev/null 2>&1
"$NCU" -i "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/src.csv" 2>/dev/null
rm -f "$OUT/src.ncu-rep"
python3 benchmarks/ncu_stalls.py "$OUT/src.csv" --out "$OUT/ncu_stalls.json" | tail -40
