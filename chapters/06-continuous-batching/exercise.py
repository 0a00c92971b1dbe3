"""Chapter 06 exercise: the scheduler of a continuous-batching engine.

Fill in the four methods below, task by task. The text is
chapters/06-continuous-batching/README.md; the tests are
tests/chapters/test_ch06_scheduler.py (the scheduler alone) and
tests/chapters/test_ch06_engine.py (the whole engine on a model, with your scheduler
inside). Run them against this file with

    python -m minicb check 6
    MINICB_IMPL=student MINICB_IMPL_ONLY=scheduler python -m minicb demo     # the demo, on your scheduler

One step is the given `schedule()`:

    out = SchedulerOutput()
    budget = self.schedule_running(out, self.max_num_batched_tokens)   # task 3: running requests first
    self.admit(out, budget)                                            # task 1: then the queue
    return out

and, after the engine's forward and sampling, your `postprocess()` (task 2).

Given, in `minicb.scheduler.SchedulerBase`, the class below inherits from (each
is described in the Scheduler docstring): the Sequence record and its
RequestStatus, the queues (add, abort, check_request), the one rule
`tokens_to_compute`, and the helpers `put`, `take_slot`, `fork`,
`slots_promised`, `preempt` and `finish`. It holds none of your four methods:
`check 6` grades only what this file defines, and a task whose method is
missing or misspelt fails, naming it.
"""
from minicb.block_allocator import BlockAllocator  # noqa: F401  # given
from minicb.sampling import SamplingParams, finish_reason  # noqa: F401  # given
from minicb.scheduler import RequestRejected, RequestStatus, SchedulerOutput, Sequence, StepResult  # noqa: F401  # given
from minicb.scheduler import SchedulerBase  # given: the state and helpers, none of your four methods


class Scheduler(SchedulerBase):
    """The given queues and helpers, with the decisions of one step left to you.

    State you will use: self.waiting (a deque, front = next), self.running (a list
    in admission order: the last one is the newest), self.slots (a list of
    Sequence | None, one per batch row), self.allocator, self.max_num_seqs,
    self.max_num_batched_tokens, self.watermark_blocks, self.eos_token_ids,
    self.max_model_len.

    A Sequence (one completion of a request) has: seq_id (its own id: the key of its blocks and
    slot; pass it to the allocator), request_id (its request's: add_request's id), prompt_token_ids,
    output_token_ids, params (its SamplingParams; params.n completions), status (a
    RequestStatus: WAITING, RUNNING or FINISHED), slot, num_computed_tokens (tokens
    whose K/V are in the cache), first_token_time, finish_time, num_preemptions,
    num_cached_tokens; and the properties token_ids (prompt + outputs), num_tokens
    (their count), is_decoding (it has outputs and every token but the newest is
    computed: it computes 1 token a step) and siblings_to_come (params.n - 1 until
    its sibling completions are forked, then 0).

    A StepResult (given) is what postprocess returns: new_tokens (a list of (Sequence, token),
    in the order they were appended), finished (a list of Sequence), forked (= out.forked), and
    its helper append(completion, token, now).

    A SchedulerOutput `out` collects one step: decodes and prefills (lists of
    Sequence), num_scheduled (seq_id -> tokens it computes this step), admitted
    and preempted (lists of seq_ids), block_copies, forked; out.sequences is decodes +
    prefills, out.num_new_tokens(seq) is num_scheduled[seq.seq_id], and
    out.is_empty is True while nothing is scheduled in the step yet.

    Given helpers:
    - self.add(seq): queue a new request at the back of self.waiting. The engine has
      already asked self.check_request(seq.prompt_token_ids, seq.params), which returns
      None or raises RequestRejected (a ValueError) when the request could never run: an empty prompt ("the prompt is empty"); a prompt as long as the
      model's context or longer (the message says "the model's context is" and
      max_model_len); params.n over max_num_seqs; or prompt + max_tokens needing
      more blocks than the whole pool (the message says "the pool has only N
      blocks", N = allocator.num_blocks).
    - self.abort(seq_id): finish a waiting or running sequence with reason
      "abort" and return its Sequence; None when there is no such request.
    - SamplingParams(...) (minicb.sampling, chapter 01) checks its own fields:
      ValueError naming the field and its value, e.g. max_tokens=0, temperature=-1.0,
      top_p=0.0 or top_p=1.5.
    - self.tokens_to_compute(num_remaining, budget, step_is_empty) -> int: the one
      rule. How many of a request's num_remaining uncomputed tokens it computes this
      step, with `budget` tokens left: in this chapter all of them if they fit the
      budget or if the step is still empty (step_is_empty: pass out.is_empty), else
      0 (it waits). Chapter 08 changes only this rule.
    - self.put(seq, num_new, out): schedule num_new tokens of seq in this step: it
      goes into out.decodes (seq.is_decoding) or out.prefills, and
      out.num_scheduled[seq.seq_id] = num_new. Returns None.
    - self.take_slot(seq): status RUNNING, the lowest free slot (seq.slot and
      self.slots), and seq appended to self.running. Returns None.
    - self.fork(parent, count, out) -> list[Sequence]: parallel sampling: count new
      completions of parent (its blocks shared, each in a slot of its own, each
      recorded in out.forked), in completion order; count 0 gives []. Marks parent
      as forked, so its siblings_to_come becomes 0.
    - self.slots_promised() -> int: slots taken or promised: 1 + siblings_to_come
      for every running sequence.
    - self.preempt(seq): back to the FRONT of self.waiting, its blocks freed, its
      slot emptied, num_computed_tokens 0, num_preemptions + 1. Returns None; you
      record the id in out.preempted.
    - self.finish(seq, reason): ends seq for good ("stop", "length", "abort"): a
      running one gives back its slot and blocks at once. Returns None.
    - finish_reason(token, num_generated, params, eos_token_ids, num_tokens,
      max_model_len) (minicb.sampling) -> "stop", "length" or None.
    """

    def admit(self, out: SchedulerOutput, budget: int) -> None:
        """Task 1: move requests from the front of self.waiting into free slots, with what is left
        of the step's token budget. Nothing at all in a step that preempted (out.preempted). For the
        request at the front, stop (FIFO: nobody overtakes it) unless:
        - a slot is free for it and its siblings: self.slots_promised() + 1 + seq.siblings_to_come
          <= self.max_num_seqs;
        - the rule gives it tokens: num_new = self.tokens_to_compute(seq.num_tokens - cached, budget,
          out.is_empty) > 0, where cached = self.allocator.num_cached_tokens(seq.token_ids) (chapter
          07's prefix cache; 0 with the plain allocator);
        - the pool has blocks for all its tokens: self.allocator.free_blocks_needed(seq.token_ids),
          plus self.watermark_blocks while any request runs, <= self.allocator.num_free_blocks.
        Then pop it, cached = self.allocator.allocate_prefix(seq.seq_id, seq.token_ids) (blocks
        for prompt + outputs: a preempted request recomputes both; returns the cached tokens), set
        seq.num_cached_tokens = cached on a first admission (seq.num_preemptions == 0),
        seq.num_computed_tokens = cached, self.take_slot(seq), append its id to out.admitted,
        self.put(seq, num_new, out), and take num_new off the budget. Returns None."""
        raise NotImplementedError(
            "Chapter 6, task 1: Scheduler.admit() — see chapters/06-continuous-batching/README.md#task-1")

    def postprocess(self, out: SchedulerOutput, sampled: list[list[int]], now: float) -> StepResult:
        """Task 2: record the step, and return what you did. sampled[i] holds the tokens sampled for
        out.sequences[i]: [] for a chunk of a longer prompt (chapter 08), [token] for a sequence that
        computed its last token, and n tokens for a request with n > 1 completions whose prompt was
        just computed (one per completion, in completion order). Start with
        result = StepResult(forked=out.forked); then for each sequence, in that order:
        - seq.num_computed_tokens += out.num_new_tokens(seq) (everything fed this step is cached);
        - no tokens: nothing more;
        - else its completions are [seq] + self.fork(seq, len(tokens) - 1, out), and each gets one
          token: result.append(completion, token, now) (it appends the token to output_token_ids,
          stamps the time, sets first_token_time if it is None, and lists (completion, token) in
          result.new_tokens), then end the completion if finish_reason(token, len(its outputs), its
          params, self.eos_token_ids, its num_tokens, self.max_model_len) names a reason:
          finish_time = now, self.finish(completion, reason), and append it to result.finished.
        Return result: the engine builds its step's output from it, and from nothing else."""
        raise NotImplementedError(
            "Chapter 6, task 2: Scheduler.postprocess() — see chapters/06-continuous-batching/README.md#task-2")

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Task 3: give the running requests their tokens under the budget, and return what is left.
        Decodes first (seq.is_decoding), then the others, oldest first within each (self.running
        order, taken before the loop: it changes when someone is preempted). Skip a sequence no longer
        RequestStatus.RUNNING (preempted a moment ago for an older one). Each gets num_new =
        self.tokens_to_compute(seq.num_tokens - seq.num_computed_tokens, budget, out.is_empty); 0:
        it waits this step. Otherwise self.grow(seq, seq.num_computed_tokens + num_new, out) makes
        room for them; if it says False (seq itself was preempted), skip it; else self.put(seq,
        num_new, out) and take num_new off the budget."""
        raise NotImplementedError(
            "Chapter 6, task 3: Scheduler.schedule_running() — "
            "see chapters/06-continuous-batching/README.md#task-3")

    def grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Task 3: make seq's blocks hold num_tokens tokens. While self.allocator.num_tokens(seq.seq_id)
        < num_tokens: if self.allocator.can_append(seq.seq_id), call self.allocator.append(
        seq.seq_id) (one more token slot; a (src, dst) copy-on-write pair it returns goes to
        out.block_copies); if not, preempt the NEWEST running request (self.running[-1]) with
        self.preempt, record its id in out.preempted, and return False if it was seq itself.
        Return True once seq holds num_tokens."""
        raise NotImplementedError(
            "Chapter 6, task 3: Scheduler.grow() — see chapters/06-continuous-batching/README.md#task-3")
