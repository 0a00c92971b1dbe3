"""lm-eval's own command line, with the time its evaluation took written to a file.

    .venv-eval/bin/python tools/lm_eval_timed.py build/t/evaluate_s run --model hf --tasks ...

Everything after the file name goes to lm-eval as if typed after `lm-eval`.
tools/eval_check.sh times each whole command too; this adds the part that
depends on the backend alone. A command's wall time also holds Python's imports,
reading the task and, for `--model hf`, loading the model, the same few seconds
whichever backend answers; lm_eval.evaluator.evaluate() is the part that builds
the requests, sends them to the model (the server, or HF transformers in this
process) and scores the answers. Its seconds go to the file.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: {sys.argv[0]} SECONDS_FILE LM_EVAL_ARGUMENTS...")
    seconds_file = Path(sys.argv.pop(1))

    import lm_eval.evaluator
    from lm_eval.__main__ import cli_evaluate

    # simple_evaluate() calls evaluate() by its module-level name, so wrapping that name times every call.
    evaluate = lm_eval.evaluator.evaluate

    def timed_evaluate(*args, **kwargs):
        start = time.perf_counter()
        results = evaluate(*args, **kwargs)
        seconds_file.write_text(f"{time.perf_counter() - start:.3f}\n")
        return results

    lm_eval.evaluator.evaluate = timed_evaluate
    sys.argv[0] = "lm-eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
