"""Two lm-eval runs of the same tasks, side by side: minicb's server against HF transformers.

    .venv-eval/bin/python tools/eval_check.py build/eval-check         # the last step of make eval-check
    .venv-eval/bin/python tools/eval_check.py build/eval-check --min-speedup 2

tools/eval_check.sh runs lm-eval four times: each task of tools/eval_task/ once
with `--model local-completions` against `python -m minicb serve` and once with
`--model hf` on the same weights, each with `--log_samples`, into

    <out>/<backend>/<task>/            lm-eval's --output_path (backend: minicb or hf)
        <model name>/samples_<task>_<date>.jsonl   one line per document
        <model name>/results_<date>.json           the task's metrics
        wall_s                                     the command's wall seconds, written by the script
        evaluate_s                                 the seconds in lm-eval's evaluate() (tools/lm_eval_timed.py)
        load                                       the 1-minute load average as it ended (/proc/loadavg)

This file reads those and decides whether minicb is a faithful server. For every
document both runs must have seen the same prompt (lm-eval's `prompt_hash`);
every choice of a multiple-choice question must get the same log-likelihood from
both within `--atol` (1e-4: both are fp32, so only the order of the additions
differs); every greedy generation must be the same text; and each metric
(acc, acc_norm, exact_match) must be equal. It prints a markdown table with the
measured times, and exits 1 when any of these fails (or, with --min-speedup, when
minicb is not that many times faster on a task that scores choices).

What lm-eval writes in a samples file, one JSON object per document (0.4.x):

    {"doc_id": 0, "doc": {...}, "arguments": {"gen_args_0": {"arg_0": context, "arg_1": " choice"}, ...},
     "resps": [[["-10.91", "False"]], [["-13.2", "False"]], ...],    # one [loglikelihood, is_greedy] per choice
     "filtered_resps": [["-10.91", "False"], ...],
     "metrics": ["acc", "acc_norm"], "acc": 1.0, "acc_norm": 1.0, "prompt_hash": "...", ...}

The numbers arrive as strings ("-10.91", "False"): lm-eval writes what it cannot
serialise with str(). A generation task's `resps` is [[" Paris"]], one text per
document, and its `filtered_resps` is ["Paris"] after the task's filters.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("minicb", "hf")  # the folder names tools/eval_check.sh writes, in the table's order
ATOL = 1e-4


# ----------------------------------------------------------------------------
# Reading what lm-eval wrote


@dataclass
class Sample:
    """One document's answers in one run."""
    doc_id: int
    prompt_hash: str
    loglikelihoods: list[float] | None  # one per choice, for a loglikelihood task; else None
    generation: str | None              # the filtered text, for a generate_until task; else None
    metrics: dict[str, float]           # e.g. {"acc": 1.0, "acc_norm": 0.0}


def as_float(value) -> float:
    """lm-eval's "-10.91" (or a plain number) as a float; anything else is refused by name."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a log-likelihood, a number or its text; got {value!r}") from None


def parse_sample(record: dict) -> Sample:
    """One line of a samples file -> Sample. Which kind of task it came from shows in `resps`."""
    resps = record["resps"]
    if not resps or not resps[0]:
        raise ValueError(f"document {record.get('doc_id')}: empty resps {resps!r}")
    first = resps[0][0]
    loglikelihoods = generation = None
    if isinstance(first, (list, tuple)):
        # A loglikelihood request per choice, each answered once: [[ll, is_greedy]].
        loglikelihoods = [as_float(resp[0][0]) for resp in resps]
    elif isinstance(first, str):
        # One generate_until request; its text after the task's filters, as it was scored.
        filtered = record["filtered_resps"]
        generation = filtered[0] if isinstance(filtered, list) else filtered
    else:
        raise ValueError(f"document {record.get('doc_id')}: resps hold neither [loglikelihood, is_greedy] pairs "
                         f"nor generated text: {resps!r}")
    metrics = {name: as_float(record[name]) for name in record.get("metrics", [])}
    return Sample(int(record["doc_id"]), record.get("prompt_hash", ""), loglikelihoods, generation, metrics)


def read_samples(path: Path) -> dict[int, Sample]:
    samples = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                sample = parse_sample(json.loads(line))
            except (ValueError, KeyError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}, line {number}: {e}") from None
            samples[sample.doc_id] = sample
    if not samples:
        raise ValueError(f"{path} holds no samples")
    return samples


def read_metrics(results: dict, task: str) -> dict[str, float]:
    """A results file's numbers for `task`: {"acc,none": 0.9, ...}, the stderrs left out."""
    numbers = results["results"][task]
    return {key: float(value) for key, value in numbers.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))}


@dataclass
class Run:
    """One lm-eval invocation: one backend on one task."""
    backend: str
    task: str
    samples: dict[int, Sample]
    metrics: dict[str, float]
    wall_s: float | None
    evaluate_s: float | None = None  # the requests and their scoring: start-up and model loading left out
    load: float | None = None  # the machine's 1-minute load average at the end: how shared the CPU was
    versions: dict[str, str] = field(default_factory=dict)


def newest(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no {pattern} under {folder}: did that lm-eval run finish? (its log is beside it)")
    return found[-1]  # lm-eval's names end in an ISO date: the last is the newest


def read_run(out: Path, backend: str, task: str) -> Run:
    folder = out / backend / task
    results = json.loads(newest(folder, "*/results_*.json").read_text())

    def number(name):  # a figure the script wrote beside the run, if it did
        path = folder / name
        return float(path.read_text()) if path.is_file() else None

    return Run(backend, task, read_samples(newest(folder, f"*/samples_{task}_*.jsonl")), read_metrics(results, task),
               number("wall_s"), number("evaluate_s"), number("load"),
               {name: str(results.get(key, "?")) for name, key in (("lm-eval", "lm_eval_version"),
                                                                    ("transformers", "transformers_version"))})


# ----------------------------------------------------------------------------
# Comparing two runs of one task


@dataclass
class Comparison:
    task: str
    num_docs: int
    num_scores: int = 0         # log-likelihoods compared (choices over all documents)
    max_abs_diff: float = 0.0   # the largest |minicb - hf| among them
    worst: str = ""             # where it was: "doc 3, choice 1"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def compare(ours: Run, reference: Run, atol: float = ATOL) -> Comparison:
    """Every document, choice and metric of `ours` against `reference`; what differs lands in .problems."""
    result = Comparison(ours.task, len(reference.samples))
    problems = result.problems
    if ours.samples.keys() != reference.samples.keys():
        missing = sorted(reference.samples.keys() - ours.samples.keys())
        extra = sorted(ours.samples.keys() - reference.samples.keys())
        problems.append(f"documents differ: {ours.backend} lacks {missing[:5]}, has extra {extra[:5]}")
    for doc_id in sorted(ours.samples.keys() & reference.samples.keys()):
        a, b = ours.samples[doc_id], reference.samples[doc_id]
        if a.prompt_hash != b.prompt_hash:
            problems.append(f"doc {doc_id}: the two runs saw different prompts (prompt_hash {a.prompt_hash[:12]} "
                            f"vs {b.prompt_hash[:12]})")
            continue
        if (a.loglikelihoods is None) != (b.loglikelihoods is None):
            problems.append(f"doc {doc_id}: one run scored choices, the other generated text")
            continue
        if a.loglikelihoods is not None:
            if len(a.loglikelihoods) != len(b.loglikelihoods):
                problems.append(f"doc {doc_id}: {len(a.loglikelihoods)} choices scored vs {len(b.loglikelihoods)}")
                continue
            for choice, (x, y) in enumerate(zip(a.loglikelihoods, b.loglikelihoods)):
                diff = abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf
                result.num_scores += 1
                if diff > result.max_abs_diff or not result.worst:
                    result.max_abs_diff, result.worst = diff, f"doc {doc_id}, choice {choice}"
                if diff > atol:
                    problems.append(f"doc {doc_id}, choice {choice}: log-likelihood {x:.6f} ({ours.backend}) vs "
                                    f"{y:.6f} ({reference.backend}), |diff| {diff:.2e} > {atol:.0e}")
        elif a.generation != b.generation:
            problems.append(f"doc {doc_id}: generated {a.generation!r} ({ours.backend}) vs {b.generation!r} "
                            f"({reference.backend})")
        if a.metrics != b.metrics:
            problems.append(f"doc {doc_id}: scored {a.metrics} ({ours.backend}) vs {b.metrics} ({reference.backend})")
    for key in sorted(ours.metrics.keys() | reference.metrics.keys()):
        x, y = ours.metrics.get(key), reference.metrics.get(key)
        if x is None or y is None or abs(x - y) > 1e-12:  # means of the same 0/1 scores: equal, not close
            problems.append(f"{key}: {x} ({ours.backend}) vs {y} ({reference.backend})")
    return result


# ----------------------------------------------------------------------------
# The report


def cpu_model() -> str:
    """minicb/bench/machine.py's, loaded from its file: this script runs in lm-eval's venv, where
    importing the minicb package (torch, numba, fastapi, ...) is not an option."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("minicb_machine", Path(__file__).parent.parent / "minicb" / "bench"
                                                  / "machine.py")
    machine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(machine)
    return machine.cpu_model()


def speedup(ours: float | None, reference: float | None) -> float | None:
    """How many times faster `ours` ran: reference seconds / ours."""
    if not ours or reference is None:
        return None
    return reference / ours


def seconds(ours: float | None, reference: float | None) -> list[str]:
    """The table's three cells for one pair of times: minicb's, hf's, and how many times faster minicb was."""
    ratio = speedup(ours, reference)
    return ["?" if ours is None else f"{ours:.1f}", "?" if reference is None else f"{reference:.1f}",
            "?" if ratio is None else f"{ratio:.2f}x"]


def table(pairs: list[tuple[Run, Run, Comparison]], min_speedup: float | None) -> str:
    """The markdown report: machine and date, then a row per task."""
    versions = pairs[0][1].versions
    lines = [
        "lm-eval on minicb's server (`local-completions`, prefix caching on) and on HF transformers (`hf`), same "
        "SmolLM2-135M-Instruct weights, fp32.",
        "",
        f"- CPU: {cpu_model()} ({os.cpu_count()} cores seen)",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- lm-eval {versions.get('lm-eval', '?')}, transformers {versions.get('transformers', '?')}",
        "",
        "| task | docs | metric | minicb | hf | log-likelihoods compared | max abs diff "
        "| wall s, minicb | wall s, hf | hf / minicb | evaluate() s, minicb | evaluate() s, hf | hf / minicb "
        "| load after (minicb / hf) | check |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for ours, reference, result in pairs:
        metrics = " / ".join(key.split(",")[0] for key in sorted(reference.metrics))
        values = [" / ".join(f"{run.metrics.get(key, math.nan):.4f}" for key in sorted(reference.metrics))
                  for run in (ours, reference)]
        scored = result.num_scores > 0
        lines.append("| " + " | ".join([
            result.task, str(result.num_docs), metrics, *values,
            str(result.num_scores) if scored else "(generated text)",
            f"{result.max_abs_diff:.1e}" if scored else "-",
            *seconds(ours.wall_s, reference.wall_s),
            *seconds(ours.evaluate_s, reference.evaluate_s),
            " / ".join("?" if run.load is None else f"{run.load:.1f}" for run in (ours, reference)),
            "ok" if result.ok else f"FAIL ({len(result.problems)})",
        ]) + " |")
    lines += ["", "wall s: each lm-eval command, start-up and model loading included (the server was started "
              "before). evaluate() s: the part of it in lm-eval's evaluate(), which builds the requests, has them "
              "answered and scores them. load: the machine's 1-minute load average at the end of the run, the run's "
              f"own threads included; well above {os.cpu_count()}, other programs shared the CPU."]
    if min_speedup:
        lines += ["", f"Goal: minicb at least {min_speedup:g}x faster than hf in lm-eval's evaluate() on every "
                      "task that scores choices."]
    return "\n".join(lines)


def too_slow(pairs: list[tuple[Run, Run, Comparison]], min_speedup: float) -> list[str]:
    """The tasks that score choices on which minicb is not min_speedup times faster: in lm-eval's
    evaluate() where both runs have its time (start-up and model loading are not serving), else wall s."""
    slow = []
    for ours, reference, result in pairs:
        timed = "evaluate()" if ours.evaluate_s is not None and reference.evaluate_s is not None else "wall"
        mine, theirs = (ours.evaluate_s, reference.evaluate_s) if timed == "evaluate()" else (ours.wall_s,
                                                                                             reference.wall_s)
        ratio = speedup(mine, theirs)
        if result.num_scores and (ratio is None or ratio < min_speedup):
            slow.append(f"{result.task}: minicb {mine} s vs hf {theirs} s ({timed}), "
                        f"{'?' if ratio is None else f'{ratio:.2f}'}x; the goal is {min_speedup:g}x")
    return slow


def tasks_in(out: Path) -> list[str]:
    return sorted(p.name for p in (out / BACKENDS[0]).iterdir() if p.is_dir()) if (out / BACKENDS[0]).is_dir() else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder tools/eval_check.sh wrote (build/eval-check)")
    ap.add_argument("--tasks", nargs="+", default=None, help="task names (default: every folder under OUT/minicb)")
    ap.add_argument("--atol", type=float, default=ATOL, help=f"largest allowed |log-likelihood difference| (default {ATOL})")
    ap.add_argument("--min-speedup", type=float, default=None,
                    help="fail unless minicb's lm-eval command is this many times faster (wall time) than hf's, "
                         "on every task that scores choices")
    ap.add_argument("--report", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)

    tasks = args.tasks or tasks_in(args.out)
    if not tasks:
        print(f"error: no task folders under {args.out / BACKENDS[0]}; run tools/eval_check.sh first", file=sys.stderr)
        return 2
    pairs = []
    for task in tasks:
        ours, reference = (read_run(args.out, backend, task) for backend in BACKENDS)
        pairs.append((ours, reference, compare(ours, reference, args.atol)))

    report = table(pairs, args.min_speedup)
    print(report)
    if args.report:
        args.report.write_text(report + "\n")
    failures = [f"{result.task}: {problem}" for _, _, result in pairs for problem in result.problems]
    if args.min_speedup:
        failures += too_slow(pairs, args.min_speedup)
    if failures:
        print(f"\nFAIL: {len(failures)} difference(s) between minicb and hf:", file=sys.stderr)
        for line in failures[:20]:
            print(f"  {line}", file=sys.stderr)
        if len(failures) > 20:
            print(f"  ... and {len(failures) - 20} more", file=sys.stderr)
        return 1
    print("\nminicb and hf agree: every log-likelihood within "
          f"{args.atol:.0e}, every generation and every metric equal.")
    for _, _, result in pairs:
        if result.num_scores:
            print(f"{result.task}: the largest difference, {result.max_abs_diff:.1e}, is at {result.worst}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
