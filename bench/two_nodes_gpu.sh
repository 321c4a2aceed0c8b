#!/usr/bin/env bash
# One engine of tp 2 over two "nodes" on one host with two GPUs (two `glmrt up` processes: NCCL
# between the ranks, the step inputs on the CURVE link), against the same engine on one node, on
# the tiny checkpoint: the greedy tokens must be the same. From the repo root on a host with two
# GPUs:
#     [WHEELS=DIR] bash bench/two_nodes_gpu.sh
# (CPU=1: the same on the CPU, gloo, float32.) Prints PASS or FAIL last; logs and tokens under $OUT.
set -u
source bench/host_env.sh
python3 -m cli.main make-checkpoint --preset tiny --out /tmp/tiny2n --dtype float32 > /dev/null || exit 1
common='[model]
path = "/tmp/tiny2n"
[engine]
mem_fraction_static = 0.3
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "detokenizer"
[[actors]]
kind = "engine"
tp = 2'
if [ -n "${CPU:-}" ]; then
  printf '%s\n' "$common" > /tmp/one_node.toml
  cp /tmp/one_node.toml /tmp/node0.toml; cp /tmp/one_node.toml /tmp/node1.toml
  extra="--dtype float32"
else  # one host: each "node" its own GPU (on real nodes every node lists the same local GPUs)
  printf '%s\ngpus = [0, 1]\n' "$common" > /tmp/one_node.toml
  printf '%s\ngpus = [0]\n' "$common" > /tmp/node0.toml
  printf '%s\ngpus = [1]\n' "$common" > /tmp/node1.toml
  extra=""
fi
nodes="--nnodes 2 --dist-init-addr 127.0.0.1:29511"

wait_ready() {  # pid log: until every actor of the deployment on port 30000 is ready
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:30000/admin/status 2> /dev/null | python3 -c \
      "import json,sys; sys.exit(0 if all(a['state'] == 'ready' for a in json.load(sys.stdin)['actors']) else 1)" \
      2> /dev/null && return 0
    kill -0 "$1" 2> /dev/null || { echo "glmrt up died"; tail -40 "$2"; exit 1; }
    sleep 1
  done
  echo "not ready"; tail -40 "$2"; exit 1
}

tokens() {  # out.json: greedy tokens of three prompts
  python3 - "$1" <<'PY'
import json, sys, urllib.request
out = []
for i in range(3):
    body = {"model": "tiny2n", "prompt": [10 + 37 * j % 900 for j in range(12 + 9 * i)], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request("http://127.0.0.1:30000/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out.append(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["token_ids"])
json.dump(out, open(sys.argv[1], "w"))
print(sys.argv[1], out)
PY
}

python3 -m cli.main up /tmp/one_node.toml $extra --port 30000 > "$OUT/one_node.log" 2>&1 &
pid=$!
wait_ready $pid "$OUT/one_node.log"
tokens "$OUT/one_node_tokens.json"
kill -TERM $pid; wait $pid

python3 -m cli.main up /tmp/node1.toml $extra $nodes --node-rank 1 > "$OUT/node1.log" 2>&1 &
n1=$!
python3 -m cli.main up /tmp/node0.toml $extra $nodes --node-rank 0 --port 30000 > "$OUT/node0.log" 2>&1 &
pid=$!
wait_ready $pid "$OUT/node0.log"
curl -s http://127.0.0.1:30000/server_info > "$OUT/two_nodes_info.json"
tokens "$OUT/two_nodes_tokens.json"
kill -TERM $pid; wait $pid
wait $n1; echo "node 1 exited with status $? (0: it stopped with node 0)"
grep -h "refused a peer\|ERROR" "$OUT/node0.log" "$OUT/node1.log"
if cmp -s "$OUT/one_node_tokens.json" "$OUT/two_nodes_tokens.json"; then echo PASS; else echo FAIL; fi
