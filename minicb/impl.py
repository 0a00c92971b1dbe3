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
keeps the reference for the rest; a comma-separated list narrows it to several
(`MINICB_IMPL_ONLY=block_allocator,scheduler` runs your allocator under your
scheduler). `check N` sets it to chapter N's module, so grading chapter 06 runs
the student's scheduler on the reference block allocator and attention: one
chapter's stubs never fail another chapter's grade.

A chapter module may sit in a package: "serve.loop" is `minicb.serve.loop`,
and a student's file for it is loaded as `minicb_student_serve_loop`.

A file is executed once and then cached, so the engine can call `load()` every
step for free. The cache is keyed on the file's path, modification time and
size: save an edited file and the next `load()` runs the new version.
`load_file(..., reload=True)` runs it again regardless.
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
    "prefix_cache": (7, "07-prefix-caching"),
    "chunked_prefill": (8, "08-chunked-prefill"),
    "serve.loop": (9, "09-serving"),  # a module in a package: minicb.serve.loop
    "cuda_graphs": (10, "10-the-gpu-step"),
    "speculative": (11, "11-speculative-decoding"),
    "structured.token_mask": (12, "12-structured-output"),  # minicb.structured.token_mask
}


CHAPTER_NUMBERS = frozenset(n for n, _ in CHAPTERS.values())  # the chapters with an exercise


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


def student_module_name(module: str) -> str:
    """The name a student's file for `module` is loaded under: "minicb_student_serve_loop" for "serve.loop".
    No dot: a dotted name would make Python look for a package "minicb_student_serve"."""
    return "minicb_student_" + module.replace(".", "_")


def which() -> str:
    """'reference' or 'student', from MINICB_IMPL (default 'reference')."""
    choice = os.environ.get("MINICB_IMPL", "reference").strip().lower() or "reference"
    if choice not in ("reference", "student"):
        raise ValueError(f"MINICB_IMPL={choice!r}; allowed: 'reference' or 'student'")
    return choice


# (resolved path, module name) -> ((mtime_ns, size) when it was executed, the module)
_loaded: dict[tuple[pathlib.Path, str], tuple[tuple[int, int], ModuleType]] = {}


def load_file(path: str | os.PathLike, name: str, reload: bool = False) -> ModuleType:
    """Import a Python file as a module named `name`.

    The same file (same path, modification time and size) under the same name
    gives the same module object without running it again; an edited file, or
    reload=True, is executed afresh. Either way sys.modules[name] is the module
    returned, because dataclasses and pickle look classes up there.
    """
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"exercise file not found: {path}")
    info = path.stat()
    stamp = (info.st_mtime_ns, info.st_size)
    cached = _loaded.get((path, name))
    if cached is not None and cached[0] == stamp and not reload:
        sys.modules[name] = cached[1]
        return cached[1]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses need the module registered while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a half-run module must not be found later, by us or by pickle
        _loaded.pop((path, name), None)
        raise
    _loaded[path, name] = (stamp, module)
    return module


def only_modules() -> set[str] | None:
    """The chapter modules MINICB_IMPL_ONLY names (comma-separated), or None when it is unset or empty."""
    raw = os.environ.get("MINICB_IMPL_ONLY", "")
    names = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = sorted(names - set(CHAPTERS))
    if unknown:
        raise ValueError(f"MINICB_IMPL_ONLY={raw!r}: {', '.join(map(repr, unknown))} "
                         f"{'is not a chapter module' if len(unknown) == 1 else 'are not chapter modules'}; "
                         f"known: {', '.join(sorted(CHAPTERS))} (separate several with commas)")
    return names or None


def student_modules() -> list[str]:
    """The chapter modules `load` hands out from a student's (or a --file) exercise file, in chapter order."""
    if not (os.environ.get("MINICB_IMPL_FILE") or which() == "student"):
        return []
    only = only_modules()
    return [m for m in CHAPTERS if only is None or m in only]


def student_file(module: str) -> pathlib.Path | None:
    """The file `load(module)` executes when it hands out a student's code (MINICB_IMPL_FILE or the
    chapter's exercise.py); None when it hands out the reference."""
    if module not in student_modules():
        return None
    override = os.environ.get("MINICB_IMPL_FILE")
    return pathlib.Path(override).resolve() if override else exercise_path(module)


def load(module: str) -> ModuleType:
    """The implementation of chapter `module` the tests should exercise."""
    if module not in CHAPTERS:
        raise ValueError(f"unknown chapter module {module!r}; known: {sorted(CHAPTERS)}")
    only = only_modules()
    if only is not None and module not in only:
        return importlib.import_module(f"minicb.{module}")
    override = os.environ.get("MINICB_IMPL_FILE")
    if override:
        return load_file(override, student_module_name(module))
    if which() == "student":
        return load_file(exercise_path(module), student_module_name(module))
    return importlib.import_module(f"minicb.{module}")
