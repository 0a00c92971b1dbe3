"""The engine's bookkeeping over a long run: one state object per request, nothing kept after it ends.

A server steps one engine for weeks, so every request must leave the engine,
the scheduler and the allocator once its output has been handed out. These
tests run on the reference only (they are not graded chapter tasks).
"""
import gc
import random
import weakref

import pytest

from minicb import LLM, SamplingParams
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache
from minicb.sampling import finish_reason
from minicb.scheduler import RequestStatus


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=3)


def held_by_engine(engine: Engine) -> dict:
    """Everything the engine, its scheduler and its allocator still hold, by where."""
    scheduler, allocator = engine.scheduler, engine.allocator
    return {
        "engine.sequences": sorted(engine.sequences),
        "scheduler.waiting": [s.seq_id for s in scheduler.waiting],
        "scheduler.running": [s.seq_id for s in scheduler.running],
        "scheduler.slots": [s.seq_id for s in scheduler.slots if s is not None],
        "allocator block owners": sorted({o for o in allocator.block_owners() if o is not None}),
    }


def test_2000_requests_leave_nothing_behind(tiny):
    """2,000 requests, some aborted while waiting or running, many preempted: afterwards
    nothing of any of them is left, every block is free, and each Sequence object is
    unreachable once the caller drops it."""
    rng = random.Random(7)
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=20, max_num_seqs=8, keep_traces=16))
    alive: list[weakref.ref] = []  # one per request: dead once nobody holds the Sequence
    finished_ids, aborted_ids, added_ids = set(), set(), set()
    counts = {"preemptions": 0, "checked": 0}

    def step() -> None:
        # A function, so no loop variable keeps a finished Sequence alive afterwards.
        for seq in engine.step().finished:
            assert seq.status == RequestStatus.FINISHED and seq.finish_reason in ("stop", "length")
            finished_ids.add(seq.request_id)
            counts["preemptions"] += seq.num_preemptions
            if counts["checked"] < 20 and seq.num_preemptions:  # some preempted ones against chapter 01
                want = generate_with_cache(tiny, seq.prompt_token_ids, seq.params).token_ids
                assert seq.output_token_ids == want, first_difference(seq.output_token_ids, want)
                counts["checked"] += 1

    for _ in range(2000):
        prompt = [rng.randrange(3, tiny.config.vocab_size) for _ in range(rng.randint(1, 12))]
        rid = engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 16)))
        added_ids.add(rid)
        alive.append(weakref.ref(engine.sequences[rid]))
        if rng.random() < 0.1:  # abort a random live request: waiting or running
            victim = rng.choice(sorted({s.request_id for s in engine.sequences.values()}))
            (aborted,) = engine.abort(victim)
            assert aborted.finish_reason == "abort" and aborted.status == RequestStatus.FINISHED
            aborted_ids.add(victim)
            del aborted
        if rng.random() < 0.5 or len(engine.sequences) > 40:
            step()
    while engine.has_unfinished():
        step()
    preemptions = counts["preemptions"]

    assert finished_ids | aborted_ids == added_ids and not finished_ids & aborted_ids, (
        f"every request must end exactly once: {len(added_ids)} added, {len(finished_ids)} finished, "
        f"{len(aborted_ids)} aborted, {len(finished_ids & aborted_ids)} both")
    assert aborted_ids and preemptions > 0, (f"the run was meant to abort and preempt: {len(aborted_ids)} "
                                             f"aborted, {preemptions} preemptions")
    held = held_by_engine(engine)
    assert not any(held.values()), f"the engine still holds finished requests: {held}"
    assert engine.allocator.num_free_blocks == 20, f"{engine.allocator.num_free_blocks} of 20 blocks are free"
    assert len(engine.traces) == 16, f"keep_traces=16 must keep the last 16 steps, got {len(engine.traces)}"
    gc.collect()
    leaked = [ref().request_id for ref in alive if ref() is not None]
    assert not leaked, f"{len(leaked)} Sequence objects are still reachable, e.g. {leaked[:5]}"


def test_step_reports_each_scheduled_token_and_each_finish_once(tiny):
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=32, max_num_seqs=2))
    prompts = {engine.add_request([5 + i] * (2 + i), SamplingParams(max_tokens=3 + i)): i for i in range(3)}
    tokens = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        out = engine.step()
        assert out.trace is None and not engine.traces, "keep_traces=0 (the default) records no trace"
        rids = [t.request_id for t in out.new_tokens]
        assert len(rids) == len(set(rids)) <= 2, f"one token per scheduled request, at most 2 slots: {rids}"
        for rid, completion, token, _ in out.new_tokens:
            assert completion == 0, f"n = 1: every token is completion 0's, got completion {completion}"
            tokens[rid].append(token)
        for seq in out.finished:
            assert seq.output_token_ids == tokens[seq.request_id], (
                f"request {seq.request_id}: the stream {tokens[seq.request_id]} differs from its final "
                f"tokens {seq.output_token_ids}")
            want = generate_with_cache(tiny, seq.prompt_token_ids, seq.params).token_ids
            assert seq.output_token_ids == want, first_difference(seq.output_token_ids, want)
    assert all(len(t) == 3 + prompts[rid] for rid, t in tokens.items()), f"token counts: {tokens}"


def test_keep_traces(tiny):
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6)
    every = LLM.from_model(tiny, num_blocks=32, block_size=4)  # LLM traces every step of a call, for its pictures
    every.generate(prompts, params, use_tqdm=False)
    assert [t.step for t in every.traces] == list(range(6)), (
        f"2 prompts of 6 tokens in 2 slots take 6 steps, got traces of steps {[t.step for t in every.traces]}")
    assert not every.engine.traces, "the engine itself keeps none (keep_traces=0, the one default)"

    def run(engine: Engine, trace: bool) -> list:
        for p in prompts:
            engine.add_request(p, params)
        outs = []
        while engine.has_unfinished():
            outs.append(engine.step(trace=trace))
        return outs

    last = Engine(tiny, EngineConfig(num_blocks=32, block_size=4, keep_traces=2))
    outs = run(last, trace=False)
    assert [t.step for t in last.traces] == [4, 5], f"keep_traces=2 keeps the last 2 steps: {list(last.traces)}"
    assert all(o.trace is not None for o in outs), "a kept trace is also the step's output"
    asked = Engine(tiny, EngineConfig(num_blocks=32, block_size=4))
    outs = run(asked, trace=True)
    assert [o.trace.step for o in outs] == list(range(6)) and not asked.traces, \
        "step(trace=True) builds the step's trace for the caller, and keep_traces=0 keeps none"
    for bad in (-1, 2.5, "all"):
        with pytest.raises(ValueError, match="keep_traces"):
            Engine(tiny, EngineConfig(keep_traces=bad))


def test_one_stop_rule_for_every_reason():
    params = SamplingParams(max_tokens=5, stop_token_ids=[9])
    eos = [2]
    cases = {  # (token, generated, prompt + generated, context) -> reason
        (2, 1, 4, 100): "stop",  # EOS
        (9, 1, 4, 100): "stop",  # a stop token, even at max_tokens
        (9, 5, 8, 100): "stop",
        (7, 5, 8, 100): "length",  # max_tokens
        (7, 2, 100, 100): "length",  # the context is full
        (7, 2, 99, 100): None,
    }
    for (token, generated, num_tokens, context), want in cases.items():
        got = finish_reason(token, generated, params, eos, num_tokens, context)
        assert got == want, (f"token {token}, {generated} generated, {num_tokens} of {context} context "
                             f"tokens: want {want!r}, got {got!r}")
    ignoring = SamplingParams(max_tokens=5, ignore_eos=True)
    assert finish_reason(2, 1, ignoring, eos, 4, 100) is None, "ignore_eos must not stop at EOS"


def test_token_times_stamp_every_output_token():
    from minicb import LLM, SamplingParams
    from minicb.model import random_model

    llm = LLM.from_model(random_model(seed=3), block_size=4, max_num_seqs=2, enable_chunked_prefill=True,
                         max_num_batched_tokens=4)
    outs = llm.generate([[5, 6, 7, 8, 9, 10, 11], [12, 13]], SamplingParams(max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    for o in outs:
        times = o.metrics.token_times
        assert len(times) == len(o.token_ids) == 5, f"prompt {o.index}: {len(times)} stamps for {len(o.token_ids)} tokens"
        assert times[0] == o.metrics.first_token_time and times[-1] == o.metrics.finish_time, (
            f"prompt {o.index}: the first and last stamps must be the first-token and finish times: {times}, "
            f"{o.metrics.first_token_time}, {o.metrics.finish_time}")
        assert all(gap > 0 for gap in o.metrics.inter_token_latencies), f"prompt {o.index}: gaps {o.metrics.inter_token_latencies}"


def test_a_lookup_that_leaves_nothing_to_compute_is_an_error_not_a_hang():
    # A cache lookup must leave the last token to compute. One that does not would leave
    # the request with nothing to schedule at the head of the queue, forever; the
    # scheduler says so instead, and changes nothing.
    from minicb.block_allocator import BlockAllocator
    from minicb.scheduler import Scheduler, Sequence

    class EverythingCached(BlockAllocator):
        def num_cached_tokens(self, token_ids):
            return len(token_ids)

    scheduler = Scheduler(EverythingCached(8, 4), max_num_seqs=2, max_model_len=64, eos_token_ids=[2])
    scheduler.add(Sequence(0, [5, 6, 7], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="3 of request 0's 3 tokens cached"):
        scheduler.schedule()
    assert [seq.seq_id for seq in scheduler.waiting] == [0] and scheduler.allocator.num_free_blocks == 8
