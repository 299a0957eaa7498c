#!/usr/bin/env bash
# One lease on the H200: install, then time the named fsattn variants (bench_attention.py specs)
# on the named shapes against SDPA's default.
#   bash benchmarks/device_variants.sh "wan13b_480p wan14b_720p" spec1 spec2 ...
set -uo pipefail
OUT=${OUT:-/tmp/fsattn-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONUNBUFFERED=1
SHAPES=$1; shift
python3 benchmarks/bench_attention.py --shapes $SHAPES --baselines default --variants "$@" --out "$OUT/variants.json"
