"""How long `python -m minicb check N` takes, and how much memory, on each chapter's reference solution.

    .venv/bin/python tools/check_times.py                        # every chapter with an exercise
    .venv/bin/python tools/check_times.py --chapters 3 6 --full  # two chapters, the slow tests too
    .venv/bin/python tools/check_times.py --json build/check_times.json

A teacher needs these figures to plan: how long a student waits for a grade, how
long a grading machine (GitHub Actions, Gradescope) runs per submission, and how
much memory it must have. For each chapter this grades the reference module
(`minicb/<module>.py`, the module `minicb.impl.CHAPTERS` names for the chapter)
exactly as a submission is graded, with `check N --file ... --format json`, and
then:

- picks the task whose tests took longest (from the report's per-task `seconds`)
  and times `check N --task K` alone: what a student waits for while working on
  that task;
- with `--full`, times `check N --full` too (the real-model tests as well).

It prints a markdown table with the date, the machine and this command, and
exits non-zero, naming the chapter and the failing tasks, as soon as a
reference solution does not pass: a figure for a failing grade means nothing.
Run it on an otherwise idle machine: every figure is one run's wall time.

Peak memory: each command runs under a small wrapper process (WRAPPER below,
a bare interpreter), which starts it, waits for it and reads
`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`: the high-water mark the kernel
kept for the largest single process among the wrapper's descendants, here the
pytest child that `check` starts, which loads torch and runs the tests. It is
exact, not sampled, and it belongs to this one run, since each wrapper has only
this one child. Two simpler ways would be wrong:

- `getrusage(RUSAGE_CHILDREN)` in this process after each run is a running
  maximum over every child it ever waited for: a small run after a big one
  would report the big one's peak.
- `os.wait4` on each child from this process: on Linux a child's `ru_maxrss`
  starts at its parent's resident size when it was forked (the high-water mark
  of the copied memory is kept across exec). This process holds torch (through
  `import minicb`), so every figure would be at least its size, 220 MiB here.
  The wrapper is the parent instead, and it holds 11 MiB.

The grading parent (`python -m minicb check`), which runs beside its pytest
child, is not added in: the figure is the largest process, not the sum.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The caller's environment, for the report: importing minicb sets OMP_WAIT_POLICY's default in os.environ.
CALLER_ENV = dict(os.environ)
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: import minicb from this checkout

from minicb import impl  # noqa: E402


@dataclass
class Run:
    command: list[str]
    seconds: float  # wall time, from start to exit
    peak_rss_mib: float  # the largest process of the run's tree, at its peak
    returncode: int
    stdout: str
    stderr: str


# Runs sys.argv[2:], then writes its wall time, exit code and peak RSS (KiB on Linux, bytes on macOS) as JSON
# to sys.argv[1]. Started with -I -S: a bare interpreter, so that its own size, which its child starts from,
# stays small.
WRAPPER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
returncode = subprocess.run(sys.argv[2:]).returncode
seconds = time.perf_counter() - start
with open(sys.argv[1], "w") as file:
    json.dump({"seconds": seconds, "returncode": returncode,
               "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}, file)
"""


def run_measured(command: list[str]) -> Run:
    """Run `command` from the repository root; its wall time and its own tree's peak RSS (see the docstring)."""
    with tempfile.TemporaryDirectory() as scratch:
        figures = Path(scratch) / "figures.json"
        wrapper = subprocess.run([sys.executable, "-I", "-S", "-c", WRAPPER, str(figures), *command], cwd=ROOT,
                                 capture_output=True, text=True, errors="replace")
        if not figures.is_file():  # the wrapper itself failed (the command not found, say)
            return Run(command, 0.0, 0.0, wrapper.returncode or 1, wrapper.stdout, wrapper.stderr)
        measured = json.loads(figures.read_text())
    maxrss = measured["maxrss"] / (2**20 if sys.platform == "darwin" else 2**10)  # -> MiB
    return Run(command, measured["seconds"], maxrss, measured["returncode"], wrapper.stdout, wrapper.stderr)


def reference_file(module: str) -> Path:
    """The reference solution of a chapter module: "block_allocator" -> minicb/block_allocator.py,
    "serve.loop" -> minicb/serve/loop.py."""
    return ROOT / "minicb" / (module.replace(".", "/") + ".py")


def check_command(chapter: int, *extra: str) -> list[str]:
    """`python -m minicb check N --file <reference> --format json ...`, with this interpreter."""
    module = impl.module_for_chapter(chapter)
    return [sys.executable, "-m", "minicb", "check", str(chapter), "--file", str(reference_file(module)),
            "--format", "json", *extra]


class ReferenceFailed(RuntimeError):
    """A reference solution did not pass its own chapter's grade."""


def graded(chapter: int, *extra: str) -> tuple[Run, dict]:
    """Run one measured grade of the reference; its Run and its JSON report. Raises ReferenceFailed
    unless the grade passed."""
    run = run_measured(check_command(chapter, *extra))
    shown = shlex.join(["python", "-m", "minicb", "check", str(chapter), *extra])
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        raise ReferenceFailed(f"chapter {chapter}: `{shown}` printed no JSON report (exit {run.returncode}); "
                              f"its stderr ends:\n{run.stderr[-2000:]}") from None
    if run.returncode != 0 or not report.get("passed"):
        failing = [f"task {t['task']}: {t['passed']}/{t['total']} passed, {t['status']}"
                   + (f" ({t['first_failure']})" if t["first_failure"] else "")
                   for t in report.get("tasks", []) if t["status"] != "PASS"]
        raise ReferenceFailed(f"chapter {chapter}: the reference solution does not pass `{shown}` "
                              f"(exit {run.returncode}):\n  " + "\n  ".join(failing + report.get("errors", [])))
    return run, report


def slowest_task(report: dict) -> dict:
    """The task whose tests took the most seconds (the first of equals). Unmarked tests ("?") cannot be
    selected with --task, so they are not candidates."""
    candidates = [t for t in report["tasks"] if t["task"] != "?"]
    if not candidates:
        raise ReferenceFailed(f"chapter {report['chapter']}: the report has no task to time on its own")
    return max(candidates, key=lambda t: t["seconds"])


def tally(report: dict) -> dict:
    """Each task's passed / total / skipped tests, for the chapter text's "PASS on every row" line."""
    return {t["task"]: [t["passed"], t["total"], t["skipped"]] for t in report["tasks"]}


def measure_chapter(chapter: int, full: bool) -> dict:
    """One chapter's figures: the quick grade, its slowest task alone, and (with full) the full grade."""
    run, report = graded(chapter)
    task = slowest_task(report)
    task_run, _ = graded(chapter, "--task", task["task"])
    figures = {"chapter": chapter, "module": impl.module_for_chapter(chapter),
               "check_s": round(run.seconds, 1), "peak_rss_mib": round(run.peak_rss_mib),
               "slowest_task": task["task"], "slowest_task_tests_s": task["seconds"],
               "task_s": round(task_run.seconds, 1), "task_peak_rss_mib": round(task_run.peak_rss_mib),
               "tasks": tally(report)}
    if full:
        full_run, full_report = graded(chapter, "--full")
        figures.update(full_s=round(full_run.seconds, 1), full_peak_rss_mib=round(full_run.peak_rss_mib),
                       full_tasks=tally(full_report))
    return figures


def machine() -> dict:
    """What the figures were measured on: usable CPUs (as `nproc` counts them), CPU model, memory."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model, memory_gib = platform.processor() or platform.machine(), None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                     if line.startswith("model name"))
        meminfo = Path("/proc/meminfo").read_text()
        kib = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal:")))
        memory_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass  # not Linux: keep what platform knows
    # The settings that move the figures (docs/results.md, "Threads on a busy machine"; MINICB_DEVICE=cuda on a GPU).
    env = {k: CALLER_ENV[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MINICB_DEVICE")
           if k in CALLER_ENV}
    return {"cpus": cpus, "cpu_model": model, "memory_gib": memory_gib, "python": platform.python_version(),
            "env": env}


def markdown(rows: list[dict], full: bool, date: str, host: dict, command: str) -> str:
    """The figures as a markdown table, with when, where and how they were measured."""
    header = ["chapter", "check N (s)", "peak RSS (MiB)", "slowest task", "check N --task K (s)"]
    if full:
        header += ["check N --full (s)", "peak RSS, --full (MiB)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in rows:
        cells = [f"{r['chapter']:02d}", f"{r['check_s']:.1f}", f"{r['peak_rss_mib']}",
                 f"{r['slowest_task']} ({r['slowest_task_tests_s']:.1f} s of tests)", f"{r['task_s']:.1f}"]
        if full:
            cells += [f"{r['full_s']:.1f}", f"{r['full_peak_rss_mib']}"]
        lines.append("| " + " | ".join(cells) + " |")
    memory = f", {host['memory_gib']} GiB of memory" if host["memory_gib"] else ""
    env = "".join(f", {k}={v}" for k, v in host["env"].items())
    intro = (f"Measured {date} on {host['cpus']} CPUs ({host['cpu_model']}){memory}, Python {host['python']}{env}, "
             f"with `{command}`. Each figure is one run's wall time; peak RSS is the largest process of the grade "
             f"(the pytest child).")
    return intro + "\n\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/check_times.py",
                                     description="Time `python -m minicb check N` on each chapter's reference "
                                                 "solution; fail if one does not pass.")
    parser.add_argument("--chapters", type=int, nargs="+", metavar="N",
                        help="these chapters only (default: every chapter with an exercise)")
    parser.add_argument("--full", action="store_true", help="also time `check N --full` (the real-model tests)")
    parser.add_argument("--json", metavar="OUT", help="also save the figures to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    chapters = args.chapters or sorted(n for n, _ in impl.CHAPTERS.values())
    for chapter in chapters:
        try:
            impl.module_for_chapter(chapter)  # a bad number fails here, before any long run
        except ValueError as error:
            parser.error(str(error))
    command = shlex.join(["python", "tools/check_times.py", *argv])
    rows = []
    for chapter in chapters:
        print(f"chapter {chapter}: grading {reference_file(impl.module_for_chapter(chapter)).relative_to(ROOT)} ...",
              file=sys.stderr, flush=True)
        try:
            rows.append(measure_chapter(chapter, args.full))
        except ReferenceFailed as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    date, host = datetime.date.today().isoformat(), machine()
    print(markdown(rows, args.full, date, host, command))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as file:
            json.dump({"date": date, "machine": host, "command": command, "full": args.full, "chapters": rows},
                      file, indent=1)
        print(f"\nwrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
