"""Chapter 08 exercise: chunked prefill -- the budget loop, cutting chunks, and the offset causal mask.

Fill in the stubs below, task by task. The text is
chapters/08-chunked-prefill/README.md; the tests are tests/test_ch08_*.py. Run
them against this file with

    python -m minicb check 8
    MINICB_IMPL=student MINICB_IMPL_ONLY=chunked_prefill python -m minicb bench --workload long-prompt \
        --engines minicb-continuous,minicb-chunked          # the benchmark, on your scheduler

Given, in the class below (minicb/scheduler.py and minicb/chunked_prefill.py
document each): everything of chapter 06's Scheduler -- the queues, slots,
preempt(), finish(), postprocess() (it skips the token of a chunk that does not
finish its prompt) -- and schedule(), which calls your two methods, and
is_prefilling(seq).
"""
from __future__ import annotations

import torch  # noqa: F401  # you will need it

from minicb.chunked_prefill import ChunkedScheduler as _GivenChunkedScheduler
from minicb.scheduler import RequestStatus, SchedulerOutput, Sequence  # noqa: F401  # given

# Task 4 writes a Triton kernel. Under `check 8` (and the notebooks) Triton is already
# set up to run interpreted on a CPU; run on your own, this chooses first.
from minicb.triton_mode import choose_triton_mode  # noqa: E402

choose_triton_mode()
import triton  # noqa: E402,F401
import triton.language as tl  # noqa: E402,F401


def chunk_size(num_remaining: int, budget: int) -> int:
    """Task 2: tokens of a request to compute this step: all num_remaining it still needs, or
    what is left of the budget, whichever is smaller (never below 0)."""
    raise NotImplementedError(
        "Chapter 8, task 2: chunk_size() — see chapters/08-chunked-prefill/README.md#task-2")


def offset_causal_mask(q_len: int, context_len: int, device=None) -> torch.Tensor:
    """Task 3: [q_len, context_len] bool, True where new token r (at position
    context_len - q_len + r) may attend to key position j. ValueError naming the value for a
    negative or non-int length, or q_len > context_len."""
    raise NotImplementedError(
        "Chapter 8, task 3: offset_causal_mask() — see chapters/08-chunked-prefill/README.md#task-3")


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Task 3: q [q_len, n_heads, head_dim] (the last q_len positions), k, v [context_len,
    n_kv_heads, head_dim] -> [q_len, n_heads, head_dim]: softmax(q k^T * scale + mask) v per
    head, with your offset_causal_mask, scale 1/sqrt(head_dim) by default, GQA (query head h
    reads KV head h // (n_heads // n_kv_heads)). ValueError for shapes that do not fit."""
    raise NotImplementedError(
        "Chapter 8, task 3: chunk_attention() — see chapters/08-chunked-prefill/README.md#task-3")


def chunk_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Task 4: chunk_attention as a Triton kernel of your own (dense K/V, one sequence): the same
    shapes, the same answer, the same errors. Compute in fp32 inside the kernel."""
    raise NotImplementedError(
        "Chapter 8, task 4: chunk_attention_triton() — see chapters/08-chunked-prefill/README.md#task-4")


class ChunkedScheduler(_GivenChunkedScheduler):
    """Chapter 06's scheduler, with one token budget per step in place of decode-then-admit.

    schedule() (given) is: budget = self.max_num_batched_tokens; budget =
    self.schedule_running(out, budget); self.admit_chunks(out, budget).
    """

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Task 1: spend the budget on the running requests, oldest first: first every decoding one
        (not self.is_prefilling(seq)) gets 1 token -- allocator.append, preempting the newest running
        request when allocator.can_append says no, as chapter 06 does -- then every prefilling one
        gets the next chunk_size(its uncomputed tokens, budget left). Record each in out.decodes or
        out.prefills and out.num_scheduled[request_id]. Stop when the budget is 0. Return what is left."""
        raise NotImplementedError(
            "Chapter 8, task 1: ChunkedScheduler.schedule_running() — see chapters/08-chunked-prefill/README.md#task-1")

    def admit_chunks(self, out: SchedulerOutput, budget: int) -> None:
        """Task 2: admit from the front of the queue as chapter 06's admit does (a slot, blocks for
        the whole prompt plus the watermark when others run, FIFO, nothing in a step that
        preempted, n - 1 slots kept for a request's siblings, allocate_prefix with a caching
        allocator), while budget > 0; each computes its first chunk_size(uncached tokens, budget) tokens."""
        raise NotImplementedError(
            "Chapter 8, task 2: ChunkedScheduler.admit_chunks() — see chapters/08-chunked-prefill/README.md#task-2")
