"""`check` cannot hang silently: a test that never answers fails on its own, the others still run.

A student's loop that never ends (a scheduler that never admits the head of the
queue, a rollback that never reaches its target) used to make `check N` run
for ever and print nothing. Here chapter 3's reference with one function
turned into `while True: pass` is graded with a 5 s limit per test: the grade
must end within a bound, fail that task with the timeout message, still report
every other task, keep its JSON report on stdout alone and show its progress,
a line per task, on stderr.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from minicb import check, impl

# Seconds per test. The row "all" (the engine on the tiny model) takes about 2 s alone and
# more on a busy machine, so the limit leaves it room: 2 s failed it once under load.
LIMIT = 5
HANG = "    while True:\n        pass\n\n"


def test_a_test_that_never_answers_fails_alone_and_the_grade_goes_on(tmp_path):
    source = (impl.ROOT / "minicb" / "block_allocator.py").read_text()
    anchor = "    def scheme(reserved: int) -> dict:\n"  # inside memory_waste, task 5's function
    assert source.count(anchor) == 1, "memory_waste changed; pick another line to hang at"
    submission = tmp_path / "hangs.py"
    submission.write_text(source.replace(anchor, HANG + anchor))

    start = time.perf_counter()
    # The long random sequences are left out (-k): they hang nowhere and take 20 s.
    run = subprocess.run([sys.executable, "-m", "minicb", "check", "3", "--file", str(submission),
                          "--test-timeout", str(LIMIT), "--format", "json", "-k", "not hypothesis and not random"],
                         cwd=impl.ROOT, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    print(f"check with a hanging task took {seconds:.1f} s\n{run.stderr}")  # shown with -s: the measured time
    report = json.loads(run.stdout)  # stdout is the report and nothing else
    assert run.returncode == 1 and report["exit_status"] == 1, (run.returncode, run.stderr[-2000:])
    tasks = {t["task"]: t for t in report["tasks"]}
    assert list(tasks) == ["1", "2", "3", "4", "5", "all"], report["tasks"]
    hung = tasks["5"]
    assert hung["status"] == "FAIL", hung
    assert re.fullmatch(rf"task 5, test_\w+: no answer in {LIMIT} s \(an endless loop\?\)", hung["first_failure"]), hung
    # Every test of task 5 that calls memory_waste fails alone; the rest of the chapter still passes.
    assert all(t["status"] == "PASS" for name, t in tasks.items() if name != "5"), report["tasks"]
    # Each hanging test costs its limit, not more: the quick grade itself takes about 10 s.
    failed = hung["total"] - hung["passed"]
    assert failed >= 1 and seconds < 60 + failed * LIMIT, f"{seconds:.0f} s for {failed} hanging tests"
    assert hung["seconds"] >= failed * LIMIT, hung
    # Progress on stderr: a line per task as it finishes.
    progress = re.findall(r"^  task (\S+): \d+/\d+ passed", run.stderr, re.M)
    assert sorted(progress) == sorted(tasks), f"want a progress line per task on stderr:\n{run.stderr}"
    assert report["course_version"] == __import__("minicb").__version__, report


def test_progress_goes_to_stderr_and_the_table_names_the_course(monkeypatch, capsys):
    report = check.Report(results=[check.TestResult("t::a", 1, "passed"), check.TestResult("t::b", "all", "passed")])

    def run_tests(chapter, exercise_file=None, pytest_args=(), verbose=False, tasks=None, test_timeout=None,
                  progress=None):
        assert test_timeout == 7, test_timeout  # --test-timeout reaches the plugin's setting
        progress({"task": "1", "passed": 1, "failed": 0, "total": 1, "seconds": 0.2, "done": 1, "of": 2})
        return report

    monkeypatch.setattr(check, "run_tests", run_tests)
    monkeypatch.setattr(check, "import_error", lambda path: None)
    assert check.main(["3", "--test-timeout", "7"]) == 0
    captured = capsys.readouterr()
    assert "  task 1: 1/1 passed, 0s  [1/2 tests run]" in captured.err, captured.err
    assert "task 1: 1/1" not in captured.out
    assert f"against minicb course {__import__('minicb').__version__} (" in captured.out, captured.out
    assert check.main(["3", "--test-timeout", "-1"]) == 2
    assert "--test-timeout -1" in capsys.readouterr().err


def test_the_default_limit_leaves_room_for_the_real_model_tests():
    # tools/check_times.py: the slowest real-model test takes about 90 s on 2 CPUs.
    assert check.DEFAULT_TEST_TIMEOUT >= 120
    assert check.build_parser().parse_args(["3"]).test_timeout == check.DEFAULT_TEST_TIMEOUT
