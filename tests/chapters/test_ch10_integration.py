"""Chapter 10, all tasks together: your buckets and padding inside the engine's decode runner.

The other chapter 10 tests grade each task on its own, with the reference
standing in for the other. This file runs the engine with the runner on
(`cuda_graphs=True`: on a CPU it runs eagerly, through the same static buffers,
buckets and padding rows) on the tiny random model: 24 requests arriving over
40 steps on a pool small enough to preempt, so decode-only steps come in many
batch sizes. Every request's greedy tokens must equal chapter 01's, and the
decode-only steps must have gone through the runner. `check 10` shows it as the
row "all".
"""
from collections import Counter

import pytest

from minicb import impl
from minicb.model import random_model


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=10)


@pytest.mark.task("all")
def test_your_runner_serves_like_chapter01(tiny, engine_matches_chapter01, random_requests, monkeypatch):
    runner_class = impl.load("cuda_graphs").DecodeGraphs
    steps = Counter()  # batch size of each step the runner took -> how many
    decode = runner_class.decode
    monkeypatch.setattr(runner_class, "decode", lambda self, batch: steps.update([batch.num_seqs]) or
                        decode(self, batch))
    requests = random_requests(tiny.config.vocab_size, 24, seed=10)
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=12, max_num_seqs=12,
                                           cuda_graphs=True)
    engine = engine_matches_chapter01.engine
    assert isinstance(engine.runner, runner_class), (f"the engine built a {type(engine.runner).__name__}; it "
                                                     f"should build the runner of impl.load('cuda_graphs')")
    assert engine.runner.buckets == [1, 2, 4, 8, 12], f"buckets for max_num_seqs=12: {engine.runner.buckets}"
    padded = {n for n in steps if n not in engine.runner.buckets}
    assert sum(steps.values()) >= 20 and padded, (f"the runner took decode steps of sizes {dict(steps)}; the "
                                                  f"run should give it many, some padded")
    assert preemptions >= 1, f"the pool was sized to force preemptions, but only {preemptions} happened"
