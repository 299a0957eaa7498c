#!/usr/bin/env bash
# One lease on 2 x H200 (issue 6, and the final kernel's GPU tests): the kernel tests on GPU 0; the
# 2-GPU context-parallel tests, now with Wan2.1-14B at 720p/81 frames next to 1.3B; then
# examples/generate_video.py and benchmarks/bench_e2e.py under torchrun with Ulysses 2 (1.3B,
# 480x832, 81 frames, two steps). Logs and JSON in $OUT. Run from the repo root, carry [".whl"].
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout ${KERNEL_S:-110} python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 | tail -4 \
  | tee "$OUT/gpu_kernel_tests.log"
timeout ${CP_S:-270} python3 -m pytest tests/integrations/test_gpu_parallel.py -m gpu -q -s -p no:cacheprovider \
  2>&1 | grep -v -e Warning -e warn | tail -16 | tee "$OUT/gpu_parallel_tests.log"
timeout ${GEN_S:-100} torchrun --standalone --nproc-per-node 2 examples/generate_video.py --model wan2.1-t2v-1.3b \
  --ulysses-degree 2 --steps 2 --no-decode --summary-json "$OUT/generate_video_ulysses2.json" \
  >"$OUT/generate_video_ulysses2.log" 2>&1; echo "generate_video rc=$?"
grep -v -e Warning -e warn "$OUT/generate_video_ulysses2.log" | tail -14
timeout ${E2E_S:-100} torchrun --standalone --nproc-per-node 2 benchmarks/bench_e2e.py --ulysses-degree 2 --steps 2 \
  --profile-steps 0 --out "$OUT/e2e_13b_ulysses2.json" >"$OUT/e2e_13b_ulysses2.log" 2>&1; echo "bench_e2e rc=$?"
grep -v -e Warning -e warn "$OUT/e2e_13b_ulysses2.log" | tail -12
