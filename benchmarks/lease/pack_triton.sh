#!/usr/bin/env bash
# Internal: packs a Triton release small enough to travel to a lent GPU machine, whose image has
# one Triton (3.6.0) and no network, so that the GPU tests and benchmarks can run under the others
# users have (3.7.1 with torch 2.13, the newest). A wheel is 200-290 MB and a call carries at most
# 64 MiB, so this keeps what compiling and launching for sm_90 needs: the Python package, the
# stripped libtriton (its debug information is most of the wheel), the CUDA headers the launcher
# is built against and the ptxas the kernels are built with for sm_90; it drops the AMD backend,
# CUPTI, the disassemblers and the MLIR headers. About 45 MB (3.7.1) and 59 MB (3.9.0) with xz:
# 3.9.0 leaves no room for .whl in the same call.
#
#   bash benchmarks/lease/pack_triton.sh 3.9.0     # writes .triton/triton-3.9.0.tar.xz, removes
#                                                  # any other release packed there
#
# benchmarks/lease/run.sh unpacks a carried .triton/triton-*.tar.xz first on PYTHONPATH; name
# ".triton" in the call's carry (one release per call; leave out ".whl" if the two do not fit).
# The machine runs Python 3.12, so the wheel is 3.12's whatever Python runs this.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: bash benchmarks/lease/pack_triton.sh VERSION   (e.g. 3.9.0)" >&2
  exit 2
fi
version=$1
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$work" "triton==$version"
mkdir "$work/pkg"
python3 -m zipfile -e "$work"/triton-*.whl "$work/pkg"
t=$work/pkg/triton
bin=$t/backends/nvidia/bin
# Which ptxas builds sm_90: up to 3.8 `ptxas` (only sm_100 and later take `ptxas-blackwell`);
# 3.9 takes `ptxas-blackwell` for sm_90 too, and this project's kernels then take `ptxas` again
# (fsattn_diffusers/kernels/toolchain.py), so 3.9 keeps both.
if grep -q "arch < 90" "$t/backends/nvidia/compiler.py"; then keep="ptxas ptxas-blackwell"
elif grep -q "arch >= 100 else knobs.nvidia.ptxas" "$t/backends/nvidia/compiler.py"; then keep=ptxas
else
  echo "pack_triton.sh: cannot tell which ptxas Triton $version runs for sm_90" \
    "(get_ptxas in backends/nvidia/compiler.py)" >&2
  exit 1
fi
for f in "$bin"/*; do [[ " $keep " == *" $(basename "$f") "* ]] || rm -f "$f"; done
chmod +x "$bin"/*  # zipfile drops the mode bits
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti"* "$t/include" "$t/instrumentation" "$t/plugins" "$t/FileCheck"
find "$work/pkg" -name '*.a' -delete
find "$work/pkg" -name '*.so*' -size +1M -exec strip --strip-all {} +
# The dist-info's entry points still name the AMD backend: run.sh sets TRITON_BACKENDS_IN_TREE.
mkdir -p .triton
rm -f .triton/triton-*.tar.xz  # run.sh takes one release a call: this one replaces any other
(cd "$work/pkg" && tar cf - .) | xz -9e -T0 > ".triton/triton-$version.tar.xz"
ls -l ".triton/triton-$version.tar.xz"
