#!/usr/bin/env bash
# NOTES v9 on the H200. PIPE=1: the pipe of each softmax instruction (pipe_probe.py). Then the
# warp-specialised kernel's speculative max against its online max: small-shape correctness
# against the Triton kernel and float64, the GPU kernel tests (default kernel), and the timing
# with SDPA in the same process.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
[ "${PIPE:-0}" = 1 ] && timeout 120 python3 benchmarks/pipe_probe.py --out "$OUT/pipe.json" 2>&1 | grep -v Warning
timeout 150 python3 benchmarks/experiments/ws_gluon_probe.py --check 2>&1 | grep -v Warning | tee "$OUT/check.log" | tail -30
timeout 240 python3 benchmarks/experiments/ws_gluon_probe.py --bench "$OUT/bench.json" 2>&1 | grep -v Warning
[ "${TESTS:-1}" = 1 ] && timeout 200 pytest tests/kernels -m gpu -q -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
