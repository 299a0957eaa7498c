#!/usr/bin/env bash
# One lease: the GPU kernel tests (the Gluon kernel's among them), then the Triton kernel (default)
# against the Gluon kernel and SDPA's default on every shape (benchmarks/NOTES.md v4 (b)).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout ${TESTS_S:-200} python3 -m pytest tests/kernels -m gpu -q -x -p no:cacheprovider 2>&1 | tail -15
timeout ${BENCH_S:-300} python3 benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p cogvideox_d64 hunyuan_720p wan_cross_480p \
  --baselines default --variants default "gluon:kernel=gluon" "gluon_s2:kernel=gluon,num_stages=2" \
  --out "$OUT/bench_gluon.json" 2>&1 | grep -v Warning
