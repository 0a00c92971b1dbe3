"""Chapter 11 exercise: speculative decoding -- propose drafts, verify them, roll the rejected back.

Fill in the stubs below, task by task. The text is
chapters/11-speculative-decoding/README.md; the tests are tests/chapters/test_ch11_*.py.
Run them against this file with

    python -m minicb check 11
    MINICB_IMPL=student MINICB_IMPL_ONLY=speculative python -m minicb bench --workload repeat \
        --engines minicb-continuous,minicb-spec          # the benchmark, on your functions

Given, written out below so that they call *your* functions: `verify`, which
picks greedy or sampled verification for one request, and `Speculator`, the
object the engine builds from this file (EngineConfig(speculative_ngram=2)) and
the scheduler calls: `propose` before a step, `verify` after the forward,
`rollback` in postprocess. Their docstrings say what each does. The
scheduler (minicb/scheduler.py) already schedules a decoding request's newest
token plus its drafts, 1 + k tokens, like a chunk of a prompt; the runner
already returns logits at all 1 + k positions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minicb.sampling import SamplingParams, draw, probabilities

if TYPE_CHECKING:
    from minicb.block_allocator import BlockAllocator
    from minicb.scheduler import Sequence


def propose_ngram(token_ids: list[int], n: int, k: int) -> list[int]:
    """Task 1: prompt lookup. Find the last n tokens earlier in token_ids, at the latest place
    that starts before the last n tokens themselves (it may overlap them), and return the up to
    k tokens that followed that match (fewer when it sits near the end). [] when there is no
    match, or len(token_ids) <= n.
        propose_ngram([5, 6, 7, 8, 5, 6], n=2, k=3) -> [7, 8, 5]"""
    raise NotImplementedError(
        "Chapter 11, task 1: propose_ngram() — see chapters/11-speculative-decoding/README.md#task-1")


def accept_greedy(argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Task 2: greedy verification. argmax [k + 1]: the model's choice after the newest token
    (argmax[0]) and after each draft. Keep drafts while each equals argmax at its position, then
    add argmax where the first draft failed (or after the last). Returns 1 .. k + 1 tokens.
        accept_greedy([7, 8, 3], [7, 9]) -> [7, 8]"""
    raise NotImplementedError(
        "Chapter 11, task 2: accept_greedy() — see chapters/11-speculative-decoding/README.md#task-2")


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Task 2: lossless verification. target_probs [k + 1, V], draft_probs [k, V], k drafts.
    For draft i (p = target_probs[i], q = draft_probs[i], x = draft_token_ids[i]): accept x with
    probability min(1, p(x) / q(x)); at the first rejection draw one token from max(0, p - q),
    normalised, and stop; if all k are accepted, draw a bonus token from target_probs[k].
    Every random draw uses `generator`. Returns 1 .. k + 1 tokens (ints)."""
    raise NotImplementedError(
        "Chapter 11, task 2: rejection_sample() — see chapters/11-speculative-decoding/README.md#task-2")


def verify(logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """Given: the tokens one speculating request yields this step. logits [k + 1, V] fp32.

    Greedy requests go through your accept_greedy; sampled ones through your
    rejection_sample, against the request's own distribution (temperature, top-k,
    top-p applied), with prompt lookup's point mass as the draft distribution.
    """
    if params.greedy:
        return accept_greedy(logits.argmax(-1).tolist(), draft_token_ids)
    target = probabilities(logits, params)  # [k + 1, V]
    drafts = torch.tensor(draft_token_ids, device=logits.device)
    point_mass = torch.nn.functional.one_hot(drafts, logits.shape[-1]).to(target.dtype)  # [k, V]
    return rejection_sample(target, draft_token_ids, point_mass, generator)


def rollback(allocator: BlockAllocator, seq: Sequence, num_rejected: int) -> None:
    """Task 3: forget the K/V of seq's last num_rejected computed tokens (rejected drafts).
    Step seq.num_computed_tokens back by num_rejected, and make the allocator keep token slots
    for the computed tokens only (allocator.truncate(seq_id, num_tokens)), so blocks past them
    go back to the pool. num_rejected 0 changes nothing.

    allocator.truncate(seq_id, num_tokens) is given (chapter 03's allocator, and chapter 07's):
    it keeps seq_id's first num_tokens token slots, drops the sequence's hold on every block
    past them (a block nobody else holds is free again; with prefix caching a keyed one becomes
    evictable), and returns None. It raises ValueError naming the count unless 0 <= num_tokens
    <= the slots held, and UnknownSequenceError for an unknown seq_id, before changing anything.
    seq.seq_id is the sequence's allocator id."""
    raise NotImplementedError(
        "Chapter 11, task 3: rollback() — see chapters/11-speculative-decoding/README.md#task-3")


class Speculator:
    """Given: chapter 11's settings and its three steps, as the engine and the scheduler call them.

    n: how many of the newest tokens to look up; k: how many tokens to propose at most.
    Its methods call this file's functions when they run, so your code is what the engine runs.
    """

    def __init__(self, n: int, k: int):
        for name, value in (("speculative_ngram", n), ("num_speculative_tokens", k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}; it must be an integer >= 1")
        self.n, self.k = n, k

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Drafts for a decoding request whose tokens are `token_ids`: at most min(k, max_drafts)."""
        if max_drafts < 1:
            return []
        return propose_ngram(token_ids, self.n, min(self.k, max_drafts))

    def verify(self, logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
               generator: torch.Generator | None) -> list[int]:
        return verify(logits, draft_token_ids, params, generator)

    def rollback(self, allocator: BlockAllocator, seq: Sequence, num_rejected: int) -> None:
        rollback(allocator, seq, num_rejected)
