"""Chapter 06 exercise: the scheduler of a continuous-batching engine.

Fill in the three methods below. The text is
chapters/06-continuous-batching/README.md; the tests are
tests/test_ch06_scheduler.py (the scheduler alone) and
tests/test_ch06_engine.py (the whole engine on a model, with your scheduler
inside). Run them against this file with

    python -m minicb check 6
    MINICB_IMPL=student MINICB_IMPL_ONLY=scheduler python -m minicb demo     # the demo, on your scheduler

Everything else -- the Sequence record and its RequestStatus, the queues,
add/abort, and the two helpers preempt() and finish() -- is given, in the class
below (minicb/scheduler.py documents each).
"""
from minicb.block_allocator import BlockAllocator  # noqa: F401  # given
from minicb.sampling import SamplingParams, finish_reason  # noqa: F401  # given
from minicb.scheduler import RequestRejected, RequestStatus, SchedulerOutput, Sequence  # noqa: F401  # given
from minicb.scheduler import Scheduler as _GivenScheduler


class Scheduler(_GivenScheduler):
    """The reference's queues and bookkeeping, with the three decisions left to you.

    State you will use: self.waiting (deque, front = next), self.running (list in
    admission order), self.slots (list of Sequence | None), self.allocator,
    self.max_num_seqs, self.max_num_batched_tokens, self.watermark_blocks,
    self.eos_token_ids, self.max_model_len; helpers self.preempt(seq) (back to the front
    of the queue, blocks freed) and self.finish(seq, reason) (slot and blocks freed).
    A sequence's status is a RequestStatus: WAITING, RUNNING or FINISHED.
    """

    def schedule_decodes(self, out: SchedulerOutput) -> None:
        """Task 3: one more token slot for every running request (oldest first), with
        allocator.append(); when allocator.can_append() says no, preempt the newest
        running request (self.preempt) and record it in out.preempted, until it fits.
        Append each decoding sequence to out.decodes (and any copy-on-write pair to
        out.block_copies)."""
        raise NotImplementedError(
            "Chapter 6, task 3: Scheduler.schedule_decodes() — see chapters/06-continuous-batching/README.md#task-3")

    def admit(self, out: SchedulerOutput) -> None:
        """Task 1: admit requests from the front of self.waiting while a slot is free,
        the allocator has blocks for all their tokens (plus self.watermark_blocks when
        others are running) and the token budget allows (the first prefill of a step
        always may, when nothing decodes). Skip admission in a step that preempted. For
        each: allocate prompt + outputs (a preempted request recomputes both), take the
        lowest free slot, set status RequestStatus.RUNNING and num_computed_tokens 0,
        add it to self.running, out.prefills and out.admitted."""
        raise NotImplementedError(
            "Chapter 6, task 1: Scheduler.admit() — see chapters/06-continuous-batching/README.md#task-1")

    def postprocess(self, out: SchedulerOutput, new_tokens: list[int], now: float) -> list[Sequence]:
        """Task 2: append each scheduled sequence's new token (out.sequences order),
        mark its tokens computed, set first_token_time (the first time only), and
        finish (self.finish) the ones finish_reason() ends -- EOS, a stop token,
        max_tokens or the context length (self.max_model_len) -- setting finish_time
        to `now`. Return the finished sequences."""
        raise NotImplementedError(
            "Chapter 6, task 2: Scheduler.postprocess() — see chapters/06-continuous-batching/README.md#task-2")
