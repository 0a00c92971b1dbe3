"""The texts point at things that exist: links, #anchors and the files they cite.

A learner who follows a link from a chapter or from a stub's error message and
lands nowhere stops trusting the text. So every relative link and #anchor in
README.md and the chapter texts must resolve, every stub's `README.md#task-K`
must name an anchor of its chapter, and every repository path a text quotes in
backticks (`minicb/engine.py`, `tests/chapters/test_ch06_engine.py::test_...`) must exist,
as must every markdown file a text names, quoted or not.
"""
import pathlib
import re

import pytest

from minicb import impl

ROOT = impl.ROOT
TEXTS = [ROOT / "README.md", *sorted((ROOT / "chapters").glob("*/README.md")), *sorted((ROOT / "chapters").glob("*.md")),
         *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), ![alt](target)
# A quoted path: starts in a top-level folder of the repository (or is a root file) and has an extension.
QUOTED_PATH = re.compile(r"`((?:minicb|tests|chapters|notebooks|tools|docs|\.ci)/[\w./*-]+|[\w-]+\.(?:md|toml))"
                         r"(?:::(\w+))?[^`]*`")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = path.read_text()
    found = {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def text_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("text", TEXTS, ids=text_id)
def test_relative_links_and_anchors_resolve(text):
    problems = []
    for match in LINK.finditer(text.read_text()):
        target = match[1] or match[2]
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: -- not ours to check offline
            continue
        file, _, anchor = target.partition("#")
        path = (text.parent / file).resolve() if file else text
        if not path.exists():
            problems.append(f"{target}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
                            f"does not exist")
        elif anchor and anchor not in anchors(path):
            problems.append(f"{target}: {path.name} has no heading or <a id> '{anchor}'")
    assert not problems, f"{text_id(text)} has broken links:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("text", TEXTS, ids=text_id)
def test_quoted_paths_exist(text):
    problems = []
    for match in QUOTED_PATH.finditer(text.read_text()):
        quoted, test_name = match[1].rstrip("."), match[2]
        quoted = re.sub(r"NN(-slug)?", "*", quoted)  # a pattern: chapters/NN-slug/README.md, test_chNN_*.py
        candidates = [ROOT / quoted, text.parent / quoted]
        if "*" in quoted:  # a glob such as tests/chapters/test_ch06_*.py: something must match it
            if not any(list(ROOT.glob(quoted)) + list(text.parent.glob(quoted))):
                problems.append(f"{quoted}: matches no file")
            continue
        found = next((path for path in candidates if path.exists()), None)
        if found is None:
            problems.append(f"{quoted}: no such file or folder")
        elif test_name and not re.search(rf"^(async )?def {test_name}\(", found.read_text(), re.M):
            problems.append(f"{quoted}::{test_name}: no such test in {quoted}")
    assert not problems, f"{text_id(text)} quotes paths that do not exist:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("text", TEXTS, ids=text_id)
def test_every_markdown_file_a_text_names_exists(text):
    # Quoted or not: a reader who meets "see FOO.md" must be able to open it here.
    problems = []
    for name in set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b", text.read_text())):
        if name.startswith("build/"):
            continue  # written by a command the text gives (build/ is ignored by git)
        pattern = re.sub(r"NN(-slug)?", "*", name)
        if not (list(ROOT.glob(pattern)) or list(text.parent.glob(pattern))):
            problems.append(name)
    assert not problems, f"{text_id(text)} names markdown files that are not in the repository: {sorted(problems)}"


@pytest.mark.parametrize("module", sorted(impl.CHAPTERS))
def test_stub_messages_link_to_anchors_that_exist(module):
    exercise = impl.exercise_path(module)
    readme = exercise.parent / "README.md"
    targets = set(re.findall(r"README\.md#([\w-]+)", exercise.read_text()))
    assert targets, f"{text_id(exercise)}'s stubs link to no task in its README.md"
    missing = sorted(targets - anchors(readme))
    assert not missing, (f"{text_id(exercise)} links to {text_id(readme)}#{', #'.join(missing)}, but the text "
                         f"has no such anchor; put <a id=\"task-K\"></a> above each '## Task K' heading")
