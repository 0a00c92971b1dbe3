"""Chapter 08 in the engine: chunked prefill gives the same tokens as whole-prompt admission, in smaller steps.

The oracle is chapter 06's engine, which admits each prompt whole (and which
its own tests hold to chapter 01). With `enable_chunked_prefill=True` and any
token budget, greedy outputs must be identical token for token: with and
without prefix caching, on a pool that forces preemption, with n = 4, and with
prompts far longer than the budget. The trace shows the budget at work: no step
computes more than `max_num_batched_tokens`, and a long prompt is cut across
steps while the running requests keep decoding in every one of them.

Every test here grades task 1, the rule (`chunk_size` and
`ChunkedScheduler.tokens_to_compute`): the loop around it is chapter 06's, given.
The attention functions of tasks 2 and 3 are the reference's meanwhile (the
one_task fixture in conftest.py). Run against your own code with `python -m minicb check 8`.
"""
import random

import pytest

from minicb import LLM, SamplingParams, impl
from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache

GRADED_MODULE = "chunked_prefill"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")
BUDGETS = [1, 7, 16, 64, 4096]
# On SmolLM2 a 1-token budget means one forward per prompt token (two thirds of its test's time), and
# the tiny model's tests run it; 2 keeps its case on the real model: a decode and a 1-token chunk.
SMOLLM2_BUDGETS = [2, 7, 16, 64, 4096]
TIGHT_SMOLLM2_BLOCKS = 60  # blocks of 4: the three SmolLM2 prompts fit, but not all of their 16-token answers
SYSTEM = [(17 * i) % 200 + 3 for i in range(30)]  # a shared 30-token start, so the cache has work


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=5)


def prompts_for(seed: int, count: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        head = SYSTEM[:rng.randint(0, 30)]  # some start alike, some not
        prompts.append(head + [rng.randrange(3, 250) for _ in range(rng.randint(1, 40))])
    return prompts


def run(model, prompts, params, **engine):
    llm = LLM.from_model(model, **{"block_size": 4, "max_num_seqs": 4, **engine})
    return llm.generate(prompts, params, use_tqdm=False), llm


def assert_same(outs, want, what):
    for o, w in zip(outs, want):
        for c, wc in zip(o.outputs, w.outputs):
            assert c.token_ids == wc.token_ids, (f"{what}, prompt {o.index} completion {c.index}: "
                                                 f"{first_difference(c.token_ids, wc.token_ids, ('chunked', 'whole'))}")


@pytest.mark.task(1)
def test_chunk_size():
    chunk_size = impl.load("chunked_prefill").chunk_size
    got = [chunk_size(remaining, budget) for remaining, budget in [(10, 4), (3, 4), (5, 0), (0, 3)]]
    assert got == [4, 3, 0, 0], f"chunk_size for (10, 4), (3, 4), (5, 0), (0, 3): {got}, want [4, 3, 0, 0]"


@pytest.mark.task(1)
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_any_budget_gives_chapter06s_tokens(tiny, budget, caching):
    prompts = prompts_for(0)  # up to 70 tokens: far longer than budgets 1, 7 and 16
    params = SamplingParams(max_tokens=8)
    want, _ = run(tiny, prompts, params)
    outs, llm = run(tiny, prompts, params, enable_chunked_prefill=True, max_num_batched_tokens=budget,
                    enable_prefix_caching=caching)
    assert_same(outs, want, f"budget {budget}, caching {caching}")
    biggest = max(t.num_tokens for t in llm.traces)
    assert biggest <= budget, f"a step computed {biggest} tokens, over the budget of {budget}"
    if caching:
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "prompts share a start: some should hit"


@pytest.mark.task(1)
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
@pytest.mark.parametrize("budget", [1, 7, 64])
def test_a_pool_that_forces_preemption_gives_the_same_tokens(tiny, budget, caching):
    prompts = prompts_for(1, 16)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want, _ = run(tiny, prompts, params, num_blocks=64)
    # 24 blocks of 4 for 4 slots of up to 77 tokens: requests are preempted and come back.
    outs, llm = run(tiny, prompts, params, num_blocks=24, enable_chunked_prefill=True,
                    max_num_batched_tokens=budget, enable_prefix_caching=caching)
    assert_same(outs, want, f"budget {budget}, caching {caching}, tight pool")
    assert llm.engine.allocator.num_free_blocks == 24, "every block must be free at the end"
    preemptions = sum(len(t.preempted) for t in llm.traces)
    # With a budget of 1 the oldest request takes the one token of every step until it
    # finishes, so only one request ever holds blocks, and nobody can be preempted.
    assert (preemptions > 0) == (budget > 1), f"budget {budget}: {preemptions} preemptions"


@pytest.mark.task(1)
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_a_request_preempted_mid_prefill_comes_back_with_the_same_tokens(tiny, caching):
    # Three requests decode; a 40-token prompt is admitted into the last free blocks and,
    # with 1 token of a budget of 4 left per step, is computed 1 token a step. The
    # decodes soon need blocks, and the newest running request, the one still
    # prefilling, is preempted. It comes back and must give chapter 06's tokens.
    decoding, long_prompt = SamplingParams(max_tokens=30, ignore_eos=True), list(range(100, 140))
    want, _ = run(tiny, [[5, 6, 7], [8, 6, 7], [9, 6, 7], long_prompt], [decoding] * 3 + [SamplingParams(max_tokens=6)],
                  num_blocks=64)
    llm = LLM.from_model(tiny, block_size=4, max_num_seqs=4, num_blocks=17, enable_chunked_prefill=True,
                         max_num_batched_tokens=4, enable_prefix_caching=caching)
    engine, finished, preempted = llm.engine, {}, []
    preempt = engine.scheduler.preempt

    def spy(seq):
        preempted.append((seq.seq_id, not seq.is_decoding, seq.num_computed_tokens))
        preempt(seq)

    engine.scheduler.preempt = spy
    ids = [engine.add_request(p, decoding) for p in ([5, 6, 7], [8, 6, 7], [9, 6, 7])]
    for _ in range(2):
        engine.step()
    ids.append(engine.add_request(long_prompt, SamplingParams(max_tokens=6)))
    while engine.has_unfinished():
        finished.update({seq.request_id: seq for seq in engine.step().finished})
    assert any(rid == ids[3] and prefilling and 0 < computed < 40 for rid, prefilling, computed in preempted), (
        f"the long prompt should be preempted part way through its prefill: preemptions "
        f"(request, prefilling, tokens computed) {preempted}")
    for i, rid in enumerate(ids):
        got, expected = finished[rid].output_token_ids, want[i].token_ids
        assert got == expected, f"request {i}: {first_difference(got, expected, ('chunked', 'whole'))}"
    assert engine.allocator.num_free_blocks == 17, "every block must be free at the end"


@pytest.mark.task(1)
def test_a_request_that_comes_back_after_its_cached_prefix_was_evicted_computes_it_again(tiny):
    # R's first admission finds 16 tokens cached (A computed them). R is preempted, and while it
    # waits B and C evict every cached block. Admitted again, R finds nothing cached: it must
    # start from position 0, not from the 16 of its first admission.
    shared = [(17 * i) % 200 + 3 for i in range(16)]
    a, b, c, r = shared + [1, 2, 3], [(7 * i) % 240 + 5 for i in range(40)], list(range(20, 8, -1)), shared + [7, 8, 9]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want, _ = run(tiny, [b, c, r], params, num_blocks=64)
    llm = LLM.from_model(tiny, block_size=4, max_num_seqs=4, num_blocks=20, enable_chunked_prefill=True,
                         max_num_batched_tokens=7, enable_prefix_caching=True, keep_traces=None)
    engine = llm.engine
    engine.add_request(a, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    ids = [engine.add_request(p, params) for p in (b, c, r)]
    outputs = {}
    while engine.has_unfinished():
        outputs.update({seq.request_id: seq.output_token_ids for seq in engine.step().finished})
    for name, rid, w in zip("BCR", ids, want):
        assert outputs[rid] == w.outputs[0].token_ids, (
            f"request {name}: {first_difference(outputs[rid], w.outputs[0].token_ids, ('chunked', 'whole'))}")
    admissions = [cached for trace in engine.traces for rid, cached in trace.cached_tokens if rid == ids[2]]
    assert admissions[:2] == [16, 0], (f"setup: R should be admitted with 16 tokens cached, preempted, and "
                                       f"admitted again with none; its admissions found {admissions}")


@pytest.mark.task(1)
@pytest.mark.parametrize("budget", [7, 64])
def test_cached_prompt_tokens_are_not_computed_again(tiny, budget):
    # What the steps computed, added up, is what the requests needed: each its prompt past
    # the cached prefix, then one token per output after the first. Right tokens are not
    # enough: a scheduler that recomputes the cached prefix gives them too, at a cost.
    prompts = prompts_for(3)
    outs, llm = run(tiny, prompts, SamplingParams(max_tokens=8), enable_chunked_prefill=True,
                    max_num_batched_tokens=budget, enable_prefix_caching=True, num_blocks=256)
    assert sum(o.metrics.num_preemptions for o in outs) == 0, "setup: a roomy pool preempts nobody"
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "setup: prompts share a start, some should hit"
    need = sum(len(p) - o.metrics.num_cached_tokens + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outs))
    computed = sum(t.num_tokens for t in llm.traces)
    assert computed == need, (f"budget {budget}: the steps computed {computed} tokens; the requests needed {need} "
                              f"(prompts past their cached prefix, then one per output after the first)")


@pytest.mark.task(1)
def test_n_4_and_seeded_sampling_match_whole_prompt_admission(tiny):
    prompts = prompts_for(2, 4)
    for params in (SamplingParams(max_tokens=9, n=4),
                   SamplingParams(max_tokens=9, n=3, temperature=0.9, seed=11)):
        want, _ = run(tiny, prompts, params, max_num_seqs=8)
        outs, _ = run(tiny, prompts, params, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=5)
        # A seeded completion draws from its generator only when a token is sampled,
        # so chunking (which samples nothing for a prompt's early chunks) changes nothing.
        assert_same(outs, want, f"{params}")


@pytest.mark.task(1)
def test_a_long_prompt_is_cut_while_the_others_keep_decoding(tiny):
    llm = LLM.from_model(tiny, block_size=4, max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=8)
    decoding = SamplingParams(max_tokens=40, ignore_eos=True)
    short = [llm.engine.add_request([5 + i, 6, 7], decoding) for i in range(3)]
    for _ in range(3):  # the three short prompts are computed, and start decoding
        llm.engine.step()
    long_id = llm.engine.add_request(list(range(10, 70)), SamplingParams(max_tokens=4))  # 60 tokens
    traces = []
    while True:
        step = llm.engine.step(trace=True)
        traces.append(step.trace)
        if any(new.request_id == long_id for new in step.new_tokens):
            break  # its first token: the prompt is done
    prefill_steps = [t for t in traces if any(s.seq_id == long_id and s.phase == "prefill" for s in t.slots)]
    # 8 tokens a step, 3 of them for the decodes: the 60-token prompt takes 12 chunks of 5.
    chunks = [next(s.num_tokens for s in t.slots if s.seq_id == long_id) for t in prefill_steps]
    assert chunks == [5] * 12, f"chunks of the long prompt per step: {chunks}, want 12 chunks of 5"
    for t in prefill_steps:
        phases = {s.seq_id: s.phase for s in t.slots}
        assert all(phases.get(rid) == "decode" for rid in short), (
            f"step {t.step}: the running requests must decode while the long prompt is cut: {phases}")
        assert t.num_tokens == 8, f"step {t.step} computed {t.num_tokens} tokens; the budget is 8"
    sampled_early = [t.step for t in prefill_steps[:-1] if any(rid == long_id for rid, _ in t.new_tokens)]
    assert not sampled_early, f"a token was sampled for the long prompt before its last chunk, at steps {sampled_early}"


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_any_budget_gives_chapter06s_tokens(smollm2):
    model, tokenizer, _ = smollm2
    from minicb.bench.workloads import SYSTEM_PROMPT
    from minicb.data import load_chat_prompts

    # Two short chat prompts and one behind the bench's long system prompt (~200 tokens,
    # far longer than most budgets here); the short ones share the chat template's start.
    questions = load_chat_prompts(3)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions[:2]]
    prompts.append(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": questions[2]}]))
    params = SamplingParams(max_tokens=16)
    want = LLM.from_model(model, tokenizer, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    for budget in SMOLLM2_BUDGETS:
        roomy = LLM.from_model(model, tokenizer, max_num_seqs=4, enable_chunked_prefill=True,
                               max_num_batched_tokens=budget)
        assert_same(roomy.generate(prompts, params, use_tqdm=False), want, f"SmolLM2, budget {budget}, no caching")
        # With caching, on a pool too small for all three to grow: the long prompt goes first,
        # the short ones join once the budget lets them, and someone is preempted as they grow.
        tight = LLM.from_model(model, tokenizer, max_num_seqs=4, enable_chunked_prefill=True,
                               max_num_batched_tokens=budget, enable_prefix_caching=True,
                               block_size=4, num_blocks=TIGHT_SMOLLM2_BLOCKS)
        outs = tight.generate(prompts[::-1], params, use_tqdm=False)
        assert_same(outs, want[::-1], f"SmolLM2, budget {budget}, caching, {TIGHT_SMOLLM2_BLOCKS} blocks of 4")
        preempted = sum(len(t.preempted) for t in tight.traces)
        # At budget 2 the long prompt's prefill takes the whole budget, and then each answer of 16
        # tokens ends before the next prompt's prefill, fed a token a step beside it, does: no two
        # answers ever grow side by side, so nothing is preempted. The tiny model's tests cover it.
        assert budget == 2 or preempted > 0, (
            f"budget {budget}: the {TIGHT_SMOLLM2_BLOCKS}-block pool forced no preemption, so this "
            f"case tested nothing; make the pool smaller")


@pytest.mark.task(1)
def test_a_new_prompt_is_cut_to_what_the_decodes_leave(tiny):
    llm = LLM.from_model(tiny, block_size=4, max_num_seqs=5, enable_chunked_prefill=True, max_num_batched_tokens=8)
    engine, decoding = llm.engine, SamplingParams(max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i, 6, 7], decoding)
    trace = engine.step(trace=True).trace  # admits the three 3-token prompts: 9 tokens > 8, so the third gets 2
    first = {s.seq_id: s.num_tokens for s in trace.slots if s.phase == "prefill"}
    assert first == {0: 3, 1: 3, 2: 2}, f"first step, budget 8: chunks {first}, want {{0: 3, 1: 3, 2: 2}}"
    engine.step()  # 0 and 1 decode, 2 finishes its prompt: 3 tokens
    new = engine.add_request(list(range(20, 40)), SamplingParams(max_tokens=3))
    trace = engine.step(trace=True).trace  # 3 decodes, then the new 20-token prompt gets the 5 tokens left
    got = {s.seq_id: (s.phase, s.num_tokens) for s in trace.slots if s.seq_id is not None}
    assert got.get(new) == ("prefill", 5) and trace.admitted == [new], (
        f"3 decodes leave 5 of 8 tokens: the new prompt's first chunk should be 5; step: {got}")
    llm_small = LLM.from_model(tiny, block_size=4, max_num_seqs=5, enable_chunked_prefill=True,
                               max_num_batched_tokens=3)
    for i in range(3):
        llm_small.engine.add_request([5 + i], decoding)
    llm_small.engine.step()
    llm_small.engine.add_request([9, 9, 9], decoding)
    trace = llm_small.engine.step(trace=True).trace  # the 3 decodes spend the whole budget: nobody is admitted
    assert trace.admitted == [], f"with no budget left, admission must wait: admitted {trace.admitted}"


@pytest.mark.task(1)
def test_a_prompt_in_chunks_keeps_the_slots_of_its_siblings(tiny):
    # The old scheduler crashed here (ValueError: None is not in list, forking into no free
    # slot): request 0 (6 tokens, n = 2) is cut 5 + 1, so it still runs unforked when requests
    # 1 (n = 2) and 2 are considered in the next step. Only one of them fits beside it.
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14]]
    params = [SamplingParams(max_tokens=6, n=2), SamplingParams(max_tokens=6, n=2), SamplingParams(max_tokens=6)]
    want, _ = run(tiny, prompts, params)
    outs, llm = run(tiny, prompts, params, enable_chunked_prefill=True, max_num_batched_tokens=5)
    assert [len(o.outputs) for o in outs] == [2, 2, 1], f"completions per prompt {[len(o.outputs) for o in outs]}"
    assert_same(outs, want, "n = 2, 2, 1, budget 5")
    for o, p in zip(outs, prompts):
        greedy = generate_with_cache(tiny, p, SamplingParams(max_tokens=6)).token_ids
        assert all(c.token_ids == greedy for c in o.outputs), f"prompt {o.index}: every completion is chapter 01's"
    assert max(len(t.running) for t in llm.traces) <= 4, "more sequences ran than the 4 slots"


@pytest.mark.task(1)
@pytest.mark.parametrize("num_blocks", [64, 10], ids=["roomy", "tight"])
@pytest.mark.parametrize("budget", [3, 8])
def test_requests_with_different_n_give_the_plain_engines_tokens(tiny, budget, num_blocks):
    # n = 1, 2 and 3 mixed on 4 slots, prompts far longer than the budget: requests still in
    # chunks hold their siblings' slots; on 10 blocks of 4 completions preempt one another too.
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 20))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(6, 14), ignore_eos=True, n=n)
              for n in (2, 3, 1, 2, 1, 3, 2, 1, 1, 2)]
    want, _ = run(tiny, prompts, params)
    outs, llm = run(tiny, prompts, params, num_blocks=num_blocks, enable_chunked_prefill=True,
                    max_num_batched_tokens=budget)
    assert [len(o.outputs) for o in outs] == [p.n for p in params], "every request gets its n completions"
    assert_same(outs, want, f"budget {budget}, {num_blocks} blocks")
    assert max(t.num_tokens for t in llm.traces) <= budget, "a step computed more than the budget"
    assert llm.engine.allocator.num_free_blocks == num_blocks, "every block must be free at the end"
    preemptions = sum(len(t.preempted) for t in llm.traces)
    assert (preemptions > 0) == (num_blocks == 10), f"{num_blocks} blocks: {preemptions} preemptions"
