#!/usr/bin/env bash
# One lease on the H200: install the carried wheels and the project, then a tile sweep of the
# default variant and an ablation of every variant at the fastest tiles. Results land in $OUT.
#   run from the repo root with carry [".whl"]:  bash benchmarks/device_sweep.sh [shape ...]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 - <<'PY'
import torch
from fsattn_diffusers import fsattn
from fsattn_diffusers.reference import attention_reference
q, k, v = (torch.randn(1, 3000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
o = fsattn(q, k, v); r, _ = attention_reference(q, k, v)
print("sanity cos", torch.nn.functional.cosine_similarity(o.double().flatten(), r.flatten(), dim=0).item(),
      "finite", bool(torch.isfinite(o).all()))
PY
TILES="t128x128w8s2:block_m=128,block_n=128,num_warps=8,num_stages=2 t128x64w8s3:block_m=128,block_n=64,num_warps=8,num_stages=3 t128x64w4s3:block_m=128,block_n=64,num_warps=4,num_stages=3 t64x128w4s3:block_m=64,block_n=128,num_warps=4,num_stages=3 t64x64w4s3:block_m=64,block_n=64,num_warps=4,num_stages=3 t128x128w8s3:block_m=128,block_n=128,num_warps=8,num_stages=3"
python3 benchmarks/bench_attention.py --shapes wan13b_480p --baselines default flash cudnn \
  --variants $TILES --out "$OUT/tiles.json"
BEST=$(python3 - "$OUT/tiles.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["method"].startswith("fsattn") and "ms" in r]
best = min(rows, key=lambda r: r["ms"])
print(",".join(f"{k}={v}" for k, v in best["config"].items()))
PY
)
echo "best tiles: $BEST"
VARIANTS=""
for v in default online recompute pv16 exp_half exp_bits k_block rowsum_fma pv_hw_acc; do
  python3 - "$v" "$BEST" > /tmp/spec <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from bench_attention import VARIANTS
fields = dict(VARIANTS[sys.argv[1]])
print(sys.argv[1] + ":" + ",".join([f"{k}={v}" for k, v in fields.items()] + [sys.argv[2]]))
PY
  VARIANTS="$VARIANTS $(cat /tmp/spec)"
done
python3 benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p --baselines default \
  --variants $VARIANTS --out "$OUT/variants.json"
