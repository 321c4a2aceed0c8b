# Shared set-up of the time-boxed lent-GPU scripts (bench/device_s6.sh, bench/device_s7.sh): source
# it from the repo root. Installs the wheels of ../shared/tools/device-wheels.sh (in .whlg) into
# /tmp/site and defines
#   left                       seconds left of the 570-s box that the device tool's 600 s allow
#   TBOX=s profile NAME ARGS   bench.decode_profile ARGS: its table printed, $OUT/NAME.txt and .json kept
#   tests SECONDS K FILES...   pytest -k K FILES, time-boxed: the summary and failures printed
#   prefill16k NAME SECONDS ARGS  bench.prefill_model at 16K tokens, one request: $OUT/NAME.txt and
#                              .json kept, the profile's kernel / host-wait / variant lines and the table printed
set -u
T0=$(date +%s)
left() { echo $((570 - ($(date +%s) - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlg/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
profile() {
  local name=$1; shift
  timeout "$TBOX" python3 -m bench.decode_profile "$@" > "$OUT/$name.txt" 2>&1
  grep -v "^  kernels" "$OUT/$name.txt" | tail -n 12
  mv "$OUT/decode_profile.json" "$OUT/$name.json" 2> /dev/null
}
tests() {
  local t=$1 k=$2; shift 2
  timeout "$t" python3 -m pytest -q -p no:cacheprovider "$@" -k "$k" > "$OUT/t_gpu.txt" 2>&1
  echo "== tests: $(tail -n 1 "$OUT/t_gpu.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/t_gpu.txt" | head -8
}
prefill16k() {
  local name=$1 box=$2; shift 2
  timeout "$box" python3 -m bench.prefill_model --tokens 16384 --hf-tokens "" --reps 3 "$@" > "$OUT/$name.txt" 2>&1
  grep -E "kernels \(|host calls|launches of|TMA GEMMs" "$OUT/$name.txt" | cut -c1-2500; tail -n 2 "$OUT/$name.txt"
  mv "$OUT/prefill_model.json" "$OUT/$name.json" 2> /dev/null
}
