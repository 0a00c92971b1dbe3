"""Parallel sampling (SamplingParams.n): one prompt computed once, n completions forked from it.

The n completions share the prompt's KV blocks (chapter 03's fork) and copy the
shared last block when they first write into it (copy-on-write, now live in
the engine). Oracles: at temperature 0 every completion is chapter 01's greedy
output; a seeded request gives the same n texts alone and in a crowd.
"""
import pytest

from minicb import LLM, SamplingParams
from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache

PROMPTS = [[5, 6, 7, 8, 9, 10], [11] * 7, [3, 4, 5], list(range(20, 33))]


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=13)


def test_the_prompt_is_computed_once(tiny):
    llm = LLM.from_model(tiny, block_size=4, num_blocks=64, max_num_seqs=8)
    llm.generate([PROMPTS[3]], SamplingParams(max_tokens=5, n=4), use_tqdm=False)
    prefill = [s.num_tokens for t in llm.traces for s in t.slots if s.phase == "prefill"]
    assert prefill == [len(PROMPTS[3])], f"one prefill of the 13-token prompt, then decodes; prefills: {prefill}"


def test_seeded_completions_do_not_depend_on_the_batch(tiny):
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=21)
    alone = LLM.from_model(tiny, block_size=4, num_blocks=64).generate([PROMPTS[0]], params, use_tqdm=False)[0]
    crowd_params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in (1, 2)] + [params]
    crowd = LLM.from_model(tiny, block_size=4, num_blocks=64).generate(
        [[9, 9], [4] * 11, PROMPTS[0]], crowd_params, use_tqdm=False)[-1]
    for a, b in zip(alone.outputs, crowd.outputs):
        assert a.token_ids == b.token_ids, f"completion {a.index}: {first_difference(b.token_ids, a.token_ids, ('crowd', 'alone'))}"
    texts = [tuple(c.token_ids) for c in alone.outputs]
    assert len(set(texts)) == 3, f"each completion should draw its own stream; got {texts}"


def test_greedy_completions_equal_chapter01_through_copy_on_write_and_preemption(tiny, monkeypatch):
    # Prefix caching off; with it on, chapter 07's test_n_4_completions_copy_on_write_and_all_equal_greedy
    # counts the copies exactly. 14 blocks of 4 for 8 completions of up to 13 + 12 tokens: they keep
    # preempting each other.
    llm = LLM.from_model(tiny, block_size=4, num_blocks=14, max_num_seqs=8)
    copies = []
    copy_block = llm.engine.pool.copy_block
    monkeypatch.setattr(llm.engine.pool, "copy_block", lambda src, dst: copies.append((src, dst)) or copy_block(src, dst))
    outs = llm.generate(PROMPTS[2:], SamplingParams(max_tokens=12, n=4), use_tqdm=False)
    assert sum(len(t.preempted) for t in llm.traces) > 0, "the pool was sized to force preemption"
    for o in outs:
        want = generate_with_cache(tiny, o.prompt_token_ids, SamplingParams(max_tokens=12)).token_ids
        assert [c.index for c in o.outputs] == [0, 1, 2, 3], f"prompt {o.index}: completions {o.outputs}"
        for c in o.outputs:
            assert c.token_ids == want, f"prompt {o.index}, completion {c.index}: {first_difference(c.token_ids, want)}"
        assert o.token_ids == o.outputs[0].token_ids
    assert copies, "the completions share a partly filled last block, so their first writes must copy it"
    assert llm.engine.allocator.num_free_blocks == 14 and not llm.engine.sequences, "everything must be freed"


def test_stream_carries_each_completions_tokens(tiny):
    llm = LLM.from_model(tiny, block_size=4, num_blocks=64)
    events = list(llm.stream([PROMPTS[1]], SamplingParams(max_tokens=5, n=3, temperature=0.8, seed=3)))
    final = [e.output for e in events if e.output is not None]
    assert len(final) == 1, f"the request's output comes once, on its last token; came {len(final)} times"
    for c in final[0].outputs:
        streamed = [e.token_id for e in events if e.completion == c.index]
        assert streamed == c.token_ids, f"completion {c.index}: streamed {streamed}, output {c.token_ids}"


def test_bad_n_is_refused(tiny):
    llm = LLM.from_model(tiny, block_size=4, num_blocks=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([[5, 6]], SamplingParams(n=5), use_tqdm=False)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="n="):
            SamplingParams(n=bad)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, n=4), use_tqdm=False)[0].outputs, "still serving"
