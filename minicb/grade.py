"""Grade a folder of submissions: `python -m minicb grade N FILE [FILE ...] [--csv grades.csv] [--timeout S]
[--full] [-k EXPR] [--fail-under PCT]`.

For a teacher: every FILE (or every .py file in a folder given instead) is
graded as chapter N's exercise, the way `python -m minicb check N --file FILE`
grades one, and the grades go into a CSV with a row per submission:

    file, outcome, score, max, task 1, task 2, ..., all, seconds, message

outcome is passed, failed, could-not-grade (the file does not import, say) or
timeout; score is the tests passed and max the tests that ran (skipped ones do
not count); each task column is that task's passed/ran; message is the first
failure, why the file could not be graded, or "timed out after N s". A line is
printed as each submission finishes, and a table at the end.

    python -m minicb grade 3 submissions/*.py --csv grades.csv
    python -m minicb grade 3 submissions/ --timeout 120 -k "not hypothesis"   # a quicker first pass

Each submission is graded in its own child process (`check N --file COPY
--format json`), which starts pytest in turn. Submissions are other people's
code, so each one gets:
- its own copy of the file, in its own temporary folder, which is also its
  TMPDIR: one submission cannot overwrite or read another's;
- its own process group, killed whole when it runs past --timeout (default
  600 s) and again once it finishes, so neither the child nor the pytest it
  started, nor anything the submission left running, outlives its row.
A submission that hangs, crashes or prints garbage costs only its own row.

The exit code is 0 once every submission has a row, whatever the scores (a
file that does not import is that student's 0, not a failed run), and 2 for a
bad argument: an unknown chapter, no files, a path that does not exist.
With `--fail-under PCT` (for a CI run that should fail on a failing class) it
is 1 when any one submission scores below PCT percent of its tests (score/max;
a submission that could not be graded or timed out scores 0), naming them; the
CSV is written either way.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

from minicb import impl

OUTCOMES = ("passed", "failed", "could-not-grade", "timeout")


@dataclass
class Row:
    """One submission's grade: a line of the CSV."""
    file: str  # the path as given on the command line
    outcome: str  # one of OUTCOMES
    score: int = 0  # tests passed
    max: int | None = None  # tests that ran (skipped ones do not count); None: nothing was graded
    tasks: dict[str, str] = field(default_factory=dict)  # "task 1" -> "12/12" (passed/ran); "all" -> "1/1"
    seconds: float = 0.0  # wall-clock, start-up included
    message: str = ""  # the first failure, or why it was not graded


def submissions(paths: list[str]) -> list[pathlib.Path]:
    """The files to grade: each path as given, a folder standing for the .py files in it (sorted)."""
    files = []
    for path in map(pathlib.Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.glob("*.py") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{str(path)!r}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"no .py files to grade in {', '.join(map(repr, paths))}")
    return files


# ---- one submission, in its own process group ------------------------------------


def _kill_group(child: subprocess.Popen) -> None:
    """Kill the child and everything it started (they share its process group)."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass
    else:  # no process groups (Windows): the child at least
        child.kill()


def _parse_report(text: str) -> dict | None:
    """The JSON report `check --format json` printed, or None.

    It is the whole of stdout unless something else wrote there too; then the
    last object that opens like a report is taken.
    """
    decoder = json.JSONDecoder()
    starts = [0] + [i for i in (text.rfind('{\n "chapter"'), text.rfind('{"chapter"')) if i > 0]
    for start in starts:
        try:
            report, _ = decoder.raw_decode(text[start:].lstrip())
        except ValueError:
            continue
        if isinstance(report, dict) and "exit_status" in report and "tasks" in report:
            return report
    return None


def _column(task: str) -> str:
    return task if task in ("all", "?") else f"task {task}"


def row_from_report(name: str, report: dict, seconds: float) -> Row:
    """A submission's row from its `check --format json` report."""
    if report["exit_status"] == 2:
        return Row(name, "could-not-grade", seconds=seconds, message="; ".join(report["errors"]))
    row = Row(name, "passed" if report["exit_status"] == 0 else "failed", seconds=seconds, max=0)
    for task in report["tasks"]:
        ran = task["total"] - task["skipped"]
        row.tasks[_column(task["task"])] = f"{task['passed']}/{ran}"
        row.score += task["passed"]
        row.max += ran
    failing = next((t for t in report["tasks"] if t["status"] == "FAIL"), None)
    if failing is not None:
        row.message = f"{_column(failing['task'])}: {failing['first_failure']}"
    elif report["errors"]:  # a test file that did not import, or pytest dying before its report
        row.message = "; ".join(report["errors"])
    return row


def grade_one(chapter: int, path: pathlib.Path, timeout: float, check_args: list[str]) -> Row:
    """Grade one submission in a child process with its own copy, TMPDIR and process group."""
    name = str(path)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minicb-grade-") as scratch:
        scratch = pathlib.Path(scratch)
        (scratch / "tmp").mkdir()
        (scratch / "submission").mkdir()
        copy = scratch / "submission" / path.name
        shutil.copyfile(path, copy)
        env = dict(os.environ, TMPDIR=str(scratch / "tmp"), TEMP=str(scratch / "tmp"), TMP=str(scratch / "tmp"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(impl.ROOT), os.environ.get("PYTHONPATH")])))
        command = [sys.executable, "-m", "minicb", "check", str(chapter), "--file", str(copy), "--format", "json",
                   *check_args]
        # Output goes to files, not pipes: a process the submission left behind could hold
        # a pipe open, and reading it would then wait for ever.
        with open(scratch / "stdout", "wb") as stdout, open(scratch / "stderr", "wb") as stderr:
            child = subprocess.Popen(command, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                     stderr=stderr, start_new_session=True)
            try:
                returncode = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:  # on time, on timeout, on Ctrl-C (which a new session does not receive) alike
                _kill_group(child)
                child.wait()
        seconds = round(time.perf_counter() - start, 1)
        if returncode is None:
            return Row(name, "timeout", seconds=seconds, message=f"timed out after {timeout:g} s")
        out = (scratch / "stdout").read_text(errors="replace")
        err = (scratch / "stderr").read_text(errors="replace")
        report = _parse_report(out)
    if report is None:
        last = (err.strip().splitlines() or ["no output"])[-1]
        row = Row(name, "could-not-grade", seconds=seconds,
                  message=f"the grader exited with code {returncode} without a report: {last}")
    else:
        row = row_from_report(name, report, seconds)
    # Messages name the private copy; the teacher knows the file by its own path.
    row.message = row.message.replace(str(copy), name)
    return row


# ---- the table and the CSV --------------------------------------------------------


def task_columns(rows: list[Row]) -> list[str]:
    """Every task column any row has, in task order: task 1, task 2, ..., all, ?."""
    names = {name for row in rows for name in row.tasks}

    def order(name: str):
        number = name.removeprefix("task ")
        return (name == "?", name == "all", int(number) if number.isdigit() else 0)

    return sorted(names, key=order)


def write_csv(rows: list[Row], path: str) -> None:
    columns = ["file", "outcome", "score", "max", *task_columns(rows), "seconds", "message"]
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({"file": row.file, "outcome": row.outcome, "score": row.score,
                             "max": "" if row.max is None else row.max, **row.tasks,
                             "seconds": f"{row.seconds:.1f}", "message": row.message})


def _message_lines(row: Row, width: int, indent: int = 4, most: int = 3) -> list[str]:
    """The row's message under it, indented, at most `most` lines (the CSV has it whole)."""
    message = row.message.removeprefix(row.file).strip()  # "<file> does not import ...": the row names the file
    lines = textwrap.wrap(message, max(width - indent, 30), break_long_words=False)
    if len(lines) > most:
        lines = lines[:most - 1] + [textwrap.shorten(" ".join(lines[most - 1:]), max(width - indent, 30),
                                                     placeholder=" ...")]
    return [" " * indent + line for line in lines]


def format_rows(rows: list[Row], width: int = 100) -> str:
    """The final table: file, outcome, score, each task, time; a row's message on the lines under it."""
    tasks = task_columns(rows)
    table = [["file", "outcome", "score", *tasks, "time"]]
    for row in rows:
        score = f"{row.score}/{row.max}" if row.max is not None else "-"
        table.append([row.file, row.outcome, score, *(row.tasks.get(t, "-") for t in tasks), f"{row.seconds:.0f}s"])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = []
    for line, row in zip(table, [None, *rows]):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if row is not None and row.message:
            lines += _message_lines(row, width)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minicb grade",
                                     description="Grade many submissions of one chapter's exercise: a table and a CSV.")
    parser.add_argument("chapter", type=int, help="chapter number, e.g. 3")
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="submissions to grade (a folder stands for the .py files in it)")
    parser.add_argument("--csv", default="grades.csv", help="where to write the grades (default grades.csv)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one submission may take, start-up included (default 600)")
    parser.add_argument("--full", action="store_true", help="run the slow tests too (the real model), as check --full")
    parser.add_argument("-k", dest="keyword", help="only run tests matching this pytest -k expression, as check -k")
    parser.add_argument("--fail-under", type=float, metavar="PCT",
                        help="exit 1 when any submission scores below PCT percent of its tests (0-100; one "
                             "that could not be graded or timed out scores 0)")
    return parser


def percent(row: Row) -> float:
    """A row's score as a percentage of its tests; 0 when nothing was graded."""
    return 100.0 * row.score / row.max if row.max else 0.0


def below(rows: list[Row], threshold: float) -> list[Row]:
    """The rows scoring under `threshold` percent (`--fail-under`)."""
    return [row for row in rows if percent(row) < threshold]


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 every submission has a row (whatever its score; with --fail-under, every score at
    least that), 1 with --fail-under, a submission scores below it, 2 a bad argument."""
    args = build_parser().parse_args(argv)
    try:
        impl.module_for_chapter(args.chapter)  # raises ValueError naming the chapters that have exercises
        if not args.timeout > 0:
            raise ValueError(f"--timeout {args.timeout:g}: give a number of seconds above 0")
        if args.fail_under is not None and not 0 <= args.fail_under <= 100:
            raise ValueError(f"--fail-under {args.fail_under:g}: give a percentage from 0 to 100")
        files = submissions(args.files)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    check_args = (["--full"] if args.full else []) + (["-k", args.keyword] if args.keyword else [])
    width = shutil.get_terminal_size((100, 24)).columns
    print(f"grading {len(files)} submissions of chapter {args.chapter}, at most {args.timeout:g} s each", flush=True)
    rows = []
    try:
        for number, path in enumerate(files, 1):
            row = grade_one(args.chapter, path, args.timeout, check_args)
            rows.append(row)
            score = f"{row.score}/{row.max}" if row.max is not None else "-"
            print(f"[{number}/{len(files)}] {row.file}  {row.outcome}  {score}  {row.seconds:.0f}s", flush=True)
            if row.message:
                print("\n".join(_message_lines(row, width, most=1)), flush=True)
    except KeyboardInterrupt:  # keep the rows graded so far
        write_csv(rows, args.csv)
        print(f"\ninterrupted: wrote {len(rows)} of {len(files)} rows to {args.csv}", file=sys.stderr)
        return 130
    write_csv(rows, args.csv)
    print("\n" + format_rows(rows, width))
    counts = ", ".join(f"{sum(r.outcome == o for r in rows)} {o}" for o in OUTCOMES)
    print(f"\n{len(rows)} submissions: {counts}. Wrote {args.csv}.")
    if args.fail_under is not None:
        failing = below(rows, args.fail_under)
        if failing:
            names = ", ".join(f"{row.file} ({percent(row):.0f}%)" for row in failing)
            print(f"--fail-under {args.fail_under:g}: {len(failing)} of {len(rows)} submissions score below "
                  f"{args.fail_under:g}%: {names}", file=sys.stderr)
            return 1
        print(f"every submission scores at least {args.fail_under:g}%.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
