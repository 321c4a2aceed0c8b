#!/usr/bin/env bash
# The GPU serving sweep: `glmrt up` on flash-4l (dummy weights, cuda-h200 kernels, decode CUDA
# graphs and the overlap schedule) and `glmrt bench serving` at 0%, 50% and 93.75% shared
# prefix, concurrency 1, 8, 32, 64. From the repo root on a CUDA host:
#     [WHEELS=DIR] [BATCHED=N] [RATIOS="0 0.5"] [CONCURRENCY=64] bash bench/serving_sweep.sh [input_len] [output_len] [num_prompts]
# BATCHED=N serves with max_num_batched_tokens = N in [engine] (the per-step token budget that
# trades time to first token for a steadier decode step); RATIOS and CONCURRENCY narrow the sweep.
# Writes $OUT/serving_<ratio>[_b<N>].json and .png, the server log, and prints the tables last.
set -u
IN=${1:-1024}; OUTLEN=${2:-64}; N=${3:-128}
RATIOS=${RATIOS:-0 0.5 0.9375}; CONCURRENCY=${CONCURRENCY:-1,8,32,64}; TAG=${BATCHED:+_b$BATCHED}
source bench/host_env.sh
python3 -m cli.main make-checkpoint --preset flash-4l --out /tmp/f4l --no-weights > /dev/null || exit 1
cat > /tmp/serve.toml <<'EOF'
[model]
path = "/tmp/f4l"
load_format = "dummy"
[engine]
page_size = 64
mem_fraction_static = 0.6
max_running_requests = 64
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "detokenizer"
[[actors]]
kind = "engine"
gpus = [0]
EOF
if [ -n "${BATCHED:-}" ]; then
  sed -i "/^\[engine\]/a max_num_batched_tokens = $BATCHED" /tmp/serve.toml
fi
t0=$SECONDS
start_server /tmp/serve.toml "$OUT/serving_up$TAG.log"
echo "healthy after $((SECONDS - t0))s"
# warm-up (not recorded): the engine already captured the decode graphs and ran the prefill
# shapes at start; this covers the rest of the serving path (sampling, streaming)
python3 -m cli.main bench serving --dataset random --input-len "$IN" --output-len 8 --num-prompts 32 \
  --vocab-size 154880 --max-concurrency 64,32,8,1 --quiet > "$OUT/serving_warmup.txt" 2>&1
echo "warm-up exit $?"
for r in $RATIOS; do
  python3 -m cli.main bench serving --dataset shared-prefix --shared-prefix-ratio $r --num-groups 1 \
    --input-len "$IN" --output-len "$OUTLEN" --num-prompts "$N" --vocab-size 154880 \
    --max-concurrency "$CONCURRENCY" --quiet --out "$OUT/serving_$r$TAG.json" --plot "$OUT/serving_$r$TAG.png" \
    > "$OUT/serving_$r$TAG.txt" 2>&1
  echo "== shared prefix $r${BATCHED:+, max_num_batched_tokens $BATCHED} (exit $?)"
  tail -8 "$OUT/serving_$r$TAG.txt"
done
grep -E "graphs|engine:|warm|slow step" "$OUT/serving_up$TAG.log" | head -8
python3 -m cli.main down > /dev/null 2>&1 || kill $pid
wait $pid 2> /dev/null
