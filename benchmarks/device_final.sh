#!/usr/bin/env bash
# One lease on the H200 with the defaults chosen: the attention benchmark on every shape, the
# Wan2.1-1.3B A/B run, then the GPU tests; each stage time-boxed so the lease ends inside its limit.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout ${BENCH_S:-250} python3 benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p cogvideox_d64 wan_cross_480p hunyuan_720p \
  --baselines default --variants default "pv16:pv_format=16bit,block_m=64,block_n=128" --out "$OUT/bench.json" 2>&1 | grep -v Warning
timeout ${AB_S:-110} python3 examples/ab_compare.py --model wan2.1-t2v-1.3b --steps 3 --warmup-steps 1 --output-dir "$OUT/ab" \
  --attention-report --report-steps first,last 2>&1 | tail -25
rm -f "$OUT"/ab/*.mp4
timeout ${TESTS_S:-120} pytest tests/kernels tests/integrations -m gpu -q -x -p no:cacheprovider 2>&1 | tail -8
