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

# start_server TOML LOG: `glmrt up TOML` on port 30000 in the background (its pid in $pid),
# back once /health answers; ends the driver with the log's tail if the server dies or is not
# healthy within 300 s.
start_server() {
  python3 -m cli.main up "$1" --port 30000 > "$2" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:30000/health > /dev/null && return 0
    kill -0 $pid 2> /dev/null || { echo "glmrt up died"; tail -40 "$2"; exit 1; }
    sleep 1
  done
  echo "not healthy"; tail -40 "$2"; exit 1
}
