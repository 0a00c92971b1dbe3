"""Planted bugs in chapters 01-05 of kinds tests/tools/test_mutants.py's first list does not have.

Each is a Mutant (tests/tools/mutant_support.py): a plain text edit of the reference's
source, graded as `check N --file` grades a submission; the grade must fail on a test
of what the code does (test_mutants.py runs them).
"""
from __future__ import annotations

from mutant_support import Mutant

MUTANTS: list[Mutant] = [
]
