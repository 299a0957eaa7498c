#!/usr/bin/env bash
# NOTES v11: the warp-specialised kernel's experiment builds (ws_gluon_probe.py VARIANTS) checked
# against the Triton kernel and float64, then timed with SDPA in the same process; TAG names the run.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
TAG=${TAG:-v11}
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout ${CHECK_S:-200} python3 benchmarks/experiments/ws_gluon_probe.py --check --families > "$OUT/${TAG}_check.log" 2>&1
echo "check rc=$? ok=$(grep -c '^ok' "$OUT/${TAG}_check.log")"; grep -i "fail\|error" "$OUT/${TAG}_check.log" | head -20
timeout ${BENCH_S:-200} python3 benchmarks/experiments/ws_gluon_probe.py --bench "$OUT/${TAG}_probe.json" 2>&1 | grep -v Warn
if [ -n "${TESTS:-}" ]; then
  timeout 200 pytest tests/kernels tests/integrations -m gpu -q -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/${TAG}_gpu_tests.log"
fi
