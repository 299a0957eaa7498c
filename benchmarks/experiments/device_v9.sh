#!/usr/bin/env bash
# NOTES v9 on the H200, run with one of this folder's v9 patches applied (`git apply X.diff`; each
# extends ws_gluon_probe.py with its rows): PIPE=1 first times each softmax instruction's pipe
# (pipe_probe.py); then the probe's small-shape correctness against the Triton kernel and float64,
# (CLOCKS=1, with ws_speculative_flag.diff) the %clock64 stamps, the probe's timing with SDPA in
# the same process, and (TESTS=1, default) the GPU kernel tests.
#   ws_score_bitcast.diff (v9 b), ws_speculative_flag.diff (v9 c, d; `--clocks` for v9 d),
#   ws_row_max_tree.diff (v9 e), ws_three_consumers.diff (v9 f),
#   ws_three_consumers_speculative.diff (v9 g, not yet run)
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
[ "${PIPE:-0}" = 1 ] && timeout 120 python3 benchmarks/pipe_probe.py --out "$OUT/pipe.json" 2>&1 | grep -v Warning
timeout 150 python3 benchmarks/experiments/ws_gluon_probe.py --check 2>&1 | grep -v Warning | tee "$OUT/check.log" | tail -30
[ "${CLOCKS:-0}" = 1 ] && timeout 100 python3 benchmarks/experiments/ws_gluon_probe.py --clocks 2>&1 | grep -v Warning | tee "$OUT/clocks.log"
timeout 240 python3 benchmarks/experiments/ws_gluon_probe.py --bench "$OUT/bench.json" 2>&1 | grep -v Warning
[ "${TESTS:-1}" = 1 ] && timeout 200 pytest tests/kernels -m gpu -q -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
