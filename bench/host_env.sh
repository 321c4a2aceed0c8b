# Sourced from the repository root by the bench shell drivers. With WHEELS set to a folder of
# wheels (the packages a bare CUDA host lacks, bench/README.md), installs them into /tmp/site and
# puts them on PYTHONPATH; puts the repository on PYTHONPATH; sets OUT (default /tmp/out), the
# folder the drivers write their logs and JSON to.
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
