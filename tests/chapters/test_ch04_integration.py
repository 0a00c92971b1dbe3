"""Chapter 04, all tasks together: your paged attention inside the real engine.

Each task test checks one function against dense attention. Here the chapter 06
engine runs the tiny model with attention="torch", which is your module:
`store_kv` (task 1) writes every new token's K/V into the pool, your decode
(`paged_decode_attention`, i.e. task 2's gather or task 3's online softmax,
whichever you return) reads the running requests' blocks, and your
`paged_prefill_attention` (task 4) serves the prompts admitted mid-run, mixed
into the same forward. A small pool forces preemption and recompute. Every
request's greedy tokens must equal chapter 01's. `check 4` shows this as the
row "all".
"""
import pytest

from minicb.model import random_model


@pytest.mark.task("all")
def test_the_engine_on_your_attention_matches_chapter01(engine_matches_chapter01, random_requests):
    tiny = random_model(seed=7)
    requests = random_requests(tiny.config.vocab_size, 24, seed=4)
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=20, max_num_seqs=6,
                                           attention="torch")
    assert preemptions >= 1, f"the pool was sized to force preemption, but only {preemptions} happened"
