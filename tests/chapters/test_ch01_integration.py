"""Chapter 01, all tasks together: both of your loops on many requests, against the reference.

The task tests check each loop and your cache on their own cases. Here your
`generate_no_cache` (task 1) and your `generate_with_cache` on your
`ContiguousKVCache` (tasks 2 and 3) serve a mix of requests -- greedy and seeded
sampling, stop tokens, EOS, max_tokens and a context that fills up -- and each
must give exactly the tokens and finish reason of the reference loop
(`minicb.naive`, which the task tests hold to chapter 00's full recompute).
`check 1` shows this as the row "all".
"""
import random

import pytest

from minicb import impl
from minicb import naive as reference
from minicb.model import random_model, tiny_config
from minicb.naive import first_difference
from minicb.sampling import SamplingParams


@pytest.mark.task("all")
def test_both_loops_serve_mixed_requests_like_the_reference(device):
    naive = impl.load("naive")
    model = random_model(tiny_config(eos_token_ids=[7], max_position_embeddings=40), seed=5).to(device)
    rng = random.Random(0)
    cases = []
    for i in range(12):
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 20),
                                **({"temperature": 0.8, "top_k": 50, "seed": i} if i % 3 == 0 else {}))
        if i % 2:  # stop at a token the reference produces mid-way (its first occurrence)
            stream = reference.generate_with_cache(model, prompt, params).token_ids
            fresh = [t for k, t in enumerate(stream) if k >= 1 and t not in stream[:k]]
            params.stop_token_ids = fresh[:1]
        cases.append((prompt, params))
    reasons = set()
    for i, (prompt, params) in enumerate(cases):
        want = reference.generate_with_cache(model, prompt, params)
        reasons.add(want.finish_reason)
        for name in ("generate_no_cache", "generate_with_cache"):
            got = getattr(naive, name)(model, prompt, params)
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (
                f"request {i} ({len(prompt)}-token prompt, {params}): your {name} finished with "
                f"{got.finish_reason!r}, the reference with {want.finish_reason!r}; "
                f"{first_difference(got.token_ids, want.token_ids, ('yours', 'reference'))}")
    assert reasons == {"stop", "length"}, f"test setup: the cases should end both ways, got {reasons}"
