"""Chapter 06, all tasks together: your whole scheduler in the real engine.

The other chapter 06 tests grade each task on its own, with the reference's
methods standing in for the other two tasks. That lets a class write the tasks
in any order, but it never runs your three methods together. This file does:
the graded scheduler's `admit`, `schedule_decodes` and `postprocess` all run in
the real engine, on a pool small enough to preempt and re-admit, and every
request's greedy tokens must equal chapter 01's. `check 6` shows it as the row
"all".

When you have also written chapter 03's allocator, the same run goes again on
your allocator: the engine built from your own pieces.
"""
import importlib
import os
import random

import pytest

from minicb import impl
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache
from minicb.sampling import SamplingParams


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


def run_engine(tiny, requests, num_blocks):
    """Serve (arrival_step, prompt, params) requests; returns ({request index: Sequence}, preemptions)."""
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=6))
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    index_of, finished, preemptions, step = {}, {}, 0, 0
    while pending or engine.has_unfinished():
        while pending and requests[pending[0]][0] <= step:
            i = pending.pop(0)
            index_of[engine.add_request(requests[i][1], requests[i][2])] = i
        out = engine.step()
        for seq in out.finished:
            assert index_of[seq.request_id] not in finished, f"request {index_of[seq.request_id]} finished twice"
            finished[index_of[seq.request_id]] = seq
            preemptions += seq.num_preemptions
        step += 1
        assert step < 3000, f"the engine stopped making progress: {len(finished)} of {len(requests)} finished"
    free = engine.allocator.num_free_blocks
    assert free == num_blocks, f"every block must be free after the run, but {free} of {num_blocks} are"
    return finished, preemptions


@pytest.mark.task("all")
@pytest.mark.parametrize("allocator", ["reference allocator", "your allocator"])
def test_your_scheduler_runs_the_engine_like_chapter01(tiny, allocator, monkeypatch):
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

    rng = random.Random(1)
    requests = []
    for _ in range(48):
        prompt = [rng.randrange(3, tiny.config.vocab_size) for _ in range(rng.randint(1, 20))]
        requests.append((rng.randint(0, 40), prompt, SamplingParams(max_tokens=rng.randint(1, 14))))
    # 20 blocks of 4 tokens for 6 slots of up to 34 tokens: preemption and re-admission
    # of requests that already have outputs, again and again.
    finished, preemptions = run_engine(tiny, requests, num_blocks=20)
    assert sorted(finished) == list(range(len(requests))), (
        f"every request must finish; missing {sorted(set(range(len(requests))) - set(finished))}")
    assert preemptions >= 5, f"the pool was sized to force preemptions, but only {preemptions} happened"
    for i, seq in sorted(finished.items()):
        _, prompt, params = requests[i]
        want = generate_with_cache(tiny, prompt, params)
        got = (seq.output_token_ids, seq.finish_reason)
        assert got == (want.token_ids, want.finish_reason), (
            f"request {i} ({len(prompt)}-token prompt, max_tokens {params.max_tokens}, preempted "
            f"{seq.num_preemptions} times): finish {seq.finish_reason!r} vs chapter 01's {want.finish_reason!r}; "
            f"{first_difference(seq.output_token_ids, want.token_ids, ('engine', 'chapter 01'))}")
