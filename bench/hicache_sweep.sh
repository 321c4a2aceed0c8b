#!/usr/bin/env bash
# The prefix cache's tiers on the GPU: `glmrt up` on flash-4l (dummy weights, as the serving
# sweep) with cache pools too small for the multi-turn working set, and `glmrt bench serving`
# against it. From the repo root on a CUDA host:
#     [WHEELS=DIR] bash bench/hicache_sweep.sh tier      # host tier off vs on (write_through)
#     [WHEELS=DIR] bash bench/hicache_sweep.sh interval  # --state-checkpoint-interval 0, 2048, 8192
#     TP=2 OUT=/tmp/out_tp2 bash bench/hicache_sweep.sh tier  # the same on one engine of 2 ranks (GPUs 0, 1)
# tier: multi-turn, 48 conversations x 4 turns of 4K + 512-token turns, concurrency 8, with
# mem_fraction_static MEM (default 0.005: ~0.4 GiB of pools, ~220K tokens of KV, less than the
# ~340K-token working set). interval: shared-prefix (16K-token prompts, 75% shared by 8 groups)
# and multi-turn, the pools at 0.6. Writes $OUT/hicache_<mode>_<setting>_<dataset>.json and .txt
# and the server logs; prints each summary (TTFT, throughput, cached tokens) last. With TP > 1
# each rank has pools of that size and a host tier of its own.
set -u
MODE=${1:-tier}; MEM=${MEM:-0.005}; TP=${TP:-1}
GPUS=$(seq -s , 0 $((TP - 1)))
source bench/host_env.sh
python3 -m cli.main make-checkpoint --preset flash-4l --out /tmp/f4l --no-weights > /dev/null || exit 1

serve() {  # serve NAME MEM "extra [engine] lines"
  cat > /tmp/hicache.toml <<EOF
[model]
path = "/tmp/f4l"
load_format = "dummy"
[engine]
page_size = 64
mem_fraction_static = $2
max_running_requests = 32
$3
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "detokenizer"
[[actors]]
kind = "engine"
gpus = [$GPUS]
tp = $TP
EOF
  start_server /tmp/hicache.toml "$OUT/hicache_$1_up.log"
}

stop() {
  grep -E "host tier|KV pool|state pool" "$OUT/hicache_$1_up.log" | head -4
  python3 -m cli.main down > /dev/null 2>&1 || kill $pid
  wait $pid 2> /dev/null
}

bench() {  # bench NAME DATASET args...
  local name=$1 ds=$2; shift 2
  python3 -m cli.main bench serving --dataset "$ds" --endpoint completions --vocab-size 154880 --output-len 64 \
    --quiet --out "$OUT/hicache_${name}_$ds.json" "$@" > "$OUT/hicache_${name}_$ds.txt" 2>&1
  echo "== $name $ds (exit $?)"
  tail -10 "$OUT/hicache_${name}_$ds.txt"
}

MULTI=(--input-len 4096 --num-turns 4 --turn-len 512 --num-prompts 48 --max-concurrency 8)
if [ "$MODE" = tier ]; then
  for tier in off on; do
    extra=""
    [ $tier = on ] && extra="enable_hierarchical_cache = true"
    serve "tier_$tier" "$MEM" "$extra"
    bench "tier_$tier" multi-turn "${MULTI[@]}"
    stop "tier_$tier"
  done
elif [ "$MODE" = interval ]; then
  for n in 0 2048 8192; do
    serve "interval_$n" 0.6 "state_checkpoint_interval = $n"
    bench "interval_$n" shared-prefix --input-len 16384 --shared-prefix-ratio 0.75 --num-groups 8 \
      --num-prompts 64 --max-concurrency 8
    bench "interval_$n" multi-turn "${MULTI[@]}"
    stop "interval_$n"
  done
else
  echo "usage: bash bench/hicache_sweep.sh tier|interval"; exit 2
fi
