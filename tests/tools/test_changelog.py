"""chapters/CHANGELOG.md keeps up with the exercises: an old solution passes, or its chapter is listed.

Each entry of the changelog names a course release: its version, its date, the
commit it starts from (`Release: <short hash>`) and the chapters whose exercise
it changes (`Chapters: 06, 08`). A teacher reads it to know what a solution
written for the previous release must change.

For every chapter with an exercise, the reference module as of the previous
release (`git show <commit>:minicb/<module>.py`) stands for a finished solution
of that release. Graded by today's `check N --file` (the quick tests), it must
pass, unless the newest entry lists the chapter. So an API change that breaks
last release's solutions cannot ship without its entry.

Without git history (no .git, no git, or a shallow clone that lacks the commit)
the grading test skips, saying why; nothing here depends on tags.
"""
from __future__ import annotations

import os

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

import minicb
from minicb import check, impl

from tool_support import runs_whole_files, sleeping_children

CHANGELOG = impl.ROOT / "chapters" / "CHANGELOG.md"
MODULES = sorted(impl.CHAPTERS, key=lambda name: impl.CHAPTERS[name][0])


@dataclass
class Entry:
    heading: str  # "0.2.0 (2026-12-03): an engine built from its parts; ..."
    version: str
    date: str
    release: str | None  # the short hash of `Release:`
    chapters: set[int] | None  # from `Chapters:`; None when the line is missing


def entries() -> list[Entry]:
    """The changelog's release entries, newest first."""
    found = []
    for block in re.split(r"^## ", CHANGELOG.read_text(), flags=re.M)[1:]:
        heading = block.splitlines()[0].strip()
        title = re.match(r"(\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)", heading)
        release = re.search(r"^Release: ([0-9a-f]{7,40})\s*$", block, re.M)
        listed = re.search(r"^Chapters: (.*)$", block, re.M)
        chapters = None if listed is None else {int(n) for n in re.findall(r"\d+", listed.group(1))}
        found.append(Entry(heading, title and title.group(1), title and title.group(2),
                           release and release.group(1), chapters))
    return found


def test_every_entry_names_its_version_release_and_chapters():
    found = entries()
    assert len(found) >= 2, f"{CHANGELOG}: want the newest release and the one before it"
    known = {number for number, _ in impl.CHAPTERS.values()}
    for entry in found:
        assert entry.version and entry.date, f"heading '## {entry.heading}': want '## X.Y.Z (YYYY-MM-DD): title'"
        assert entry.release, f"entry '{entry.heading}' has no 'Release: <short hash>' line"
        assert entry.chapters is not None, f"entry '{entry.heading}' has no 'Chapters: NN, NN' line"
        assert entry.chapters <= known, f"entry '{entry.heading}' lists chapters without an exercise: " \
                                        f"{sorted(entry.chapters - known)}"
    dates = [entry.date for entry in found]
    assert dates == sorted(dates, reverse=True), f"entries must be newest first: {dates}"
    newest = found[0]
    assert (newest.version, newest.date) == (minicb.__version__, minicb.__course_date__), (
        f"the newest entry is {newest.version} ({newest.date}), but minicb says {minicb.__version__} "
        f"({minicb.__course_date__}): bump minicb/__init__.py with the entry")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=impl.ROOT, capture_output=True, text=True, timeout=60)


def previous_release() -> str:
    """The commit of the release before the newest; pytest.skip when git history cannot show it."""
    found = entries()
    commit = found[1].release
    if shutil.which("git") is None:
        pytest.skip("git is not installed, so the previous release's solutions cannot be read")
    if not (impl.ROOT / ".git").exists():
        pytest.skip(f"{impl.ROOT} is not a git checkout, so the previous release's solutions cannot be read")
    if git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {commit} (release '{found[1].heading}') is not in this checkout's history "
                    "(a shallow clone?): fetch it with `git fetch --unshallow`")
    return commit


def old_solution(module: str, commit: str) -> str | None:
    """The reference module's text at `commit`, or None when it did not exist then."""
    shown = git("show", f"{commit}:minicb/{module.replace('.', '/')}.py")
    return shown.stdout if shown.returncode == 0 else None


def grade_old(module: str, commit: str, folder) -> check.Report | str:
    """Grade the module as of `commit` with today's quick tests; a string says why it was not graded."""
    source = old_solution(module, commit)
    if source is None:
        return f"minicb/{module}.py did not exist at {commit}: chapter {impl.CHAPTERS[module][0]} is new since"
    path = folder / f"{module.replace('.', '_')}_at_{commit}.py"
    path.write_text(source)
    return check.run_tests(impl.CHAPTERS[module][0], path, ["-m", "not slow"], timeout=600)


@pytest.fixture(scope="module")
def old_grades(request, tmp_path_factory):
    """The selected chapters' old solutions, graded two at a time (each grade mostly waits on imports)."""
    commit = previous_release()
    newest = entries()[0]
    items = request.session.items if runs_whole_files(request.config) else []
    selected = [item.callspec.params["module"] for item in items
                if getattr(item, "callspec", None) and "module" in item.callspec.params
                and item.originalname == "test_the_previous_release_passes_or_is_listed"]
    todo = [m for m in selected if impl.CHAPTERS[m][0] not in newest.chapters]
    folder = tmp_path_factory.mktemp("previous-release")
    with sleeping_children(), ThreadPoolExecutor(max_workers=2) as pool:  # two at once: see tool_support
        ahead = {m: pool.submit(grade_old, m, commit, folder) for m in todo}
        yield commit, lambda m: (ahead.get(m) or pool.submit(grade_old, m, commit, folder)).result()


@pytest.mark.slow  # four quick grades, two at a time: one to two minutes on a 2-core CPU
@pytest.mark.skipif(os.environ.get("MINICB_GRADER_CHECKS", "") != "all",
                    reason="grades the previous release: MINICB_GRADER_CHECKS=all (make grader-check)")
@pytest.mark.parametrize("module", MODULES, ids=[f"ch{impl.CHAPTERS[m][0]:02d}_{m}" for m in MODULES])
def test_the_previous_release_passes_or_is_listed(module, old_grades):
    chapter = impl.CHAPTERS[module][0]
    newest = entries()[0]
    if chapter in newest.chapters:
        pytest.skip(f"chapter {chapter:02d} changed in {newest.version}: CHANGELOG.md's newest entry lists it")
    commit, grades = old_grades
    graded = grades(module)
    if isinstance(graded, str):
        pytest.skip(graded)
    failures = [f"{r.nodeid}: {r.message}" for r in graded.results if r.outcome == "failed"]
    assert graded.passed, (
        f"chapter {chapter:02d}'s solution of the previous release (minicb/{module}.py at {commit}) fails today's "
        f"check {chapter}: the exercise changed. Keep the old API, or list chapter {chapter:02d} in the newest "
        f"entry of chapters/CHANGELOG.md with a migration note.\n  "
        + "\n  ".join(graded.errors + failures[:10]) + ("" if graded.results else graded.output[-2000:]))
