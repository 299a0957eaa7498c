#!/usr/bin/env bash
# NOTES v6 on one H200, on commit afa8df5 with lazy_max.diff applied: the GPU kernel tests, then
# the attention benchmark of the lazy max, the per-block K scale, 64-key tiles and a register cap
# of 168 (three programs per SM) against the default, SDPA in the same process.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout ${TESTS_S:-170} pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout ${FAST_S:-220} python3 benchmarks/bench_attention.py --shapes wan13b_480p cogvideox_d64 --baselines default \
  --variants default lazy "lazy_t2:max_policy=lazy,max_threshold=2.0" "lazy_kb:max_policy=lazy,k_granularity=block" \
  "n64:block_n=64" "lazy_n64:max_policy=lazy,block_n=64" "lazy_n64_r168:max_policy=lazy,block_n=64,max_registers=168" \
  "lazy_n64s2_r168:max_policy=lazy,block_n=64,num_stages=2,max_registers=168" \
  "lazy_kb_n64_r168:max_policy=lazy,k_granularity=block,block_n=64,max_registers=168" \
  --out "$OUT/fast.json" 2>&1 | grep -v Warning | tail -30
timeout ${SLOW_S:-180} python3 benchmarks/bench_attention.py --shapes wan14b_720p hunyuan_720p --baselines default \
  --variants default lazy "lazy_n64_r168:max_policy=lazy,block_n=64,max_registers=168" \
  --out "$OUT/slow.json" 2>&1 | grep -v Warning | tail -20
