"""Chapter 08: chunked prefill -- a token budget per step, and no prefill phase.

What you will learn:
- why admitting a prompt whole stalls everyone else: one 2,000-token prefill
  in a step makes that step (and every running request's next token) as slow
  as 2,000 decodes;
- how a per-step token budget (`max_num_batched_tokens`) bounds the work of a
  step, and how a long prompt is cut into chunks that fill what is left of it;
- why there is no "prefill phase" any more: every running request simply has
  `num_computed_tokens` catching up to `num_tokens`. A request whose prompt is
  computed needs 1 token a step (a decode); one still prefilling needs the
  rest of its prompt, and gets as much of it as the budget allows;
- why the first output token is sampled only in the step that computes the
  prompt's last token: before that, the logits of a chunk's last row predict
  a prompt token we already know.

One step, with a budget of 8 tokens, three decoding requests and a 13-token
prompt arriving:

    budget 8:   [ a | b | c ]  decodes first: 3 tokens
                [ D0 D1 D2 D3 D4 ]  then the new prompt, cut to the 5 tokens left
    next step:  [ a | b | c ][ D5 ... D9 ]       its next chunk, 5 more
    next step:  [ a | b | c ][ D10 D11 D12 ] d   its last chunk: D's first token is sampled

The blocks for the whole prompt are allocated when the request is admitted, as
in chapter 06; only the computing is spread over steps. A chunk attends to the
earlier chunks' K/V through the block table, with a causal mask shifted by the
number of tokens already computed (chapter 04's `paged_prefill_attention`
already takes `context_lens > q_len`).

The engine (minicb/engine.py) uses this scheduler when
`EngineConfig.enable_chunked_prefill` is on; chapter 06's `Scheduler`, which
admits prompts whole, stays the default for comparison.
"""
from __future__ import annotations

from minicb.scheduler import RequestStatus, Scheduler, SchedulerOutput, Sequence


def chunk_size(num_remaining: int, budget: int) -> int:
    """Tokens of a request to compute this step: all it still needs, or what is left of the budget."""
    return max(0, min(num_remaining, budget))


class ChunkedScheduler(Scheduler):
    """Chapter 06's scheduler with one budget loop in place of decode-then-admit.

    A step takes, while its budget of `max_num_batched_tokens` tokens lasts:
    1. the running requests that decode (their prompt is computed), one token each,
       oldest first, preempting the newest when the pool runs out of blocks;
    2. the next chunk of every running request still prefilling, oldest first;
    3. new requests from the front of the queue, each cut to what is left.
    `out.num_scheduled[request_id]` says how many tokens each computes.
    """

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self.schedule_running(out, budget)
        self.admit_chunks(out, budget)
        return out

    def is_prefilling(self, seq: Sequence) -> bool:
        """A running request whose prompt (prompt + outputs, after a preemption) is not all computed yet.

        Its blocks hold every token already, so the allocator knows as many tokens as
        the sequence; a decoding request holds one fewer, its newest sampled token,
        until append() makes room for it.
        """
        return self.allocator.num_tokens(seq.request_id) == seq.num_tokens

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first, then the next chunk of each prefilling request; returns the budget left."""
        for seq in list(self.running):  # oldest first
            if budget == 0:
                break
            if seq.status != RequestStatus.RUNNING or self.is_prefilling(seq):
                continue  # preempted a moment ago, or prefilling (its turn comes below)
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
                out.num_scheduled[seq.request_id] = 1
                budget -= 1
        for seq in self.running:
            if budget == 0:
                break
            if seq.request_id in out.num_scheduled or not self.is_prefilling(seq):
                continue  # decoding this step (append made it look prefilling), or waiting for budget
            chunk = chunk_size(seq.num_tokens - seq.num_computed_tokens, budget)
            out.prefills.append(seq)
            out.num_scheduled[seq.request_id] = chunk
            budget -= chunk
        return budget

    def admit_chunks(self, out: SchedulerOutput, budget: int) -> None:
        """Admit from the front of the queue while a slot, blocks and budget last; each computes a chunk."""
        caching = hasattr(self.allocator, "allocate_prefix")
        promised = 0  # slots for the siblings of n > 1 requests, which fork when their prompt is done
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            siblings = 0 if seq.forked else seq.params.n - 1
            if len(self.running) + promised + 1 + siblings > self.max_num_seqs:
                break
            reserve = self.watermark_blocks if self.running else 0
            need = (self.allocator.free_blocks_needed(seq.token_ids) if caching
                    else self.allocator.blocks_needed(seq.num_tokens))
            if need + reserve > self.allocator.num_free_blocks:
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            if caching:
                cached = self.allocator.allocate_prefix(seq.request_id, seq.token_ids)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            else:
                cached = 0
                self.allocator.allocate(seq.request_id, seq.num_tokens)
            seq.status, seq.num_computed_tokens = RequestStatus.RUNNING, cached
            seq.slot = self.slots.index(None)
            self.slots[seq.slot] = seq
            self.running.append(seq)
            chunk = chunk_size(seq.num_tokens - cached, budget)
            out.prefills.append(seq)
            out.num_scheduled[seq.request_id] = chunk
            out.admitted.append(seq.request_id)
            budget -= chunk
            promised += siblings
