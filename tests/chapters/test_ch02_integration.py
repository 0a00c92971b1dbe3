"""Chapter 02, all tasks together: your static batcher on mixed requests, against chapter 01.

Your `run_static` runs your `run_batch` (task 3), which pads with your
`left_pad` (task 1) and attends through your `PaddedKVCache` (task 2). Here it
serves requests of very different lengths, greedy and seeded, with stop tokens
and EOS, in batch sizes that leave a short last batch; every request must get
exactly what the reference chapter 01 loop gives it alone. `check 2` shows this
as the row "all".
"""
import random

import pytest

from minicb import impl
from minicb import naive as chapter01  # the previous chapter is the oracle
from minicb.model import random_model, tiny_config
from minicb.naive import first_difference
from minicb.sampling import SamplingParams


@pytest.mark.task("all")
@pytest.mark.parametrize("batch_size", [2, 5])
def test_your_batcher_serves_mixed_requests_like_chapter01(device, batch_size):
    static = impl.load("static_batching")
    model = random_model(tiny_config(eos_token_ids=[7]), seed=6).to(device)
    rng = random.Random(batch_size)
    prompts, params = [], []
    for i in range(11):
        prompts.append([rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(1, 40))])
        params.append(SamplingParams(max_tokens=rng.randint(1, 12), stop_token_ids=[rng.randrange(3, 200)],
                                     **({"temperature": 0.9, "seed": i} if i % 4 == 0 else {})))
    result = static.run_static(model, prompts, params, batch_size=batch_size)
    assert len(result.generations) == len(prompts), (f"{len(result.generations)} generations for "
                                                     f"{len(prompts)} prompts")
    for i, (got, prompt, sp) in enumerate(zip(result.generations, prompts, params)):
        want = chapter01.generate_with_cache(model, prompt, sp)
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (
            f"batch size {batch_size}, prompt {i} ({len(prompt)} tokens, {sp}): finish {got.finish_reason!r} "
            f"vs chapter 01's {want.finish_reason!r}; {first_difference(got.token_ids, want.token_ids)}")
