"""Chapter 03, all tasks together: your block allocator inside the real engine.

The task tests drive the allocator by hand. Here the chapter 06 engine uses it
for every request: `allocate` at admission, `can_append` / `append` before each
decode, `slot_mapping` and `block_table` to build each step's attention
metadata, `block_owners` for the step traces, and `free` on finish and on
preemption. A pool of 20 blocks for 6 slots forces preemption and re-admission
over and over. Every request's greedy tokens must still equal chapter 01's, and
every block must be free at the end. `check 3` shows this as the row "all".
"""
import pytest

from minicb.model import random_model


@pytest.mark.task("all")
def test_the_engine_on_your_allocator_matches_chapter01(engine_matches_chapter01, random_requests):
    tiny = random_model(seed=4)
    requests = random_requests(tiny.config.vocab_size, 40, seed=3)
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=20, max_num_seqs=6,
                                           keep_traces=None)  # traces call block_owners every step
    assert preemptions >= 5, f"the pool was sized to force preemptions, but only {preemptions} happened"
