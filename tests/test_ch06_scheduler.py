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
pytestmark = pytest.mark.usefixtures("one_scheduler_task")
EOS = 2


def sched():
    """The scheduler module under test (looked up per test: the fixture above may swap it)."""
    return impl.load("scheduler")


def make(num_blocks=16, block_size=4, max_num_seqs=2, max_model_len=256, budget=2048, watermark=0.0):
    return sched().Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs, max_model_len, [EOS],
                             max_num_batched_tokens=budget, watermark=watermark)


def seq(rid, prompt_len, max_tokens=8):
    return sched().Sequence(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def run_step(s, token=7):
    out = s.schedule()
    finished = s.postprocess(out, [token] * len(out.sequences), now=0.0)
    return out, finished


@pytest.mark.task(1)
def test_admits_into_free_slots_and_batches_decodes_with_prefills():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq(i, prompt_len=3, max_tokens=2 + i))
    out, _ = run_step(s)
    assert [q.request_id for q in out.prefills] == [0, 1] and out.decodes == []
    assert [q.request_id for q in s.waiting] == [2], "a third request must wait: only 2 slots"
    # Step 2: request 0 finishes (max_tokens 2), so its slot frees at the end of this step.
    out, finished = run_step(s)
    assert [q.request_id for q in out.decodes] == [0, 1]
    assert [q.request_id for q in finished] == [0]
    # Step 3: request 2 takes the freed slot while request 1 keeps decoding: one mixed step.
    out, _ = run_step(s)
    assert [q.request_id for q in out.decodes] == [1] and [q.request_id for q in out.prefills] == [2]
    assert out.prefills[0].slot == 0, "the refill goes into the slot request 0 left"


@pytest.mark.task(2)
def test_finished_sequences_free_their_blocks_at_once():
    s = make(num_blocks=8, block_size=4, max_num_seqs=4)
    s.add(seq(0, prompt_len=5, max_tokens=1))
    out, finished = run_step(s)
    assert [q.request_id for q in finished] == [0] and finished[0].finish_reason == "length"
    assert s.allocator.num_free_blocks == 8, "a finished sequence must return every block"
    s.add(seq(1, prompt_len=2, max_tokens=5))
    _, finished = run_step(s, token=EOS)
    assert finished[0].finish_reason == "stop" and finished[0].output_token_ids == [EOS]


@pytest.mark.task(3)
def test_preempts_newest_and_requeues_it_first():
    # 4 blocks of 2 tokens. Two sequences with 3-token prompts take 2 blocks each;
    # the first decode step fits (slots 4 of 4), the next needs a new block each.
    s = make(num_blocks=4, block_size=2, max_num_seqs=2)
    s.add(seq(0, prompt_len=3, max_tokens=5))
    s.add(seq(1, prompt_len=3, max_tokens=5))
    run_step(s)  # prefill both (positions 0-2 each)
    out, _ = run_step(s)  # decode at position 3: still inside block 2 of each
    assert out.preempted == []
    out, _ = run_step(s)  # position 4 needs a third block each: only the oldest gets one
    assert out.preempted == [1], f"the newest request must be preempted, got {out.preempted}"
    assert [q.request_id for q in out.decodes] == [0]
    assert s.waiting[0].request_id == 1 and s.waiting[0].num_computed_tokens == 0
    assert s.waiting[0].output_token_ids == [7, 7], "outputs so far are kept for the recompute"


@pytest.mark.task(3)
def test_a_request_that_can_never_finish_is_rejected_up_front():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(sched().RequestRejected, match="4 blocks"):
        s.add(seq(0, prompt_len=10, max_tokens=20))
    with pytest.raises(sched().RequestRejected, match="empty"):
        s.add(seq(1, prompt_len=0))
    with pytest.raises(sched().RequestRejected, match="context"):
        make(max_model_len=8).add(seq(2, prompt_len=8))
    assert not s.has_unfinished(), "a rejected request must not be queued"
    # The boundary: a request that needs the whole pool (10 + 6 tokens = 4 blocks of 4) is
    # accepted, and alone it grows into the last block and finishes without a preemption.
    s.add(seq(3, prompt_len=10, max_tokens=6))
    finished, preempted = [], []
    for _ in range(6):
        out, done = run_step(s)
        finished, preempted = finished + done, preempted + out.preempted
    assert [q.request_id for q in finished] == [3], f"finished {[q.request_id for q in finished]}, want [3]"
    assert preempted == [] and s.allocator.num_free_blocks == 4, (preempted, s.allocator.num_free_blocks)


@pytest.mark.task(1)
def test_token_budget_caps_prefill_but_never_starves():
    s = make(num_blocks=64, max_num_seqs=4, budget=10)
    for i in range(3):
        s.add(seq(i, prompt_len=6))
    out, _ = run_step(s)
    assert [q.request_id for q in out.prefills] == [0], "a second 6-token prefill would exceed 10 tokens"
    s2 = make(num_blocks=64, budget=4)
    s2.add(seq(0, prompt_len=9))
    out, _ = run_step(s2)
    assert [q.request_id for q in out.prefills] == [0], "a prompt over the budget still runs when alone"


@pytest.mark.task(2)
def test_abort_frees_everything():
    s = make(max_num_seqs=1)
    s.add(seq(0, prompt_len=3))
    s.add(seq(1, prompt_len=3))
    run_step(s)
    assert s.abort(0).finish_reason == "abort" and s.abort(1).finish_reason == "abort"
    assert not s.has_unfinished() and s.allocator.num_free_blocks == 16
