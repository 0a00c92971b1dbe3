#!/usr/bin/env bash
# lm-eval as a real client of minicb's server, checked against lm-eval's own HF backend (make eval-check).
#
# What it does, in order:
#   1. installs lm-eval into a venv of its own, .venv-eval (torch==2.13.0 first, for the small
#      CPU wheel), the first time; later runs reuse it. The project's .venv is left alone.
#   2. asks minicb (the .venv) for SmolLM2's HF-format checkpoint, which it converts once from
#      the GGUF file, and writes the tokenizer beside the results, so nothing touches a hub.
#   3. starts `python -m minicb serve --enable-prefix-caching --linear-backend mkl` on 127.0.0.1 at
#      a free port (MKL's matmuls, as HF's are: a prompt's forward then rounds as HF's does, and only
#      the different attention and batch shapes remain; oneDNN's packed products differ in the last
#      bits, which over a ten-token continuation came near the 1e-4 the check allows),
#      checks that /v1/completions scores a prompt (echo + logprobs), and runs lm-eval
#      `--model local-completions` on the two tasks of tools/eval_task/: a multiple-choice task
#      (30 passages, 4 choices each: loglikelihood requests that share long prefixes) and a
#      generation task (16 one-word answers, greedy until a newline, exact match).
#   4. runs each task with `--model hf` on the same checkpoint, fp32, right after minicb's run
#      of it, then stops the server (always: on failure and Ctrl-C too).
#   5. tools/eval_check.py compares the two runs' --log_samples files: every log-likelihood
#      within 1e-4, every generation and metric equal. It prints a markdown table with the times
#      of both (each command's wall time, and the part in lm-eval's evaluate(), which leaves out
#      start-up and model loading) and exits non-zero when anything differs.
#
# Each run's lm-eval output is in build/eval-check/<backend>-<task>.log, the server's in
# build/eval-check/server.log, the table in build/eval-check/report.md. Settings:
#   EVAL_CHECK_CONCURRENT  requests lm-eval keeps in flight to the server (default 2)
#   EVAL_CHECK_MINICB_BATCH prompts lm-eval puts in each of them, as a list (default 16): one
#                          request of the engine each, admitted together, so a step computes many
#   EVAL_CHECK_HF_BATCH    the hf backend's --batch_size (default 8)
#   EVAL_CHECK_TOKENIZER   local (default): lm-eval tokenizes for the server with the saved tokenizer
#                          files, as for hf; remote: with the server's own /tokenize (lm-eval's
#                          tokenizer_backend=remote, which reads /tokenizer_info first)
#   EVAL_CHECK_LINEAR_BACKEND the server's --linear-backend (default mkl, as in step 3; auto or onednn:
#                          minicb's fastest on this CPU, agreeing with HF to the last bits less often)
#   EVAL_CHECK_MIN_SPEEDUP fail unless minicb is this many times faster on the multiple-choice
#                          task (default: empty, the ratio is reported, not enforced)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
EVAL_VENV="${EVAL_VENV:-.venv-eval}"
EVAL_PY="$EVAL_VENV/bin/python"
OUT="${EVAL_CHECK_OUT:-build/eval-check}"
TASKS=(minicb_facts_mc minicb_facts_sentence_mc minicb_facts_gen)
MODEL_NAME="SmolLM2-135M-Instruct"
CONCURRENT="${EVAL_CHECK_CONCURRENT:-2}"
MINICB_BATCH="${EVAL_CHECK_MINICB_BATCH:-16}"
HF_BATCH="${EVAL_CHECK_HF_BATCH:-8}"
TOKENIZER_BACKEND="${EVAL_CHECK_TOKENIZER:-local}"
MIN_SPEEDUP="${EVAL_CHECK_MIN_SPEEDUP:-}"
LINEAR_BACKEND="${EVAL_CHECK_LINEAR_BACKEND:-mkl}"
START_TIMEOUT="${EVAL_CHECK_START_TIMEOUT:-300}"  # seconds for the model to load and the server to answer
# lm-eval's parsing of the samples files (tools/eval_check.py) is written for this release.
LM_EVAL_SPEC="lm-eval[hf,api]==0.4.13"
TORCH_SPEC="torch==2.13.0"

# Nothing may come from a hub: the weights, the tokenizer and the data are all on disk.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

say() { echo "[eval-check] $*"; }
die() { echo "[eval-check] FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
began="$(now)"

[ -x "$PY" ] || die "no Python at $PY; run 'make setup' first"
case "$TOKENIZER_BACKEND" in
    local|remote) ;;
    *) die "EVAL_CHECK_TOKENIZER=$TOKENIZER_BACKEND; use local or remote" ;;
esac

# ---- 1. lm-eval in a venv of its own ---------------------------------------------------------
STAMP="$EVAL_VENV/.eval-check-installed"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$TORCH_SPEC $LM_EVAL_SPEC" ]; then
    say "installing $LM_EVAL_SPEC into $EVAL_VENV ($TORCH_SPEC first; a minute or two, once)"
    [ -x "$EVAL_PY" ] || python3 -m venv "$EVAL_VENV"
    # torch first and pinned: left to lm-eval's requirements, pip would pick a CUDA build of gigabytes.
    "$EVAL_PY" -m pip install --disable-pip-version-check -q "$TORCH_SPEC"
    "$EVAL_PY" -m pip install --disable-pip-version-check -q "$LM_EVAL_SPEC"
    echo "$TORCH_SPEC $LM_EVAL_SPEC" >"$STAMP"
else
    say "reusing $EVAL_VENV ($(cat "$STAMP"))"
fi

# ---- 2. the checkpoint and its tokenizer, from minicb --------------------------------------------
rm -rf "$OUT/minicb" "$OUT/hf" "$OUT/tokenizer" "$OUT/report.md" "$OUT"/*.log  # the last run's, and only those
mkdir -p "$OUT"
say "finding SmolLM2's HF checkpoint (converted from the GGUF file the first time)"
CHECKPOINT="$("$PY" -c 'from minicb.weights import resolve_checkpoint; print(resolve_checkpoint(None))')"
TOKENIZER="$OUT/tokenizer"
# The tokenizer minicb serves with, saved in HF's layout: both lm-eval backends load it by path.
"$PY" -c 'import sys; from minicb.tokenizer import load_tokenizer; load_tokenizer(None).hf.save_pretrained(sys.argv[1])' \
    "$TOKENIZER" >/dev/null
say "checkpoint: $CHECKPOINT"

# One lm-eval run: backend name, task, then lm-eval's model arguments. Its wall time goes to
# wall_s, the time of lm-eval's evaluate() alone (the requests and their scoring) to evaluate_s.
run_lm_eval() {
    local backend="$1" task="$2"
    shift 2
    local dir="$OUT/$backend/$task" log="$OUT/$backend-$task.log"
    mkdir -p "$dir"
    say "lm-eval --model $2 on $task (log: $log)"
    local start end
    start="$(now)"
    # lm-eval's command line, through a wrapper that also writes the seconds of its evaluate() step.
    if ! "$EVAL_PY" tools/lm_eval_timed.py "$dir/evaluate_s" run "$@" --tasks "$task" --include_path tools/eval_task \
        --log_samples --output_path "$dir" >"$log" 2>&1; then
        tail -n 25 "$log" >&2
        die "lm-eval --model $2 on $task failed; the whole log is $log"
    fi
    end="$(now)"
    awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f\n", b - a }' >"$dir/wall_s"
    cut -d' ' -f1 /proc/loadavg >"$dir/load" 2>/dev/null || true  # how busy the machine was, for the table
    say "  done in $(cat "$dir/wall_s") s, $(cat "$dir/evaluate_s") s of them in lm-eval's evaluate()"
}

# ---- 3. minicb's server, with prefix caching -----------------------------------------------------
stop_server() {
    status=$?
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true  # a graceful shutdown: drain, abort, exit
        for _ in $(seq 1 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        say "server stopped"
    fi
    SERVER_PID=""
    return "$status"
}
SERVER_PID=""
trap 'stop_server; exit $?' EXIT
trap 'exit 130' INT TERM

PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
say "starting python -m minicb serve --enable-prefix-caching --linear-backend $LINEAR_BACKEND on 127.0.0.1:$PORT (log: $OUT/server.log)"
setsid "$PY" -m minicb serve --host 127.0.0.1 --port "$PORT" --device cpu --dtype float32 \
    --served-model-name "$MODEL_NAME" --enable-prefix-caching --linear-backend "$LINEAR_BACKEND" --shutdown-timeout 5 --log-level warning \
    >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
for attempt in $(seq 1 "$START_TIMEOUT"); do
    if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$URL/health" 2>/dev/null; then
        break
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -n 20 "$OUT/server.log" >&2; die "the server exited while starting; see $OUT/server.log"; }
    [ "$attempt" -lt "$START_TIMEOUT" ] || die "the server did not answer /health within $START_TIMEOUT s; see $OUT/server.log"
    sleep 1
done
say "server is up at $URL"

# lm-eval scores a choice by sending context + choice as token ids with echo and logprobs, and
# reading the prompt's own log-probabilities back. One such request first, to fail here, clearly.
"$EVAL_PY" - "$URL" "$MODEL_NAME" <<'EOF' || die "the server does not score prompts the way lm-eval asks (above)"
import json, sys, urllib.error, urllib.request
url, model = sys.argv[1], sys.argv[2]
prompt = [[19556, 905, 28, 338, 314]]  # "Hello world, this is": any ids will do
body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, "seed": 1234}
request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
try:
    answer = json.load(urllib.request.urlopen(request, timeout=60))
except urllib.error.HTTPError as e:
    sys.exit(f"POST /v1/completions {json.dumps(body)}\n  -> {e.code} {e.read().decode(errors='replace')}")
logprobs = answer["choices"][0].get("logprobs") or {}
scores = logprobs.get("token_logprobs") or []
if len(scores) != len(prompt[0]) + 1 or scores[0] is not None or not logprobs.get("top_logprobs"):
    sys.exit(f"POST /v1/completions {json.dumps(body)}\n  -> expected token_logprobs for the 5 prompt tokens "
             f"(the first null) and the 1 generated, and top_logprobs; got {json.dumps(logprobs)[:400]}")
EOF
say "the server scores prompts (echo + logprobs)"

# tokenized_requests: lm-eval sends token ids, made with the tokenizer the hf run reads (the saved
# files, or the server's /tokenize, which serves the same one), so both runs score exactly the
# same tokens. num_concurrent: requests in flight, which the engine
# batches; the choices of one question share their context, which the prefix cache keeps.
if [ "$TOKENIZER_BACKEND" = remote ]; then
    LOCAL_ARGS="base_url=$URL/v1/completions,model=$MODEL_NAME,tokenizer_backend=remote"
else
    LOCAL_ARGS="base_url=$URL/v1/completions,model=$MODEL_NAME,tokenizer=$TOKENIZER,tokenizer_backend=huggingface"
fi
LOCAL_ARGS="$LOCAL_ARGS,tokenized_requests=True,num_concurrent=$CONCURRENT,max_retries=1,timeout=600"

# ---- 4. lm-eval's HF backend on the same weights, right after minicb on each task -----------------
# Run one after the other on the same task, the two times see about the same machine: on a
# shared one, other work comes and goes. The idle server meanwhile takes no CPU time.
# add_bos_token=False: as the local-completions run sends its prompts, and as minicb encodes.
HF_ARGS="pretrained=$CHECKPOINT,tokenizer=$TOKENIZER,dtype=float32,add_bos_token=False"
for task in "${TASKS[@]}"; do
    run_lm_eval minicb "$task" --model local-completions --model_args "$LOCAL_ARGS" --batch_size "$MINICB_BATCH"
    run_lm_eval hf "$task" --model hf --model_args "$HF_ARGS" --device cpu --batch_size "$HF_BATCH"
done
stop_server

# ---- 5. the comparison --------------------------------------------------------------------------
say "comparing the two runs (tools/eval_check.py)"
echo
"$EVAL_PY" tools/eval_check.py "$OUT" --tasks "${TASKS[@]}" --report "$OUT/report.md" \
    ${MIN_SPEEDUP:+--min-speedup "$MIN_SPEEDUP"} || die "minicb and the hf backend disagree (above); logs in $OUT"
echo
say "passed in $(awk -v a="$began" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }') s; the table is in $OUT/report.md"
