#!/usr/bin/env bash
# make gpu-check: everything that needs a CUDA GPU, in one prepared run.
#   1. the whole test suite on the GPU (MINICB_DEVICE=cuda, compiled Triton)
#   2. every notebook, executed top to bottom
#   3. the Triton kernel benchmark at batch 64 x ctx 4096, bf16 (goal: >= 70% of HBM bandwidth),
#      and the query-tile kernel beside chapter 05's prefill on prefill and mixed steps
#   4. the engine benchmark (minicb with Triton attention vs HF transformers), bf16
# and a short report in build/gpu-report.md. Each part is time-limited, and a
# failing part is recorded without stopping the others; the script exits
# non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${GPU_CHECK_OUT:-build/gpu-check}
mkdir -p "$OUT"
report=build/gpu-report.md

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: torch sees no CUDA GPU here; nothing to do (run it on a CUDA machine)" >&2
    exit 1
fi

status=0
run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, remember failure
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 3 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1
run tests 240 env MINICB_DEVICE=cuda $PY -m pytest tests -q -p no:cacheprovider -x
run notebooks 150 $PY -m pytest --nbmake notebooks -q -p no:cacheprovider --nbmake-timeout=120
run kernel-bench 60 $PY -m minicb.triton_attention --batch 64 --ctx 4096 --dtype bfloat16 --json "$OUT/kernel.json"
run tile-bench 60 $PY -m minicb.tile_attention --dtype bfloat16
run engine-bench 150 $PY -m minicb bench --workload chat --device cuda --dtype bfloat16 --attention triton \
    --num-prompts 100 --max-tokens 256 --slots 32 --out "$OUT/bench.json"

{
    echo "# gpu-check report"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"
    echo "- torch: $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)'), triton: $($PY -c 'import triton; print(triton.__version__)')"
    echo
    echo '## parts'
    echo '```'; cat "$OUT/summary.txt"; echo '```'
    echo
    echo '## tests (last lines)'
    echo '```'; tail -n 5 "$OUT/tests.log"; echo '```'
    echo
    echo '## kernel benchmark'
    echo '```'; tail -n 15 "$OUT/kernel-bench.log"; echo '```'
    echo
    echo '## tile kernel vs chapter 05 prefill'
    echo '```'; tail -n 12 "$OUT/tile-bench.log"; echo '```'
    echo
    echo '## engine benchmark'
    if [ -f "$OUT/bench.md" ]; then cat "$OUT/bench.md"; else echo '```'; tail -n 15 "$OUT/engine-bench.log"; echo '```'; fi
} >"$report"
echo "wrote $report"
exit $status
