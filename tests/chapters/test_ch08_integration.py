"""Chapter 08, all tasks together: your chunked scheduler in the real engine.

The other chapter 08 tests grade each task on its own, with the reference
standing in for the others. This file runs all your code in the engine at
once: your rule (`chunk_size`, `tokens_to_compute`) inside chapter 06's loop,
48 requests with prompts up to 20 tokens on a budget of 5 tokens a step, on a pool of 12 blocks, small enough to preempt (with prefix caching on, so
re-admitted requests find their computed chunks). Every request's greedy
tokens must equal chapter 01's. `check 8` shows it as the row "all".
"""
import pytest

from minicb.model import random_model


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=8)


@pytest.mark.task("all")
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_your_chunked_scheduler_runs_the_engine_like_chapter01(tiny, caching, engine_matches_chapter01,
                                                               random_requests):
    requests = random_requests(tiny.config.vocab_size, 48, seed=4)
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=12, max_num_seqs=6,
                                           enable_chunked_prefill=True, max_num_batched_tokens=5,
                                           enable_prefix_caching=caching)
    steps = engine_matches_chapter01.engine.num_steps
    assert preemptions >= 1, f"the pool was sized to force preemptions, but only {preemptions} happened"
    prompt_tokens = sum(len(prompt) for _, prompt, _ in requests)
    assert steps >= prompt_tokens / 5, (f"{steps} steps for {prompt_tokens} prompt tokens: a budget of 5 tokens "
                                        f"a step needs at least {prompt_tokens / 5:.0f}")
