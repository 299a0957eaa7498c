#!/usr/bin/env bash
# One lease on the H200: install, then time the named fsattn variants (bench_attention.py specs)
# on the named shapes against SDPA's default.
#   bash benchmarks/device_variants.sh "wan13b_480p wan14b_720p" spec1 spec2 ...
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
SHAPES=$1; shift
python3 benchmarks/bench_attention.py --shapes $SHAPES --baselines default --variants "$@" --out "$OUT/variants.json"
