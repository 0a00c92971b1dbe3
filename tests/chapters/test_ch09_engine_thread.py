"""Chapter 09: the engine thread's three functions, on their own (minicb/serve/loop.py).

Task 1, group_step: one StepOutput becomes each handle's events. Built by hand
first (unknown ids, finished completions, a request with n completions that
stays until all n have ended), then on the tiny engine: every handle's tokens,
collected step by step through group_step, must equal `LLM.generate`'s, for
greedy and for n = 3 seeded requests.

Task 2, take_commands and apply_commands: the inbox is drained before each step,
submits then aborts apply in order, an abort frees the request's blocks at once
(before any further step), one completion of n is aborted alone (completion 0
too), and aborting what already finished is harmless.

Each test grades one task, with the reference standing in for the other (the
one_task fixture in conftest.py). Every wait is bounded: a take_commands that
blocks when it must not fails in seconds instead of hanging.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from minicb import LLM, SamplingParams, impl
from minicb.engine import NewToken, StepOutput
from minicb.model import random_model
from minicb.naive import first_difference
from minicb.scheduler import Sequence
from minicb.serve.events import Failed, Finished, RequestHandle, Token

GRADED_MODULE = "serve.loop"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=9)


_ids = iter(range(10**6))


def handle(prompt=(5, 6, 7), params=None, arrival=None) -> RequestHandle:
    """A handle as EngineLoop.submit makes it (its asyncio queue is never used here)."""
    h = RequestHandle(list(prompt), params or SamplingParams(max_tokens=4), asyncio.Queue(), id=next(_ids))
    if arrival is not None:
        h.arrival = arrival
    return h


def finished(request_id: int, completion: int, reason: str) -> Sequence:
    """Completion `completion` of the request add_request called `request_id`, finished, as the engine hands it out.

    Completions 1 .. n - 1 are sequences of their own, with seq_ids of their own:
    only seq.request_id and seq.completion name them to the caller.
    """
    own_id = request_id if completion == 0 else 1000 * request_id + completion
    seq = Sequence(own_id, [1, 2], SamplingParams(max_tokens=2), completion=completion, request_id=request_id)
    seq.finish_reason = reason
    return seq


def tokens(*triples) -> list[NewToken]:
    """(request_id, completion, token) triples -> the NewTokens of a StepOutput."""
    return [NewToken(*t) for t in triples]


def n_of(n: int, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, seed=3, max_tokens=max_tokens)


def live_completions(engine, h) -> list[int]:
    """The completions of h's request that the engine still has (waiting or running)."""
    return sorted(s.completion for s in engine.sequences.values() if s.request_id == h.request_id)


def engine_for(model, **config):
    return LLM.from_model(model, **{"block_size": 4, "num_blocks": 64, "max_num_seqs": 4, **config}).engine


def kinds(commands) -> list:
    """("add", handle, None) -> ("add", handle.id, None): a readable command list for failure messages."""
    return [(kind, None if h is None else h.id, c) for kind, h, c in commands] if isinstance(commands, list) else commands


def show(mapping) -> dict:
    """Handles by their id, for failure messages: {handle: events} -> {"handle 3": events}; owners likewise."""
    if not isinstance(mapping, dict):
        return mapping
    return {(f"handle {k.id}" if isinstance(k, RequestHandle) else k):
            (f"handle {v.id}" if isinstance(v, RequestHandle) else v) for k, v in mapping.items()}


def show_aborted(applied) -> list:
    return [(f"handle {h.id}", c) for h, c in applied.aborted]


def within(seconds: float, function, *args):
    """function(*args) on a thread; fail if it has not returned in `seconds` (it blocked)."""
    result, error = [], []

    def run():
        try:
            result.append(function(*args))
        except BaseException as e:  # noqa: BLE001  # handed back to the test
            error.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if error:
        raise error[0]
    assert not thread.is_alive(), f"{function.__name__}{args[1:]} was still blocked after {seconds} s"
    return result[0]


# ---- task 1: group_step --------------------------------------------------------------------------


@pytest.mark.task(1)
def test_tokens_are_grouped_per_handle_in_the_steps_order():
    group_step = impl.load("serve.loop").group_step
    a, b = handle(params=n_of(2)), handle()
    owners = {10: a, 11: b}
    out = StepOutput(new_tokens=tokens((11, 0, 7), (10, 0, 3), (10, 1, 4), (99, 0, 1)))  # 99: nobody's
    got = group_step(out, owners)
    want = {a: [Token(0, 3), Token(1, 4)], b: [Token(0, 7)]}
    assert got == want, f"group_step gave {show(got)}, want {show(want)} (request 99 is not in owners: skip it)"
    assert owners == {10: a, 11: b}, f"no request finished, yet owners became {show(owners)}"
    assert group_step(StepOutput(), owners) == {}, "an empty step gives no events, and no handle in the result"


@pytest.mark.task(1)
def test_a_finished_completion_ends_after_its_last_token_and_a_finished_request_leaves_owners():
    group_step = impl.load("serve.loop").group_step
    a, b = handle(params=n_of(2)), handle()
    owners = {10: a, 11: b}
    out = StepOutput(new_tokens=tokens((10, 0, 3), (10, 1, 4), (11, 0, 9)),
                     finished=[finished(10, 1, "length"), finished(11, 0, "stop"), finished(77, 0, "stop")])
    got = group_step(out, owners)
    want = {a: [Token(0, 3), Token(1, 4), Finished(1, "length")], b: [Token(0, 9), Finished(0, "stop")]}
    assert got == want, f"group_step gave {show(got)}, want {show(want)}"
    assert owners == {10: a}, (f"request 11 (n = 1) ended and must leave owners; request 10 (n = 2) still runs "
                               f"its completion 0 and must stay (77 was never there); owners: {show(owners)}")
    assert (a.ended, b.ended) == ({1}, {0}), f"ended completions: a {a.ended}, b {b.ended}; want {{1}} and {{0}}"


@pytest.mark.task(1)
def test_a_request_with_n_completions_stays_in_owners_until_all_n_have_ended():
    group_step = impl.load("serve.loop").group_step
    a, b = handle(params=n_of(3)), handle(params=n_of(2))
    b.ended = {1}  # b's completion 1 was aborted earlier (a stop string): only its completion 0 runs
    owners = {4: a, 5: b}
    # Request 4 computed its prompt in this step: completions 0, 1, 2 each get a first token, and
    # completion 1 ends at once (EOS).
    out = StepOutput(new_tokens=tokens((4, 0, 40), (4, 1, 41), (4, 2, 42), (5, 0, 50)),
                     finished=[finished(4, 1, "stop")])
    got = group_step(out, owners)
    want = {a: [Token(0, 40), Token(1, 41), Token(2, 42), Finished(1, "stop")], b: [Token(0, 50)]}
    assert got == want, f"step 1: group_step gave {show(got)}, want {show(want)}"
    assert owners == {4: a, 5: b}, (f"after step 1 request 4 still runs completions 0 and 2: it must stay in "
                                    f"owners until all 3 have ended; owners: {show(owners)}")
    # The next step: completions 0 and 2 of request 4 go on; both end, and so does b's last one.
    out = StepOutput(new_tokens=tokens((4, 0, 43), (4, 2, 44), (5, 0, 51)),
                     finished=[finished(4, 2, "length"), finished(5, 0, "length"), finished(4, 0, "length")])
    got = group_step(out, owners)
    want = {a: [Token(0, 43), Token(2, 44), Finished(2, "length"), Finished(0, "length")],
            b: [Token(0, 51), Finished(0, "length")]}
    assert got == want, (f"step 2: group_step gave {show(got)}, want {show(want)} (a completion that has not "
                         f"ended keeps getting its tokens after a sibling's Finished)")
    assert owners == {}, (f"every completion of both requests has ended (b's completion 1 by an abort: it is in "
                          f"b.ended), so both must leave owners; owners: {show(owners)}")


@pytest.mark.task(1)
def test_the_engines_steps_through_group_step_give_generates_tokens(tiny):
    group_step = impl.load("serve.loop").group_step
    prompts = [[5, 17, 99, 3], [200, 201], [9] * 13, [33, 34, 35]]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=3),
              SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=9), SamplingParams(max_tokens=20)]
    engine = engine_for(tiny)
    handles = [handle(p, sp) for p, sp in zip(prompts, params)]
    owners = {}
    for h in handles:
        h.request_id = engine.add_request(h.prompt_token_ids, h.params)
        owners[h.request_id] = h
    tokens = [[[] for _ in range(h.params.n)] for h in handles]
    reasons = [[None] * h.params.n for h in handles]
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for h, events in group_step(engine.step(), owners).items():
            i = handles.index(h)
            for e in events:
                assert reasons[i][e.completion] is None, f"prompt {i} completion {e.completion}: an event after Finished"
                if isinstance(e, Token):
                    tokens[i][e.completion].append(e.token_id)
                else:
                    reasons[i][e.completion] = e.reason
    assert not owners, f"every request finished, yet owners still holds {show(owners)}"
    want = LLM.from_model(tiny, block_size=4, num_blocks=64, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    for i, w in enumerate(want):
        for c in w.outputs:
            assert tokens[i][c.index] == c.token_ids, (f"prompt {i} completion {c.index}: "
                                                       f"{first_difference(tokens[i][c.index], c.token_ids, ('group_step', 'generate'))}")
            assert reasons[i][c.index] == c.finish_reason, (f"prompt {i} completion {c.index}: finish "
                                                            f"{reasons[i][c.index]!r}, generate's {c.finish_reason!r}")


# ---- task 2: take_commands and apply_commands --------------------------------------------------------


@pytest.mark.task(2)
def test_take_commands_drains_the_whole_inbox_and_never_blocks_when_busy():
    take_commands = impl.load("serve.loop").take_commands
    inbox = queue.Queue()
    commands = [("add", handle(), None), ("abort", handle(), None), ("add", handle(), None)]
    for c in commands:
        inbox.put(c)
    got = within(5, take_commands, inbox, False)
    assert got == commands, f"take_commands(wait=False) took {kinds(got)}, want all three in order: {kinds(commands)}"
    assert inbox.empty(), "the inbox must be empty afterwards: an abort left in it waits a whole step"
    assert within(2, take_commands, inbox, False) == [], "an empty inbox with wait=False gives [] at once"


@pytest.mark.task(2)
def test_take_commands_waits_for_the_first_command_when_idle_then_takes_the_rest():
    take_commands = impl.load("serve.loop").take_commands
    inbox = queue.Queue()
    commands = [("add", handle(), None), ("abort", handle(), 0)]
    for c in commands:
        inbox.put(c)
    got = within(5, take_commands, inbox, True)
    assert got == commands, f"take_commands(wait=True) with two commands queued took {kinds(got)}, want {kinds(commands)}"
    late = ("add", handle(), None)
    threading.Timer(0.3, inbox.put, [late]).start()
    began = time.monotonic()
    got = within(5, take_commands, inbox, True)
    waited = time.monotonic() - began
    assert got == [late], f"take_commands(wait=True) on an empty inbox returned {kinds(got)}; it must wait for one"
    assert waited >= 0.2, f"it returned after {waited:.2f} s, before the command came (0.3 s)"


@pytest.mark.task(2)
def test_add_registers_completion_0_and_a_refused_add_fails_only_its_handle(tiny):
    apply_commands = impl.load("serve.loop").apply_commands
    engine, owners = engine_for(tiny), {}
    good, bad, other = handle(arrival=123.5), handle(prompt=[5] * 300), handle([8, 9])  # 300 tokens: never fits
    applied = apply_commands(engine, owners, [("add", good, None), ("add", bad, None), ("add", other, None)])
    assert not applied.stop and applied.aborted == [], f"nothing was stopped or aborted: {applied}"
    rids = [good.request_id, other.request_id]
    assert None not in rids, f"request_id must be set on every accepted handle: {rids}"
    assert owners == {rids[0]: good, rids[1]: other}, f"owners: {show(owners)}"
    assert engine.sequences[rids[0]].arrival_time == 123.5, "pass the handle's arrival time to add_request"
    assert engine.sequences[rids[1]].prompt_token_ids == [8, 9]
    assert list(applied.failed) == [bad] and len(applied.failed[bad]) == 1, f"failed: {applied.failed}"
    with pytest.raises(ValueError) as refused:
        engine.check_request(bad.prompt_token_ids, bad.params)
    want = Failed(f"{type(refused.value).__name__}: {refused.value}")
    assert applied.failed[bad] == [want], f"the refused add gets [{want}], the engine's complaint; got {applied.failed[bad]}"
    assert bad.request_id is None, f"a refused request has no engine id; it got {bad.request_id}"


@pytest.mark.task(2)
def test_an_abort_frees_the_blocks_before_the_next_step(tiny):
    loop_module = impl.load("serve.loop")
    engine, owners = engine_for(tiny), {}
    total = engine.allocator.num_blocks
    a, b = handle([5] * 9, SamplingParams(max_tokens=40, ignore_eos=True)), handle([6] * 5)
    loop_module.apply_commands(engine, owners, [("add", a, None), ("add", b, None)])
    for _ in range(3):
        loop_module.group_step(engine.step(), owners)
    used = total - engine.allocator.num_free_blocks
    assert used > 0, "the two running requests hold blocks"
    applied = loop_module.apply_commands(engine, owners, [("abort", a, None)])
    assert applied.aborted == [(a, 0)], f"aborted: {show_aborted(applied)}, want [(handle {a.id}, 0)]"
    rid = a.request_id
    assert rid not in owners and rid not in engine.sequences, "the aborted request must leave owners and the engine"
    assert engine.scheduler.running and all(s.request_id != rid for s in engine.scheduler.running)
    still = total - engine.allocator.num_free_blocks
    assert still < used, f"{used} blocks were used before the abort and {still} after: a's blocks must be free now"
    applied = loop_module.apply_commands(engine, owners, [("abort", b, None)])
    assert engine.allocator.num_free_blocks == total and not engine.has_unfinished(), (
        f"after aborting both, {total - engine.allocator.num_free_blocks} blocks are still used")


@pytest.mark.task(2)
def test_a_submit_then_its_abort_in_one_batch_and_aborts_of_finished_requests_are_harmless(tiny):
    loop_module = impl.load("serve.loop")
    engine, owners = engine_for(tiny), {}
    quick, gone = handle([5, 6], SamplingParams(max_tokens=1)), handle([7, 8, 9], n_of(2))
    applied = loop_module.apply_commands(engine, owners, [("add", quick, None), ("add", gone, None),
                                                          ("abort", gone, None)])
    # gone waited, so its completion 1 was never forked: the engine aborted completion 0 alone.
    assert applied.aborted == [(gone, 0)], (f"the abort after the add in the same batch: aborted "
                                            f"{show_aborted(applied)}, want [(handle {gone.id}, 0)], the one "
                                            f"completion the engine had")
    assert owners == {quick.request_id: quick}, (f"an abort of the whole request (completion None) leaves nothing "
                                                 f"of it to come, so it leaves owners; owners: {show(owners)}")
    assert len(engine.sequences) == 1, f"the engine still holds {len(engine.sequences)} sequences, want 1 (quick)"
    while engine.has_unfinished():
        loop_module.group_step(engine.step(), owners)
    assert owners == {}, "quick finished (max_tokens 1)"
    # The client hangs up after the answer is complete, or twice: nothing to abort, nothing raised.
    applied = loop_module.apply_commands(engine, owners, [("abort", quick, None), ("abort", quick, 0),
                                                          ("abort", gone, None)])
    assert applied.aborted == [] and not applied.failed, f"aborting finished requests did something: {applied}"
    # A request still in owners that the engine no longer has (it let go of it): no KeyError, nothing
    # aborted, and it leaves owners.
    late = handle([4, 4])
    loop_module.apply_commands(engine, owners, [("add", late, None)])
    engine.abort(late.request_id)
    applied = loop_module.apply_commands(engine, owners, [("abort", late, None)])
    assert applied.aborted == [] and owners == {}, f"aborted {show_aborted(applied)}, owners {show(owners)}"


@pytest.mark.task(2)
def test_one_completion_of_n_is_aborted_alone_and_stop_ends_the_batch(tiny):
    loop_module = impl.load("serve.loop")
    engine, owners = engine_for(tiny), {}
    h = handle([5, 6, 7], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True))
    loop_module.apply_commands(engine, owners, [("add", h, None)])
    for _ in range(2):
        loop_module.group_step(engine.step(), owners)
    assert live_completions(engine, h) == [0, 1, 2], "the engine should run 3 completions after the prompt's step"
    applied = loop_module.apply_commands(engine, owners, [("abort", h, 1)])
    assert applied.aborted == [(h, 1)], f"abort of completion 1 alone: aborted {show_aborted(applied)}"
    live = live_completions(engine, h)
    assert live == [0, 2], f"completions 0 and 2 keep running; the engine has {live}"
    # A stop string in completion 0 stops completion 0 alone, like any other.
    applied = loop_module.apply_commands(engine, owners, [("abort", h, 0)])
    assert applied.aborted == [(h, 0)], f"abort of completion 0 alone: aborted {show_aborted(applied)}"
    live = live_completions(engine, h)
    assert live == [2], f"completion 2 keeps running, and it alone; the engine has {live}"
    assert h.ended == {0, 1}, f"the aborted completions 0 and 1 have ended: handle.ended is {h.ended}"
    assert owners == {h.request_id: h}, f"completion 2 still runs, so the request stays in owners: {show(owners)}"
    got = loop_module.group_step(engine.step(), owners)
    assert [(type(e), e.completion) for e in got.get(h, [])] == [(Token, 2)], (
        f"after the aborts, a step gives the handle completion 2's token alone: {show(got)}")
    later = handle([1, 2])
    applied = loop_module.apply_commands(engine, owners, [("abort", h, 2), ("stop", None, None),
                                                          ("add", later, None)])
    assert applied.stop, "a stop command must set applied.stop"
    assert applied.aborted == [(h, 2)], f"the abort before the stop: aborted {show_aborted(applied)}"
    assert owners == {}, (f"all 3 completions have ended (each aborted on its own), so the request leaves owners: "
                          f"{show(owners)}")
    assert later.request_id is None and not engine.has_unfinished(), "nothing after a stop is applied"
