"""Chapter 06, end to end: the continuous-batching engine against chapter 01.

Whatever the batch looks like -- requests arriving mid-run, slots refilled,
sequences preempted and recomputed -- each request's greedy tokens must be the
ones chapter 01's one-at-a-time loop produces.
"""
import random

import pytest

from minicb import LLM, SamplingParams
from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache

# Each test runs the graded scheduler's method for its own task and the reference's
# for the other two (conftest.py), so every task is graded on its own.
GRADED_MODULE = "scheduler"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")


@pytest.fixture(scope="module")
def tiny(device="cpu"):
    return random_model(seed=1)


@pytest.mark.task(3)
def test_stress_random_arrivals_with_preemption(tiny, engine_matches_chapter01):
    """200 requests, random lengths, random arrival steps, a pool small enough to preempt.

    The check (conftest.py): every request finishes once, with chapter 01's tokens
    and finish reason, and every block is free at the end."""
    rng = random.Random(0)
    requests = []
    for _ in range(200):
        prompt = [rng.randrange(3, tiny.config.vocab_size) for _ in range(rng.randint(1, 24))]
        requests.append((rng.randint(0, 150), prompt, SamplingParams(max_tokens=rng.randint(1, 16))))
    preemptions = engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=24, max_num_seqs=8)
    assert preemptions > 0, "the pool was meant to force preemption, but no request was ever preempted"


@pytest.mark.task(1)
def test_seeded_sampling_does_not_depend_on_the_batch(tiny):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    prompt = [5, 17, 99, 3]
    alone = LLM.from_model(tiny, num_blocks=64, block_size=4).generate([prompt], params, use_tqdm=False)[0]
    others = [[7] * 9, [200, 3, 4], [11] * 20]
    crowd = LLM.from_model(tiny, num_blocks=64, block_size=4).generate(
        others + [prompt], [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in (1, 2, 3)] + [params],
        use_tqdm=False)[-1]
    assert crowd.token_ids == alone.token_ids, first_difference(crowd.token_ids, alone.token_ids, ('crowded', 'alone'))
    unseeded_greedy = generate_with_cache(tiny, prompt, SamplingParams(max_tokens=12)).token_ids
    assert alone.token_ids != unseeded_greedy, "temperature 1 sampling should not collapse to greedy here"


@pytest.mark.task(1)
def test_bad_requests_are_refused_and_the_llm_keeps_serving(tiny):
    llm = LLM.from_model(tiny, num_blocks=8, block_size=4)
    bad = {
        "empty prompt": ([[]], SamplingParams()),
        "never fits": ([[5] * 10], SamplingParams(max_tokens=40)),
        "token id out of range": ([[5, 10_000]], SamplingParams(max_tokens=2)),
    }
    for name, (prompts, params) in bad.items():
        with pytest.raises(ValueError) as err:
            llm.generate(prompts, params, use_tqdm=False)
        assert str(err.value), name
    for kwargs, field in (({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert not llm.engine.has_unfinished(), "nothing from a refused call may stay queued"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.token_ids == generate_with_cache(tiny, [5, 6, 7], SamplingParams(max_tokens=3)).token_ids


@pytest.mark.task(2)
def test_streaming_and_metrics(tiny):
    llm = LLM.from_model(tiny, num_blocks=64, block_size=4, max_num_seqs=2)
    prompts = [[5, 6], [7, 8, 9], [10]]
    events = list(llm.stream(prompts, SamplingParams(max_tokens=4), arrival_times=[0.0, 0.0, 0.05]))
    per_request = {i: [e.token_id for e in events if e.index == i] for i in range(3)}
    finals = {e.index: e.output for e in events if e.output is not None}
    assert sorted(finals) == [0, 1, 2], f"each of the 3 prompts must end once in the stream; ended: {sorted(finals)}"
    for i, out in finals.items():
        assert per_request[i] == out.token_ids, (f"prompt {i}: the stream carried {per_request[i]}, but its "
                                                 f"output says {out.token_ids}")
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time, (
            f"prompt {i}: want arrival <= first token <= finish, got {m.arrival_time:.4f}, "
            f"{m.first_token_time:.4f}, {m.finish_time:.4f}")
    assert finals[2].metrics.arrival_time >= 0.05 - 1e-3, "request 2 must not arrive early"


@pytest.mark.task(1)
def test_triton_backend_matches_torch_backend(tiny):
    prompts = [[5, 6, 7, 8, 9], [3] * 11]
    params = SamplingParams(max_tokens=4)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM.from_model(tiny, num_blocks=16, block_size=4, attention=backend)
        runs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (a, b) in enumerate(zip(runs["torch"], runs["triton"])):
        assert a == b, f"prompt {i}: {first_difference(a, b, ('torch', 'triton'))}"


@pytest.mark.task(1)
@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "tight"])
def test_requests_with_different_n_share_the_slots_and_give_chapter01s_tokens(tiny, num_blocks):
    """n = 1, 2 and 3 mixed in one workload on 4 slots: a request with n completions takes n
    slots, its siblings fork from it when its prompt is done, and greedy completions all equal
    chapter 01's one answer. On 14 blocks of 4 the completions also preempt one another."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, tiny.config.vocab_size) for _ in range(rng.randint(2, 12))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(4, 12), ignore_eos=True, n=n)
              for n in (3, 1, 2, 2, 1, 3, 1, 2, 3, 1)]
    llm = LLM.from_model(tiny, block_size=4, max_num_seqs=4, num_blocks=num_blocks)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, p) in enumerate(zip(outs, params)):
        want = generate_with_cache(tiny, prompts[i], SamplingParams(max_tokens=p.max_tokens, ignore_eos=True)).token_ids
        assert len(o.outputs) == p.n, f"prompt {i} asked for n={p.n} completions and got {len(o.outputs)}"
        for c in o.outputs:
            assert c.token_ids == want, (f"prompt {i} (n={p.n}) completion {c.index}: "
                                         f"{first_difference(c.token_ids, want, ('engine', 'chapter 01'))}")
    assert llm.engine.allocator.num_free_blocks == num_blocks, "every block must be free at the end"
    preemptions = sum(len(t.preempted) for t in llm.traces)
    assert (preemptions > 0) == (num_blocks == 14), f"{num_blocks} blocks: {preemptions} preemptions"


# ---- the real model


@pytest.mark.slow
@pytest.mark.task(3)
def test_smollm2_32_prompts_equal_chapter01_with_and_without_preemption(smollm2, chapter01_answers):
    model, tok, prompts = smollm2
    params = SamplingParams(max_tokens=24)
    # All 32 prompts with enough blocks for everyone, then the first 16 (with 4-token blocks,
    # so sequences need new blocks often) with so few blocks that only two or three sequences
    # fit and the rest keep getting preempted (12 times).
    need = max(-(-(len(p) + params.max_tokens) // 4) for p in prompts[:16])
    for count, block_size, num_blocks, min_preemptions in ((32, 16, None, 0), (16, 4, need + 8, 8)):
        llm = LLM.from_model(model, tok, max_num_seqs=8, num_blocks=num_blocks, block_size=block_size)
        outs = llm.generate(prompts[:count], params, use_tqdm=False)
        assert len(outs) == count, f"num_blocks={num_blocks}: {len(outs)} outputs for {count} prompts"
        want = chapter01_answers(count, params.max_tokens)  # after the engine ran: stubs fail fast
        for i, (o, w) in enumerate(zip(outs, want)):
            assert o.token_ids == w.token_ids, (f"num_blocks={num_blocks}, prompt {i}: "
                                                f"{first_difference(o.token_ids, w.token_ids, ('engine', 'chapter 01'))}")
        preemptions = sum(len(t.preempted) for t in llm.traces)
        assert preemptions >= min_preemptions, f"num_blocks={num_blocks}: only {preemptions} preemptions"
