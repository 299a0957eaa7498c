#!/usr/bin/env bash
# End-to-end Wan 2.1 runs of benchmarks/bench_e2e.py on one H200 (issue 5), one job per argument;
# results in $OUT/e2e_<job>.json, logs in $OUT/e2e_<job>.log.
#
#   bash benchmarks/device_e2e.sh 13b 13b_compile    # first call:  ~4-5 min
#   bash benchmarks/device_e2e.sh 14b                # second call: ~4-5 min
#
# The three jobs do not fit one 600-s device call together (estimates below, each also its
# time box), hence the job names. Each job: 1 untimed warm-up step, the timed steps, 1 profiled
# step (attention share), baseline first, then fsattn, in one process.
#   13b          1.3B 480x832, 81 frames, 3 timed steps, eager  ~1 min: build 10 s, ~1.3 s/step x 5 x 2 sides, Triton JIT
#   14b          14B 720x1280, 81 frames, 2 timed steps, eager  ~4 min: build 20 s, ~24 s/step (2 x 12-s forwards) x 4 x 2
#   13b_compile  13b with torch.compile (regional), 3 steps      ~3 min: an inductor compile per side (~30-60 s each)
#   14b_compile  optional, alone in a call                        ~6-7 min
set -uo pipefail
if [ $# -eq 0 ]; then  # before the install below: a bare call changes nothing
  echo "usage: bash benchmarks/device_e2e.sh JOB...   (jobs: 13b 14b 13b_compile 14b_compile)" >&2
  exit 2
fi
source "$(dirname "$0")/device_env.sh"

run_job() {  # name, time box (s), bench_e2e.py arguments...
  local name=$1 box=$2
  shift 2
  echo "== e2e $name (time box ${box} s) =="
  timeout "$box" python3 benchmarks/bench_e2e.py "$@" --out "$OUT/e2e_$name.json" >"$OUT/e2e_$name.log" 2>&1
  local rc=$?
  grep -v -e Warning -e "experimental feature" "$OUT/e2e_$name.log" | tail -14
  [ $rc -eq 0 ] || echo "e2e $name: exit status $rc (124: hit its ${box}-s time box)"
}

for job in "$@"; do
  case "$job" in
    13b) run_job 13b 150 --model wan2.1-t2v-1.3b --height 480 --width 832 --frames 81 --warmup-steps 1 --steps 3 \
           --check-restore-forward ;;
    14b) run_job 14b 420 --model wan2.1-t2v-14b --height 720 --width 1280 --frames 81 --warmup-steps 1 --steps 2 ;;
    13b_compile) run_job 13b_compile 330 --model wan2.1-t2v-1.3b --height 480 --width 832 --frames 81 \
                   --warmup-steps 1 --steps 3 --compile ;;
    14b_compile) run_job 14b_compile 560 --model wan2.1-t2v-14b --height 720 --width 1280 --frames 81 \
                   --warmup-steps 1 --steps 2 --compile ;;
    *) echo "unknown job $job (jobs: 13b 14b 13b_compile 14b_compile)" >&2; exit 2 ;;
  esac
done
