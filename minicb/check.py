"""Grade a chapter's exercises: `python -m minicb check N|all [--file PATH] [--task K] [--full] [-k EXPR] [-m MARKS]
[-v] [--format table|json|gradescope] [--test-timeout S]`.

It runs chapter N's tests (tests/chapters/test_chNN_*.py) against your
chapters/NN-slug/exercise.py -- or against PATH with --file, which is how a
teacher grades a submission -- and prints one row per task, with the time its
tests took:

    task  passed  time  status  first failure
    1     12/12   1s    PASS
    2     0/4     0s    FAIL    NotImplementedError: Chapter 3, task 2: append() — see
                                chapters/03-block-allocation/README.md#task-2
    all   0/1     0s    FAIL    NotImplementedError: Chapter 3, task 1: ...

By default it runs every test but the slow ones (`-m "not slow"`): those are
enough to catch every bug planted in tests/tools/test_mutants.py. `--full` adds the
slow tests, which run the real model through your code.

It says which course release it grades against ("minicb course 0.2.0
(2026-12-03)"; chapters/CHANGELOG.md lists what changed in each), and prints a
line on stderr as each task's last test finishes, so a long grade shows it is
moving. A test that runs longer than `--test-timeout` seconds (default 120; the
real-model tests take up to 90) fails with "task K, test_x: no answer in 120 s
(an endless loop?)" and the others still run; 0 turns the limit off.

The exit code is 0 only when every test ran and passed (tests that skip
themselves, such as GPU-only ones on a laptop, are not failures), 1 when
something failed, and 2 when nothing could be graded: no such file, a file
that does not import, no such chapter, or every selected test skipped itself
(a CUDA-only task on a CPU). `--format json` prints the same grade as
one JSON object and `--format gradescope` writes Gradescope's results.json, for
a course platform.

`python -m minicb check all` grades every chapter's own exercise file in turn,
with the same options, and prints a row per chapter as it finishes: tests
passed, PASS / FAIL / "not started" (every failure is a stub's
NotImplementedError) / "could not grade", and the time. It exits 0 only when
every chapter passes. To grade other people's files, one chapter at a time,
see `python -m minicb grade` (minicb/grade.py).

How it works: the tests run in a fresh `python -m pytest` with
MINICB_IMPL=student (or MINICB_IMPL_FILE=PATH) and MINICB_IMPL_ONLY naming
the chapter's module, so `minicb.impl.load()` hands them your module for this
chapter and the reference for every other one; and with this file loaded as a
pytest plugin (`-p minicb.check`), beside hypothesis' and no other (plugin autoload
is off in the child). The plugin reads each test's
`@pytest.mark.task(k)` marker and writes every result to a JSON file that the
parent reads back. A subprocess keeps your module, and anything it breaks, out
of the grader's own process.

The row "all" is the chapter's integration test (`@pytest.mark.task("all")`):
every task's code running together, usually inside the real engine, against
the previous chapter. A chapter can pass task by task and still fail there.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field

import minicb
from minicb import impl

REPORT_ENV = "MINICB_CHECK_REPORT"  # where the plugin in the child process writes its results
TASKS_ENV = "MINICB_CHECK_TASKS"  # comma-separated tasks to run ("2", "1,all"); unset: every test
TEST_TIMEOUT_ENV = "MINICB_CHECK_TEST_TIMEOUT"  # seconds one test's setup, call or teardown may take; unset: none
PROGRESS_ENV = "MINICB_CHECK_PROGRESS_FD"  # a pipe the plugin writes a JSON line to as each task finishes
# Generous for the real-model tests (25-90 s each under --full on 2 CPUs, tools/check_times.py),
# short enough that an endless loop in a student's code is reported within minutes.
DEFAULT_TEST_TIMEOUT = 120.0


@dataclass
class TestResult:
    nodeid: str  # pytest's id, e.g. "tests/chapters/test_ch03_block_allocator.py::test_fork_errors"
    task: int | str | None  # from @pytest.mark.task(k): k, or "all" for every task together; None: no marker
    outcome: str  # "passed" | "failed" | "skipped"
    message: str = ""  # first line of the failure ("NotImplementedError: ..."), or the skip reason
    seconds: float = 0.0  # setup + call + teardown


@dataclass
class Report:
    results: list[TestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # collection errors: a test file that did not import
    returncode: int = 0  # pytest's exit code
    output: str = ""  # pytest's own output (empty when it went to the terminal)

    @property
    def passed(self) -> bool:
        # pytest's exit code counts too: it catches what per-test results cannot
        # show, such as an internal error after the last test or no test selected.
        return (self.returncode == 0 and not self.errors and bool(self.results)
                and all(r.outcome != "failed" for r in self.results))


# ---- the plugin half: runs inside the child pytest -----------------------------


def _first_line(longrepr) -> str:
    """What a pytest failure says, on one line, e.g. 'AssertionError: seq 1: ...'.

    The exception's message keeps up to its first four lines: a `pytest.raises(match=...)`
    that failed says "Regex pattern did not match." on the first and the pattern and
    the actual message on the next two, and a student needs all three in one run.
    """
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        lines = [line.strip() for line in crash.message.strip().splitlines() if line.strip()]
        return " ".join(lines[:4])
    if isinstance(longrepr, tuple):  # skips: (path, lineno, reason)
        return str(longrepr[-1])
    # Collection errors arrive as formatted text; pytest prefixes exception lines with "E".
    text = str(longrepr).strip()
    exception_lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return exception_lines[-1] if exception_lines else (text.splitlines()[-1] if text else "")


def _window(items, index: int, width: int = 6) -> str:
    """items[index - width : index + width + 1] as a list or string, with "..." where it was cut."""
    lo, hi = max(0, index - width), min(len(items), index + width + 1)
    if isinstance(items, str):
        return ("..." if lo else "") + repr(items[lo:hi]) + ("..." if hi < len(items) else "")
    inner = ", ".join(repr(x) for x in items[lo:hi])
    return "[" + ("..., " if lo else "") + inner + (", ..." if hi < len(items) else "") + "]"


def pytest_assertrepr_compare(config, op, left, right):
    """`assert a == b` on two sequences (token ids, texts): both sides around their first difference.

    pytest's own summary shortens each side from its start, so a mismatch at
    token 90 of 128 shows 128 tokens cut off long before it. This shows the
    index and a window of each side around it, on the lines that `_first_line`
    keeps for the grade's first-failure column.
    """
    if op != "==" or not isinstance(left, (list, tuple, str)) or not isinstance(right, (list, tuple, str)):
        return None
    if isinstance(left, str) != isinstance(right, str):
        return None
    index = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
    if index < min(len(left), len(right)):
        what = f"{left[index]!r} != {right[index]!r}"
    else:
        what = "one side ends there"
    return [f"{_window(left, index)} == {_window(right, index)}",
            f"first difference at index {index} (lengths {len(left)} and {len(right)}): {what}"]


class TestTimeout(BaseException):
    """A test ran past check's time limit. A BaseException, so that a student's `except Exception`
    around the loop that never ends cannot swallow it; pytest still reports it as the test's failure."""


def _watchdog(seconds: float):
    """A pytest plugin that fails a test whose setup, call or teardown runs longer than `seconds`,
    so that the rest still run (pytest has no time limit of its own; made here, not at import,
    so that the grader's own process need not import pytest).

    SIGALRM on the main thread (where pytest runs the tests) raises TestTimeout
    inside whatever the test is doing, a `while True: pass` included; pytest
    records it as that test's failure and goes on to the next test. The alarm
    fires again every few seconds until the phase ends, in case the code it
    interrupted caught the first one. Where there is no SIGALRM (Windows) or
    pytest is not on the main thread, tests run without a limit.
    """
    import pytest

    repeat = 5.0  # seconds between alarms after the first

    class Watchdog:
        usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

        def _phase(self, item, when: str):
            if not self.usable:
                yield
                return
            marker = item.get_closest_marker("task")
            task = marker.args[0] if marker and marker.args else "?"
            where = "" if when == "call" else f" (in its {when})"
            message = f"task {task}, {item.name}{where}: no answer in {seconds:g} s (an endless loop?)"

            def alarm(signum, frame):
                raise TestTimeout(message)

            previous = signal.signal(signal.SIGALRM, alarm)
            signal.setitimer(signal.ITIMER_REAL, seconds, repeat)
            try:
                yield
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_setup(self, item):
            yield from self._phase(item, "setup")

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            yield from self._phase(item, "call")

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_teardown(self, item):
            yield from self._phase(item, "teardown")

    return Watchdog()


class _Collector:
    def __init__(self, path: str, tasks: set[str] | None = None, progress=None):
        self.path = path
        self.only_tasks = tasks  # run only tests of these tasks (as strings: "2", "all"); None: all
        self.tasks: dict[str, int | str | None] = {}
        self.results: dict[str, TestResult] = {}
        self.errors: list[str] = []
        self.progress = progress  # a text file (the parent's pipe) for a line per finished task, or None
        self.left: dict[str, int] = {}  # task (as a string) -> its tests not finished yet
        self.total = 0  # tests selected
        self.done: set[str] = set()  # tests finished

    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            marker = item.get_closest_marker("task")
            task = marker.args[0] if marker and marker.args else None
            # task("all"): an integration test that runs every task's code together.
            self.tasks[item.nodeid] = task if task in (None, "all") else int(task)
        if self.only_tasks is not None:
            keep = [item for item in items if str(self.tasks[item.nodeid]) in self.only_tasks]
            config.hook.pytest_deselected(items=[item for item in items if item not in keep])
            items[:] = keep

    def pytest_collection_finish(self, session):
        # After every plugin's selection (-k and -m deselect in hooks that may run after ours).
        self.total = len(session.items)
        for item in session.items:
            key = str(self.tasks.get(item.nodeid))
            self.left[key] = self.left.get(key, 0) + 1

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"{report.nodeid or 'collection'}: {_first_line(report.longrepr)}")

    def pytest_runtest_logreport(self, report):
        # One test reports three times (setup, call, teardown). The first failure
        # wins; a skip in setup (e.g. no CUDA) makes the whole test a skip.
        result = self.results.setdefault(report.nodeid, TestResult(report.nodeid, self.tasks.get(report.nodeid),
                                                                   "passed"))
        result.seconds = round(result.seconds + report.duration, 3)
        if result.outcome == "failed":
            return
        if report.failed:
            result.outcome, result.message = "failed", _first_line(report.longrepr)
            if result.message.startswith(f"{__name__}.TestTimeout: "):  # the message says it all
                result.message = result.message.split(": ", 1)[1]
        elif report.skipped:
            result.outcome, result.message = "skipped", _first_line(report.longrepr)

    def pytest_runtest_logfinish(self, nodeid):
        """Tell the parent when the last test of a task has finished (tasks interleave across files)."""
        if nodeid in self.done or nodeid not in self.tasks:
            return
        self.done.add(nodeid)
        task = str(self.tasks[nodeid])
        self.left[task] = self.left.get(task, 1) - 1
        if self.progress is None or self.left[task] > 0:
            return
        mine = [r for r in self.results.values() if str(r.task) == task]
        line = {"task": "?" if task == "None" else task, "passed": sum(r.outcome == "passed" for r in mine),
                "failed": sum(r.outcome == "failed" for r in mine), "total": len(mine),
                "seconds": round(sum(r.seconds for r in mine), 1), "done": len(self.done), "of": self.total}
        try:
            self.progress.write(json.dumps(line) + "\n")
            self.progress.flush()
        except OSError:  # the parent stopped reading: grading goes on without progress
            self.progress = None

    def pytest_sessionfinish(self):
        with open(self.path, "w") as file:
            json.dump({"results": [vars(r) for r in self.results.values()], "errors": self.errors}, file)


def pytest_configure(config):
    path = os.environ.get(REPORT_ENV)
    if path:
        tasks = os.environ.get(TASKS_ENV)
        only = {t.strip() for t in tasks.split(",") if t.strip()} if tasks else None
        fd = os.environ.get(PROGRESS_ENV)
        progress = os.fdopen(int(fd), "w", buffering=1, closefd=True) if fd else None
        config.pluginmanager.register(_Collector(path, only, progress), "minicb-check-collector")
    limit = float(os.environ.get(TEST_TIMEOUT_ENV) or 0)
    if limit > 0:
        config.pluginmanager.register(_watchdog(limit), "minicb-check-watchdog")


# ---- the grader half: runs in your process --------------------------------------


# The graded tests: tests/chapters/test_chNN_*.py, chapter NN's (the other folders of
# tests/ hold what no chapter grades).
CHAPTER_TESTS = impl.ROOT / "tests" / "chapters"


def chapter_test_files(chapter: int) -> list[pathlib.Path]:
    """Chapter `chapter`'s test files, in order."""
    return sorted(CHAPTER_TESTS.glob(f"test_ch{chapter:02d}_*.py"))


def run_tests(chapter: int, exercise_file: str | os.PathLike | None = None,
              pytest_args: list[str] | tuple[str, ...] = (), verbose: bool = False,
              tasks: list[int | str] | None = None, timeout: float | None = None,
              test_timeout: float | None = DEFAULT_TEST_TIMEOUT, progress=None) -> Report:
    """Run chapter `chapter`'s tests against the student's file; collect per-test results.

    exercise_file: grade this file instead of chapters/NN-slug/exercise.py.
    pytest_args: passed on to pytest (e.g. ["-k", "not random"]).
    verbose: let pytest print to the terminal (-v) instead of capturing it.
    tasks: run only the tests of these tasks (e.g. [2] or [1, "all"]); None runs them all.
    timeout: stop the tests after this many seconds (a submission whose loop never ends);
    the report then has an error saying so. None: no limit.
    test_timeout: fail any one test (its setup, call or teardown) that runs longer than
    this many seconds, with "task K, test_x: no answer in S s (an endless loop?)", and go
    on with the others. None or 0: no limit per test.
    progress: called with a dict (task, passed, failed, total, seconds, done, of) as the
    last test of each task finishes, from a thread of this process. None: no progress.
    """
    module = impl.module_for_chapter(chapter)  # raises ValueError naming the allowed chapters
    test_files = chapter_test_files(chapter)
    if not test_files:
        raise FileNotFoundError(f"chapter {chapter} has no tests: nothing matches "
                                f"{CHAPTER_TESTS.relative_to(impl.ROOT)}/test_ch{chapter:02d}_*.py")
    # The child must import minicb (for `-p minicb.check` and impl.load) from
    # this checkout, whether or not the package is pip-installed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(impl.ROOT), os.environ.get("PYTHONPATH")])))
    # A MINICB_IMPL_FILE left over in the caller's shell would silently win over
    # the file we were asked to grade; impl.load() checks it first.
    env.pop("MINICB_IMPL_FILE", None)
    # Only this chapter's module is swapped; the engine around it stays the
    # reference, so unfinished earlier (or later) chapters cannot fail this grade.
    env["MINICB_IMPL_ONLY"] = module
    if exercise_file is not None:
        exercise_file = os.path.abspath(exercise_file)  # the child runs from the repository root
        if not os.path.isfile(exercise_file):
            raise FileNotFoundError(f"--file {exercise_file}: no such file")
        env["MINICB_IMPL_FILE"] = exercise_file
    else:
        if not impl.exercise_path(module).is_file():
            raise FileNotFoundError(f"exercise file not found: {impl.exercise_path(module)}")
        env["MINICB_IMPL"] = "student"

    for name in (TASKS_ENV, TEST_TIMEOUT_ENV, PROGRESS_ENV):
        env.pop(name, None)
    if tasks is not None:
        env[TASKS_ENV] = ",".join(map(str, tasks))
    if test_timeout:
        env[TEST_TIMEOUT_ENV] = f"{test_timeout:g}"
    # The child loads only the plugins the chapter tests use: this file's and hypothesis'. Whatever
    # else the environment holds (the notebook, schema-fuzzing and LangChain plugins of this project's
    # own tests, 2-3 s of imports in every grade; a classroom's pytest-randomly, which would reorder
    # the tests) stays out of the grade.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    with tempfile.TemporaryDirectory() as scratch:
        env[REPORT_ENV] = os.path.join(scratch, "results.json")
        # no:cacheprovider: grading must not leave .pytest_cache behind, nor reorder
        # tests by what failed last time.
        command = [sys.executable, "-m", "pytest", *map(str, test_files), "-p", "minicb.check",
                   *hypothesis_plugin(), "-p", "no:cacheprovider", "-v" if verbose else "-q", "--tb=short",
                   *pytest_args]
        returncode, output = _run_child(command, env, verbose, timeout, progress)
        if returncode is None:
            return Report(errors=[f"the tests did not finish in {timeout:g} s: a loop that never ends?"],
                          returncode=1, output=output)
        report = Report(returncode=returncode, output=output)
        try:
            with open(env[REPORT_ENV]) as file:
                data = json.load(file)
        except FileNotFoundError:  # pytest died before the session finished (bad arguments, crash)
            report.errors.append(f"pytest exited with code {returncode} before reporting any results")
            return report
    report.results = [TestResult(**r) for r in data["results"]]
    report.errors += data["errors"]
    return report


def hypothesis_plugin() -> list[str]:
    """["-p", module]: hypothesis' pytest plugin, as its package names it (an entry point), or [] without one."""
    for entry in importlib.metadata.entry_points(group="pytest11"):
        if entry.dist is not None and entry.dist.name.lower() == "hypothesis":
            return ["-p", entry.value]
    return []


def _run_child(command: list[str], env: dict, verbose: bool, timeout: float | None,
               progress) -> tuple[int | None, str]:
    """Run the child pytest: (its exit code, or None past `timeout`; its output).

    With `progress`, the child gets the write end of a pipe (PROGRESS_ENV names it)
    and a thread here hands each line it writes to `progress` as it comes.
    """
    read_end = write_end = None
    if progress is not None:
        read_end, write_end = os.pipe()
        env = dict(env, **{PROGRESS_ENV: str(write_end)})
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        # Output goes to a file, not a pipe: nothing the tests leave running can make reading it wait.
        child = subprocess.Popen(command, cwd=impl.ROOT, env=env, text=True, stdin=subprocess.DEVNULL,
                                 stdout=None if verbose else out, stderr=None if verbose else subprocess.STDOUT,
                                 pass_fds=() if write_end is None else (write_end,))
        reader = None
        if write_end is not None:
            os.close(write_end)  # the child holds it now; the pipe ends when the child does
            reader = threading.Thread(target=_read_progress, args=(read_end, progress), daemon=True)
            reader.start()
        try:
            returncode = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            returncode = None
        if reader is not None:
            reader.join(timeout=5)
        out.seek(0)
        return returncode, out.read()


def _read_progress(fd: int, progress) -> None:
    with os.fdopen(fd) as lines:
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            try:
                progress(event)
            except Exception:  # a broken progress display must not lose the grade
                pass


def print_progress(event: dict, file=None) -> None:
    """`check N`'s line as each task finishes, on stderr: it never mixes with a JSON report."""
    failed = f", {event['failed']} failed" if event.get("failed") else ""
    print(f"  task {event['task']}: {event['passed']}/{event['total']} passed{failed}, {event['seconds']:.0f}s"
          f"  [{event['done']}/{event['of']} tests run]", file=file or sys.stderr, flush=True)


def task_summaries(report: Report) -> list[dict]:
    """One dict per task, in order (then "all", every task together, then unmarked tests "?"):
    task, passed, skipped, total, seconds (its tests' own time, without pytest's start-up),
    status (PASS / FAIL / SKIP), first_failure, and its results."""
    by_task: dict[int | str | None, list[TestResult]] = {}
    for result in report.results:
        by_task.setdefault(result.task, []).append(result)
    summaries = []
    for task in sorted(by_task, key=lambda t: (t is None, t == "all", t if isinstance(t, int) else 0)):
        results = by_task[task]
        passed = sum(r.outcome == "passed" for r in results)
        failures = [r for r in results if r.outcome == "failed"]
        summaries.append({"task": "?" if task is None else str(task), "passed": passed,
                          "skipped": sum(r.outcome == "skipped" for r in results), "total": len(results),
                          "seconds": round(sum(r.seconds for r in results), 1),
                          "status": "FAIL" if failures else ("PASS" if passed else "SKIP"),
                          "first_failure": failures[0].message if failures else "", "results": results})
    return summaries


def exit_status(report: Report, graded: bool = True) -> int:
    """0 every test passed, 1 something failed, 2 nothing could be graded."""
    return 2 if not graded else (0 if report.passed else 1)


def course() -> str:
    """The course release a grade is made against, e.g. "minicb course 0.2.0 (2026-12-03)"
    (chapters/CHANGELOG.md says what changed in each)."""
    return f"minicb course {minicb.__version__} ({minicb.__course_date__})"


def json_report(chapter: int, report: Report, seconds: float, graded: bool = True) -> dict:
    """`check N --format json`: the whole grade as one JSON object, for a course platform."""
    return {"chapter": chapter, "course_version": minicb.__version__, "course_date": minicb.__course_date__,
            "exit_status": exit_status(report, graded), "passed": report.passed,
            "duration_s": round(seconds, 1), "errors": report.errors,
            "tasks": [{k: t[k] for k in ("task", "passed", "skipped", "total", "seconds", "status", "first_failure")}
                      for t in task_summaries(report)]}


def gradescope_results(chapter: int, report: Report, seconds: float, graded: bool = True) -> dict:
    """`check N --format gradescope`: Gradescope's results.json, one graded entry per task.

    A task scores its passed tests out of its tests; its output lists every test
    with its outcome and, for a failure, what the failure said. A submission that
    could not be graded scores 0, with the reason as its output.
    """
    tests = []
    for t in task_summaries(report):
        lines = [f"{r.outcome.upper()} {r.nodeid}" + (f": {r.message}" if r.outcome == "failed" else "")
                 for r in t["results"]]
        tests.append({"name": f"chapter {chapter}, task {t['task']}", "score": t["passed"],
                      "max_score": t["total"] - t["skipped"], "output": "\n".join(lines)})
    if report.errors:
        tests.append({"name": f"chapter {chapter}: errors", "score": 0, "max_score": 0,
                      "output": "\n".join(report.errors)})
    results = {"execution_time": round(seconds), "tests": tests}
    if not graded:
        results.update(score=0, output="could not grade: " + "; ".join(report.errors))
    return results


def format_table(report: Report, width: int = 100) -> str:
    """One row per task: task | passed/total | time | status | first failure (wrapped to `width`).

    The failure message is kept whole, since its end is often the part that says
    what differed ("... want 2, got 4") or where to read ("see chapters/..."):
    it wraps onto more lines, indented under its column, instead of being cut.
    """
    rows = [("task", "passed", "time", "status", "first failure")]
    for t in task_summaries(report):
        count = f"{t['passed']}/{t['total']}" + (f" ({t['skipped']} skipped)" if t["skipped"] else "")
        rows.append((t["task"], count, f"{t['seconds']:.0f}s", t["status"], t["first_failure"]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    indent = sum(widths) + 2 * 4  # where the message column starts
    # Below 30 characters a wrapped message reads as a word per line; then let the terminal wrap it.
    room = max(width - indent, 30)
    lines = []
    for row in rows:
        start = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  "
        wrapped = textwrap.wrap(row[4], room, break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(start + wrapped[0])
        lines += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(line.rstrip() for line in lines)


def chapter_arg(text: str) -> int | str:
    """The chapter argument: a number, or "all"."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a chapter number (e.g. 3) nor 'all'") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minicb check",
                                     description="Run a chapter's tests against your exercise file, task by task.")
    parser.add_argument("chapter", type=chapter_arg,
                        help="chapter number, e.g. 3; or 'all': every chapter's exercise file, a row each")
    parser.add_argument("--file", help="grade this file instead of chapters/NN-slug/exercise.py")
    parser.add_argument("-k", dest="keyword", help="only run tests whose names match this pytest -k expression")
    parser.add_argument("-m", dest="markers",
                        help='only run tests whose marks match this pytest -m expression (default "not slow": '
                             "every test but the SmolLM2 ones; --full runs those too)")
    parser.add_argument("--full", action="store_true",
                        help="run the slow tests too: the real model (SmolLM2) through your code, minutes more")
    parser.add_argument("--task", action="append", dest="tasks", metavar="K",
                        help="only grade task K (a number, or 'all' for the integration row); repeatable")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show pytest's output and every failing test in full")
    parser.add_argument("--format", choices=["table", "json", "gradescope"], default="table",
                        help="table (default); json: one report on stdout; gradescope: write Gradescope's "
                             "results.json (to --out)")
    parser.add_argument("--out", default="results.json", help="--format gradescope: where to write (default "
                        "results.json; Gradescope reads /autograder/results/results.json)")
    parser.add_argument("--test-timeout", type=float, default=DEFAULT_TEST_TIMEOUT, metavar="S",
                        help=f"fail a test that runs longer than S seconds (an endless loop) and go on with the "
                             f"rest (default {DEFAULT_TEST_TIMEOUT:g}; 0: no limit)")
    return parser


def selection_args(args: argparse.Namespace) -> list[str]:
    """The pytest selection for parsed `check` arguments: -k as given; -m as given, or "not slow"
    unless --full (the quick tests catch every planted bug in tests/tools/test_mutants.py; the slow ones
    run the real model through the student's code)."""
    markers = args.markers or (None if args.full else "not slow")
    return (["-k", args.keyword] if args.keyword else []) + (["-m", markers] if markers else [])


def import_error(path: str | os.PathLike) -> str | None:
    """Why the file at `path` cannot be imported (its last line of traceback), or None if it can."""
    code = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='minicb_student_check')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(impl.ROOT), os.environ.get("PYTHONPATH")])))
    try:
        child = subprocess.run([sys.executable, "-c", code, str(path)], cwd=impl.ROOT, env=env, text=True,
                               capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "importing it took more than 300 s"
    if child.returncode == 0:
        return None
    lines = child.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {child.returncode}"


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 every test passed, 1 something failed, 2 could not grade (a missing file, a file
    that does not import, a bad chapter number)."""
    args = build_parser().parse_args(argv)
    if args.test_timeout < 0:
        print(f"error: --test-timeout {args.test_timeout:g}: give a number of seconds (0: no limit)", file=sys.stderr)
        return 2
    if args.chapter == "all":
        return check_all(args)
    quiet = args.format != "table"  # json / gradescope: only the report goes to stdout
    start = time.perf_counter()
    try:
        module = impl.module_for_chapter(args.chapter)
        target = args.file or impl.exercise_path(module)
        if not os.path.isfile(target):
            raise FileNotFoundError(f"exercise file not found: {target}")
        problem = import_error(target)
        if problem is not None:
            raise ImportError(f"{target} does not import, so nothing in it can be graded: {problem}")
        if not quiet:
            shown = os.path.relpath(target, impl.ROOT) if args.file is None else target
            print(f"chapter {args.chapter} ({module}): grading {shown} against {course()}", flush=True)
        report = run_tests(args.chapter, args.file, selection_args(args), args.verbose and not quiet, args.tasks,
                           test_timeout=args.test_timeout, progress=print_progress)
        if report.results and all(r.outcome == "skipped" for r in report.results):
            # Nothing ran: a CUDA-only task on a CPU, say. A pass would be a lie and a fail unfair.
            reasons = sorted({r.message for r in report.results})
            raise RuntimeError(f"every selected test skipped itself, so nothing was graded: {'; '.join(reasons)}")
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        report, graded = Report(errors=[str(error)], returncode=2), False
    else:
        graded = True
    seconds = time.perf_counter() - start

    # A platform gets its report whatever happened, a could-not-grade one included.
    if args.format == "json":
        print(json.dumps(json_report(args.chapter, report, seconds, graded), indent=1))
    elif args.format == "gradescope":
        with open(args.out, "w") as file:
            json.dump(gradescope_results(args.chapter, report, seconds, graded), file, indent=1)
        print(f"wrote {args.out}")
    if quiet or not graded:
        return exit_status(report, graded)

    for error in report.errors:
        print(f"error: {error}")
    if report.results:
        print(format_table(report, width=shutil.get_terminal_size((100, 24)).columns))
    elif report.output:  # nothing ran: show pytest's own explanation
        print(report.output[-3000:])
    if args.verbose:
        for result in report.results:
            if result.outcome == "failed":
                print(f"\nFAILED {result.nodeid}\n  {result.message}")
    total = len(report.results)
    passed = sum(r.outcome == "passed" for r in report.results)
    verdict = "all tests passed" if report.passed else "not done yet"
    print(f"\n{passed}/{total} tests passed: {verdict}.")
    return exit_status(report)



# ---- check all: every chapter's own exercise file, a row each -------------------


def grade_chapter(chapter: int, pytest_args: list[str], tasks: list[int | str] | None = None,
                  test_timeout: float | None = DEFAULT_TEST_TIMEOUT) -> tuple[str, Report, str]:
    """Grade chapter `chapter`'s chapters/NN-slug/exercise.py as `check N` does.

    Returns its status (PASS / FAIL / not started / could not grade), the report,
    and a one-line note: the first failure, or why nothing could be graded.
    "not started" is a FAIL whose every failure is a stub's NotImplementedError
    and where no task passes yet: the chapter's file is still as it was handed out.
    """
    try:
        module = impl.module_for_chapter(chapter)
        path = impl.exercise_path(module)
        if not path.is_file():
            raise FileNotFoundError(f"exercise file not found: {path.relative_to(impl.ROOT)}")
        problem = import_error(path)
        if problem is not None:
            raise ImportError(f"{path.relative_to(impl.ROOT)} does not import: {problem}")
        report = run_tests(chapter, None, pytest_args, tasks=tasks, test_timeout=test_timeout)
    except (ValueError, FileNotFoundError, ImportError) as error:
        return "could not grade", Report(errors=[str(error)], returncode=2), str(error)
    if not report.results and not report.errors:  # e.g. --task 5 in a chapter with four tasks
        return "could not grade", report, f"no test was selected (pytest exit code {report.returncode})"
    if report.results and all(r.outcome == "skipped" for r in report.results):
        reasons = "; ".join(sorted({r.message for r in report.results}))
        return "could not grade", report, f"every selected test skipped itself: {reasons}"
    if report.passed:
        return "PASS", report, ""
    summaries = task_summaries(report)
    failures = [r for r in report.results if r.outcome == "failed"]
    untouched = (failures and not report.errors
                 and all(r.message.startswith("NotImplementedError") for r in failures)
                 and not any(t["status"] == "PASS" for t in summaries if t["task"] not in ("all", "?")))
    if untouched:
        return "not started", report, ""
    failing = next((t for t in summaries if t["status"] == "FAIL"), None)
    if report.errors:
        note = report.errors[0]
    elif failing is not None:
        note = f"task {failing['task']}: {failing['first_failure']}"
    else:  # every test passed, yet pytest itself failed (an error after the last test)
        note = f"pytest exited with code {report.returncode}"
    return "FAIL", report, note


def check_all(args: argparse.Namespace) -> int:
    """`check all`: every chapter's exercise file in turn, a row printed as each finishes.

    Each chapter is graded exactly as `check N` grades it, with the same -k, -m,
    --full and --task. Exit 0 when every chapter passes, 1 otherwise, 2 for
    --file or --format gradescope, which name one file and one chapter.
    """
    if args.file or args.format == "gradescope":
        option = "--file" if args.file else "--format gradescope"
        print(f"error: {option} grades one chapter; give a chapter number instead of 'all'", file=sys.stderr)
        return 2
    quiet = args.format == "json"
    chapters = sorted((number, module) for module, (number, _) in impl.CHAPTERS.items())
    header = ("chapter", "module", "passed", "status", "time")
    widths = (7, max(len(module) for _, module in chapters), 9, 15, 5)
    room = max(shutil.get_terminal_size((100, 24)).columns - sum(widths) - 2 * len(widths), 30)

    def row(cells: tuple[str, ...], note: str = "") -> str:
        note = textwrap.shorten(note, room, placeholder=" ...") if note else ""
        return ("  ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + "  " + note).rstrip()

    if not quiet:
        print(f"grading every chapter against {course()}", flush=True)
        print(row(header + ("note",)), flush=True)
    statuses, reports = [], []
    for number, module in chapters:
        start = time.perf_counter()
        status, report, note = grade_chapter(number, selection_args(args), args.tasks, args.test_timeout)
        seconds = time.perf_counter() - start
        statuses.append(status)
        reports.append(dict(json_report(number, report, seconds, graded=status != "could not grade"),
                            module=module, status=status))
        if not quiet:
            # passed/ran, as `grade` counts: a test that skipped itself (no GPU) neither passed nor failed.
            passed = sum(r.outcome == "passed" for r in report.results)
            skipped = sum(r.outcome == "skipped" for r in report.results)
            count = f"{passed}/{len(report.results) - skipped}"
            note = note or (f"{skipped} skipped" if skipped else "")
            print(row((str(number), module, count, status, f"{seconds:.0f}s"), note), flush=True)
    code = 0 if all(status == "PASS" for status in statuses) else 1
    if quiet:
        print(json.dumps({"exit_status": code, "course_version": minicb.__version__,
                          "course_date": minicb.__course_date__, "chapters": reports}, indent=1))
    else:
        print(f"\n{statuses.count('PASS')}/{len(statuses)} chapters pass.")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
