"""tools/check_times.py: its memory figure belongs to one run, it times the right commands, it fails loudly.

The tool's real runs take minutes a chapter, so these tests run it cheaply: the
measuring function on small Python programs (a real peak to find), and the
tool's flow with the grading command replaced by a fake that prints the JSON
`minicb.check.json_report` builds, so a change of the report's fields breaks
this test rather than the maintainer's long run.
"""
import json
import resource
import sys

import pytest

from minicb import check, impl

from tool_support import load_tool

# A child that starts a grandchild which holds 300 MiB: the grade's shape (the pytest child under `check`).
BIG_GRANDCHILD = ("import subprocess, sys; "
                  "subprocess.run([sys.executable, '-c', 'block = b\"x\" * (300 << 20)'], check=True)")


@pytest.fixture(scope="module")
def tool():
    return load_tool("check_times")


def test_peak_rss_counts_grandchildren_and_belongs_to_one_run(tool):
    big = tool.run_measured([sys.executable, "-c", BIG_GRANDCHILD])
    small = tool.run_measured([sys.executable, "-c", "print('hello')"])
    print(f"big: {big.peak_rss_mib:.0f} MiB in {big.seconds:.2f} s; small: {small.peak_rss_mib:.0f} MiB; "
          f"RUSAGE_CHILDREN now says {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB")
    assert big.returncode == 0 and small.returncode == 0, (big.stderr, small.stderr)
    assert big.peak_rss_mib >= 300, f"the grandchild held 300 MiB, but the run's peak is {big.peak_rss_mib:.0f} MiB"
    # A running maximum (what getrusage(RUSAGE_CHILDREN) keeps) would say 300 MiB here too.
    assert small.peak_rss_mib < 100, f"a bare interpreter measured {small.peak_rss_mib:.0f} MiB: not its own peak"
    assert small.stdout == "hello\n"
    assert big.seconds > 0


def test_exit_code_and_stderr_come_back(tool):
    run = tool.run_measured([sys.executable, "-c", "import sys; sys.stderr.write('broken'); sys.exit(3)"])
    assert (run.returncode, run.stderr) == (3, "broken")


def test_every_chapter_has_its_reference_file(tool):
    missing = {m: tool.reference_file(m) for m in impl.CHAPTERS if not tool.reference_file(m).is_file()}
    assert not missing, f"no reference file for: {missing}"
    assert tool.reference_file("serve.loop") == impl.ROOT / "minicb" / "serve" / "loop.py"


def fake_report(chapter, task_seconds, failing=()):
    """check's own JSON report for tests of the given tasks (task -> seconds), failing the tasks named."""
    results = [check.TestResult(f"tests/chapters/test_ch{chapter:02d}_x.py::test_{task}", task,
                                "failed" if task in failing else "passed",
                                f"AssertionError: task {task} is wrong" if task in failing else "", seconds)
               for task, seconds in task_seconds.items()]
    report = check.Report(results=results, returncode=1 if failing else 0)
    return check.json_report(chapter, report, sum(task_seconds.values()))


class FakeGrader:
    """Stands in for run_measured: answers each `check` command with a report, and remembers the commands."""

    def __init__(self, tool, task_seconds, failing=()):
        self.tool, self.task_seconds, self.failing, self.commands = tool, task_seconds, failing, []

    def __call__(self, command):
        self.commands.append(command)
        chapter = int(command[command.index("check") + 1])
        tasks = self.task_seconds
        if "--task" in command:
            wanted = command[command.index("--task") + 1]
            tasks = {t: s for t, s in tasks.items() if str(t) == wanted}
        report = fake_report(chapter, tasks, self.failing)
        n = len(self.commands)  # each run a different figure, to see which one lands where
        return self.tool.Run(command, seconds=10.0 * n, peak_rss_mib=100.0 * n,
                             returncode=report["exit_status"], stdout=json.dumps(report), stderr="")


def test_times_the_slowest_task_alone_and_reports_every_figure(tool, monkeypatch, tmp_path, capsys):
    task_seconds = {1: 0.3, 2: 0.5, 4: 31.3, "all": 1.1, None: 40.0}  # None: an unmarked test, not selectable
    fake = FakeGrader(tool, task_seconds)
    monkeypatch.setattr(tool, "run_measured", fake)
    out = tmp_path / "times.json"
    assert tool.main(["--chapters", "3", "9", "--full", "--json", str(out)]) == 0

    def command(chapter, *extra):
        module = impl.module_for_chapter(chapter)
        return [sys.executable, "-m", "minicb", "check", str(chapter), "--file", str(tool.reference_file(module)),
                "--format", "json", *extra]
    slowest = str(max((t for t in task_seconds if t is not None), key=task_seconds.get))
    assert fake.commands == [command(3), command(3, "--task", slowest), command(3, "--full"),
                             command(9), command(9, "--task", slowest), command(9, "--full")]

    saved = json.loads(out.read_text())
    assert saved["command"] == f"python tools/check_times.py --chapters 3 9 --full --json {out}"
    assert saved["machine"]["cpus"] >= 1 and saved["machine"]["cpu_model"]
    # Run n of the fake took 10 n seconds and 100 n MiB: each figure must come from its own run.
    assert [(r["chapter"], r["check_s"], r["peak_rss_mib"], r["slowest_task"], r["task_s"], r["full_s"],
             r["full_peak_rss_mib"]) for r in saved["chapters"]] == [
        (3, 10.0, 100, slowest, 20.0, 30.0, 300), (9, 40.0, 400, slowest, 50.0, 60.0, 600)]

    table = capsys.readouterr().out
    print(table)
    assert "| chapter | check N (s) | peak RSS (MiB) | slowest task | check N --task K (s) | check N --full (s) |" in table
    assert f"| 03 | 10.0 | 100 | {slowest} ({task_seconds[int(slowest)]:.1f} s of tests) | 20.0 | 30.0 | 300 |" in table
    assert saved["date"] in table and saved["command"] in table


def test_a_failing_reference_stops_the_tool_loudly(tool, monkeypatch, capsys):
    fake = FakeGrader(tool, {1: 0.2, 2: 0.4, "all": 1.0}, failing=(2,))
    monkeypatch.setattr(tool, "run_measured", fake)
    assert tool.main(["--chapters", "6", "7"]) == 1
    captured = capsys.readouterr()
    print(captured.err)
    assert len(fake.commands) == 1, f"it went on after a failing reference: {fake.commands[1:]}"
    assert "chapter 6" in captured.err and "task 2: 0/1 passed, FAIL (AssertionError: task 2 is wrong)" in captured.err
    assert "|" not in captured.out, "a table was printed for a failing reference"


def test_a_grade_that_prints_no_report_fails_too(tool, monkeypatch, capsys):
    monkeypatch.setattr(tool, "run_measured", lambda command: tool.Run(command, 1.0, 50.0, 2, "", "Traceback: boom"))
    assert tool.main(["--chapters", "3"]) == 1
    err = capsys.readouterr().err
    assert "printed no JSON report (exit 2)" in err and "boom" in err, err
