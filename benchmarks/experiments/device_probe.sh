#!/usr/bin/env bash
# The warp-specialisation probe of benchmarks/NOTES.md v4 (a): one lease, about a minute.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 python3 benchmarks/experiments/ws_probe.py --out "$OUT/ws_probe.json" 2>&1 | grep -v Warning | tail -12
