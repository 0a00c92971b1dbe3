"""Chapter 07, all tasks together: your caching block pool in the real engine.

The other chapter 07 tests grade each task on its own, with the reference
standing in for the other tasks (and the random operation sequences run your
pool alone). This file runs your keys, lookup, eviction and copy-on-write
together inside the engine: 48 requests that share three system prompts and
resend each other's prompts, on a pool small enough to evict and preempt
again and again. Every request's greedy tokens must equal chapter 01's.
`check 7` shows it as the row "all".
"""
import random

import pytest

from minicb.model import random_model
from minicb.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=7)


@pytest.mark.task("all")
def test_your_caching_pool_runs_the_engine_like_chapter01(tiny, engine_matches_chapter01):
    rng = random.Random(3)
    vocab = tiny.config.vocab_size
    systems = [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 14, 5)]
    requests, prompts = [], []
    for _ in range(48):
        if prompts and rng.random() < 0.25:
            prompt = rng.choice(prompts) + [rng.randrange(3, vocab)]  # a later turn: an earlier prompt, resent
        else:
            prompt = rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))]
        prompts.append(prompt)
        requests.append((rng.randint(0, 40), prompt, SamplingParams(max_tokens=rng.randint(1, 12))))
    # 16 blocks of 4 tokens for 6 slots of up to 35 tokens: cached blocks are
    # evicted, running requests preempted, and re-admitted ones hit what is left.
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=16, max_num_seqs=6,
                                           enable_prefix_caching=True)
    stats = engine_matches_chapter01.engine.allocator.stats
    got = (preemptions, stats.hit_tokens, stats.evicted_blocks)
    assert preemptions >= 3 and stats.hit_tokens > 0 and stats.evicted_blocks > 0, (
        f"the run should preempt, hit the cache and evict: (preemptions, cached tokens, evicted blocks) = {got}")
