"""A grade loads the chapter tests' pytest plugins and no others.

`check` runs the tests in a child pytest with plugin autoload off and two plugins
named: its own (minicb.check) and hypothesis'. This project's own test plugins
(nbmake, schemathesis, langsmith: about 2.5 s of imports in every grade) and whatever
a classroom's environment holds (pytest-randomly would reorder the graded tests)
stay out. The submission here is chapter 3's reference that refuses to load
beside any of them.
"""
from __future__ import annotations

import importlib.util

import pytest

from minicb import check, impl

OTHERS = ("nbmake", "schemathesis", "langsmith")


def test_a_grade_loads_no_plugin_but_its_own_and_hypothesis(tmp_path):
    installed = [name for name in OTHERS if importlib.util.find_spec(name) is not None]
    if not installed:
        pytest.skip(f"none of {OTHERS} is installed here, so there is nothing to keep out")
    guard = ("import sys as _sys\n"
             f"_loaded = [n for n in {OTHERS!r} if n in _sys.modules or n + '.pytest_plugin' in _sys.modules]\n"
             "assert not _loaded, f'plugins loaded in the grade: {_loaded}'\n"
             "assert 'minicb.check' in _sys.modules, 'the grade runs without its own plugin'\n"
             "from minicb.check import hypothesis_plugin as _hypothesis\n"
             "assert _hypothesis()[1] in _sys.modules, 'the grade runs without hypothesis\\' plugin'\n")
    submission = tmp_path / "exercise.py"
    submission.write_text((impl.ROOT / "minicb" / "block_allocator.py").read_text() + "\n" + guard)
    report = check.run_tests(3, submission, ["-k", "not hypothesis and not random"], tasks=[1])
    failed = [(r.nodeid, r.message) for r in report.results if r.outcome == "failed"]
    assert report.results and report.passed, f"{report.errors} {failed[:3]} {report.output[-1500:]}"

