#!/usr/bin/env bash
# minicb's server against HF transformers' own OpenAI-compatible server, on the same
# SmolLM2 weights (fp32, CPU), driven one after the other by the same bench-serve run.
#
#   bash tools/peer_serve.sh                      # 32 prompts, 64 tokens, 32 at once
#   NUM_PROMPTS=16 MAX_TOKENS=32 bash tools/peer_serve.sh
#   PEER_FLAGS=--continuous-batching PEER_ONLY=1 bash tools/peer_serve.sh   # the peer's other mode alone
#
# The peer is `transformers serve DIR`, with DIR an HF checkpoint directory made from
# the embedded GGUF: minicb's converted config.json and model.safetensors (Q/K
# un-permuted, as HF expects) beside the GGUF's tokenizer files. Each server gets the
# machine alone; reports go to build/peer/. Needs nothing from the network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NUM_PROMPTS=${NUM_PROMPTS:-32}
MAX_TOKENS=${MAX_TOKENS:-64}
CONCURRENCY=${CONCURRENCY:-32}
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

if [ -z "${PEER_ONLY:-}" ]; then
  echo "== minicb serve =="
  run minicb 8012 "$PY" -m minicb serve --port 8012 --device cpu --dtype float32 --max-num-seqs "$CONCURRENCY"
fi
echo "== transformers serve $DIR $PEER_FLAGS =="
# shellcheck disable=SC2086  # PEER_FLAGS is a list of flags
run "peer${PEER_FLAGS:+-cb}" 8011 .venv/bin/transformers serve "$DIR" --device cpu --dtype float32 --host 127.0.0.1 --port 8011 \
    $PEER_FLAGS
