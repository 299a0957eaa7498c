#!/usr/bin/env bash
# NOTES v8: the intra-warpgroup overlap of the warp-specialised Gluon kernel (P through shared
# memory) against its ping-pong-only loop: correctness on small shapes, then timings with SDPA and
# the Triton kernel in one process, then the GPU tests of the current default.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout ${CHECK_S:-150} python3 benchmarks/experiments/ws_gluon_probe.py --check 2>&1 | grep -v Warning | tee "$OUT/check.log" | tail -40
timeout ${BENCH_S:-200} python3 benchmarks/experiments/ws_gluon_probe.py --bench "$OUT/probe.json" 2>&1 | grep -v Warning | tail -30
timeout ${TESTS_S:-180} pytest tests/kernels tests/integrations -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
