#!/usr/bin/env bash
# minicb's server against HF transformers' own OpenAI-compatible server, on the same
# SmolLM2 weights (fp32, CPU), driven one after the other by the same bench-serve run.
#
#   bash tools/peer_serve.sh                      # 32 prompts, 64 tokens, 32 at once
#   NUM_PROMPTS=16 MAX_TOKENS=32 bash tools/peer_serve.sh
#   PEER_FLAGS=--continuous-batching PEER_ONLY=1 bash tools/peer_serve.sh   # the peer's other mode alone
#   ROUNDS=5 PEER_FLAGS=--continuous-batching bash tools/peer_serve.sh      # in turns, 5 times each, then medians
#
# The peer is `transformers serve DIR`, with DIR an HF checkpoint directory made from
# the embedded GGUF: minicb's converted config.json and model.safetensors (Q/K
# un-permuted, as HF expects) beside the GGUF's tokenizer files. Each server gets the
# machine alone; reports go to build/peer/. Needs nothing from the network.
#
# A run of a few hundred tokens a second lasts seconds, and on a shared machine one
# server's figure can move by a third from one run to the next. With ROUNDS=N the two
# take N turns each (minicb, peer, minicb, peer, ...; reports NAME-rK.json), and the
# script prints every round and the medians: the ratio is the median of the ratios
# of rounds run back to back.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_TOKENS=${MAX_TOKENS:-64}
CONCURRENCY=${CONCURRENCY:-32}
ROUNDS=${ROUNDS:-1}
PEER_FLAGS=${PEER_FLAGS:-}
TIMEOUT=${TIMEOUT:-900}
OUT=build/peer
mkdir -p "$OUT"

# The checkpoint directory, converted once (minicb.weights and minicb.tokenizer cache both).
DIR=$("$PY" - <<'EOF'
import pathlib, shutil
from minicb import tokenizer, weights
checkpoint = weights.resolve_checkpoint(None)
tok_dir = checkpoint.with_name(checkpoint.name + "-tokenizer")
tokenizer.load_tokenizer(None)  # writes tok_dir if it is not there yet
out = pathlib.Path("build/peer/SmolLM2-135M-Instruct-hf")
out.mkdir(parents=True, exist_ok=True)
for source in [checkpoint / "config.json", checkpoint / "model.safetensors", *tok_dir.iterdir()]:
    target = out / source.name
    if not target.exists():
        shutil.copy(source, target)
print(out)
EOF
)

wait_up() {  # $1: base URL; up to 300 s for the model to load
  for _ in $(seq 300); do
    curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "the server at $1 did not come up" >&2
  return 1
}

run() {  # $1: name, $2: port, then the server's command line
  local name=$1 port=$2
  shift 2
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  wait_up "http://127.0.0.1:$port"
  "$PY" -m minicb bench-serve --url "http://127.0.0.1:$port" --num-prompts "$NUM_PROMPTS" \
      --max-tokens "$MAX_TOKENS" --max-concurrency "$CONCURRENCY" --temperature 0 \
      --timeout "$TIMEOUT" --json "$OUT/$name.json" | tee "$OUT/$name.txt"
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  trap - EXIT
}

PEER="peer${PEER_FLAGS:+-cb}"
for round in $(seq "$ROUNDS"); do
  suffix=$([ "$ROUNDS" -gt 1 ] && echo "-r$round" || true)
  if [ -z "${PEER_ONLY:-}" ]; then
    echo "== minicb serve (round $round of $ROUNDS) =="
    run "minicb$suffix" 8012 "$PY" -m minicb serve --port 8012 --device cpu --dtype float32 --max-num-seqs "$CONCURRENCY"
  fi
  echo "== transformers serve $DIR $PEER_FLAGS (round $round of $ROUNDS) =="
  # shellcheck disable=SC2086  # PEER_FLAGS is a list of flags
  run "$PEER$suffix" 8011 .venv/bin/transformers serve "$DIR" --device cpu --dtype float32 --host 127.0.0.1 \
      --port 8011 $PEER_FLAGS
done

if [ "$ROUNDS" -gt 1 ] && [ -z "${PEER_ONLY:-}" ]; then
  "$PY" - "$OUT" "$PEER" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, peer, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
def summary(name, k):
    return json.load(open(f"{out}/{name}-r{k}.json"))["summary"]
print(f"\n| round | minicb tok/s | {peer} tok/s | ratio | minicb TTFT p99 | {peer} TTFT p99 |")
print("|---:|---:|---:|---:|---:|---:|")
ratios, ours, theirs, ttft_ours, ttft_theirs = [], [], [], [], []
for k in range(1, rounds + 1):
    a, b = summary("minicb", k), summary(peer, k)
    ours.append(a["output_token_throughput"])
    theirs.append(b["output_token_throughput"])
    ttft_ours.append(a["ttft_s"]["p99"])
    ttft_theirs.append(b["ttft_s"]["p99"])
    ratios.append(ours[-1] / theirs[-1])
    print(f"| {k} | {ours[-1]:.1f} | {theirs[-1]:.1f} | {ratios[-1]:.2f}x | {ttft_ours[-1]:.2f} s | "
          f"{ttft_theirs[-1]:.2f} s |")
med = statistics.median
print(f"| median | {med(ours):.1f} | {med(theirs):.1f} | {med(ratios):.2f}x | {med(ttft_ours):.2f} s | "
      f"{med(ttft_theirs):.2f} s |")
EOF
fi
