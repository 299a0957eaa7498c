#!/usr/bin/env bash
# Ablation of the magic INT32 accumulator start (NOTES v5b). Apply plain_i2f.diff to a second
# checkout to get the other side; this runs the bench on whichever kernel the tree has:
#   bash benchmarks/experiments/device_magic.sh LABEL
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 100 python3 benchmarks/bench_attention.py --shapes wan13b_480p wan14b_720p cogvideox_d64 --baselines default \
  --variants default --out "$OUT/magic_ablation_${1:-run}.json" 2>&1 | grep -v Warning
