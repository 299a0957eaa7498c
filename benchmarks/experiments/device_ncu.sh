#!/usr/bin/env bash
# NOTES v9: Nsight Compute on the default kernel at the Wan-1.3B shape (one launch after a warm-up):
# scheduler and warp-state statistics, then per-instruction stall sampling as CSV ($OUT/src.csv).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
cat > /tmp/ncu_one.py <<'PY'
import torch
from fsattn_diffusers import fsattn
q, k, v = (torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    fsattn(q, k, v)
torch.cuda.synchronize()
PY
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 240 "$NCU" --kernel-name regex:gluon_ws --launch-skip 1 --launch-count 1 --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis python3 /tmp/ncu_one.py 2>&1 | grep -v Warning | tail -60
timeout 200 "$NCU" --kernel-name regex:gluon_ws --launch-skip 1 --launch-count 1 --section SourceCounters \
  --import-source no -o "$OUT/src" python3 /tmp/ncu_one.py >/dev/null 2>&1
"$NCU" -i "$OUT/src.ncu-rep" --page source --csv --print-source sass > "$OUT/src.csv" 2>/dev/null
python3 benchmarks/ncu_stalls.py "$OUT/src.csv" --out "$OUT/ncu_stalls.json"
