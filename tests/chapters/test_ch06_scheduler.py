"""Chapter 06, the scheduler on its own: admission, eviction, refill, preemption.

Plain Python, no model: we play the engine's part by hand, feeding made-up
tokens, and check who runs when. The end-to-end checks against chapter 01's
outputs are in test_ch06_engine.py.
"""
import pytest

from minicb import impl
from minicb.block_allocator import BlockAllocator
from minicb.sampling import SamplingParams

# Each test runs the graded method of its own task, the reference for the others (conftest.py).
GRADED_MODULE = "scheduler"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")
EOS = 2


def sched():
    """The scheduler module under test (looked up per test: the fixture above may swap it)."""
    return impl.load("scheduler")


def make(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=256, budget=2048, watermark=0.0):
    return sched().Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs, max_model_len, [EOS],
                             max_num_batched_tokens=budget, watermark=watermark)


def seq(rid, prompt_len, max_tokens=8, n=1):
    """A request of `prompt_len` tokens. With n > 1, give it ids from s.new_seq_id() (its
    forked completions take theirs from the same counter)."""
    q = sched().Sequence(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, n=n))
    q.sibling_generators = [None] * (n - 1)  # the engine's generators for completions 1 .. n - 1 (greedy: None)
    return q


def ids(seqs) -> list[int]:
    return [q.seq_id for q in seqs]


def sampled_for(out, token=7) -> list[list[int]]:
    """What the engine samples after a step: nothing for a chunk that does not finish its
    prompt, one token for a sequence that computed its last token, and n for a request whose
    n completions fork now."""
    return [[token] * (1 + q.siblings_to_come) if q.num_computed_tokens + out.num_new_tokens(q) == q.num_tokens
            else [] for q in out.sequences]


def run_step(s, token=7):
    out = s.schedule()
    result = s.postprocess(out, sampled_for(out, token), now=0.0)
    return out, result.finished


def cutting(scheduler_class):
    """The graded scheduler with chapter 08's rule: a prompt may be cut to what is left of the budget.
    Nothing else changes, so a request can run for steps with its prompt still being computed."""
    class Cutting(scheduler_class):
        def tokens_to_compute(self, num_remaining, budget, step_is_empty):
            return max(0, min(num_remaining, budget))
    return Cutting


@pytest.mark.task(1)
def test_admits_into_free_slots_and_batches_decodes_with_prefills():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq(i, prompt_len=3, max_tokens=2 + i))
    out, _ = run_step(s)
    assert (ids(out.prefills), ids(out.decodes)) == ([0, 1], []), (
        f"step 1 should prefill requests 0 and 1 into the 2 free slots; it prefilled {ids(out.prefills)} "
        f"and decoded {ids(out.decodes)}")
    assert ids(s.waiting) == [2], f"a third request must wait (only 2 slots); waiting is {ids(s.waiting)}"
    # Step 2: request 0 finishes (max_tokens 2), so its slot frees at the end of this step.
    out, finished = run_step(s)
    assert ids(out.decodes) == [0, 1], f"step 2 should decode requests 0 and 1, it decoded {ids(out.decodes)}"
    assert ids(finished) == [0], f"request 0 reaches max_tokens=2 in step 2; finished: {ids(finished)}"
    # Step 3: request 2 takes the freed slot while request 1 keeps decoding: one mixed step.
    out, _ = run_step(s)
    assert (ids(out.decodes), ids(out.prefills)) == ([1], [2]), (
        f"step 3 should refill request 0's slot with request 2 while request 1 decodes (one mixed step); "
        f"it decoded {ids(out.decodes)} and prefilled {ids(out.prefills)}")
    assert out.prefills[0].slot == 0, f"the refill goes into slot 0, which request 0 left; got slot {out.prefills[0].slot}"


@pytest.mark.task(2)
def test_finished_sequences_free_their_blocks_at_once():
    s = make(num_blocks=8, block_size=4, max_num_seqs=4)
    s.add(seq(0, prompt_len=5, max_tokens=1))
    out, finished = run_step(s)
    assert ids(finished) == [0] and finished[0].finish_reason == "length", (
        f"request 0 (max_tokens=1) must finish with 'length' after its first token; finished "
        f"{[(q.seq_id, q.finish_reason) for q in finished]}")
    assert s.allocator.num_free_blocks == 8, (f"a finished sequence must return every block at once: "
                                              f"{s.allocator.num_free_blocks} of 8 are free")
    s.add(seq(1, prompt_len=2, max_tokens=5))
    _, finished = run_step(s, token=EOS)
    got = [(q.seq_id, q.finish_reason, q.output_token_ids) for q in finished]
    assert got == [(1, "stop", [EOS])], f"EOS must finish request 1 with 'stop', keeping the EOS token; got {got}"


@pytest.mark.task(3)
def test_preempts_newest_and_requeues_it_first():
    # 4 blocks of 2 tokens. Two sequences with 3-token prompts take 2 blocks each;
    # the first decode step fits (slots 4 of 4), the next needs a new block each.
    s = make(num_blocks=4, block_size=2, max_num_seqs=2)
    s.add(seq(0, prompt_len=3, max_tokens=5))
    s.add(seq(1, prompt_len=3, max_tokens=5))
    run_step(s)  # prefill both (positions 0-2 each)
    out, _ = run_step(s)  # decode at position 3: still inside block 2 of each
    assert out.preempted == [], f"position 3 fits in each request's second block; preempted {out.preempted}"
    out, _ = run_step(s)  # position 4 needs a third block each: only the oldest gets one
    assert out.preempted == [1], f"the newest request must be preempted, got {out.preempted}"
    assert ids(out.decodes) == [0], f"only request 0 still decodes after the preemption; decodes {ids(out.decodes)}"
    front = s.waiting[0] if s.waiting else None
    assert front is not None and (front.seq_id, front.num_computed_tokens) == (1, 0), (
        f"the preempted request 1 must wait at the front of the queue with nothing computed; the queue is "
        f"{[(q.seq_id, q.num_computed_tokens) for q in s.waiting]} as (id, num_computed_tokens)")
    assert front.output_token_ids == [7, 7], (f"outputs so far are kept for the recompute: want [7, 7], "
                                              f"got {front.output_token_ids}")


@pytest.mark.task(3)
def test_a_request_that_can_never_finish_is_rejected_up_front():
    # The engine asks check_request before it queues anything (Engine.check_request); it must refuse:
    s = make(num_blocks=4, block_size=4)
    too_long, empty, whole_context = seq(0, prompt_len=10, max_tokens=20), seq(1, prompt_len=0), seq(2, prompt_len=8)
    with pytest.raises(sched().RequestRejected, match="4 blocks"):
        s.check_request(too_long.prompt_token_ids, too_long.params)
    with pytest.raises(sched().RequestRejected, match="empty"):
        s.check_request(empty.prompt_token_ids, empty.params)
    with pytest.raises(sched().RequestRejected, match="context"):
        make(max_model_len=8).check_request(whole_context.prompt_token_ids, whole_context.params)
    assert not s.has_unfinished(), "checking a request queues nothing"
    # The boundary: a request that needs the whole pool (10 + 6 tokens = 4 blocks of 4) is
    # accepted, and alone it grows into the last block and finishes without a preemption.
    s.add(seq(3, prompt_len=10, max_tokens=6))
    finished, preempted = [], []
    for _ in range(6):
        out, done = run_step(s)
        finished, preempted = finished + done, preempted + out.preempted
    assert [q.seq_id for q in finished] == [3], f"finished {[q.seq_id for q in finished]}, want [3]"
    assert preempted == [] and s.allocator.num_free_blocks == 4, (
        f"alone, it must finish without preemption and free all 4 blocks; preempted {preempted}, "
        f"{s.allocator.num_free_blocks} blocks free")


@pytest.mark.task(1)
def test_token_budget_caps_prefill_but_never_starves():
    s = make(num_blocks=64, max_num_seqs=4, budget=10)
    for i in range(3):
        s.add(seq(i, prompt_len=6))
    out, _ = run_step(s)
    assert ids(out.prefills) == [0], (f"a budget of 10 tokens fits one 6-token prefill, not two; "
                                      f"prefilled {ids(out.prefills)}")
    s2 = make(num_blocks=64, budget=4)
    s2.add(seq(0, prompt_len=9))
    out, _ = run_step(s2)
    assert ids(out.prefills) == [0], (f"a 9-token prompt over the 4-token budget still runs when the step has "
                                      f"nothing else to do; prefilled {ids(out.prefills)}")


@pytest.mark.task(1)
def test_nobody_overtakes_the_head_of_the_queue():
    # 6 blocks of 4 tokens. After its first decode, request 0 (8 + 1 tokens) holds 3
    # blocks and 3 are free. Request 1 (17 tokens) needs 5, so it waits; request 2
    # (2 tokens) would fit in 1 block, but it must wait behind request 1.
    s = make(num_blocks=6, block_size=4, max_num_seqs=4)
    s.add(seq(0, prompt_len=8, max_tokens=8))
    run_step(s)
    s.add(seq(1, prompt_len=17, max_tokens=1))
    s.add(seq(2, prompt_len=2, max_tokens=1))
    out, _ = run_step(s)
    assert ids(out.prefills) == [], (f"request 1 needs 5 blocks and only 4 are free, so it waits, and request 2 "
                                     f"must not overtake it (FIFO); prefilled {ids(out.prefills)}")
    assert ids(s.waiting) == [1, 2], f"the queue must stay [1, 2], got {ids(s.waiting)}"


@pytest.mark.task(1)
def test_the_watermark_is_kept_free_while_others_run():
    # 20 blocks of 4, watermark 10% = 2 blocks. Request 0 runs with 1 block; 19 are free.
    s = make(num_blocks=20, block_size=4, max_num_seqs=4, watermark=0.1)
    assert s.watermark_blocks == 2
    s.add(seq(0, prompt_len=3, max_tokens=8))
    run_step(s)
    s.add(seq(1, prompt_len=4 * 18, max_tokens=1))  # 18 blocks: fits the 19 free, not 19 - 2
    out, _ = run_step(s)
    assert ids(out.prefills) == [], (f"with others running, admission must leave watermark_blocks = 2 free: "
                                     f"request 1 needs 18 of 19 free blocks, so it waits; prefilled "
                                     f"{ids(out.prefills)}")
    # Alone, the same request is admitted: the watermark protects running requests only.
    lone = make(num_blocks=20, block_size=4, max_num_seqs=4, watermark=0.1)
    lone.add(seq(1, prompt_len=4 * 19, max_tokens=1))  # 19 of 20 blocks, with nothing running
    out, _ = run_step(lone)
    assert ids(out.prefills) == [1], (f"with nothing running the watermark does not apply: a request needing "
                                      f"19 of 20 free blocks is admitted; prefilled {ids(out.prefills)}")


@pytest.mark.task(2)
def test_a_full_context_finishes_with_length():
    s = make(max_model_len=6)
    s.add(seq(0, prompt_len=4, max_tokens=10))
    finished = []
    for _ in range(3):
        if s.has_unfinished():
            finished += run_step(s)[1]
    got = [(q.seq_id, q.finish_reason, len(q.output_token_ids)) for q in finished]
    assert got == [(0, "length", 2)], (f"a 4-token prompt in a 6-token context gets 2 tokens and ends with "
                                       f"'length' (max_tokens is 10); got (id, reason, tokens) {got}")
    assert s.allocator.num_free_blocks == 16, f"its blocks must be free: {s.allocator.num_free_blocks} of 16"


@pytest.mark.task(2)
def test_abort_frees_everything():
    s = make(max_num_seqs=1)
    s.add(seq(0, prompt_len=3))
    s.add(seq(1, prompt_len=3))
    run_step(s)
    reasons = [s.abort(0).finish_reason, s.abort(1).finish_reason]  # 0 running, 1 waiting
    assert reasons == ["abort", "abort"], f"aborted requests end with 'abort', got {reasons}"
    assert not s.has_unfinished() and s.allocator.num_free_blocks == 16, (
        f"after aborting both, nothing may wait or run and all 16 blocks be free: waiting {ids(s.waiting)}, "
        f"running {ids(s.running)}, {s.allocator.num_free_blocks} free")


# ---- the one loop: every scheduled sequence in num_scheduled, one budget for all ---------------


@pytest.mark.task(1)
def test_every_admitted_request_has_its_tokens_in_num_scheduled():
    s = make(max_num_seqs=3)
    s.add(seq(0, prompt_len=3))
    s.add(seq(1, prompt_len=5))
    out = s.schedule()
    assert (ids(out.prefills), out.admitted) == ([0, 1], [0, 1]), (
        f"both prompts should be admitted as prefills; prefills {ids(out.prefills)}, admitted {out.admitted}")
    assert out.num_scheduled == {0: 3, 1: 5}, (f"num_scheduled must give every scheduled sequence its tokens "
                                               f"(self.put does it): want {{0: 3, 1: 5}}, got {out.num_scheduled}")
    held = [(q.num_computed_tokens, s.allocator.num_tokens(q.seq_id)) for q in out.prefills]
    assert held == [(0, 3), (0, 5)], (f"admitted with nothing computed yet and blocks for every token: "
                                      f"(num_computed_tokens, tokens held) {held}, want [(0, 3), (0, 5)]")


@pytest.mark.task(3)
def test_every_running_request_has_its_token_in_num_scheduled():
    s = make(max_num_seqs=3)
    s.add(seq(0, prompt_len=3))
    s.add(seq(1, prompt_len=5))
    run_step(s)
    out = s.schedule()
    assert (ids(out.decodes), ids(out.prefills)) == ([0, 1], []), (
        f"step 2 decodes both, oldest first; decodes {ids(out.decodes)}, prefills {ids(out.prefills)}")
    assert out.num_scheduled == {0: 1, 1: 1}, f"a decode computes 1 token: num_scheduled {out.num_scheduled}"
    held = [s.allocator.num_tokens(q) for q in (0, 1)]
    assert held == [4, 6], f"grow must give each its newest token's slot: tokens held {held}, want [4, 6]"


@pytest.mark.task(3)
def test_decodes_come_before_a_prompt_still_in_chunks():
    # Under chapter 08's rule a running request can still be computing its prompt. The decodes go
    # first: with a budget of 4, two decodes take 2 and the prompt's next chunk gets the other 2.
    s = cutting(sched().Scheduler)(BlockAllocator(32, 4), 3, 256, [EOS], max_num_batched_tokens=4, watermark=0.0)
    for rid in (0, 1):
        s.add(seq(rid, prompt_len=2, max_tokens=8))
    run_step(s)  # both prompts in one chunk each: they decode from now on
    s.add(seq(2, prompt_len=12, max_tokens=4))
    out, _ = run_step(s)  # the two decodes, and a first chunk of 2 of the long prompt
    out, _ = run_step(s)
    got = {q.seq_id: out.num_new_tokens(q) for q in out.sequences}
    assert got == {0: 1, 1: 1, 2: 2}, (f"running requests: decodes first (1 token each), then the prompt still in "
                                       f"chunks with what is left of the budget of 4; tokens scheduled {got}")
    assert ids(out.decodes) == [0, 1] and ids(out.prefills) == [2], (ids(out.decodes), ids(out.prefills))


@pytest.mark.task(3)
def test_grow_records_the_copy_on_write_of_a_shared_last_block():
    # n = 2 forks after the prompt: both completions share its partial last block. The first to
    # write its next token into it needs its own copy, and the engine must copy the K/V before
    # the forward: grow records the allocator's (src, dst) in out.block_copies.
    s = make(num_blocks=16, block_size=4, max_num_seqs=2)
    s.add(seq(s.new_seq_id(), prompt_len=6, max_tokens=4, n=2))  # 6 tokens: block 1 holds 2 of 4
    run_step(s)  # the prompt, then the fork: both hold blocks [b0, b1]
    shared = s.allocator.block_table(s.running[0].seq_id)[-1]
    out, _ = run_step(s)
    assert len(out.block_copies) == 1 and out.block_copies[0][0] == shared, (
        f"one completion must copy the shared partial block {shared} before writing into it (the other then "
        f"holds it alone); out.block_copies is {out.block_copies}: record each pair allocator.append returns")


@pytest.mark.task(3)
def test_a_decode_waits_when_the_budget_is_spent():
    # A 2-token prompt with n = 3 on a budget of 2: its prompt fits, and it forks into
    # three completions. From then on three sequences decode, and only two tokens fit a step.
    s = make(max_num_seqs=4, budget=2)
    s.add(seq(s.new_seq_id(), prompt_len=2, max_tokens=3, n=3))
    out, _ = run_step(s)
    assert ids(s.running) == [0, 1, 2], f"step 1 computes the prompt and forks: running {ids(s.running)}"
    out = s.schedule()
    assert (ids(out.decodes), out.num_scheduled) == ([0, 1], {0: 1, 1: 1}), (
        f"a budget of 2 tokens decodes the two oldest of three; decodes {ids(out.decodes)}, "
        f"num_scheduled {out.num_scheduled}")
    waiting = s.running[2]
    assert (waiting.seq_id, waiting.status, out.preempted) == (2, "running", []), (
        "the third waits for budget in its slot: it is neither preempted nor requeued")
    assert s.allocator.num_tokens(2) == 2, (f"a sequence that waits this step gets no new token slot: it holds "
                                            f"{s.allocator.num_tokens(2)} tokens, want 2")
    finished = s.postprocess(out, sampled_for(out), now=0.0).finished
    for _ in range(3):
        finished += run_step(s)[1]
    got = sorted((q.seq_id, len(q.output_token_ids)) for q in finished)
    assert got == [(0, 3), (1, 3), (2, 3)], (f"nobody starves: once the oldest finish, the third decodes too; "
                                             f"finished (id, tokens) {got}")


@pytest.mark.task(1)
def test_a_long_prompt_waits_behind_decodes_and_runs_in_an_empty_step():
    s = make(num_blocks=64, max_num_seqs=4, budget=4)
    s.add(seq(0, prompt_len=2, max_tokens=2))
    run_step(s)
    s.add(seq(1, prompt_len=9, max_tokens=1))
    out, _ = run_step(s)  # request 0 decodes (1 token); 9 tokens do not fit the 3 left
    assert (ids(out.decodes), ids(out.prefills)) == ([0], []), (
        f"a 9-token prompt does not fit what one decode leaves of a budget of 4, so it waits; decodes "
        f"{ids(out.decodes)}, prefills {ids(out.prefills)}")
    out, _ = run_step(s)  # request 0 finished: the step is empty, so the whole prompt runs
    assert (ids(out.prefills), out.num_scheduled) == ([1], {1: 9}), (
        f"in a step with nothing else to compute a prompt runs whole, over the budget, or it would never run; "
        f"prefills {ids(out.prefills)}, num_scheduled {out.num_scheduled}")


@pytest.mark.task(1)
def test_admission_keeps_slots_for_the_siblings_of_every_running_request():
    # 4 slots. A request with n = 3 needs 3 of them: its prompt is computed once, and its two
    # siblings fork from it when it is done. In the same step a second request takes the 4th
    # slot; a third must wait, though only 2 sequences run yet.
    s = make(max_num_seqs=4)
    for n in (3, 1, 1):
        s.add(seq(s.new_seq_id(), prompt_len=3, max_tokens=2, n=n))
    out = s.schedule()
    assert out.admitted == [0, 1], (f"slots promised: 3 for request 0 (n = 3) + 1 for request 1 = 4, so request 2 "
                                    f"waits; admitted {out.admitted}")
    s.postprocess(out, sampled_for(out), now=0.0)
    assert sorted(q.slot for q in s.running) == [0, 1, 2, 3], "the forked siblings take the slots kept for them"
    # The same with chapter 08's rule, under which a prompt runs for several steps before it forks:
    # a running request still computing its prompt holds its siblings' slots all that time.
    s = cutting(sched().Scheduler)(BlockAllocator(16, 4), 4, 256, [EOS], max_num_batched_tokens=5, watermark=0.0)
    for prompt_len, n in ((6, 2), (2, 2), (2, 1)):
        s.add(seq(s.new_seq_id(), prompt_len=prompt_len, max_tokens=3, n=n))
    admitted = []
    for _ in range(8):
        if s.has_unfinished():
            out, _ = run_step(s)
            admitted.append(out.admitted)
            assert len(s.running) <= 4, f"more sequences run than there are slots: {ids(s.running)}"
    assert admitted[:5] == [[0], [1], [], [], [2]], (
        f"request 0 (6 tokens, n = 2) is cut 5 + 1; in step 2 request 1 (n = 2) is admitted, and request 2 "
        f"must wait: request 0, still computing its prompt, keeps a slot for its sibling. The four completions "
        f"then hold every slot until they finish after step 4. Admitted per step {admitted[:5]}, "
        f"want [[0], [1], [], [], [2]]")
    assert not s.has_unfinished(), "every request must finish"


@pytest.mark.task(2)
def test_postprocess_forks_the_completions_of_a_finished_prompt():
    s = make(max_num_seqs=4)
    parent = seq(s.new_seq_id(), prompt_len=6, max_tokens=4, n=3)
    s.add(parent)
    out = s.schedule()
    result = s.postprocess(out, [[7, EOS, 9]], now=1.5)  # one token per completion, in completion order
    finished = result.finished
    got = [(q.completion, q.request_id, q.output_token_ids) for q in out.forked]
    assert got == [(1, 0, [EOS]), (2, 0, [9])], (
        f"postprocess must fork n - 1 = 2 completions (self.fork) and give each its own token: "
        f"(completion, request_id, outputs) {got}, want [(1, 0, [{EOS}]), (2, 0, [9])]")
    assert parent.output_token_ids == [7] and parent.siblings_to_come == 0, (
        f"the parent keeps the first token and has forked: outputs {parent.output_token_ids}, "
        f"siblings to come {parent.siblings_to_come}")
    assert [(q.completion, q.finish_reason) for q in finished] == [(1, "stop")], (
        f"completion 1 sampled EOS: it finishes in the step it is born; finished "
        f"{[(q.completion, q.finish_reason) for q in finished]}")
    times = [q.first_token_time for q in [parent] + out.forked]
    assert times == [1.5] * 3, f"every completion's first token came at now=1.5: {times}"
    # What postprocess returns is all the engine learns of the step: every token appended, in order.
    told = [(q.completion, token) for q, token in result.new_tokens]
    assert told == [(0, 7), (1, EOS), (2, 9)] and result.forked == out.forked, (
        f"the StepResult must list each appended token as (completion, token), the parent's first, then each "
        f"forked completion's (use result.append); got {told}, forked {[q.completion for q in result.forked]}")
    assert [q.num_computed_tokens for q in [parent] + out.forked] == [6] * 3, "all share the computed prompt"
    assert [q.completion for q in s.running] == [0, 2], (
        f"running afterwards: the parent and completion 2 (completion 1 finished); got "
        f"{[q.completion for q in s.running]}")


@pytest.mark.task(2)
def test_postprocess_of_a_chunk_samples_nothing():
    s = cutting(sched().Scheduler)(BlockAllocator(16, 4), 2, 256, [EOS], max_num_batched_tokens=4, watermark=0.0)
    s.add(seq(0, prompt_len=10, max_tokens=3))
    computed = []
    for _ in range(3):
        out = s.schedule()
        result = s.postprocess(out, sampled_for(out), now=0.0)
        q = out.prefills[0]
        computed.append((q.num_computed_tokens, list(q.output_token_ids)))
    assert computed == [(4, []), (8, []), (10, [7])], (
        f"a 10-token prompt in chunks of 4, 4 and 2: each chunk counts as computed, and only the last one "
        f"gets a token; (num_computed_tokens, outputs) per step {computed}")
    assert result.finished == [] and out.prefills[0].first_token_time == 0.0, "its first token came with the last chunk"
    assert [(q.seq_id, token) for q, token in result.new_tokens] == [(0, 7)], (
        f"only the last chunk's token is appended and reported: {result.new_tokens}")
