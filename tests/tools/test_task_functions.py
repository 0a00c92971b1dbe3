"""A task passes only on functions the student's file defines (minicb/tasks.py, tests/conftest.py).

A stub's class inherits from a given base, and once that base was the reference
itself: a file with a task's method deleted or misspelt passed the task on the
reference's code. Now the grader reads the file first. These tests delete each
task function in turn, from the stubs and from a correct solution (the
reference written out as a submission, as tests/tools/test_mutants.py does),
and check that the task it belongs to, and only that task, loses it.
"""
from __future__ import annotations

import ast

import pytest

from minicb import check, impl, tasks
from test_mutants import Mutant, mutant_source

CHAPTERS = sorted(impl.CHAPTER_NUMBERS)


def without(source: str, qualname: str, rename: str | None = None) -> str:
    """`source` with function `qualname` ("f" or "Class.method") deleted, or renamed to `rename`."""
    tree = ast.parse(source)
    owner, _, name = qualname.rpartition(".")
    scopes = [tree] if not owner else [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    found = False
    for scope in scopes:
        for node in list(scope.body):
            defined = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
            # A solution may bind a function by name (`admit = _reference.Scheduler.admit`).
            bound = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]
            if defined or bound:
                found = True
                if rename and defined:
                    node.name = rename
                elif rename:
                    node.targets[0].id = rename
                else:
                    scope.body.remove(node)
        if not scope.body:
            scope.body.append(ast.Pass())
    assert found, f"{qualname} is not defined in the source"
    return ast.unparse(tree)


def solution(chapter: int) -> str:
    """A correct exercise file for `chapter`: the reference's code, every task function defined."""
    first = next(iter(tasks.task_functions(chapter).values()))[0]
    return mutant_source(Mutant(chapter, 1, "none", first, []))


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_task_lists_its_functions(chapter):
    found = tasks.task_functions(chapter)
    assert found and all(found.values()), f"chapter {chapter}: no task functions read off its stubs: {found}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_deleted_task_function_fails_its_task_and_no_other(chapter, tmp_path):
    stub = impl.exercise_path(impl.module_for_chapter(chapter)).read_text()
    for name, source in (("the stub", stub), ("a correct solution", solution(chapter))):
        path = tmp_path / "exercise.py"
        path.write_text(source)
        assert all(tasks.missing_functions(path, chapter, task) == [] for task in tasks.task_functions(chapter)), (
            f"chapter {chapter}: {name} defines every task's functions, yet the grader finds some missing")
        for task, functions in tasks.task_functions(chapter).items():
            for function in functions:
                path.write_text(without(source, function))
                missing = {task_: [m for m, _ in tasks.missing_functions(path, chapter, task_)]
                           for task_ in tasks.task_functions(chapter)}
                assert missing[task] == [function], (
                    f"chapter {chapter}, {name} without {function}: task {task} must miss exactly it; "
                    f"the grader found {missing[task]}")
                assert all(not m for t, m in missing.items() if t != task), (
                    f"chapter {chapter}, {name} without {function}: other tasks lost functions too: {missing}")
                assert [m for m, _ in tasks.missing_functions(path, chapter, "all")] == [function]


def test_a_misspelt_method_is_named_with_its_near_miss(tmp_path):
    path = tmp_path / "exercise.py"
    path.write_text(without(solution(6), "Scheduler.postprocess", rename="post_process"))
    missing = tasks.missing_functions(path, 6, 2)
    assert missing == [("Scheduler.postprocess", "post_process")], missing
    message = tasks.missing_message(6, 2, missing)
    assert "Scheduler.postprocess()" in message and "post_process" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("chapter, function", [(2, "PaddedKVCache.key_mask"), (6, "Scheduler.admit"),
                                               (7, "CachingBlockAllocator.free"),
                                               (8, "ChunkedScheduler.tokens_to_compute")])
def test_check_fails_a_task_whose_method_only_a_given_class_has(chapter, function, tmp_path):
    """End to end: these four stubs' classes inherit given classes that have a method of that name
    (chapter 01's key_mask, chapter 06's rule, chapter 03's free), so without the grader's reading
    the task would pass."""
    task = next(t for t, names in tasks.task_functions(chapter).items() if function in names)
    path = tmp_path / "exercise.py"
    path.write_text(without(solution(chapter), function))
    report = check.run_tests(chapter, path, ["-m", "not slow"], tasks=[int(task)])
    failed = [r for r in report.results if r.outcome == "failed"]
    ran = [r for r in report.results if r.outcome != "skipped"]
    assert ran and len(failed) == len(ran), (
        f"chapter {chapter} without {function}: every test of task {task} must fail; "
        f"{len(failed)} of {len(ran)} did: {[(r.nodeid, r.outcome) for r in report.results]}")
    assert all(f"does not define {function}()" in r.message for r in failed), [r.message for r in failed][:3]
