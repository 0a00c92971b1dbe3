"""The course-platform wiring in docs/teaching/ grades for real: Gradescope's scripts and Classroom's workflow.

- docs/teaching/run_autograder runs in a temporary /autograder (AUTOGRADER_ROOT)
  on a correct chapter 3 submission (the reference, written out as an exercise
  file the way tests/tools/test_mutants.py writes its mutants) and must leave a
  results.json in Gradescope's shape that gives full marks; on a submission
  without the file, a results.json that scores 0 and says what was expected.
- docs/teaching/classroom.yml: every grading command must be one `check`
  accepts, the reporter must read every grader, and chapter 3's command must
  pass the same correct submission.
- chapters/TEACHING.md: its links and quoted paths resolve, and its table of
  grading times has the columns tools/check_times.py prints.

The two real grades of chapter 3 take most of this file's time (20-45 s each).
"""
import json
import os
import shlex
import stat
import subprocess

import pytest
import yaml  # PyYAML: installed with transformers, a dependency of minicb

import test_docs
from minicb import check, impl
from test_mutants import Mutant, mutant_source
from tool_support import load_tool

ROOT = impl.ROOT
TEACHING = ROOT / "docs" / "teaching"
RUN_AUTOGRADER = TEACHING / "run_autograder"
WORKFLOW = TEACHING / "classroom.yml"
GUIDE = ROOT / "chapters" / "TEACHING.md"

# What Gradescope's results.json may hold at the top level and in each test, with the types it reads.
GRADESCOPE_TEST_FIELDS = {"score": (int, float), "max_score": (int, float), "name": str, "output": str}
VISIBILITY = {"visible", "hidden", "after_due_date", "after_published"}


def assert_gradescope_results(results: dict) -> None:
    """Gradescope's required fields and their types: a score at the top or in every test."""
    assert isinstance(results, dict), f"results.json holds a {type(results).__name__}, not an object"
    assert "tests" in results or "score" in results, f"neither 'tests' nor 'score' at the top: {sorted(results)}"
    if "score" in results:
        assert isinstance(results["score"], (int, float)), f"score: {results['score']!r}"
    if "execution_time" in results:
        assert isinstance(results["execution_time"], int), f"execution_time: {results['execution_time']!r}"
    if "output" in results:
        assert isinstance(results["output"], str), f"output: {results['output']!r}"
    if "visibility" in results:
        assert results["visibility"] in VISIBILITY, f"visibility: {results['visibility']!r}"
    assert isinstance(results.get("tests", []), list), f"tests: {results['tests']!r}"
    for test in results.get("tests", []):
        for field, kind in GRADESCOPE_TEST_FIELDS.items():
            assert isinstance(test.get(field), kind), f"test {test.get('name')!r}: {field} = {test.get(field)!r}"


def run_autograder(tmp_path, **env) -> tuple[subprocess.CompletedProcess, dict]:
    """Run run_autograder with /autograder under tmp_path; its process and the results.json it left."""
    # Only what this test sets: a setting left in the caller's shell must not change the run.
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("AUTOGRADER_", "MINICB_CHAPTER", "MINICB_CHECK_ARGS", "MINICB_PYTHON"))}
    full_env.update(AUTOGRADER_ROOT=str(tmp_path), **env)
    done = subprocess.run([str(RUN_AUTOGRADER)], env=full_env, capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:], done.stderr[-3000:])
    results_file = tmp_path / "results" / "results.json"
    assert results_file.is_file(), f"run_autograder (exit {done.returncode}) left no results.json"
    return done, json.loads(results_file.read_text())


@pytest.fixture(scope="module")
def correct_chapter3(tmp_path_factory) -> str:
    """A correct chapter 3 exercise file: the reference, written out as a submission."""
    path = tmp_path_factory.mktemp("sample") / "exercise.py"
    path.write_text(mutant_source(Mutant(3, 1, "none", "BlockAllocator.allocate", [])))
    return str(path)


# ---- Gradescope ------------------------------------------------------------------


def test_scripts_are_executable_shell():
    for script in (RUN_AUTOGRADER, TEACHING / "setup.sh"):
        assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable; Gradescope runs it as is"
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{script.name}: {syntax.stderr}"


@pytest.fixture(scope="module")
def correct_grades(tmp_path_factory, correct_chapter3) -> dict:
    """The correct chapter 3 submission graded twice, side by side: by run_autograder in a temporary
    /autograder, and by classroom.yml's chapter 3 command with --file. Each grade is mostly one
    single-threaded hypothesis test, so two at once take about the time of one on two cores."""
    root = tmp_path_factory.mktemp("autograder")
    (root / "submission").mkdir()
    (root / "submission" / "exercise.py").write_text(open(correct_chapter3).read())
    ((_, command),) = [(s, a) for s, a in check_commands(workflow_steps()) if a[4:5] == ["3"]]
    command = command + ["--file", correct_chapter3]
    with open(root / "workflow.log", "w+") as log:
        workflow = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            gradescope = run_autograder(root, AUTOGRADER_SOURCE=str(ROOT), MINICB_CHAPTER="3")
        finally:
            workflow.wait(timeout=600)
        log.seek(0)
        output = log.read()
    return {"gradescope": gradescope, "workflow": (command, workflow.returncode, output)}


def test_gradescope_gives_a_correct_submission_full_marks(correct_grades):
    done, results = correct_grades["gradescope"]
    assert done.returncode == 0
    assert_gradescope_results(results)
    tests = results["tests"]
    assert tests, "no graded tests"
    names = [t["name"] for t in tests]
    assert "chapter 3, task all" in names and "chapter 3, task 1" in names, names
    short = [(t["name"], t["score"], t["max_score"]) for t in tests if t["score"] != t["max_score"]]
    assert not short, f"a correct submission lost points: {short}"
    assert sum(t["max_score"] for t in tests) > 0
    assert "score" not in results or results["score"] == sum(t["max_score"] for t in tests)


def test_gradescope_without_the_file_scores_zero_and_says_why(tmp_path):
    # The chapter from chapter.txt in the autograder source, as on Gradescope.
    source = tmp_path / "source"
    source.mkdir()
    (source / "chapter.txt").write_text("03\n")
    submission = tmp_path / "submission"
    submission.mkdir()
    (submission / "block_allocator.py").write_text("# the wrong name\n")
    done, results = run_autograder(tmp_path, AUTOGRADER_SOURCE=str(source))
    assert done.returncode == 0
    assert_gradescope_results(results)
    assert results["score"] == 0
    assert "Chapter 3" in results["output"] and "exercise.py" in results["output"], results["output"]
    assert "block_allocator.py" in results["output"], "the message should say what was uploaded"


def test_gradescope_without_a_chapter_scores_zero(tmp_path):
    (tmp_path / "source").mkdir()
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "exercise.py").write_text("")
    _, results = run_autograder(tmp_path, AUTOGRADER_SOURCE=str(tmp_path / "source"))
    assert_gradescope_results(results)
    assert results["score"] == 0 and "chapter.txt" in results["output"], results


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for the venv's python: records the check command, then writes a report (or not).
printf '%s\\n' "$@" > "$FAKE_ARGS"
if [ -n "${FAKE_WRITES:-}" ]; then
    for ((i = 1; i <= $#; i++)); do
        if [ "${!i}" = --out ]; then j=$((i + 1)); echo '{"tests": []}' > "${!j}"; fi
    done
fi
exit 1
"""


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "fake_python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return path


def test_gradescope_finds_a_whole_repository_and_passes_the_arguments(tmp_path, fake_python):
    exercise = tmp_path / "submission" / "minicb-main" / "chapters" / "07-prefix-caching" / "exercise.py"
    exercise.parent.mkdir(parents=True)
    exercise.write_text("")
    (tmp_path / "submission" / "chapters" / "03-block-allocation").mkdir(parents=True)  # another chapter's
    (tmp_path / "submission" / "chapters" / "03-block-allocation" / "exercise.py").write_text("")
    args_file = tmp_path / "args.txt"
    _, results = run_autograder(tmp_path, AUTOGRADER_SOURCE=str(ROOT), MINICB_CHAPTER="07",
                                MINICB_PYTHON=str(fake_python), MINICB_CHECK_ARGS="--full --task 2",
                                FAKE_ARGS=str(args_file), FAKE_WRITES="1")
    args = args_file.read_text().splitlines()
    assert args == ["-m", "minicb", "check", "7", "--file", str(exercise), "--format", "gradescope",
                    "--out", str(tmp_path / "results" / "results.json"), "--full", "--task", "2"], args
    assert results == {"tests": []}, "run_autograder replaced the report check wrote"
    parsed = check.build_parser().parse_args(args[3:])
    assert (parsed.chapter, parsed.full, parsed.tasks) == (7, True, ["2"])


def test_gradescope_reports_a_grader_that_broke(tmp_path, fake_python):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "exercise.py").write_text("")
    _, results = run_autograder(tmp_path, AUTOGRADER_SOURCE=str(ROOT), MINICB_CHAPTER="3",
                                MINICB_PYTHON=str(fake_python), FAKE_ARGS=str(tmp_path / "args.txt"))
    assert_gradescope_results(results)
    assert results["score"] == 0 and "exit code 1" in results["output"], results


# ---- GitHub Classroom ---------------------------------------------------------------

# The actions the workflow may use, and the inputs each documents.
ACTIONS = {"actions/checkout@v4": set(), "actions/setup-python@v5": {"python-version"},
           "classroom-resources/autograding-command-grader@v1": {"test-name", "setup-command", "command",
                                                                  "timeout", "max-score"},
           "classroom-resources/autograding-grading-reporter@v1": {"runners"}}


def workflow_steps() -> list[dict]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert set(workflow) >= {"name", "on", "jobs"}, f"top-level keys: {sorted(workflow)}"
    (job,) = workflow["jobs"].values()
    return job["steps"]


def check_commands(steps) -> list[tuple[dict, list[str]]]:
    """Every `minicb check` command line in the workflow (in `run:` or a grader's `command:`), split."""
    found = []
    for step in steps:
        lines = step.get("run", "").splitlines() + [step.get("with", {}).get("command", "")]
        found += [(step, shlex.split(line)) for line in lines if "minicb check" in line]
    return found


def test_workflow_commands_are_ones_check_accepts():
    steps = workflow_steps()
    for step in steps:
        if "uses" in step:
            assert step["uses"] in ACTIONS, f"step {step.get('name')!r} uses {step['uses']}, not a known action"
            unknown = set(step.get("with", {})) - ACTIONS[step["uses"]]
            assert not unknown, f"step {step.get('name')!r}: {step['uses']} has no input {unknown}"
    commands = check_commands(steps)
    chapters = []
    for step, argv in commands:
        assert argv[:4] == [".venv/bin/python", "-m", "minicb", "check"], f"{step['name']}: {argv}"
        try:
            parsed = check.build_parser().parse_args(argv[4:])
        except SystemExit:
            pytest.fail(f"step {step['name']!r}: `check` rejects {shlex.join(argv[4:])}")
        chapters.append(parsed.chapter)
    assert sorted(chapters) == sorted(n for n, _ in impl.CHAPTERS.values()), f"graded chapters: {chapters}"
    # .venv comes from `make setup`, in a step before the first grade.
    setup = next(i for i, s in enumerate(steps) if s.get("run", "").startswith("make setup"))
    assert setup < steps.index(commands[0][0])
    makefile = (ROOT / "Makefile").read_text()
    for assignment in shlex.split(steps[setup]["run"])[2:]:
        variable = assignment.split("=")[0]
        assert f"\n{variable} ?=" in makefile, f"make setup is given {variable}, which the Makefile does not read"


def test_workflow_reporter_reads_every_grader():
    steps = workflow_steps()
    graders = [s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-command-grader")]
    (reporter,) = [s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-grading-reporter")]
    ids = [s["id"] for s in graders]
    assert reporter["with"]["runners"].split(",") == ids
    # The reporter reads runner r's result from the variable r.upper() + "_RESULTS".
    assert reporter["env"] == {f"{i.upper()}_RESULTS": f"${{{{steps.{i}.outputs.result}}}}" for i in ids}
    assert steps.index(reporter) == len(steps) - 1
    for grader in graders:
        assert isinstance(grader["with"]["max-score"], int) and grader["with"]["max-score"] > 0, grader


def test_workflow_chapter3_command_passes_a_correct_submission(correct_grades):
    command, returncode, output = correct_grades["workflow"]
    print(output[-3000:])
    assert returncode == 0, f"`{shlex.join(command)}` exited {returncode}"


# ---- the guide ---------------------------------------------------------------------


def test_guide_links_and_paths_resolve():
    test_docs.test_relative_links_and_anchors_resolve(GUIDE)
    test_docs.test_quoted_paths_exist(GUIDE)
    test_docs.test_every_markdown_file_a_text_names_exists(GUIDE)


def test_guide_table_has_the_columns_check_times_prints():
    tool = load_tool("check_times")
    host = {"cpus": 1, "cpu_model": "x", "memory_gib": None, "python": "3", "env": {}}
    header = tool.markdown([], True, "today", host, "python tools/check_times.py --full").split("\n")[2]
    assert header in GUIDE.read_text(), f"chapters/TEACHING.md lacks the tool's table header:\n{header}"
