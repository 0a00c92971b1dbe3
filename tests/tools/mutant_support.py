"""The Mutant record: one realistic bug planted in one task's code (tests/tools/test_mutants.py grades them).

Its own module, so that the lists of mutants can live in several files: test_mutants.py
holds the first ones, mutants_ch01_05.py and mutants_ch06_11.py later kinds.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Mutant:
    chapter: int
    task: int
    bug: str  # what a student got wrong, in words
    target: str  # "function" or "Class.method" of the chapter's reference module
    edits: list[tuple[str, str]]  # (old, new) text replacements in the target's source
    extra: str = ""  # more source for the file, e.g. a given wrapper that must call the mutated function
    # Reference functions to define again in the mutant's file, unchanged, so that they
    # call the mutated function (a copied function still calls the reference's).
    recompile: tuple[str, ...] = ()
    # Source of a student's own solution to mutate instead of the reference's `target`
    # (chapter 08's kernel: the reference hands the chunk to a shared kernel instead).
    source: str = ""
