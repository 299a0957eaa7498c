#!/usr/bin/env bash
# After a kernel change, one lease on the H200: the GPU tests (kernels and one-GPU integrations),
# the attention benchmark on four shapes (the default and the Triton kernel, SDPA in the same
# process), then the Wan2.1-1.3B end-to-end run (bench_e2e.py, as device_e2e.sh 13b).
# NOTES v6 ran it on deferred_rowsum.diff, v7 on the warp-specialised default, v8 with
# EXTRA_VARIANTS="ws:kernel=gluon_ws ws4:kernel=gluon_ws,num_stages=4" (more bench_attention variants).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout ${TESTS_S:-150} pytest tests/kernels tests/integrations -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_S:-130} python3 benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p cogvideox_d64 hunyuan_720p \
  --baselines default --variants default "triton:kernel=triton" ${EXTRA_VARIANTS:-} --out "$OUT/bench.json" 2>&1 | grep -v Warning | tail -12
timeout ${E2E_S:-100} python3 benchmarks/bench_e2e.py --out "$OUT/e2e_13b.json" >"$OUT/e2e_13b.log" 2>&1
grep -v -e Warning -e "experimental feature" "$OUT/e2e_13b.log" | tail -14
