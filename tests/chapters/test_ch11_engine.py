"""Chapter 11 in the engine: the same greedy tokens, and no state left behind.

The oracle is the engine with speculation off. On the tiny model, prompts that
repeat themselves make prompt lookup propose drafts that the model sometimes
accepts and sometimes rejects; on SmolLM2, prompts that ask it to copy text.
Rollback is checked after every step: a decoding request holds KV slots for
its computed tokens and no more, its blocks are exactly the blocks those slots
need, and with prefix caching every key is the key of the request's own
verified tokens -- never of a rejected draft.
"""
from __future__ import annotations

import pytest

from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.naive import first_difference
from minicb.prefix_cache import block_keys
from minicb.sampling import SamplingParams

GRADED_MODULE = "speculative"
pytestmark = pytest.mark.usefixtures("one_task")

MODEL = random_model(seed=3)
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [9], [20, 21, 22, 23, 24], [30, 31] * 6, [40, 41, 42, 40, 41]]


def run(prompts, check_each_step=None, **config):
    """Greedy outputs of `prompts` (24 tokens each), and the engine; check_each_step(engine) after every step."""
    engine = Engine(MODEL, EngineConfig(**{"block_size": 4, "max_num_seqs": 4, "num_blocks": 64, **config}))
    ids = [engine.add_request(p, SamplingParams(max_tokens=24)) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for seq in engine.step().finished:
            done[seq.request_id] = seq
        if check_each_step:
            check_each_step(engine)
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks, (
        f"{engine.allocator.num_free_blocks} of {engine.allocator.num_blocks} blocks are free after the run")
    return [done[i] for i in ids], engine


def assert_same_tokens(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.output_token_ids == b.output_token_ids, (
            f"request {i}: {first_difference(a.output_token_ids, b.output_token_ids, ('speculation', 'plain'))}")


def no_state_behind(engine: Engine) -> None:
    allocator, size = engine.allocator, engine.config.block_size
    for seq in engine.scheduler.running:
        if not seq.is_decoding:
            continue
        held = allocator.num_tokens(seq.seq_id)
        table = allocator.block_table(seq.seq_id)
        assert held == seq.num_computed_tokens, (
            f"sequence {seq.seq_id} holds {held} KV slots after the step but has {seq.num_computed_tokens} "
            f"computed tokens: rejected drafts' slots were kept")
        assert len(table) == allocator.blocks_needed(held), (
            f"sequence {seq.seq_id} holds {len(table)} blocks for {held} tokens of block size {size}")
        if engine.config.enable_prefix_caching:
            keys = block_keys(seq.token_ids[:seq.num_computed_tokens], size)
            for i, block in enumerate(table):
                key = allocator.block_key(block)
                assert key is None or (i < len(keys) and key == keys[i]), (
                    f"sequence {seq.seq_id}'s block {i} has a key that is not the key of its own tokens")


@pytest.mark.task(3)
@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_rollback_leaves_no_state_behind(caching):
    want, _ = run(PROMPTS, enable_prefix_caching=caching)
    got, _ = run(PROMPTS, no_state_behind, enable_prefix_caching=caching, block_size=2,
                 speculative_ngram=2, num_speculative_tokens=3)
    drafts = sum(s.num_draft_tokens for s in got)
    accepted = sum(s.num_accepted_tokens for s in got)
    assert 0 < accepted < drafts, f"{accepted} of {drafts} drafts accepted; the test needs accepted and rejected ones"
    assert_same_tokens(got, want)


@pytest.mark.task("all")
def test_a_request_that_runs_out_of_blocks_while_verifying_is_preempted_and_still_right():
    want, _ = run(PROMPTS)
    # 2 tokens a block and 16 blocks: four requests of up to 40 tokens cannot all fit.
    got, engine = run(PROMPTS, no_state_behind, block_size=2, num_blocks=24, speculative_ngram=1,
                      num_speculative_tokens=4)
    assert sum(s.num_preemptions for s in got) > 0, "the pool was sized to force preemption, but none happened"
    assert sum(s.num_accepted_tokens for s in got) > 0, "no draft was accepted"
    assert_same_tokens(got, want)


@pytest.mark.task("all")
def test_traces_and_metrics_count_the_same_drafts():
    got, engine = run(PROMPTS, speculative_ngram=2, num_speculative_tokens=4, keep_traces=None)
    by_request = {s.seq_id: [0, 0] for s in got}
    for trace in engine.traces:
        new = {}
        for rid, token in trace.new_tokens:
            new.setdefault(rid, []).append(token)
        for rid, drafts, accepted, added in trace.speculation:
            by_request[rid][0] += len(drafts)
            by_request[rid][1] += accepted
            assert 1 <= len(drafts) <= 4 and 0 <= accepted <= len(drafts), (trace.step, rid, drafts, accepted)
            # The step appended the accepted drafts, then the token after them (unless a stop token came first).
            assert new[rid] == (drafts[:accepted] + [added])[:len(new[rid])], (
                f"step {trace.step}, request {rid}: drafts {drafts}, {accepted} accepted, then {added}; "
                f"but the step's new tokens were {new[rid]}")
    for seq in got:
        assert by_request[seq.seq_id] == [seq.num_draft_tokens, seq.num_accepted_tokens], (
            f"sequence {seq.seq_id}: the traces count {by_request[seq.seq_id]} (drafts, accepted), "
            f"the sequence {[seq.num_draft_tokens, seq.num_accepted_tokens]}")
        assert seq.num_decode_steps + seq.num_accepted_tokens == len(seq.output_token_ids) - 1, (
            f"sequence {seq.seq_id}: {seq.num_decode_steps} decode steps and {seq.num_accepted_tokens} accepted "
            f"drafts must make its {len(seq.output_token_ids) - 1} tokens after the first")
    assert sum(s.num_draft_tokens for s in got) > 0, "no drafts were proposed"


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_copies_text_with_the_same_greedy_tokens(smollm2):
    from minicb.llm import LLM

    model, tokenizer, _ = smollm2
    paragraph = ("The river starts as rain on a hill. The water runs down into small streams, the streams meet "
                 "and grow, and after many miles the river reaches the sea.")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task}]) for task in (
        f"Repeat this paragraph exactly:\n\n{paragraph}",
        f"Fix the typo in this text and write it out again:\n\n{paragraph.replace('streams', 'straems', 1)}")]
    params = SamplingParams(max_tokens=40)
    plain = LLM.from_model(model, tokenizer, keep_traces=0).generate(prompts, params, use_tqdm=False)
    spec = LLM.from_model(model, tokenizer, keep_traces=0, speculative_ngram=3,
                          num_speculative_tokens=4).generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(spec, plain)):
        assert a.token_ids == b.token_ids, (
            f"prompt {i}: {first_difference(a.token_ids, b.token_ids, ('speculation', 'plain'))}")
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    steps = sum(o.metrics.num_decode_steps for o in spec)
    assert accepted > steps / 2, (f"{accepted} drafts accepted in {steps} decode steps on prompts that copy text; "
                                  f"prompt lookup should find most of them")
