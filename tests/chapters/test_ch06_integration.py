"""Chapter 06, all tasks together: your whole scheduler in the real engine.

The other chapter 06 tests grade each task on its own, with the reference's
methods standing in for the other two tasks. That lets a class write the tasks
in any order, but it never runs your methods together. This file does: the
graded scheduler's `admit`, `postprocess`, `schedule_running` and `grow` all run
in the real engine, on a pool small enough to preempt and re-admit, and every
request's greedy tokens must equal chapter 01's. `check 6` shows it as the row
"all".

When you have also written chapter 03's allocator, the same run goes again on
your allocator: the engine built from your own pieces.
"""
import importlib
import os

import pytest

from minicb import impl
from minicb.model import random_model


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=2)


def students_allocator():
    """The student's chapter 03 module when they grade their own exercise files and wrote it, else None.

    Not when a teacher grades one submitted file (MINICB_IMPL_FILE): that file is
    the scheduler alone."""
    if impl.which() != "student" or os.environ.get("MINICB_IMPL_FILE"):
        return None
    module = impl.load_file(impl.exercise_path("block_allocator"), "minicb_student_block_allocator")
    try:  # a first call tells whether it is still the stubs
        module.BlockAllocator(4, 2).allocate(0, 3)
    except NotImplementedError:
        return None
    return module


@pytest.mark.task("all")
@pytest.mark.parametrize("allocator", ["reference allocator", "your allocator"])
def test_your_scheduler_runs_the_engine_like_chapter01(tiny, allocator, monkeypatch, engine_matches_chapter01,
                                                        random_requests):
    if allocator == "your allocator":
        mine = students_allocator()
        if mine is None:
            pytest.skip("chapter 03's exercise is not written (or this is the reference): ran on the reference "
                        "allocator only")
        load = impl.load
        monkeypatch.setattr(impl, "load", lambda m: mine if m == "block_allocator" else load(m))
    elif impl.load("block_allocator") is not importlib.import_module("minicb.block_allocator"):
        load = impl.load  # MINICB_IMPL=student swaps every chapter: keep this run on the reference allocator
        reference = importlib.import_module("minicb.block_allocator")
        monkeypatch.setattr(impl, "load", lambda m: reference if m == "block_allocator" else load(m))

    # 48 requests on 20 blocks of 4 tokens for 6 slots of up to 34 tokens: preemption
    # and re-admission of requests that already have outputs, again and again.
    requests = random_requests(tiny.config.vocab_size, 48, seed=1)
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=20, max_num_seqs=6)
    assert preemptions >= 5, f"the pool was sized to force preemptions, but only {preemptions} happened"
