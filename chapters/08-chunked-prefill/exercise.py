"""Chapter 08 exercise: chunked prefill -- one rule changed, and the offset causal mask.

Fill in the stubs below, task by task. The text is
chapters/08-chunked-prefill/README.md; the tests are tests/chapters/test_ch08_*.py. Run
them against this file with

    python -m minicb check 8
    MINICB_IMPL=student MINICB_IMPL_ONLY=chunked_prefill python -m minicb bench --workload long-prompt \
        --engines minicb-continuous,minicb-chunked          # the benchmark, on your scheduler

Given: all of chapter 06's Scheduler, which ChunkedScheduler below inherits:
the loop of one step (schedule(): the running requests first, decodes before
the others, oldest first; then admissions from the front of the queue), the
admission rules, preemption of the newest, postprocess() (a sequence whose
step sampled no token, a chunk that does not finish its prompt, only adds the
chunk to num_computed_tokens) and forking. Every request in that loop asks one
method how many tokens it computes this step: tokens_to_compute(). Chapter 06
gives a prompt all or nothing; you write the rule that cuts it (task 1). The
chapter text describes the whole loop you inherit.
"""
from __future__ import annotations

import torch  # noqa: F401  # you will need it

from minicb.scheduler import Scheduler  # given: chapter 06's whole loop, with chapter 06's rule

# Task 3 writes a Triton kernel. Under `check 8` (and the notebooks) Triton is already
# set up to run interpreted on a CPU; run on your own, this chooses first.
from minicb.triton_mode import choose_triton_mode  # noqa: E402

choose_triton_mode()
import triton  # noqa: E402,F401
import triton.language as tl  # noqa: E402,F401


def chunk_size(num_remaining: int, budget: int) -> int:
    """Task 1: tokens of a request to compute this step: all num_remaining it still needs, or
    what is left of the budget, whichever is smaller (never below 0)."""
    raise NotImplementedError(
        "Chapter 8, task 1: chunk_size() — see chapters/08-chunked-prefill/README.md#task-1")


def offset_causal_mask(q_len: int, context_len: int, device=None) -> torch.Tensor:
    """Task 2: [q_len, context_len] bool, True where new token r (at position
    context_len - q_len + r) may attend to key position j. ValueError naming the value for a
    negative or non-int length, or q_len > context_len."""
    raise NotImplementedError(
        "Chapter 8, task 2: offset_causal_mask() — see chapters/08-chunked-prefill/README.md#task-2")


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Task 2: q [q_len, n_heads, head_dim] (the last q_len positions), k, v [context_len,
    n_kv_heads, head_dim] -> [q_len, n_heads, head_dim]: softmax(q k^T * scale + mask) v per
    head, with your offset_causal_mask, scale 1/sqrt(head_dim) by default, GQA (query head h
    reads KV head h // (n_heads // n_kv_heads)). ValueError for shapes that do not fit, saying
    which: naming q_len for a q_len over context_len, the word "multiple" for n_heads not a
    multiple of n_kv_heads, the word "shape" (and the shapes) for k and v of different shapes."""
    raise NotImplementedError(
        "Chapter 8, task 2: chunk_attention() — see chapters/08-chunked-prefill/README.md#task-2")


def chunk_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """Task 3: chunk_attention as a Triton kernel of your own (dense K/V, one sequence): the same
    shapes, the same answer, the same errors. Compute in fp32 inside the kernel."""
    raise NotImplementedError(
        "Chapter 8, task 3: chunk_attention_triton() — see chapters/08-chunked-prefill/README.md#task-3")


class ChunkedScheduler(Scheduler):
    """Chapter 06's scheduler with its one rule changed: a prompt may be cut to the budget.

    Given (inherited from chapter 06's Scheduler): the whole loop, and chapter 06's rule
    (whole or wait), which your tokens_to_compute replaces. schedule() calls self.schedule_running(out,
    self.max_num_batched_tokens), which goes through the running requests, decodes
    first, and returns the budget left; then self.admit(out, budget), which takes
    requests from the front of the queue. For each request both ask
    self.tokens_to_compute(num_remaining, budget, step_is_empty), with
    num_remaining = seq.num_tokens - seq.num_computed_tokens (for a request not yet
    admitted: its tokens not served by the prefix cache), budget = what is left of
    max_num_batched_tokens, and step_is_empty = nothing is scheduled in this step
    yet. Whatever it returns, the loop schedules: positions [num_computed_tokens,
    num_computed_tokens + that) are computed this step, and that many tokens come
    off the budget. 0 means the request waits: a running one is skipped this step,
    and admission stops at it (FIFO).
    """

    def tokens_to_compute(self, num_remaining: int, budget: int, step_is_empty: bool) -> int:
        """Task 1: the rule of chunked prefill: every request gets chunk_size(num_remaining, budget)
        -- all it still needs, or what is left of the budget -- so no step ever computes more than
        max_num_batched_tokens tokens, even when the step is still empty."""
        raise NotImplementedError(
            "Chapter 8, task 1: ChunkedScheduler.tokens_to_compute() — "
            "see chapters/08-chunked-prefill/README.md#task-1")
