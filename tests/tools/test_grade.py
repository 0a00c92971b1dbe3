"""`python -m minicb grade` (many submissions, one CSV) and `python -m minicb check all` (every chapter).

The grade test is the teacher's folder in small: four chapter 3 submissions,
one right, one wrong, one that does not import and one that hangs. Each must
cost only its own row, and the hanging one no more than its time limit. The
right and wrong files are made the way tests/tools/test_mutants.py makes its mutants:
the reference module's names, with one method written again.
"""
from __future__ import annotations

import csv
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
from test_mutants import Mutant, mutant_source

from minicb import check, grade, impl

TIMEOUT = 30  # seconds per submission; a right one takes about 10 on a busy 2-core CPU

BREAKS_AT_IMPORT = """import os
raise RuntimeError("this submission breaks at import; TMPDIR=" + os.environ.get("TMPDIR", ""))
"""


def process_gone(pid: int) -> bool:
    """No such process, or only a zombie that nobody has reaped yet (it runs nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return stat.is_file() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow  # three quick gradings and one 30 s timeout: about 70 s on a busy 2-core CPU
def test_grade_a_folder_of_four_submissions(tmp_path):
    folder = tmp_path / "submissions"
    folder.mkdir()
    pid_file = tmp_path / "hang.pid"
    files = {
        "right": mutant_source(Mutant(3, 1, "none", "BlockAllocator.allocate", [])),
        "wrong": mutant_source(Mutant(3, 3, "fork forgets the child's references", "BlockAllocator.fork",
                                      [("self._ref_counts[block] += 1", "pass")])),
        "broken": BREAKS_AT_IMPORT,
        # It imports fine, so the hang happens inside pytest, two processes below `grade`.
        "hangs": mutant_source(Mutant(3, 1, "allocate never returns", "BlockAllocator.allocate", [(
            "    needed = self.blocks_needed(num_tokens)\n",
            f"    open({str(pid_file)!r}, 'w').write(str(__import__('os').getpid()))\n"
            "    while True:\n        pass\n")])),
    }
    for name, source in files.items():
        (folder / f"{name}.py").write_text(source)
    grades = tmp_path / "grades.csv"

    start = time.perf_counter()
    # The quick tests without the long random ones: every outcome below still shows.
    run = subprocess.run([sys.executable, "-m", "minicb", "grade", "3", str(folder), "--csv", str(grades),
                          "--timeout", str(TIMEOUT), "-k", "not hypothesis and not random"],
                         cwd=impl.ROOT, capture_output=True, text=True, timeout=TIMEOUT + 300)
    seconds = time.perf_counter() - start
    print(f"grade took {seconds:.0f} s\n{run.stdout}")  # shown with -s: the measured time
    assert run.returncode == 0, f"exit code {run.returncode}:\n{run.stdout}\n{run.stderr[-3000:]}"
    progress = [line for line in run.stdout.splitlines() if re.match(r"\[\d/4\] ", line)]
    assert len(progress) == 4, f"want a progress line per submission:\n{run.stdout}"

    with open(grades, newline="") as file:
        rows = {pathlib.Path(row["file"]).stem: row for row in csv.DictReader(file)}
    assert sorted(rows) == sorted(files), f"want one row per submission: {sorted(rows)}"
    outcomes = {name: row["outcome"] for name, row in rows.items()}
    assert outcomes == {"right": "passed", "wrong": "failed", "broken": "could-not-grade", "hangs": "timeout"}, outcomes

    right, wrong = rows["right"], rows["wrong"]
    task_columns = [column for column in right if column.startswith("task ") or column == "all"]
    assert task_columns[:3] == ["task 1", "task 2", "task 3"] and task_columns[-1] == "all", task_columns
    assert int(right["score"]) == int(right["max"]) > 0, right
    assert 0 < int(wrong["score"]) < int(wrong["max"]) == int(right["max"]), wrong
    for row in (right, wrong):  # the task columns add up to the score
        passed, ran = zip(*(map(int, row[column].split("/")) for column in task_columns))
        assert (sum(passed), sum(ran)) == (int(row["score"]), int(row["max"])), row
    assert wrong["task 3"] != right["task 3"] and wrong["message"].startswith("task 3: AssertionError"), wrong

    broken = rows["broken"]
    assert "this submission breaks at import" in broken["message"], broken
    assert str(folder / "broken.py") in broken["message"], "the message should name the file, not its copy"
    # It ran with its own TMPDIR, in a folder of its own that is gone now.
    tmpdir = pathlib.Path(broken["message"].split("TMPDIR=")[1].split()[0])
    assert tmpdir.parent.name.startswith("minicb-grade-") and not tmpdir.parent.exists(), broken["message"]

    hangs = rows["hangs"]
    assert hangs["message"] == f"timed out after {TIMEOUT} s", hangs
    assert TIMEOUT <= float(hangs["seconds"]) < TIMEOUT + 15, hangs
    assert pid_file.is_file(), "the hanging submission never ran, so this proves nothing"
    pid = int(pid_file.read_text())
    assert process_gone(pid), f"the pytest running the hanging submission (pid {pid}) outlived its timeout"
    # The three others took seconds each; only the hang waited for its limit.
    assert seconds < TIMEOUT + 3 * 60, f"grading four submissions took {seconds:.0f} s"


def test_grade_rejects_bad_arguments_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a rejected run must not leave a grades.csv behind
    submission = tmp_path / "alice.py"
    submission.write_text("x = 1\n")
    (tmp_path / "empty").mkdir()
    cases = {("99", str(submission)): "99",
             ("3", str(tmp_path / "bob.py")): "bob.py",
             ("3", str(tmp_path / "empty")): "no .py files",
             ("3", str(submission), "--timeout", "0"): "--timeout 0"}
    for argv, named in cases.items():
        assert grade.main(list(argv)) == 2, argv
        error = capsys.readouterr().err
        assert named in error, f"grade {' '.join(argv)}: the error should name {named!r}: {error}"
    with pytest.raises(SystemExit) as exit:  # no FILE at all
        grade.main(["3"])
    assert exit.value.code == 2
    assert not (tmp_path / "grades.csv").exists()


def test_a_report_after_stray_output_is_still_read():
    report = {"chapter": 3, "exit_status": 1, "passed": False, "duration_s": 1.0, "errors": [],
              "tasks": [{"task": "1", "passed": 2, "skipped": 1, "total": 4, "seconds": 0.1, "status": "FAIL",
                         "first_failure": "AssertionError: want 2, got 4"}]}
    text = "garbage {not json\n" + json.dumps(report, indent=1) + "\n"
    row = grade.row_from_report("a.py", grade._parse_report(text), 1.0)
    assert (row.outcome, row.score, row.max, row.tasks) == ("failed", 2, 3, {"task 1": "2/3"}), row
    assert row.message == "task 1: AssertionError: want 2, got 4"
    assert grade._parse_report("Segmentation fault\n") is None



def test_fail_under_fails_the_run_when_any_submission_scores_below_it(tmp_path, monkeypatch, capsys):
    # What a CI run over a class needs: exit 1 when one submission is under the bar, naming it.
    scores = {"alice": grade.Row("", "passed", 10, 10), "bob": grade.Row("", "failed", 6, 10),
              "carol": grade.Row("", "could-not-grade")}
    for name in scores:
        (tmp_path / f"{name}.py").write_text("x = 1\n")

    def grade_one(chapter, path, timeout, check_args):
        row = scores[path.stem]
        return grade.Row(str(path), row.outcome, row.score, row.max)

    monkeypatch.setattr(grade, "grade_one", grade_one)
    csv_path = str(tmp_path / "grades.csv")
    files = [str(tmp_path / f"{name}.py") for name in ("alice", "bob")]
    assert grade.main(["3", *files, "--csv", csv_path]) == 0  # no bar: every row written is a success
    assert grade.main(["3", *files, "--csv", csv_path, "--fail-under", "60"]) == 0  # 60% is not below 60
    assert "at least 60%" in capsys.readouterr().out
    assert grade.main(["3", *files, "--csv", csv_path, "--fail-under", "61"]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 submissions score below 61%" in err and "bob.py (60%)" in err and "alice" not in err, err
    assert pathlib.Path(csv_path).is_file(), "the CSV is written even when the run fails"
    # A submission that could not be graded scores 0, below any bar above 0.
    assert grade.main(["3", str(tmp_path / "carol.py"), "--csv", csv_path, "--fail-under", "1"]) == 1
    assert "carol.py (0%)" in capsys.readouterr().err
    assert grade.main(["3", *files, "--csv", csv_path, "--fail-under", "101"]) == 2
    assert "--fail-under 101" in capsys.readouterr().err


# ---- check all -----------------------------------------------------------------------


def fake_report(chapter: int) -> check.Report:
    """A report for each kind of row `check all` can print, by chapter."""
    R = check.TestResult
    stub = "NotImplementedError: Chapter {}, task 2: see the README"
    if chapter == 5:  # the stubs as handed out: only given code's test passes
        return check.Report(results=[R("a", 1, "failed", stub.format(5)), R("b", 2, "failed", stub.format(5)),
                                     R("c", None, "passed")], returncode=1)
    if chapter == 6:  # task 1 done, task 2 still a stub: started
        return check.Report(results=[R("a", 1, "passed"), R("b", 2, "failed", stub.format(6))], returncode=1)
    if chapter == 7:
        return check.Report(results=[R("a", 1, "passed"), R("b", 2, "failed", "AssertionError: want 2, got 4")],
                            returncode=1)
    if chapter == 10:  # CUDA-only tests on a CPU
        return check.Report(results=[R("a", 1, "skipped", "needs CUDA")])
    return check.Report(results=[R("a", 1, "passed"), R("b", 1, "skipped", "needs CUDA"), R("c", "all", "passed")])


def test_check_all_prints_a_row_per_chapter_as_it_goes(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")  # room for the whole note
    printed_before = {}  # chapter -> what had been printed when its tests started

    def run_tests(chapter, exercise_file=None, pytest_args=(), verbose=False, tasks=None, test_timeout=None):
        assert exercise_file is None and list(pytest_args) == ["-m", "not slow"], (exercise_file, pytest_args)
        printed_before[chapter] = capsys.readouterr().out
        return fake_report(chapter)

    def import_error(path):
        return "SyntaxError: invalid syntax" if "09-" in str(path) else None

    monkeypatch.setattr(check, "run_tests", run_tests)
    monkeypatch.setattr(check, "import_error", import_error)
    assert check.main(["all"]) == 1
    output = "".join(printed_before.values()) + capsys.readouterr().out
    rows = [re.split(r"\s{2,}", line) for line in output.splitlines() if re.match(r"\d+ ", line)]
    chapters = sorted(number for number, _ in impl.CHAPTERS.values())
    assert [int(row[0]) for row in rows] == chapters, output
    assert [row[1] for row in rows] == [impl.module_for_chapter(n) for n in chapters], output
    status = {int(row[0]): row[3] for row in rows}
    want = {n: "PASS" for n in chapters} | {5: "not started", 6: "FAIL", 7: "FAIL", 9: "could not grade",
                                            10: "could not grade"}
    assert status == want, output
    assert rows[chapters.index(3)][2:] == ["2/2", "PASS", "0s", "1 skipped"], output  # passed/ran, then the note
    assert "task 2: AssertionError: want 2, got 4" in next(" ".join(row) for row in rows if row[0] == "7")
    assert "SyntaxError" in next(" ".join(row) for row in rows if row[0] == "9")
    # Each row is out before the next chapter starts (chapter 9 did not import, so it ran no tests).
    assert sorted(printed_before) == [n for n in chapters if n != 9], sorted(printed_before)
    for previous, chapter in zip(chapters, chapters[1:]):
        if chapter in printed_before:
            assert re.search(rf"^{previous} ", printed_before[chapter], re.M), f"chapter {previous}'s row came late"

    monkeypatch.setattr(check, "run_tests", lambda chapter, *args, **kwargs: fake_report(3))
    monkeypatch.setattr(check, "import_error", lambda path: None)
    assert check.main(["all"]) == 0
    assert f"{len(chapters)}/{len(chapters)} chapters pass." in capsys.readouterr().out
    assert check.main(["all", "--format", "json"]) == 0
    graded = json.loads(capsys.readouterr().out)
    assert [c["chapter"] for c in graded["chapters"]] == chapters and graded["exit_status"] == 0


def test_check_all_rejects_one_file_options(capsys):
    assert check.main(["all", "--file", "x.py"]) == 2
    assert "--file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.build_parser().parse_args(["three"])
    assert "'three'" in capsys.readouterr().err
