"""Chapter 07 in the engine: the same tokens with prefix caching on and off, and fewer computed.

`EngineConfig(enable_prefix_caching=True)` gives the engine chapter 07's
caching block pool (your exercise under `check 7`): a request that starts like
an earlier one shares that one's computed blocks and prefills only the rest.
The oracle is the engine with caching off, which chapter 06 holds to chapter
01: greedy outputs must be identical, token for token, through shared system
prompts, a full-prefix hit, a multi-turn conversation, preemption and n = 4
parallel sampling. The SmolLM2 tests (marked slow) do the same on the real model.
"""
import random

import pytest

from minicb import LLM, SamplingParams
from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache

GRADED_MODULE = "prefix_cache"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")

SYSTEM = [(13 * i) % 200 + 3 for i in range(45)]  # a 45-token "system prompt" every request starts with


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=11)


def run(model, prompts, caching, **engine):
    llm = LLM.from_model(model, enable_prefix_caching=caching, **{"block_size": 4, "max_num_seqs": 4, **engine})
    outs = llm.generate(prompts, SamplingParams(max_tokens=10), use_tqdm=False)
    computed = sum(slot.num_tokens for t in llm.traces for slot in t.slots if slot.phase == "prefill")
    return outs, computed, llm


def assert_same_tokens(with_cache, without, what):
    for i, (a, b) in enumerate(zip(with_cache, without)):
        assert a.token_ids == b.token_ids, f"{what}, request {i}: {first_difference(a.token_ids, b.token_ids, ('caching on', 'caching off'))}"


@pytest.mark.task(2)
def test_a_shared_system_prompt_is_computed_once(tiny):
    rng = random.Random(0)
    prompts = [SYSTEM + [rng.randrange(3, 250) for _ in range(rng.randint(1, 9))] for _ in range(12)]
    on, computed_on, llm = run(tiny, prompts, True, num_blocks=80)
    off, computed_off, _ = run(tiny, prompts, False, num_blocks=80)
    assert_same_tokens(on, off, "shared system prompt")
    # The first request computes the system prompt. Its 11 full blocks (44 tokens) get
    # their keys when they are scheduled, so the other 11 find them in the cache, the 3
    # admitted in the same step as the first among them.
    hits = [o.metrics.num_cached_tokens for o in on]
    assert hits[0] == 0 and all(h == 44 for h in hits[1:]), f"cached prompt tokens per request: {hits}"
    assert computed_on == computed_off - 11 * 44, (f"prefill tokens computed: {computed_on} with caching, "
                                                   f"{computed_off} without; want 11 x 44 fewer")
    assert llm.traces[-1].cached_free_blocks, "after the run the finished requests' blocks stay cached"
    # The trace tells the same story, per admission, for the step player.
    traced = dict(pair for trace in llm.traces for pair in trace.cached_tokens)
    assert [traced[o.index] for o in on] == hits, f"trace cached_tokens {traced}, metrics {hits}"  # ids = indices here
    assert any(trace.shared_blocks for trace in llm.traces), "requests sharing the system prompt share blocks"


@pytest.mark.task(1)
def test_requests_admitted_in_one_step_compute_a_shared_prefix_once(tiny):
    # 8 requests behind one 300-token prefix arrive together and are all admitted in the
    # first step. The first registers the keys of the 75 full blocks it schedules; the
    # other 7 look them up in the same step and compute only their own tail. (Every
    # layer stores the step's K/V before any attention reads it, so sharing blocks that
    # are written in this very forward is safe.)
    rng = random.Random(3)
    prefix = [rng.randrange(3, 250) for _ in range(300)]
    prompts = [prefix + [rng.randrange(3, 250) for _ in range(rng.randint(1, 7))] for _ in range(8)]
    on, computed_on, llm = run(tiny, prompts, True, max_num_seqs=8, num_blocks=160)
    off, computed_off, _ = run(tiny, prompts, False, max_num_seqs=8, num_blocks=160)
    assert_same_tokens(on, off, "one step, one shared prefix")
    assert llm.traces[0].admitted == list(range(8)), f"all 8 must be admitted in step 0: {llm.traces[0].admitted}"
    hits = [o.metrics.num_cached_tokens for o in on]
    assert hits == [0] + [300] * 7, f"cached prompt tokens per request, want [0] + [300] * 7: {hits}"
    assert computed_on == computed_off - 7 * 300, (f"prefill tokens computed: {computed_on} with caching, "
                                                   f"{computed_off} without; want 7 x 300 fewer")


@pytest.mark.task(1)
def test_a_chunk_keys_only_the_blocks_it_fills(tiny):
    # With chunked prefill, a block gets its key when every one of its tokens is
    # scheduled, not before: a later request must never hit a block still half empty.
    llm = LLM.from_model(tiny, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=10,
                         block_size=4, max_num_seqs=2, num_blocks=64)
    engine = llm.engine
    rid = engine.add_request(SYSTEM, SamplingParams(max_tokens=2))
    engine.step()  # tokens 0-9: blocks 0 and 1 are full, block 2 holds 2 of its 4
    table = engine.allocator.block_table(rid)
    keyed = [engine.allocator.block_key(block) is not None for block in table[:4]]
    assert keyed == [True, True, False, False], f"after a 10-token chunk, blocks keyed: {keyed}; want the 2 full ones"
    engine.step()  # tokens 10-19: blocks 2, 3 and 4 fill up
    keyed = [engine.allocator.block_key(block) is not None for block in engine.allocator.block_table(rid)[:6]]
    assert keyed == [True] * 5 + [False], f"after two chunks (20 tokens), blocks keyed: {keyed}; want the 5 full ones"


@pytest.mark.task(2)
def test_the_same_prompt_twice_is_a_full_hit_that_still_computes_the_last_token(tiny):
    prompt = SYSTEM[:40]  # exactly 10 blocks of 4
    llm = LLM.from_model(tiny, enable_prefix_caching=True, block_size=4, num_blocks=40)
    first = llm.generate([prompt], SamplingParams(max_tokens=6), use_tqdm=False)[0]
    second = llm.generate([prompt], SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert second.token_ids == first.token_ids, first_difference(second.token_ids, first.token_ids)
    # 40 tokens, all in cached blocks, but the last token's logits are needed: the
    # last block is recomputed, so 9 blocks (36 tokens) come from the cache.
    assert second.metrics.num_cached_tokens == 36, f"want 36 cached tokens, got {second.metrics.num_cached_tokens}"
    prefill = [s.num_tokens for t in llm.traces for s in t.slots if s.phase == "prefill"]
    assert prefill == [4], f"the second request should prefill only its last block (4 tokens), got {prefill}"


@pytest.mark.task(1)
def test_a_three_turn_conversation_reuses_the_earlier_turns(tiny):
    llm_on = LLM.from_model(tiny, enable_prefix_caching=True, block_size=4, num_blocks=80)
    llm_off = LLM.from_model(tiny, enable_prefix_caching=False, block_size=4, num_blocks=80)
    history, cached = list(SYSTEM), []
    for turn in range(3):
        history += [50 + turn, 60 + turn, 70 + turn]  # the user's next message
        on = llm_on.generate([history], SamplingParams(max_tokens=8), use_tqdm=False)[0]
        off = llm_off.generate([history], SamplingParams(max_tokens=8), use_tqdm=False)[0]
        assert on.token_ids == off.token_ids, f"turn {turn}: {first_difference(on.token_ids, off.token_ids)}"
        cached.append(on.metrics.num_cached_tokens)
        history += on.token_ids  # the answer is part of the next turn's prompt
    assert cached[0] == 0 and cached[1] > len(SYSTEM) and cached[2] > cached[1], (
        f"each turn should find the earlier turns cached: cached prompt tokens per turn {cached}")


@pytest.mark.task(3)
def test_preemption_with_caching_gives_the_same_tokens(tiny):
    rng = random.Random(1)
    prompts = [SYSTEM[:rng.randint(5, 30)] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
               for _ in range(16)]
    # 22 blocks of 4 for 4 slots of up to ~52 tokens: requests keep being preempted,
    # and come back to find part of what they had computed still cached.
    on, _, llm = run(tiny, prompts, True, num_blocks=22)
    off, _, _ = run(tiny, prompts, False, num_blocks=22)
    assert_same_tokens(on, off, "preemption")
    preemptions = sum(len(t.preempted) for t in llm.traces)
    assert preemptions > 0, "the pool was sized to force preemption, but none happened"
    assert llm.engine.allocator.num_free_blocks == 22, "every block must be free (or evictable) at the end"


@pytest.mark.task(4)
def test_n_4_completions_copy_on_write_and_all_equal_greedy(tiny, monkeypatch):
    # (With caching off: tests/engine/test_parallel_sampling.py.)
    prompts = [SYSTEM[:6], SYSTEM[:13], SYSTEM[:3] + [7, 7, 7, 7, 7]]
    llm = LLM.from_model(tiny, block_size=4, num_blocks=64, max_num_seqs=8, enable_prefix_caching=True)
    copies = []
    copy_block = llm.engine.pool.copy_block
    monkeypatch.setattr(llm.engine.pool, "copy_block", lambda src, dst: copies.append((src, dst)) or copy_block(src, dst))
    outs = llm.generate(prompts, SamplingParams(max_tokens=9, n=4), use_tqdm=False)
    for o in outs:
        want = generate_with_cache(tiny, o.prompt_token_ids, SamplingParams(max_tokens=9)).token_ids
        assert [c.index for c in o.outputs] == [0, 1, 2, 3], f"prompt {o.index}: completions {o.outputs}"
        for c in o.outputs:
            assert c.token_ids == want, (f"prompt {o.index}, completion {c.index}: "
                                         f"{first_difference(c.token_ids, want, ('n=4', 'greedy'))}")
    # Prompts of 6, 13 and 8 tokens: the first two end in a partial block that 4
    # completions share, so 3 of each 4 copy it on their first write; the 8-token
    # prompt fills its last block, and a full block is never written again.
    assert len(copies) == 6, f"want 3 + 3 copy-on-write copies (partial last blocks), got {len(copies)}: {copies}"
    assert llm.engine.allocator.num_free_blocks == 64 and not llm.engine.sequences, "everything must be freed"


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_chat_with_a_shared_system_prompt_is_unchanged_by_caching(smollm2):
    model, tokenizer, _ = smollm2
    from minicb.data import load_chat_prompts

    system = ("You are a careful assistant for a physics class. Answer in one or two sentences, "
              "state units, and say so when a question has no single answer.")
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": q}]) for q in load_chat_prompts(12)]
    params = SamplingParams(max_tokens=16)
    runs = {}
    for caching in (False, True):
        llm = LLM.from_model(model, tokenizer, enable_prefix_caching=caching, max_num_seqs=4, block_size=16)
        runs[caching] = llm.generate(prompts, params, use_tqdm=False)
    assert_same_tokens(runs[True], runs[False], "SmolLM2 with a system prompt")
    hits = [o.metrics.num_cached_tokens for o in runs[True]]
    assert sum(h > 0 for h in hits) >= 8, f"later requests should hit the system prompt's blocks: {hits}"


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_tight_pool_with_n_4_equals_greedy_with_and_without_caching(smollm2):
    model, tokenizer, _ = smollm2
    from minicb.data import load_chat_prompts

    system = "You answer in one short sentence."
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": q}]) for q in load_chat_prompts(4)]
    greedy = LLM.from_model(model, tokenizer, max_num_seqs=4).generate(
        prompts, SamplingParams(max_tokens=12), use_tqdm=False)
    need = max(-(-(len(p) + 12) // 4) for p in prompts)  # one completion alone must fit
    for caching in (False, True):
        llm = LLM.from_model(model, tokenizer, enable_prefix_caching=caching, max_num_seqs=8, block_size=4,
                             num_blocks=need + 6)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, n=4), use_tqdm=False)
        assert sum(len(t.preempted) for t in llm.traces) > 0, f"caching={caching}: the pool should force preemption"
        for o, want in zip(outs, greedy):
            for c in o.outputs:
                assert c.token_ids == want.token_ids, (
                    f"caching={caching}, prompt {o.index}, completion {c.index}: "
                    f"{first_difference(c.token_ids, want.token_ids, ('n=4', 'greedy'))}")


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_conversation_and_full_hit_equal_caching_off(smollm2):
    model, tokenizer, _ = smollm2
    from minicb.bench.workloads import EARLIER_ANSWER, SYSTEM_PROMPT

    # A 3-turn conversation (each turn resends the earlier ones) and the same prompt
    # twice (a full hit), sent one after the other, so later requests hit what the
    # earlier ones left in the pool. (Preemption with caching on SmolLM2: the n = 4 test
    # above; with n = 1: the tiny-model tests and tests/chapters/test_ch07_integration.py.)
    history = [{"role": "system", "content": SYSTEM_PROMPT}]
    turns = []
    for question in ["Can I renew a book online?", "How many times?", "What if I lose it?"]:
        history = history + [{"role": "user", "content": question}]
        turns.append(tokenizer.apply_chat_template(history))
        history = history + [{"role": "assistant", "content": EARLIER_ANSWER}]
    sequence = [turns[0], turns[0], turns[1], turns[2]]
    for n in (1, 4):
        runs = {}
        for caching in (False, True):
            llm = LLM.from_model(model, tokenizer, enable_prefix_caching=caching, max_num_seqs=4, block_size=16)
            runs[caching] = [llm.generate([prompt], SamplingParams(max_tokens=6, n=n), use_tqdm=False)[0]
                             for prompt in sequence]
        for a, b in zip(runs[True], runs[False]):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], (
                f"n={n}, request {sequence.index(a.prompt_token_ids)}: caching changed the completions")
        hits = [o.metrics.num_cached_tokens for o in runs[True]]
        full = (len(turns[0]) - 1) // 16 * 16
        assert hits[0] == 0 and hits[1] == full and hits[3] > hits[2] > full - 16, (
            f"n={n}: cached tokens per request {hits}; the repeat should hit {full} (all full blocks but the "
            f"last token's) and each later turn more than the one before")


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_n_1_on_pools_that_force_preemption_equal_caching_off(smollm2):
    model, tokenizer, _ = smollm2
    from minicb.bench.workloads import SYSTEM_PROMPT
    from minicb.data import load_chat_prompts

    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": q}]) for q in load_chat_prompts(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    blocks = [-(-len(p) // 4) for p in prompts]  # blocks of 4 for each prompt alone
    shared = min(len(p) for p in prompts) // 4 - 2  # about the system prompt's full blocks
    # Caching off: room for two prompts at once, not for both to grow by 12 tokens.
    # Caching on: the system prompt once, the four prompts' own tails, and little more.
    pools = {False: max(blocks) + min(blocks) + 2, True: shared + 4 * (max(blocks) - shared) + 2}
    runs = {}
    for caching, num_blocks in pools.items():
        llm = LLM.from_model(model, tokenizer, enable_prefix_caching=caching, max_num_seqs=4, block_size=4,
                             num_blocks=max(num_blocks, max(blocks) + 4))
        runs[caching] = llm.generate(prompts, params, use_tqdm=False)
        preempted = sum(len(t.preempted) for t in llm.traces)
        assert preempted > 0, f"caching={caching}, {num_blocks} blocks: the pool should force preemption"
    assert_same_tokens(runs[True], runs[False], "SmolLM2, n = 1, tight pools")
