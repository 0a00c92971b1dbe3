#!/usr/bin/env bash
# make gpu-check: everything that needs a CUDA GPU, in one run on an offline machine.
#
# No pip, no network, no model download. It runs on the machine's own python3, which
# must already hold torch with CUDA and Triton (GPU_CHECK_PYTHON names another one),
# with the repository and the bundle's site/ on PYTHONPATH. Everything else comes
# from the bundle that `make gpu-bundle` prepares on a machine with network
# (build/gpu-bundle, or GPU_CHECK_BUNDLE; tools/gpu_bundle.py says what is in it).
# The SmolLM2 weights do not travel: the model is SmolLM2's exact shape with random
# weights, checked chapter against chapter.
#
#   0. preflight   the bundle, the Python packages, the GPU
#   1. tests       the engine's greedy tokens vs chapter 01's, Triton vs PyTorch, graphs vs
#                  eager (tests/engine/test_gpu_parity.py, tests/engine/test_cuda_graphs.py, the padding rows
#                  of tests/chapters/test_ch10_padding.py), and the
#                  kernels' own tests, with MINICB_DEVICE=cuda and compiled Triton
#   2. kernel      the Triton decode kernels at batch 64 x ctx 4096, bf16: bandwidth as a share
#                  of a measured device-to-device copy (python -m minicb.triton_attention)
#   3. tile        the query-tile kernel beside chapter 05's prefill (python -m minicb.tile_attention)
#   4. graphs      decode steps at batch 32, eager vs CUDA graphs (python tools/cuda_graph_bench.py)
#   5. model       SmolLM2's config and tokenizer from the bundle, random weights (tools/gpu_bundle.py)
#   6. engine      the bench on that model in bf16, replaying the real model's answer lengths:
#                  minicb continuous (graphs on, and off: minicb-eager), with speculative
#                  decoding (minicb-spec: random weights rarely repeat, so this is its cost
#                  when drafts are few) vs HF generate and HF's continuous batching
#                  (python -m minicb bench --lengths-json ...)
#   7. report      build/gpu-report.md (tools/gpu_report.py)
# Each part is time-limited (8.5 minutes in all at most), and a failing part is recorded
# without stopping the others; the script exits non-zero if any part failed.
#
# GPU_CHECK_DRY=1 takes every step on a CPU instead, with the Triton interpreter and tiny
# shapes (a minute or two): tests/tools/test_gpu_check.py runs it inside `make test`, so this
# script cannot rot unseen. Its figures are not GPU figures.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
DRY=${GPU_CHECK_DRY:-0}
OUT=${GPU_CHECK_OUT:-build/gpu-check}
REPORT=${GPU_CHECK_REPORT:-build/gpu-report.md}
BUNDLE=${GPU_CHECK_BUNDLE:-build/gpu-bundle}
if [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=${GPU_CHECK_PYTHON:-.venv/bin/python}; else PY=${GPU_CHECK_PYTHON:-python3}; fi

fail() { echo "gpu-check: $*" >&2; exit 1; }

# ---- 0. preflight -------------------------------------------------------------------------
for f in manifest.json smollm2/config.json smollm2/tokenizer.json chat_output_lengths.json; do
    [ -f "$BUNDLE/$f" ] || fail "the bundle $BUNDLE has no $f. Make it with \`make gpu-bundle\` on a machine" \
        "with network (it needs the venv and the SmolLM2 package), copy build/gpu-bundle here, then run this again"
done
BUNDLE=$(cd "$BUNDLE" && pwd)
export PYTHONPATH="$PWD:$BUNDLE/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 MINICB_DEVICE=cpu
    device=cpu
else
    device=cuda
    export MINICB_DEVICE=cuda
fi
"$PY" - "$DRY" <<'EOF' || fail "preflight failed with $PY (above). Torch with CUDA, Triton and the compiled" \
    "packages must be on this machine; the bundle can carry pure-Python ones only"
import importlib, sys
dry = sys.argv[1] == "1"
missing = []
for name in ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "jinja2", "tqdm",
             "matplotlib", "pytest", "hypothesis", "minicb"):
    try:
        importlib.import_module(name)
    except Exception as e:  # an import can fail in other ways than ModuleNotFoundError
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("cannot import: " + "; ".join(missing))
import torch
if not dry and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA GPU here (run it on a CUDA machine, or GPU_CHECK_DRY=1 "
             f"to rehearse on a CPU)")
EOF
rm -rf "$OUT"
mkdir -p "$OUT" "$(dirname "$REPORT")"

status=0
run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, remember failure
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0)) $limit" >>"$OUT/parts.txt"
    echo "$name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (time limit)')"
    tail -n 3 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

if [ "$DRY" = 1 ]; then
    # The CPU runs the GPU parity tests on the tiny model; `make test` runs the rest itself.
    tests=(tests/engine/test_gpu_parity.py)
    model_args=(--tiny)
    bench_size=(--num-prompts 4 --max-tokens 8 --slots 4 --hf-batch 2)
else
    tests=(tests/engine/test_gpu_parity.py tests/engine/test_cuda_graphs.py tests/chapters/test_ch10_padding.py
           tests/chapters/test_ch05_triton_attention.py tests/engine/test_tile_attention.py
           tests/engine/test_parts.py tests/engine/test_host_syncs.py
           tests/engine/test_logprobs.py tests/engine/test_structured_device.py)  # the parts and backends chosen
    # on CUDA; scores through the graphs; grammar masks onto CUDA logits
    model_args=()
    bench_size=(--num-prompts 64 --max-tokens 256 --slots 32 --hf-batch 16)
fi
: >"$OUT/parts.txt"
run tests 120 "$PY" -m pytest -q -rfEs -p no:cacheprovider -m "not slow" "${tests[@]}"
run kernel 45 "$PY" -m minicb.triton_attention --batch 64 --ctx 4096 --dtype bfloat16 --json "$OUT/kernel.json"
run tile 45 "$PY" -m minicb.tile_attention --dtype bfloat16
run graphs 45 "$PY" tools/cuda_graph_bench.py --seqs 32 --json "$OUT/graphs.json"
run model 45 "$PY" tools/gpu_bundle.py model --bundle "$BUNDLE" --out "$OUT/model" "${model_args[@]}"
run engine 180 "$PY" -m minicb bench --model "$OUT/model" --workload chat \
    --lengths-json "$BUNDLE/chat_output_lengths.json" --device "$device" --dtype bfloat16 --attention triton \
    "${bench_size[@]}" --engines minicb-continuous,minicb-eager,minicb-spec,hf-generate,hf-generate-batch \
    --out "$OUT/bench.json"
rm -rf "$OUT/model"  # 0.5 GB of random weights: made again in seconds

"$PY" tools/gpu_report.py --out "$OUT" --report "$REPORT" --dry "$DRY" --seconds $((SECONDS - start)) || status=1
echo "gpu-check: $((SECONDS - start)) s in all, exit $status; wrote $REPORT"
exit $status
