#!/usr/bin/env bash
source "$(dirname "$0")/device_env.sh"
# One lease on 2 x H200: the 2-GPU context-parallel tests, then Wan2.1-14B 720p (81 frames) transformer
# forward time (real config, random weights, bf16; 1 warm-up + 2 timed forwards each) on 1 GPU with fsattn
# and with diffusers' default attention, and on 2 GPUs with fsattn under Ulysses 2 and ring 2.
# Results land in $OUT (JSON per run, and the test log).   Run from the repo root with carry [".whl"]:
#   bash benchmarks/device_parallel.sh
set -uo pipefail
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
timeout ${TESTS_S:-180} python3 -m pytest tests/integrations/test_gpu_parallel.py -m gpu -q -s -p no:cacheprovider \
  2>&1 | grep -v Warning | tail -20 | tee "$OUT/gpu_parallel_tests.log"
B="benchmarks/bench_parallel.py --model wan2.1-t2v-14b --height 720 --width 1280 --num-frames 81"
timeout ${ONE_S:-120} python3 $B --attention fsattn --out "$OUT/wan14b_720p_1gpu_fsattn.json" 2>&1 | grep -v Warning | tail -3
timeout ${ONE_S:-120} python3 $B --attention native --out "$OUT/wan14b_720p_1gpu_native.json" 2>&1 | grep -v Warning | tail -3
timeout ${TWO_S:-120} torchrun --standalone --nproc-per-node 2 $B --attention fsattn --ulysses 2 \
  --out "$OUT/wan14b_720p_2gpu_fsattn_ulysses2.json" 2>&1 | grep -v Warning | tail -3
timeout ${TWO_S:-120} torchrun --standalone --nproc-per-node 2 $B --attention fsattn --ring 2 \
  --out "$OUT/wan14b_720p_2gpu_fsattn_ring2.json" 2>&1 | grep -v Warning | tail -3
python3 - "$OUT" <<'PY'
import glob, json, os, sys
rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(sys.argv[1], "wan14b_720p_*.json")))]
base = next((r["forward_seconds_mean"] for r in rows if r["world_size"] == 1 and r["attention"] == "native"), None)
for r in rows:
    speedup = f", {base / r['forward_seconds_mean']:.2f}x vs 1 GPU native" if base else ""
    print(f"{r['world_size']} GPU {r['attention']:6s} ulysses {r['ulysses_degree']} ring {r['ring_degree']}: "
          f"{r['forward_seconds_mean']:.3f} s{speedup}")
PY
