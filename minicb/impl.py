"""One switch between the reference implementation and a student's exercise file.

Every chapter from 01 on has a reference module in `minicb/` and a file of
stubs in `chapters/NN-slug/exercise.py` with the same public names. The tests
never import the chapter module directly; they call `load("block_allocator")`
and get:

- the reference module `minicb.block_allocator` by default;
- the student's `chapters/03-block-allocation/exercise.py` when the environment
  has `MINICB_IMPL=student` (or pytest runs with `--impl student`);
- any other file with `MINICB_IMPL_FILE=path/to/file.py` (used by
  `python -m minicb check N --file ...`, e.g. to grade a submission).

`MINICB_IMPL_ONLY=scheduler` narrows either switch to one chapter module and
keeps the reference for the rest. `check N` sets it, so grading chapter 06 runs
the student's scheduler on the reference block allocator and attention: one
chapter's stubs never fail another chapter's grade.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAPTERS_DIR = ROOT / "chapters"

# reference module -> (chapter number, chapter folder)
CHAPTERS: dict[str, tuple[int, str]] = {
    "naive": (1, "01-naive-generation"),
    "static_batching": (2, "02-static-batching"),
    "block_allocator": (3, "03-block-allocation"),
    "paged_attention": (4, "04-paged-attention"),
    "triton_attention": (5, "05-triton-attention"),
    "scheduler": (6, "06-continuous-batching"),
}


def module_for_chapter(chapter: int) -> str:
    for name, (n, _) in CHAPTERS.items():
        if n == chapter:
            return name
    allowed = sorted(n for n, _ in CHAPTERS.values())
    raise ValueError(f"chapter {chapter!r} has no exercise; chapters with exercises: {allowed}")


def exercise_path(module: str) -> pathlib.Path:
    if module not in CHAPTERS:
        raise ValueError(f"unknown chapter module {module!r}; known: {sorted(CHAPTERS)}")
    return CHAPTERS_DIR / CHAPTERS[module][1] / "exercise.py"


def which() -> str:
    """'reference' or 'student', from MINICB_IMPL (default 'reference')."""
    choice = os.environ.get("MINICB_IMPL", "reference").strip().lower() or "reference"
    if choice not in ("reference", "student"):
        raise ValueError(f"MINICB_IMPL={choice!r}; allowed: 'reference' or 'student'")
    return choice


def load_file(path: str | os.PathLike, name: str) -> ModuleType:
    """Import a Python file as a module named `name` (fresh each call)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exercise file not found: {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses need the module registered while it executes
    spec.loader.exec_module(module)
    return module


def load(module: str) -> ModuleType:
    """The implementation of chapter `module` the tests should exercise."""
    if module not in CHAPTERS:
        raise ValueError(f"unknown chapter module {module!r}; known: {sorted(CHAPTERS)}")
    only = os.environ.get("MINICB_IMPL_ONLY")
    if only and only not in CHAPTERS:
        raise ValueError(f"MINICB_IMPL_ONLY={only!r} is not a chapter module; known: {sorted(CHAPTERS)}")
    if only and module != only:
        return importlib.import_module(f"minicb.{module}")
    override = os.environ.get("MINICB_IMPL_FILE")
    if override:
        return load_file(override, f"minicb_student_{module}")
    if which() == "student":
        return load_file(exercise_path(module), f"minicb_student_{module}")
    return importlib.import_module(f"minicb.{module}")
