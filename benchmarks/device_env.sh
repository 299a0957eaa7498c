# Sourced by the device_*.sh scripts on the lent H200: install the carried wheels (.whl: diffusers
# and its one missing dependency) and the project, editable, into the image's Python.
OUT=${OUT:-/tmp/fsattn-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export PYTHONUNBUFFERED=1
