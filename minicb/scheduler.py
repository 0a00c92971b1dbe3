"""Chapter 06: the scheduler -- who runs this step, who waits, who is evicted.

In this file you will learn the bookkeeping of continuous batching, with no
tensors in sight:
- requests wait in a FIFO queue; running requests sit in `max_num_seqs` fixed
  slots (the rows of the batch);
- every request has `num_computed_tokens` (tokens whose K/V are in the cache)
  catching up to `num_tokens` (prompt + outputs). One rule schedules them all:
  a step has a budget of `max_num_batched_tokens` tokens, and each request in
  turn -- the running ones first, then new ones from the front of the queue --
  gets `tokens_to_compute(what it still needs, what is left of the budget)`.
  A decoding request needs 1 (its newest token); a new prompt needs all of it;
- this chapter's rule admits a prompt whole or not at all: one that does not
  fit what is left of the budget waits, unless the step is still empty.
  Chapter 08 (minicb/chunked_prefill.py) changes only that rule, and prompts
  are cut into chunks; nothing else here changes;
- a new request is admitted when a slot is free (with slots for its n - 1
  sibling completions, n > 1), and the KV pool has blocks for all its tokens
  plus a small watermark kept back for the running requests to grow into;
- a request that finishes (EOS, stop token, max_tokens) leaves its slot at once
  and its blocks go back to the pool, so the next step can refill the slot;
- when a running request needs a new block and none is free, the *newest*
  running request is preempted: its blocks are freed, and it goes back to the
  front of the queue to be recomputed (prompt + what it generated so far) later.

The engine (minicb/engine.py) calls `schedule()` before the forward pass and
`postprocess()` after sampling. Chapter text: chapters/06-continuous-batching/README.md.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Iterator

from minicb.block_allocator import BlockAllocator
from minicb.sampling import SamplingParams, finish_reason

if TYPE_CHECKING:  # the scheduler itself never touches a tensor
    import torch


class RequestRejected(ValueError):
    """A request that can never be served, however long it waits: an empty prompt, one too
    long for the context, n beyond the slots, a request the whole KV pool cannot hold, a
    token id outside the vocabulary.

    The message is for a person (the value seen and what is allowed). `param` names the
    request field at fault as a client names it ("prompt", "n", "max_tokens"), and `code`
    says what is wrong in a word a program can test ("context_length_exceeded"), so a
    server answers OpenAI's 400 from the engine's own verdict instead of restating the
    rules (minicb/serve/app.py).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class RequestStatus(str, Enum):
    """Where a request is. A str too, so `seq.status == "running"` also reads true."""

    WAITING = "waiting"  # in the queue: no slot, no blocks
    RUNNING = "running"  # in a slot, with blocks for its tokens
    FINISHED = "finished"  # ended (finish_reason says why); slot and blocks given back


@dataclass
class Sequence:
    """Everything the engine knows about one completion of a request, from arrival to finish.

    There is no other record: the engine, the scheduler and the allocator hold a
    sequence only while it waits or runs, and let go of this object in the step
    that finishes it (or when it is aborted), by handing it out.

    Two ids, two names. `seq_id` is this sequence's own: the key of its blocks
    and its slot, which the scheduler and the allocator use. `request_id` is the
    request's, the id add_request returned, which the engine's outputs, aborts
    and the server use. A request with n > 1 completions (parallel sampling) is n
    sequences: the first is the one add_request made (`completion` 0, whose
    seq_id is the request_id); the other n - 1 are forked from it when its prompt
    is computed, each with a seq_id of its own, the same request_id, and its
    `completion` index.
    """

    seq_id: int  # this sequence's own id: the key of its blocks and its slot
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # time.perf_counter() when it was added
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None  # which batch row it occupies while running
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    first_token_time: float | None = None  # when its first output token was sampled
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled (StepResult.append)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    request_id: int | None = None  # the request it is a completion of (add_request's id); None: its own seq_id
    completion: int = 0  # parallel sampling: which of its request's n completions this is
    forked: bool = False  # parallel sampling: its n - 1 sibling completions exist (or n = 1)
    generator: torch.Generator | None = None  # its own torch.Generator for seeded sampling (None: greedy or unseeded)
    # Parallel sampling: the generators of completions 1 .. n - 1, kept here until they are forked.
    sibling_generators: list = field(default_factory=list)
    # Speculative decoding (chapter 11): draft tokens proposed, and how many of them the model accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_decode_steps: int = 0  # steps in which it decoded (with drafts or without)
    # Scores, when params ask (minicb/logprobs.py): one TokenLogprob per output token, and the
    # prompt's (None first), set once its prompt is computed; completion 0 carries the prompt's.
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    # Structured output (chapter 12): its grammar state (minicb/structured/guide.py's Guide), set when
    # its grammar is compiled; None for a request without one. error: why it ended, if it could not run.
    guide: object | None = None
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def __post_init__(self):
        if self.request_id is None:  # a request's first sequence: the request is named by it
            self.request_id = self.seq_id

    @property
    def is_decoding(self) -> bool:
        """It has outputs, and all its tokens but the newest are computed: it computes 1 token a step."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def siblings_to_come(self) -> int:
        """Slots its sibling completions will need when it forks: n - 1 until then, 0 after."""
        return 0 if self.forked else self.params.n - 1


@dataclass
class SchedulerOutput:
    """What the engine computes this step. Decodes come first in the batch, then prefills."""

    decodes: list[Sequence] = field(default_factory=list)  # their newest token: 1 each (and drafts, chapter 11)
    prefills: list[Sequence] = field(default_factory=list)  # prompt tokens (prompt + outputs after a preemption)
    # seq_id -> how many tokens it computes this step: positions
    # [num_computed_tokens, num_computed_tokens + this). Every scheduled sequence is here.
    num_scheduled: dict[int, int] = field(default_factory=dict)
    admitted: list[int] = field(default_factory=list)  # seq_ids
    preempted: list[int] = field(default_factory=list)  # seq_ids
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write copies
    # Chapter 11: seq_id -> the draft tokens a decoding request verifies this step. It
    # computes its newest token and these: num_scheduled = 1 + len(drafts).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    forked: list[Sequence] = field(default_factory=list)  # completions born in postprocess (n > 1)

    @property
    def sequences(self) -> list[Sequence]:
        return self.decodes + self.prefills

    def num_new_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` computes this step."""
        return self.num_scheduled[seq.seq_id]

    def drafts(self, seq: Sequence) -> list[int]:
        """The draft tokens `seq` verifies this step ([] for all but speculating decodes)."""
        return self.draft_token_ids.get(seq.seq_id, [])

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled

    def placements(self) -> list[tuple[int, int, str, int, int]]:
        """(seq_id, slot, "decode" | "prefill", tokens computed now, tokens computed before) of each
        scheduled sequence, in batch order. Read it before postprocess, which frees finished slots."""
        return [(s.seq_id, s.slot, "decode" if s.is_decoding else "prefill", self.num_new_tokens(s),
                 s.num_computed_tokens) for s in self.sequences]


@dataclass
class StepResult:
    """What postprocess did, so that nobody works it out afterwards (the engine builds its StepOutput from it).

    new_tokens lists every token appended, as (completion, token), in batch
    order: a request's accepted drafts and its one more token in order (chapter
    11), and a request that forked this step as its completions' first tokens in
    completion order. A token after a stop token was never appended, so it is not here.
    """

    new_tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended this step; the scheduler has let go of them
    forked: list[Sequence] = field(default_factory=list)  # completions born this step (n > 1), = out.forked
    num_draft_tokens: int = 0  # chapter 11: drafts verified this step
    num_accepted_tokens: int = 0  # of them, accepted

    def append(self, completion: Sequence, token: int, now: float) -> None:
        """Append one sampled token to a completion, stamped `now` (token_times, first_token_time), and record it."""
        completion.output_token_ids.append(token)
        completion.token_times.append(now)  # for inter-token latency
        if completion.first_token_time is None:
            completion.first_token_time = now
        self.new_tokens.append((completion, token))


class SchedulerBase:
    """The scheduler's state and its given helpers: the queues and slots, requests in (add, check_request,
    abort), one step's frame (schedule) and its one rule (tokens_to_compute), and the moves of a
    sequence between queues (put, take_slot, fork, preempt, finish). It decides nothing: the
    decisions of a step are `Scheduler`'s, below, and chapter 06's exercise starts from this class.
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_model_len: int,
                 eos_token_ids: list[int], max_num_batched_tokens: int = 2048, watermark: float = 0.01,
                 speculator=None, seq_ids: Iterator[int] | None = None):
        # The settings come from an EngineConfig, which has checked them (minicb/config.py).
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        # Blocks kept free at admission so running requests can grow without
        # being preempted right away. 1% of the pool, as in vLLM, at least 1 block.
        self.watermark_blocks = max(1, int(watermark * allocator.num_blocks)) if watermark > 0 else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.slots: list[Sequence | None] = [None] * max_num_seqs
        # Sequence ids, for forked completions: the engine's counter, which also numbers its
        # requests, so an id never names two sequences (not even across Engine.reset).
        self.seq_ids = itertools.count() if seq_ids is None else seq_ids
        # Chapter 11 (minicb/speculative.py): proposes drafts for decoding requests and rolls
        # back the rejected ones. None: no speculation, every decode computes 1 token.
        self.speculator = speculator

    def new_seq_id(self) -> int:
        return next(self.seq_ids)

    # ---- requests in ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request the engine has checked: Engine.check_request, the one place a request's rules
        are checked, asks check_request below for the scheduler's, before add_request gets here."""
        self.waiting.append(seq)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if this request can never be served; change nothing."""
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty; give at least one token", "prompt", "empty_prompt")
        if params.n > self.max_num_seqs:
            raise RequestRejected(f"n={params.n} completions need {params.n} slots at once, but the engine has "
                                  f"max_num_seqs={self.max_num_seqs}; lower n or raise max_num_seqs",
                                  "n", "too_many_completions")
        if prompt_len >= self.max_model_len:
            raise RequestRejected(f"the prompt has {prompt_len} tokens but the model's context is "
                                  f"{self.max_model_len}; it must be shorter so one token can be generated",
                                  "prompt", "context_length_exceeded")
        # Running alone, with the whole pool to itself, the request must be able to
        # finish: prompt + every token it may generate. Otherwise it would be
        # preempted and re-admitted forever, and everyone behind it would wait.
        max_len = min(prompt_len + params.max_tokens, self.max_model_len)
        need = self.allocator.blocks_needed(max_len)
        if need > self.allocator.num_blocks:
            # The prompt is at fault when it leaves no room for even one token; else max_tokens is.
            prompt_fits = self.allocator.blocks_needed(prompt_len + 1) <= self.allocator.num_blocks
            raise RequestRejected(
                f"the request needs up to {max_len} tokens of KV cache (prompt {prompt_len} + max_tokens "
                f"{params.max_tokens}) = {need} blocks of {self.allocator.block_size}, but the pool has only "
                f"{self.allocator.num_blocks} blocks; it can never finish. Lower max_tokens, shorten the prompt, "
                f"or give the engine more num_blocks", "max_tokens" if prompt_fits else "prompt",
                "kv_cache_too_small")

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish a waiting or running request with reason "abort"; None if there is no such request."""
        for seq in list(self.waiting) + self.running:
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: the running requests first, then new ones, within one token budget."""
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.max_num_batched_tokens)
        self.admit(out, budget)
        return out

    def tokens_to_compute(self, num_remaining: int, budget: int, step_is_empty: bool) -> int:
        """The one rule: how many of a request's `num_remaining` uncomputed tokens it computes now.

        Chapter 06 computes a prompt whole: all of it if it fits what is left of
        the budget, or if nothing else is in the step yet (a prompt longer than
        the budget must run some time); otherwise 0, and it waits. A decode (1
        token) waits only when the budget is spent. Chapter 08 cuts instead.
        """
        return num_remaining if num_remaining <= budget or step_is_empty else 0

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Chapter 11: draft tokens for a decoding request, none past its max_tokens, its context or `budget - 1`."""
        if self.speculator is None:
            return []
        max_drafts = min(budget - 1,
                         seq.params.max_tokens - len(seq.output_token_ids) - 1,  # the step adds drafts + 1
                         self.max_model_len - seq.num_tokens)  # the last draft's position must exist
        drafts = self.speculator.propose(seq.token_ids, max_drafts)
        # Chapter 12: a guided request verifies its forced tokens (jump-forward), or the drafts' valid prefix.
        return drafts if seq.guide is None else seq.guide.drafts(drafts, max_drafts)

    def slots_promised(self) -> int:
        """Slots taken or promised: every running sequence's, and its siblings' that will fork from it."""
        return sum(1 + seq.siblings_to_come for seq in self.running)

    # ---- the helpers of one step ----------------------------------------------------------

    def put(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Schedule `num_new` tokens of `seq` in this step (a decode's drafts are already in out)."""
        (out.decodes if seq.is_decoding else out.prefills).append(seq)
        out.num_scheduled[seq.seq_id] = num_new
        # Chapter 07: the full blocks whose tokens are all computed by the end of this
        # step get their keys now, so a request admitted later in this same step
        # already shares them. That is safe: in the forward every layer writes the
        # step's K/V before any attention reads it. (The plain allocator keys nothing.)
        self.allocator.cache_full_blocks(seq.seq_id, seq.token_ids[:seq.num_computed_tokens + num_new])

    def take_slot(self, seq: Sequence) -> None:
        """Put a sequence (admitted, or a forked completion) into the lowest free slot, running."""
        seq.status = RequestStatus.RUNNING
        seq.slot = self.slots.index(None)
        self.slots[seq.slot] = seq
        self.running.append(seq)

    def fork(self, parent: Sequence, count: int, out: SchedulerOutput) -> list[Sequence]:
        """Parallel sampling: `count` more completions of `parent`, whose prompt was just computed.

        Each shares all of the parent's blocks (allocator.fork): the prompt is
        computed once, and the shared last block is copied when a completion first
        writes into it (chapter 03's copy-on-write). They take the slots promised
        at admission, and the generators kept in parent.sibling_generators. They are
        recorded in out.forked. count 0 forks nothing.
        """
        if count == 0:
            return []
        children = []
        for completion in range(1, count + 1):
            child = type(parent)(self.new_seq_id(), list(parent.prompt_token_ids), parent.params,
                                 arrival_time=parent.arrival_time, num_computed_tokens=parent.num_computed_tokens,
                                 num_cached_tokens=parent.num_cached_tokens, request_id=parent.request_id,
                                 completion=completion, forked=True,
                                 generator=parent.sibling_generators[completion - 1])
            self.allocator.fork(parent.seq_id, child.seq_id)
            self.take_slot(child)
            out.forked.append(child)
            children.append(child)
        parent.forked, parent.sibling_generators = True, []
        return children

    # ---- moving sequences between the queues --------------------------------------

    # The step's decisions call preempt() and finish(); _release() is theirs alone.
    def _release(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back to the allocator and empty its slot."""
        self.allocator.free(seq.seq_id)
        self.running.remove(seq)
        self.slots[seq.slot] = None
        seq.slot = None

    def preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to the FRONT of the queue, dropping its K/V.

        Recompute, not swap: its blocks are freed and its slot emptied. Its
        outputs so far are kept, and on re-admission prompt + outputs are
        computed again (num_computed_tokens goes back to 0, or to what the prefix
        cache still holds), under the same rule as any prompt: whole in chapter
        06, in chunks under chapter 08's. Counts the
        preemption in seq.num_preemptions. The caller records it in out.preempted.
        """
        self._release(seq)
        seq.status, seq.num_computed_tokens = RequestStatus.WAITING, 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence for good: "stop", "length" or "abort".

        A running sequence gives back its slot and blocks at once; a waiting one
        leaves the queue. Afterwards the scheduler holds nothing of it. The caller
        sets seq.finish_time if it wants one.
        """
        if seq.status == RequestStatus.RUNNING:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = RequestStatus.FINISHED, reason


class Scheduler(SchedulerBase):
    """Chapter 06's decisions of one step: the running requests first (schedule_running, grow), then
    admissions from the queue (admit), and after the forward, what the step did (postprocess)."""

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its tokens under the budget, decodes first; returns the budget left.

        Oldest first within decodes, then within requests still computing their
        prompt. Each gets tokens_to_compute(what it still needs, budget left), and
        blocks for them (grow), preempting the newest running request while the
        pool is short.
        """
        decoding = [seq for seq in self.running if seq.is_decoding]
        prefilling = [seq for seq in self.running if not seq.is_decoding]
        for i, seq in enumerate(decoding + prefilling):
            if seq.status != RequestStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older request
            # Chapter 11: a decode may bring drafts to verify, paid from budget that the
            # decodes after it do not need (each of them needs 1 token).
            drafts = self.propose(seq, budget - (len(decoding) - i - 1)) if i < len(decoding) else []
            num_new = self.tokens_to_compute(seq.num_tokens - seq.num_computed_tokens + len(drafts), budget,
                                             out.is_empty)
            if num_new == 0 or not self.grow(seq, seq.num_computed_tokens + num_new, out):
                continue  # waits for budget, or was itself the newest and gave its blocks up
            if drafts:
                out.draft_token_ids[seq.seq_id] = drafts[:num_new - 1]
            self.put(seq, num_new, out)
            budget -= num_new
        return budget

    def admit(self, out: SchedulerOutput, budget: int) -> None:
        """Move requests from the front of the queue into free slots while slots, blocks and budget last."""
        # Not in a step that just preempted: the pool is short, and the preempted
        # requests are at the front of the queue anyway.
        while self.waiting and not out.preempted:
            seq = self.waiting[0]
            if self.slots_promised() + 1 + seq.siblings_to_come > self.max_num_seqs:
                break  # no slot for it, or not for all its n completions at once
            # Blocks already cached for its prefix (chapter 07) are shared, not computed:
            # only the rest costs budget. The plain allocator has no cache: 0.
            cached = self.allocator.num_cached_tokens(seq.token_ids)
            if cached >= seq.num_tokens:  # it would wait at the head of the queue forever
                raise RuntimeError(f"the allocator reports {cached} of request {seq.seq_id}'s {seq.num_tokens} "
                                   f"tokens cached; a lookup must leave at least the last token to compute, "
                                   f"since its logits pick the next token")
            num_new = self.tokens_to_compute(seq.num_tokens - cached, budget, out.is_empty)
            if num_new == 0:
                break  # too much work for this step; it goes first next step
            reserve = self.watermark_blocks if self.running else 0
            if self.allocator.free_blocks_needed(seq.token_ids) + reserve > self.allocator.num_free_blocks:
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            # Blocks for every token (prompt, plus earlier outputs when recomputing).
            cached = self.allocator.allocate_prefix(seq.seq_id, seq.token_ids)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.status, seq.num_computed_tokens = RequestStatus.RUNNING, cached
            self.take_slot(seq)
            out.admitted.append(seq.seq_id)
            self.put(seq, num_new, out)
            budget -= num_new

    def postprocess(self, out: SchedulerOutput, sampled: list[list[int]], now: float) -> StepResult:
        """Record the step: tokens computed, tokens sampled, completions forked, sequences finished.

        sampled[i] holds the tokens sampled for out.sequences[i]: none for a chunk
        of a longer prompt, one for a sequence that computed its last token, and n
        for a request with n > 1 completions whose prompt just finished (one per
        completion, in completion order). Returns what it did: a StepResult.
        """
        result = StepResult(forked=out.forked)
        for seq, tokens in zip(out.sequences, sampled):
            if seq.is_decoding:
                seq.num_decode_steps += 1
            seq.num_computed_tokens += out.num_new_tokens(seq)  # everything fed this step is now cached
            if not tokens:
                continue  # a chunk of a longer prompt (chapter 08): its last logits predict a prompt token
            drafts = out.drafts(seq)
            if drafts:  # chapter 11: the accepted drafts and one more token, all for this completion
                num_accepted = len(tokens) - 1
                seq.num_draft_tokens += len(drafts)
                seq.num_accepted_tokens += num_accepted
                result.num_draft_tokens += len(drafts)
                result.num_accepted_tokens += num_accepted
                self.speculator.rollback(self.allocator, seq, len(drafts) - num_accepted)
                runs = [(seq, tokens)]
            else:  # one token, or one for each of n completions that fork now
                runs = [(c, [t]) for c, t in zip([seq] + self.fork(seq, len(tokens) - 1, out), tokens)]
            for completion, run in runs:
                for token in run:
                    result.append(completion, token, now)
                    reason = finish_reason(token, len(completion.output_token_ids), completion.params,
                                           self.eos_token_ids, completion.num_tokens, self.max_model_len)
                    if reason:  # accepted drafts after a stop token are dropped with it
                        completion.finish_time = now
                        self.finish(completion, reason)
                        result.finished.append(completion)
                        break
        return result

    def grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make `seq`'s blocks hold `num_tokens` tokens, preempting the newest running request while short.

        Returns False if `seq` itself was the newest and was preempted. Copy-on-write
        copies go to out.block_copies, preemptions to out.preempted.
        """
        while self.allocator.num_tokens(seq.seq_id) < num_tokens:
            if not self.allocator.can_append(seq.seq_id):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim.seq_id)
                if victim is seq:
                    return False
                continue
            copy = self.allocator.append(seq.seq_id)
            if copy is not None:
                out.block_copies.append(copy)
        return True
