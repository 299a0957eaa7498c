#!/usr/bin/env bash
# Internal: how this project runs a command on a lent GPU machine (a bare image with torch and
# Triton, no network). Installs the wheels carried in .whl/ (diffusers and what the image lacks)
# and a Triton release carried in .triton/ (benchmarks/lease/pack_triton.sh), then this checkout,
# editable and without dependencies, and runs the command line it is given from the repository
# root, with $OUT (where results go) defaulting to a fresh temporary folder.
#
#   bash benchmarks/lease/run.sh python3 benchmarks/bench_attention.py --shapes wan13b_480p --out "$OUT/b.json"
#   bash benchmarks/lease/run.sh bash -c 'pytest tests/kernels -m gpu -q && python3 benchmarks/pipe_probe.py --out $OUT/p.json'
#
# The command is run as given (no shell parsing): "$OUT" in it is expanded by the calling shell,
# so outside a machine that sets OUT, use `bash -c '...'` as above to get the default folder.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: bash benchmarks/lease/run.sh COMMAND [ARGUMENT...]   (runs COMMAND from the repository root)" >&2
  exit 2
fi
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/fsattn-out.XXXXXX")}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  # Into a folder of their own, first on the path: the image's packages stay as they are.
  site=${FSATTN_LEASE_SITE:-/tmp/fsattn-lease-site}
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
tritons=(.triton/triton-*.tar.xz)
if [ ${#tritons[@]} -gt 1 ]; then
  echo "benchmarks/lease/run.sh: carry one Triton release a call, found ${tritons[*]}" >&2
  exit 2
elif [ ${#tritons[@]} -eq 1 ]; then
  # A release packed by benchmarks/lease/pack_triton.sh, first on the path, in place of the image's.
  # Its entry points still name the AMD backend it left behind: find backends by folder instead.
  tsite=${FSATTN_LEASE_TRITON:-/tmp/fsattn-lease-triton}
  rm -rf "$tsite" && mkdir -p "$tsite" && tar xJf "${tritons[0]}" -C "$tsite"
  export PYTHONPATH="$tsite${PYTHONPATH:+:$PYTHONPATH}" TRITON_BACKENDS_IN_TREE=1
fi
if ! log=$(python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1); then
  echo "$log" >&2
  echo "benchmarks/lease/run.sh: installing this checkout failed (pip install -e . above)" >&2
  exit 1
fi
python3 - >&2 <<'PY' || true
import importlib, subprocess
versions = []
for name in ("torch", "triton", "diffusers", "torchao"):
    try:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception as exc:  # noqa: BLE001 - a report line, not a check
        versions.append(f"{name} missing ({type(exc).__name__})")
try:
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30).stdout.strip().replace("\n", "; ")
except (OSError, subprocess.SubprocessError):
    gpus = "no nvidia-smi"
print(f"lease: {gpus or 'no GPU'}; " + ", ".join(versions))
# The checkout is installed without its dependencies: name those the image lacks (not carried),
# with the test extra's (tests that need one skip or take another path).
import importlib.metadata as md, re
missing = []
for req in md.requires("fsattn-diffusers") or []:
    if "extra ==" in req and 'extra == "test"' not in req:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        missing.append(name)
if missing:
    print("lease: dependencies missing here: " + ", ".join(dict.fromkeys(missing)))
PY
echo "lease: OUT=$OUT" >&2
exec "$@"
