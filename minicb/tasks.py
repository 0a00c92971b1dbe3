"""Which functions each exercise task asks for, and whether a student's file defines them.

A chapter's stubs (chapters/NN-slug/exercise.py) say what each task is: every
function or method a student writes raises

    NotImplementedError("Chapter 6, task 1: Scheduler.admit() — see ...")

so `task_functions(6)` reads them off the stub file's syntax tree:
{1: ["Scheduler.admit"], 2: ["Scheduler.postprocess"], 3: ["Scheduler.grow",
"Scheduler.schedule_running"]}. `missing_functions(path, 6, task)` then
reads a student's file the same way and lists the task's functions it does not
define, each with the nearest name it does define ("post_process" for
"postprocess"), so the grader can fail the task with a message that names
both, before any test runs. Defining a function is the only way to pass a
task: one inherited from a given class, or misspelt, never counts.

Nothing here imports the student's file: it only parses it.
Teachers' guide: chapters/TEACHING.md ("How grading works").
"""
from __future__ import annotations

import ast
import difflib
import functools
import pathlib
import re

from minicb import impl

TASK_MESSAGE = re.compile(r"Chapter (\d+), task (\d+|all)\b")


def _raised_task(node: ast.FunctionDef) -> str | None:
    """The task a stub's function belongs to: the k of the NotImplementedError("Chapter N, task k: ...")
    its body raises, or None when it raises none (a given function)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Raise) and inner.exc is not None:
            text = "".join(c.value for c in ast.walk(inner.exc) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str))
            match = TASK_MESSAGE.search(text)
            if match and "NotImplementedError" in ast.unparse(inner.exc):
                return match.group(2)
    return None


def defined_functions(source: str) -> dict[str, list[str]]:
    """{scope: names}: the functions a file defines, scope "" for the module and the class
    name for a class's methods (one level: nested classes and functions are not the API)."""
    tree = ast.parse(source)
    scopes: dict[str, list[str]] = {"": []}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scopes[""].append(node.name)
        elif isinstance(node, ast.Assign):  # `allocate = _allocate` defines a name too
            scopes[""] += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.ClassDef):
            names = scopes.setdefault(node.name, [])
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.append(item.name)
                elif isinstance(item, ast.Assign):
                    names += [t.id for t in item.targets if isinstance(t, ast.Name)]
    return scopes


@functools.lru_cache(maxsize=None)
def task_functions(chapter: int) -> dict[str, list[str]]:
    """{task: ["function", "Class.method", ...]} of chapter `chapter`, read from its stub file."""
    path = impl.exercise_path(impl.module_for_chapter(chapter))
    tree = ast.parse(path.read_text())
    tasks: dict[str, list[str]] = {}
    for node in tree.body:
        members = [(f"{node.name}.{item.name}", item) for item in node.body
                   if isinstance(item, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else []
        if isinstance(node, ast.FunctionDef):
            members = [(node.name, node)]
        for name, function in members:
            task = _raised_task(function)
            if task is not None:
                tasks.setdefault(task, []).append(name)
    return {task: sorted(names) for task, names in tasks.items()}


def missing_functions(path: str | pathlib.Path, chapter: int, task: str | int) -> list[tuple[str, str | None]]:
    """The functions task `task` of chapter `chapter` asks for that the file at `path` does not define,
    each as (name, the nearest name it does define in the same scope, or None). Task "all" asks for
    every task's. A file that does not parse defines nothing (its import error is reported elsewhere)."""
    wanted = task_functions(chapter)
    names = [n for names in wanted.values() for n in names] if str(task) == "all" else wanted.get(str(task), [])
    try:
        scopes = defined_functions(pathlib.Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    missing = []
    for name in names:
        scope, _, function = name.rpartition(".")
        present = scopes.get(scope, [])
        if function not in present:
            near = difflib.get_close_matches(function, present, n=1, cutoff=0.6)
            missing.append((name, near[0] if near else None))
    return missing


def missing_message(chapter: int, task: str | int, missing: list[tuple[str, str | None]]) -> str:
    """What a student reads: which functions are missing, and the near-miss names seen instead."""
    parts = []
    for name, near in missing:
        scope, _, function = name.rpartition(".")
        hint = f" (your file has {scope + '.' if scope else ''}{near}: a misspelling?)" if near else ""
        parts.append(f"{name}(){hint}")
    where = "" if str(task) == "all" else f", task {task}"
    return (f"chapter {chapter}{where}: your file does not define {', '.join(parts)}. Each task is graded on "
            f"the functions you write; one inherited from a given class or spelt differently does not count")
