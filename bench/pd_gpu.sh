#!/usr/bin/env bash
# PD across two GPUs with NIXL moving GPU memory, against a unified engine on one GPU, on the
# same dummy flash-4l weights and the same workload. From the repo root on a host with two
# GPUs and the NIXL wheel (bench/README.md):
#     [WHEELS=DIR] bash bench/pd_gpu.sh
# Prints a short table last; logs and JSON under $OUT.
set -u
source bench/host_env.sh
python3 -m cli.main make-checkpoint --preset flash-4l --out /tmp/f4l --no-weights > /dev/null
common='[model]
path = "/tmp/f4l"
load_format = "dummy"
[engine]
page_size = 64
mem_fraction_static = 0.3
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "detokenizer"'
printf '%s\n[[actors]]\nkind = "prefill"\ngpus = [0]\n[[actors]]\nkind = "decode"\ngpus = [1]\n' "$common" > /tmp/pd.toml
printf '%s\n[[actors]]\nkind = "engine"\ngpus = [0]\n' "$common" > /tmp/unified.toml
run() {  # name topology
  python3 -m cli.main up "$2" --port 30000 > "$OUT/$1_up.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do
    curl -sf http://127.0.0.1:30000/health > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "$1: glmrt up died"; tail -30 "$OUT/$1_up.log"; return 1; }
    sleep 1
  done
  python3 -m cli.main bench serving --url http://127.0.0.1:30000 --dataset random --num-prompts 16 \
    --input-len 2048 --output-len 16 --max-concurrency 4 --vocab-size 154880 --seed 1 --quiet \
    --out "$OUT/$1_bench.json" > "$OUT/$1_bench.txt" 2>&1
  sleep 2
  curl -s http://127.0.0.1:30000/server_info > "$OUT/$1_info.json"
  kill -TERM $pid; wait $pid
}
run unified /tmp/unified.toml
run pd /tmp/pd.toml
cp "$OUT/pd_info.json" "$OUT/pd_info_nochecksum.json"
GLMRT_KV_CHECKSUM=1 run pdcrc /tmp/pd.toml
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
print(f"{'run':<8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'TPOT p50 ms':>12} {'out tok/s':>10} {'errors':>7}")
for name in ("unified", "pd"):
    try:
        d = json.load(open(os.path.join(out, f"{name}_bench.json")))
    except Exception as e:
        print(name, "no results:", e); continue
    s = d["runs"][0]["summary"]
    g = lambda k, q: s[k + "_ms"][q] if s.get(k + "_ms") else float("nan")
    print(f"{name:<8} {g('ttft','p50'):>12.1f} {g('ttft','p90'):>12.1f} {g('tpot','p50'):>12.1f} "
          f"{s.get('output_throughput', float('nan')):>10.1f} {s.get('errors', 0):>7}")
for label, name in (("no checksum", "pd_info.json"), ("crc32 checked", "pdcrc_info.json")):
  if not os.path.exists(os.path.join(out, name)):
    continue
  info = json.load(open(os.path.join(out, name)))
  print(label)
  for k, v in info["engines"].items():
    line = f"  {k}: transfer {v.get('kv_transfer')}, sent {v.get('handoff_bytes_sent')}, received {v.get('handoff_bytes_received')}"
    if v.get("handoff_transfers"):
        n, t, b = v["handoff_transfers"], v["handoff_transfer_seconds"], v["handoff_bytes_sent"]
        line += f", {n} transfers, mean {1000 * t / n:.2f} ms each, {b / max(t, 1e-9) / 1e9:.2f} GB/s"
    print(line)
PY
