"""The exercise files fit their reference and their tests, for every chapter.

For each chapter in `minicb.impl.CHAPTERS`:
- every stub in chapters/NN-slug/exercise.py has the reference's signature
  (names, kinds and defaults of its parameters), so a student's finished file
  can stand in for the reference anywhere;
- every stub only raises NotImplementedError("Chapter N, task K: ... #task-K")
  (never passes), and the chapter text has a "## Task K" heading for each K;
  a function that raises nothing is given code (e.g. a wrapper that calls the
  student's functions) and is left alone;
- the chapter's tests, run against the untouched stubs, all fail, with
  NotImplementedError and nothing else, and at least once per task -- so each
  task is graded, no test trips over something the student was given, and no
  test hands out a pass for code the student did not write.

Then `python -m minicb check 3` must fail on the stubs and pass on a copy of
the reference (chapter 3 only, to stay fast).

Run one chapter with e.g. `pytest tests/tools/test_exercises.py -k ch03`.
"""
import ast
import functools
import importlib
import inspect
import pathlib
import re
import shutil
import sys

import pytest

from minicb import check, impl

MODULES = sorted(impl.CHAPTERS, key=lambda name: impl.CHAPTERS[name][0])
IDS = [f"ch{impl.CHAPTERS[name][0]:02d}_{name}" for name in MODULES]
STUB_MESSAGE = re.compile(r"Chapter (\d+), task (\d+)\b.*README\.md#task-(\d+)", re.S)


def exercise_file(module):
    path = impl.exercise_path(module)
    assert path.is_file(), f"chapter {impl.CHAPTERS[module][0]} has no exercise file yet: {path}"
    return path


def parameters(function) -> list[tuple]:
    # Annotations are left out on purpose: with or without `from __future__ import
    # annotations` they print differently, and they do not change how a call binds.
    return [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(function).parameters.values()]


def callable_of(member):
    """The function behind a class attribute (method, property, static or class method)."""
    if isinstance(member, property):
        return member.fget
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    return member if inspect.isfunction(member) else None


def stubs(exercise) -> dict[str, object]:
    """Public functions, classes and methods the exercise file defines itself (not the given ones)."""
    found = {}
    for name, obj in vars(exercise).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != exercise.__name__:
            continue  # private, or re-exported from the reference
        if inspect.isfunction(obj):
            found[name] = obj
        elif inspect.isclass(obj):
            found[name] = obj
            for attr, member in vars(obj).items():
                if attr == "__init__" or not attr.startswith("_"):
                    found[f"{name}.{attr}"] = member
    return found


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_stub_signatures_match_the_reference(module):
    exercise = impl.load_file(exercise_file(module), impl.student_module_name(module))
    reference = importlib.import_module(f"minicb.{module}")
    found = stubs(exercise)
    assert found, f"{exercise_file(module)} defines no stubs"
    problems = []
    for qualname, stub in found.items():
        owner = reference
        for part in qualname.split(".")[:-1]:
            owner = getattr(owner, part, None)
        name = qualname.split(".")[-1]
        if owner is None or not hasattr(owner, name):
            problems.append(f"{qualname}: not in minicb.{module}")
            continue
        ref = inspect.getattr_static(owner, name)
        if inspect.isclass(stub):
            if not inspect.isclass(ref):
                problems.append(f"{qualname}: a class here, {type(ref).__name__} in the reference")
            continue
        if type(stub) is not type(ref) and not (inspect.isfunction(stub) and inspect.isfunction(ref)):
            problems.append(f"{qualname}: {type(stub).__name__} here, {type(ref).__name__} in the reference")
            continue
        stub_fn, ref_fn = callable_of(stub), callable_of(ref)
        if stub_fn is not None and parameters(stub_fn) != parameters(ref_fn):
            problems.append(f"{qualname}{inspect.signature(stub_fn)} != reference "
                            f"{qualname}{inspect.signature(ref_fn)}")
    assert not problems, "exercise and reference differ:\n  " + "\n  ".join(problems)


def stub_functions(tree):
    """Every function defined at module level or directly in a class, with its qualified name."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


@functools.lru_cache(maxsize=None)
def stub_tasks(module) -> frozenset[int]:
    """Task numbers named by the stubs' NotImplementedError messages; checks each stub on the way."""
    chapter = impl.CHAPTERS[module][0]
    source = exercise_file(module).read_text()
    tasks, problems = set(), []
    for qualname, function in stub_functions(ast.parse(source)):
        body = function.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if all(isinstance(statement, ast.Pass) or (isinstance(statement, ast.Expr) and isinstance(
                statement.value, ast.Constant)) for statement in body):
            problems.append(f"{qualname}: an empty stub; it must raise NotImplementedError, never pass")
            continue
        raises = [node.exc for node in ast.walk(function) if isinstance(node, ast.Raise)
                  and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", None) == "NotImplementedError"]
        if not raises:
            continue  # given code, written out here because it calls the student's functions
        if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is not raises[0]:
            problems.append(f"{qualname}: a stub must do nothing but `raise NotImplementedError(...)`")
            continue
        raised = raises[0]
        match = STUB_MESSAGE.search(ast.get_source_segment(source, raised) or "")
        if not match or int(match[1]) != chapter or match[2] != match[3]:
            problems.append(f"{qualname}: message must read 'Chapter {chapter}, task K: ... "
                            f"see chapters/.../README.md#task-K'")
            continue
        tasks.add(int(match[2]))
    assert not problems, f"{exercise_file(module)}:\n  " + "\n  ".join(problems)
    return frozenset(tasks)


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_stubs_only_raise_and_point_at_the_text(module):
    tasks = stub_tasks(module)
    assert tasks, f"{exercise_file(module)} has no stubs"
    readme = exercise_file(module).parent / "README.md"
    assert readme.is_file(), f"chapter text missing: {readme}"
    headings = {int(n) for n in re.findall(r"^## Task (\d+)\b", readme.read_text(), re.M)}
    missing = sorted(tasks - headings)
    assert not missing, f"stubs point at tasks {missing}, but {readme} has no '## Task K' heading for them"


@functools.lru_cache(maxsize=None)
def stub_report(module) -> check.Report:
    # Slow tests (the real model) are left out: against stubs they fail like
    # their fast neighbours, only later.
    return check.run_tests(impl.CHAPTERS[module][0], pytest_args=["-m", "not slow"])


@pytest.mark.parametrize("module", MODULES, ids=IDS)
def test_tests_fail_on_stubs_with_not_implemented_only(module):
    exercise_file(module)
    report = stub_report(module)
    assert not report.errors, f"chapter tests did not run against the stubs: {report.errors}\n{report.output[-2000:]}"
    assert report.results, f"no tests ran:\n{report.output[-2000:]}"
    unmarked = [r.nodeid for r in report.results if r.task is None]
    assert not unmarked, f"tests without @pytest.mark.task(k), so no task can be graded: {unmarked}"
    wrong = [f"{r.nodeid}: {r.message}" for r in report.results
             if r.outcome == "failed" and not r.message.startswith("NotImplementedError")]
    assert not wrong, ("against the untouched stubs these tests failed with something other than "
                       "NotImplementedError:\n  " + "\n  ".join(wrong))
    passed = [r.nodeid for r in report.results if r.outcome == "passed"]
    assert not passed, ("these tests pass on the untouched stubs, so they grade nothing the student writes; "
                        "tests of given code belong outside tests/chapters/test_chNN_*.py:\n  " + "\n  ".join(passed))
    tasks = stub_tasks(module)
    failing_tasks = {r.task for r in report.results if r.outcome == "failed"}
    assert tasks <= failing_tasks, f"tasks {sorted(tasks - failing_tasks)} have stubs but no test that fails on them"
    unknown = {r.task for r in report.results} - tasks - {"all"}
    assert not unknown, f"tests are marked with tasks {sorted(unknown)}, which no stub names"
    assert any(r.task == "all" for r in report.results), (
        "the chapter has no integration test: mark one @pytest.mark.task(\"all\") that runs every task's "
        "code together (check N shows it as the row 'all')")


def test_check_command_exit_codes(tmp_path, monkeypatch, capsys):
    # Against the stubs: a non-zero exit and a table naming the task to do first.
    # (The stub run is shared with the test above; main() still formats and decides.)
    report = stub_report("block_allocator")  # before the patch: run alone, the test must not recurse into it
    with monkeypatch.context() as patch:
        patch.setattr(check, "run_tests", lambda *args, **kwargs: report)
        assert check.main(["3"]) == 1
    table = capsys.readouterr().out
    assert "FAIL" in table and "NotImplementedError: Chapter 3, task 1" in table, table

    # Against a copy of the reference: exit 0. The random operation sequences are
    # left out (-k) to keep this fast; test_ch03 runs them on the reference.
    copy = tmp_path / "submission.py"
    shutil.copy(impl.ROOT / "minicb" / "block_allocator.py", copy)
    assert check.main(["3", "--file", str(copy), "-k", "not random"]) == 0, capsys.readouterr().out
    table = capsys.readouterr().out
    assert "PASS" in table and "FAIL" not in table, table

    # Usage errors are exit code 2 with a sentence, not a traceback.
    assert check.main(["99"]) == 2
    assert "chapter 99" in capsys.readouterr().err
    assert check.main(["3", "--file", str(tmp_path / "missing.py")]) == 2


def test_impl_only_swaps_the_graded_chapter(monkeypatch):
    # `check 6` grades the student's scheduler inside the reference engine: with
    # MINICB_IMPL_ONLY=scheduler, chapter 03's stubs must not be loaded for the allocator.
    monkeypatch.setenv("MINICB_IMPL", "student")
    monkeypatch.setenv("MINICB_IMPL_ONLY", "scheduler")
    assert impl.load("block_allocator") is importlib.import_module("minicb.block_allocator")
    student = impl.load("scheduler")
    assert pathlib.Path(student.__file__) == impl.exercise_path("scheduler"), student.__file__
    monkeypatch.setenv("MINICB_IMPL_ONLY", "sheduler")
    with pytest.raises(ValueError, match="MINICB_IMPL_ONLY='sheduler'"):
        impl.load("scheduler")


def test_impl_only_takes_a_comma_separated_list(monkeypatch, tmp_path):
    # Your allocator under your scheduler, the reference for everything else.
    monkeypatch.setenv("MINICB_IMPL_FILE", str(tmp_path / "mine.py"))
    (tmp_path / "mine.py").write_text("WHO = 'student'\n")
    monkeypatch.setenv("MINICB_IMPL_ONLY", " block_allocator, scheduler ")
    assert impl.load("block_allocator").WHO == impl.load("scheduler").WHO == "student"
    assert impl.load("naive") is importlib.import_module("minicb.naive")
    # An unknown name is named, with the known ones listed; the known one beside it does not hide it.
    monkeypatch.setenv("MINICB_IMPL_ONLY", "scheduler,alocator")
    with pytest.raises(ValueError, match=r"'alocator' is not a chapter module; known: block_allocator, chunked_prefill, cuda_graphs, naive"):
        impl.load("scheduler")


def test_load_file_runs_a_file_once_until_it_changes(tmp_path):
    path = tmp_path / "counter.py"
    path.write_text("VERSION = 1\n")
    first = impl.load_file(path, "minicb_test_counter")
    assert impl.load_file(path, "minicb_test_counter") is first, "an unchanged file must not run again"
    # An edited file (new size, new mtime) reloads: a grader never sees a stale module.
    path.write_text("VERSION = 22\n")
    edited = impl.load_file(path, "minicb_test_counter")
    assert edited is not first and edited.VERSION == 22, f"got VERSION={edited.VERSION}, want the edited 22"
    forced = impl.load_file(path, "minicb_test_counter", reload=True)
    assert forced is not edited and forced.VERSION == 22, "reload=True must run the file again"
    # A file that fails to run is not cached, and is not left in sys.modules half-built.
    path.write_text("VERSION = 3\nraise RuntimeError('broken on purpose')\n")
    with pytest.raises(RuntimeError, match="broken on purpose"):
        impl.load_file(path, "minicb_test_counter")
    assert "minicb_test_counter" not in sys.modules


def test_chapter06_grades_each_task_on_its_own(tmp_path):
    # A submission with only task 1 written: task 1 passes, though every test also
    # calls the methods of tasks 2 and 3; those tasks fail, each on its own stub.
    partial = tmp_path / "task1_only.py"
    partial.write_text(exercise_file("scheduler").read_text() + "\n\n"
                       "from minicb.scheduler import Scheduler as _Reference\n"
                       "Scheduler.admit = _Reference.admit  # task 1 done; tasks 2 and 3 still stubs\n")
    report = check.run_tests(6, partial, pytest_args=["-m", "not slow"])
    assert not report.errors, f"{report.errors}\n{report.output[-2000:]}"
    results = {task: [r for r in report.results if r.task == task] for task in (1, 2, 3)}
    failed = [f"{r.nodeid}: {r.message}" for r in results[1] if r.outcome != "passed"]
    assert results[1] and not failed, "task 1 is written, yet its tests failed:\n  " + "\n  ".join(failed)
    for task in (2, 3):
        method = {2: "postprocess", 3: "schedule_running"}[task]  # schedule() calls it before grow()
        messages = {r.message.split(" —")[0] for r in results[task] if r.outcome == "failed"}
        assert messages == {f"NotImplementedError: Chapter 6, task {task}: Scheduler.{method}()"}, \
            f"task {task}'s tests should fail on its own stub only; they failed with {messages}"


def test_grade_table_wraps_the_whole_first_failure_line():
    # The end of a message is often what matters: the value seen, or the link to the text.
    message = ("AssertionError: after seq 1 copied block 1, seq 0 is its only holder and writes in place; "
               "append(0) returned copy (1, 3)")
    report = check.Report(results=[check.TestResult("t::a", 1, "passed"), check.TestResult("t::b", 3, "failed", message)])
    table = check.format_table(report, width=60)
    assert all(len(line) <= 60 for line in table.splitlines()), f"lines wider than 60:\n{table}"
    rows = table.splitlines()
    column = rows[0].index("first failure")
    assert " ".join(line[column:].strip() for line in rows[2:]) == message, f"the message was cut or garbled:\n{table}"


def documented_check_commands() -> list[tuple[str, str]]:
    """Every `python -m minicb check ...` a chapter text or the README shows: (where, arguments)."""
    found = []
    for text in [impl.ROOT / "README.md", *sorted((impl.ROOT / "chapters").glob("*/README.md"))]:
        for number, line in enumerate(text.read_text().splitlines(), 1):
            for match in re.finditer(r"python -m minicb check\b([^`#\n]*)", line):
                found.append((f"{text.relative_to(impl.ROOT)}:{number}", match.group(1).strip()))
    return found


def test_every_documented_check_command_parses(capsys):
    import shlex

    commands = documented_check_commands()
    assert len(commands) >= 12, f"found only {len(commands)} documented check commands; is the pattern stale?"
    rejected = []
    for where, arguments in commands:
        words = ["3" if word == "N" else word for word in shlex.split(arguments)]  # N: any chapter
        try:
            check.build_parser().parse_args(words)
        except SystemExit:
            rejected.append(f"{where}: python -m minicb check {arguments}")
    assert not rejected, "check's argument parser rejects these documented command lines:\n" + "\n".join(rejected)


def test_a_failed_match_shows_the_pattern_and_the_message():
    class Crash:
        message = "AssertionError: Regex pattern did not match.\n  Regex: '5.*6'\n  Input: 'token_ids has 7 tokens'"

    class Longrepr:
        reprcrash = Crash()

    line = check._first_line(Longrepr())
    assert "Regex: '5.*6'" in line and "Input: 'token_ids has 7 tokens'" in line, line


def fake_report() -> check.Report:
    return check.Report(results=[
        check.TestResult("tests/chapters/test_ch03_x.py::test_a", 1, "passed"),
        check.TestResult("tests/chapters/test_ch03_x.py::test_b", 1, "failed", "AssertionError: want 2, got 4"),
        check.TestResult("tests/chapters/test_ch03_x.py::test_c", 2, "passed"),
        check.TestResult("tests/chapters/test_ch03_x.py::test_d", 2, "skipped", "needs CUDA"),
        check.TestResult("tests/chapters/test_ch03_x.py::test_e", "all", "passed")], returncode=1)


def test_check_json_and_gradescope_reports(tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.setattr(check, "run_tests", lambda *args, **kwargs: fake_report())
    assert check.main(["3", "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["chapter"] == 3 and report["exit_status"] == 1 and report["passed"] is False, report
    tasks = {t["task"]: t for t in report["tasks"]}
    assert list(tasks) == ["1", "2", "all"], report["tasks"]
    assert (tasks["1"]["passed"], tasks["1"]["total"], tasks["1"]["status"]) == (1, 2, "FAIL"), tasks["1"]
    assert tasks["1"]["first_failure"] == "AssertionError: want 2, got 4", tasks["1"]
    assert (tasks["2"]["passed"], tasks["2"]["skipped"], tasks["2"]["status"]) == (1, 1, "PASS"), tasks["2"]

    out = tmp_path / "results.json"
    assert check.main(["3", "--format", "gradescope", "--out", str(out)]) == 1
    graded = json.loads(out.read_text())
    scores = {t["name"]: (t["score"], t["max_score"]) for t in graded["tests"]}
    assert scores == {"chapter 3, task 1": (1, 2), "chapter 3, task 2": (1, 1), "chapter 3, task all": (1, 1)}, scores
    task1 = next(t for t in graded["tests"] if t["name"] == "chapter 3, task 1")
    assert "FAILED tests/chapters/test_ch03_x.py::test_b: AssertionError: want 2, got 4" in task1["output"], task1["output"]


def test_check_cannot_grade_a_file_that_does_not_import(tmp_path, capsys):
    import json

    broken = tmp_path / "submission.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    assert check.main(["3", "--file", str(broken), "--format", "json"]) == 2
    captured = capsys.readouterr()
    assert "does not import" in captured.err and "boom at import" in captured.err, captured.err
    assert json.loads(captured.out)["exit_status"] == 2, captured.out

    out = tmp_path / "results.json"  # a course platform still gets a results file, scoring 0
    assert check.main(["3", "--file", str(broken), "--format", "gradescope", "--out", str(out)]) == 2
    graded = json.loads(out.read_text())
    assert graded["score"] == 0 and "boom at import" in graded["output"], graded


def test_a_failed_sequence_comparison_shows_both_sides_around_the_first_difference():
    # The grader's plugin explains `assert a == b` on token lists and texts: the index of the first
    # difference and a window of each side there, where pytest's own summary cuts both from the start.
    left, right = list(range(100)), list(range(100))
    right[70] = -1
    summary, where = check.pytest_assertrepr_compare(None, "==", left, right)
    assert "first difference at index 70" in where and "70 != -1" in where, where
    assert "69, 70, 71" in summary and "69, -1, 71" in summary and "0, 1, 2" not in summary, summary
    _, where = check.pytest_assertrepr_compare(None, "==", [1, 2, 3], [1, 2])
    assert "index 2" in where and "one side ends there" in where, where
    _, where = check.pytest_assertrepr_compare(None, "==", "a lone text", "a long text")
    assert "index 5" in where and "'e' != 'g'" in where, where
    assert check.pytest_assertrepr_compare(None, "==", {1: 2}, {1: 3}) is None  # pytest's own diff is fine there
