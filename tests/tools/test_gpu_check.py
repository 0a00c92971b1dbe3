"""The GPU check's pieces, on a CPU: the lengths replay, the bundle, and a dry run of tools/gpu_check.sh.

`make gpu-check` runs on an offline CUDA machine that the development machine
does not have, and a script nobody runs rots. So the last test here makes a
bundle the way `make gpu-bundle` does and runs the whole script on it with
GPU_CHECK_DRY=1: every step, on the CPU, with the Triton interpreter and tiny
shapes. It is marked slow (the bundle holds the real SmolLM2's tokenizer), and
`make test` runs it.
"""
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import pytest

from minicb.bench.workloads import Request, build_requests, replay_lengths

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_lengths_json_replays_each_answer_length(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"output_lengths": [3, 300, 0, 7]}))
    requests = [Request([1, 2], 256), Request([3], 256), Request([4, 5, 6], 256)]
    replayed = replay_lengths(requests, str(path), max_tokens=256)
    assert [(r.prompt_ids, r.max_tokens, r.ignore_eos) for r in replayed] == [
        ([1, 2], 3, True), ([3], 256, True), ([4, 5, 6], 1, True)]  # capped at max_tokens, at least 1
    with pytest.raises(ValueError, match="4 prompts; 5 were asked for"):
        replay_lengths(requests + [Request([7], 9)] * 2, str(path), 256)


def test_the_chat_workload_takes_the_lengths_json(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"output_lengths": [5, 9]}))

    class Tokenizer:  # the chat workload only needs the template
        def apply_chat_template(self, messages):
            return [10, len(messages[0]["content"]) % 50 + 3]

    args = types.SimpleNamespace(num_prompts=2, max_tokens=8, lengths_json=str(path), seed=0, rate=1.0)
    requests, arrivals, description = build_requests("chat", args, Tokenizer(), 100)
    assert [(r.max_tokens, r.ignore_eos) for r in requests] == [(5, True), (8, True)] and arrivals is None
    assert "real model's answer" in description and str(path) in description


@pytest.mark.slow
def test_the_gpu_check_runs_every_step_on_a_cpu(tmp_path):
    bundle = tmp_path / "bundle"
    made = subprocess.run([sys.executable, "tools/gpu_bundle.py", "bundle", "--out", str(bundle)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    assert "MiB" in made.stdout and (bundle / "smollm2" / "tokenizer.json").is_file()
    assert (bundle / "site" / "gguf" / "__init__.py").is_file(), "the pure-Python packages should be in site/"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["bytes"] <= 60 * 2**20

    out, report = tmp_path / "out", tmp_path / "report.md"
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_BUNDLE": str(bundle), "GPU_CHECK_OUT": str(out),
           "GPU_CHECK_REPORT": str(report), "GPU_CHECK_PYTHON": sys.executable}
    start = time.perf_counter()
    run = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=480)
    seconds = time.perf_counter() - start
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, f"the dry run failed after {seconds:.0f} s:\n{log}"
    parts = [line.split() for line in (out / "parts.txt").read_text().splitlines()]
    assert [name for name, *_ in parts] == ["tests", "kernel", "tile", "graphs", "model", "engine"], parts
    assert all(rc == "0" for _, rc, *_ in parts), parts
    text = report.read_text()
    for heading in ("## Parts", "## Tests", "## Kernel bandwidth", "## Decode steps: eager vs CUDA graphs",
                    "## Query-tile kernel", "## Engine benchmark"):
        assert heading in text, f"the report lacks {heading!r}:\n{text}"
    assert "dry run on a CPU" in text and " passed" in text
    for engine in ("minicb-continuous", "minicb-eager", "minicb-spec", "hf-generate", "hf-generate-batch"):
        assert f"| {engine} |" in text, f"the engine table lacks {engine}:\n{text}"
    assert "error:" not in text, text
    print(f"dry run of tools/gpu_check.sh: {seconds:.0f} s")
