"""Chapter 06: the scheduler -- who runs this step, who waits, who is evicted.

In this file you will learn the bookkeeping of continuous batching, with no
tensors in sight:
- requests wait in a FIFO queue; running requests sit in `max_num_seqs` fixed
  slots (the rows of the batch);
- every step, each running request decodes one token, and waiting requests are
  admitted into free slots *in the same step* as prefills -- as long as a slot
  is free, the KV pool has blocks for the whole prompt (plus a small watermark
  kept back for the running requests to grow into), and the step's token budget
  allows;
- a request that finishes (EOS, stop token, max_tokens) leaves its slot at once
  and its blocks go back to the pool, so the next step can refill the slot;
- when a running request needs a new block and none is free, the *newest*
  running request is preempted: its blocks are freed, and it goes back to the
  front of the queue to be recomputed (prompt + what it generated so far) later.

The engine (minicb/engine.py) calls `schedule()` before the forward pass and
`postprocess()` after sampling. Chapter text: chapters/06-continuous-batching/README.md.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from minicb.block_allocator import BlockAllocator
from minicb.sampling import SamplingParams, finish_reason

if TYPE_CHECKING:  # the scheduler itself never touches a tensor
    import torch


class RequestRejected(ValueError):
    """A request that can never be served (too long for the context or the KV pool)."""


class RequestStatus(str, Enum):
    """Where a request is. A str too, so `seq.status == "running"` also reads true."""

    WAITING = "waiting"  # in the queue: no slot, no blocks
    RUNNING = "running"  # in a slot, with blocks for its tokens
    FINISHED = "finished"  # ended (finish_reason says why); slot and blocks given back


@dataclass
class Sequence:
    """Everything the engine knows about one request, from arrival to finish.

    There is no other record: the engine, the scheduler and the allocator hold a
    request only while it waits or runs, and let go of this object in the step
    that finishes it (or when it is aborted), by handing it out.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0  # time.perf_counter() when it was added
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None  # which batch row it occupies while running
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    first_token_time: float | None = None  # when its first output token was sampled
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled (the engine stamps them)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    parent_id: int | None = None  # parallel sampling: the request this completion belongs to (None: itself)
    forked: bool = False  # parallel sampling: its n - 1 sibling completions exist (or n = 1)
    generator: torch.Generator | None = None  # its own torch.Generator for seeded sampling (None: greedy or unseeded)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SchedulerOutput:
    """What the engine computes this step. Decodes come first in the batch, then prefills."""

    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[Sequence] = field(default_factory=list)  # all their uncached tokens (or a chunk of them)
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write copies
    # Chunked prefill (chapter 08): request_id -> tokens it computes this step, when fewer
    # than all its uncomputed ones. Chapter 06 leaves it empty: a prefill is whole.
    num_scheduled: dict[int, int] = field(default_factory=dict)

    @property
    def sequences(self) -> list[Sequence]:
        return self.decodes + self.prefills

    def num_new_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` computes this step: positions [num_computed_tokens, num_computed_tokens + this)."""
        return self.num_scheduled.get(seq.request_id, seq.num_tokens - seq.num_computed_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_model_len: int,
                 eos_token_ids: list[int], max_num_batched_tokens: int = 2048, watermark: float = 0.01):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}; it must be >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}; it must be >= 1")
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

    # ---- requests in ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request, or reject it now if it could never run (it would block the queue forever)."""
        self.check_request(seq.prompt_token_ids, seq.params)
        self.waiting.append(seq)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if this request can never be served; change nothing."""
        prompt_len = len(prompt_token_ids)
        if prompt_len == 0:
            raise RequestRejected("the prompt is empty; give at least one token")
        if params.n > self.max_num_seqs:
            raise RequestRejected(f"n={params.n} completions need {params.n} slots at once, but the engine has "
                                  f"max_num_seqs={self.max_num_seqs}; lower n or raise max_num_seqs")
        if prompt_len >= self.max_model_len:
            raise RequestRejected(f"the prompt has {prompt_len} tokens but the model's context is "
                                  f"{self.max_model_len}; it must be shorter so one token can be generated")
        # Running alone, with the whole pool to itself, the request must be able to
        # finish: prompt + every token it may generate. Otherwise it would be
        # preempted and re-admitted forever, and everyone behind it would wait.
        max_len = min(prompt_len + params.max_tokens, self.max_model_len)
        need = self.allocator.blocks_needed(max_len)
        if need > self.allocator.num_blocks:
            raise RequestRejected(
                f"the request needs up to {max_len} tokens of KV cache (prompt {prompt_len} + max_tokens "
                f"{params.max_tokens}) = {need} blocks of {self.allocator.block_size}, but the pool has only "
                f"{self.allocator.num_blocks} blocks; it can never finish. Lower max_tokens, shorten the prompt, "
                f"or give the engine more num_blocks")

    def abort(self, request_id: int) -> Sequence | None:
        """Finish a waiting or running request with reason "abort"; None if there is no such request."""
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: decodes of the running requests, then new prefills."""
        out = SchedulerOutput()
        if self.running:  # (the first step has nothing to decode: admission comes first)
            self.schedule_decodes(out)
        self.admit(out)
        return out

    def schedule_decodes(self, out: SchedulerOutput) -> None:
        """Give every running request one more token slot, preempting the newest when blocks run out."""
        # Oldest first, so when blocks run out, the newest requests give theirs up.
        for seq in list(self.running):
            if seq.status != RequestStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older request
            while not self.allocator.can_append(seq.request_id):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is seq:
                    break
            if seq.status == RequestStatus.RUNNING:
                copy = self.allocator.append(seq.request_id)
                if copy is not None:
                    out.block_copies.append(copy)
                out.decodes.append(seq)

    def admit(self, out: SchedulerOutput) -> None:
        """Move requests from the front of the queue into free slots, as prefills."""
        # Admit while there is a slot, blocks (beyond the watermark) and token budget.
        # Not in a step that just preempted: the pool is short, and the preempted
        # requests are at the front of the queue anyway.
        budget = self.max_num_batched_tokens - len(out.decodes)
        # With a prefix-caching allocator (minicb/prefix_cache.py), blocks already
        # cached for a request's prefix are shared, not computed: only the rest costs
        # budget and free blocks. (Chapter 07; chapter 06 needs none of it.)
        caching = hasattr(self.allocator, "allocate_prefix")
        promised = 0  # slots for the siblings of this step's n > 1 requests, which fork at its end
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            siblings = 0 if seq.forked else seq.params.n - 1
            if len(self.running) + promised + 1 + siblings > self.max_num_seqs:
                break  # parallel sampling: all n completions need a slot together
            num_tokens = seq.num_tokens  # prompt, plus earlier outputs when recomputing
            cached = self.allocator.num_cached_tokens(seq.token_ids) if caching else 0
            if num_tokens - cached > budget and (out.decodes or out.prefills):
                break  # too much work for this step; it goes first next step
            reserve = self.watermark_blocks if self.running else 0
            need = (self.allocator.free_blocks_needed(seq.token_ids) if caching
                    else self.allocator.blocks_needed(num_tokens))
            if need + reserve > self.allocator.num_free_blocks:
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            if caching:
                cached = self.allocator.allocate_prefix(seq.request_id, seq.token_ids)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            else:
                self.allocator.allocate(seq.request_id, num_tokens)
            seq.status, seq.num_computed_tokens = RequestStatus.RUNNING, cached
            seq.slot = self.slots.index(None)
            self.slots[seq.slot] = seq
            self.running.append(seq)
            out.prefills.append(seq)
            out.admitted.append(seq.request_id)
            budget -= num_tokens - cached
            promised += siblings

    def postprocess(self, out: SchedulerOutput, new_tokens: list[int], now: float) -> list[Sequence]:
        """Append each scheduled sequence's sampled token; evict the finished. Returns them."""
        finished = []
        for seq, token in zip(out.sequences, new_tokens):
            seq.num_computed_tokens += out.num_new_tokens(seq)  # everything fed this step is now cached
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a chunk of a longer prompt (chapter 08): no token is sampled until it is all computed
            seq.output_token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = finish_reason(token, len(seq.output_token_ids), seq.params, self.eos_token_ids,
                                   seq.num_tokens, self.max_model_len)
            if reason:
                seq.finish_time = now
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    # ---- moving sequences between the queues --------------------------------------

    def adopt(self, child: Sequence) -> None:
        """Put a forked completion (parallel sampling) into a free slot, running.

        Its blocks come from allocator.fork(); admit() kept the slot free for it.
        """
        child.status, child.forked = RequestStatus.RUNNING, True
        child.slot = self.slots.index(None)
        self.slots[child.slot] = child
        self.running.append(child)

    # The exercise's methods call preempt() and finish(); _release() is theirs alone.

    def _release(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back to the allocator and empty its slot."""
        self.allocator.free(seq.request_id)
        self.running.remove(seq)
        self.slots[seq.slot] = None
        seq.slot = None

    def preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to the FRONT of the queue, dropping its K/V.

        Recompute, not swap: its blocks are freed and its slot emptied. Its
        outputs so far are kept, and on re-admission prompt + outputs are
        prefilled in one go (num_computed_tokens goes back to 0). Counts the
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
