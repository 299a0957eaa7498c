#!/usr/bin/env bash
# NOTES v11 (d), one lease: the new default (two consumers on 128 keys) through the GPU tests of the
# Gluon kernels and the integrations, the four-shape benchmark (three consumers on 64 keys and the
# Triton kernel beside), then the 1.3B end-to-end run (the 14B one: benchmarks/device_e2e.sh 14b).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 130 pytest tests/kernels/test_fsattn_fwd_gluon.py tests/integrations -m gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
timeout 130 python3 benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p cogvideox_d64 hunyuan_720p \
  --baselines default --variants default "triton:kernel=triton" "ws64:kernel=gluon_ws,block_n=64" --out "$OUT/bench.json" 2>&1 | grep -v Warning | tail -16
timeout 100 python3 benchmarks/bench_e2e.py --out "$OUT/e2e_13b.json" >"$OUT/e2e_13b.log" 2>&1
grep -v -e Warning -e "experimental feature" "$OUT/e2e_13b.log" | grep -i "speed-up\|memory fsattn\|latents\|baseline \|fsattn  "
