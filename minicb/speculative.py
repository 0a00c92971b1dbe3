"""Chapter 11: speculative decoding -- propose, verify, roll back, losslessly.

In this file you will learn why a decode step can yield more than one token
without changing what the model says:
- a decode step at small batch reads every weight to compute one token per
  request, so computing 1 + k tokens of a request in the same forward costs
  about the same. If we can *guess* the next k tokens, one forward checks all
  the guesses at once;
- the guess here needs no second model: *prompt lookup*. Text that copies its
  context (rewrite this, fix the typo, continue the list) repeats n-grams, so
  find the request's last n tokens earlier in its own context and propose the
  k tokens that followed them (`propose_ngram`);
- the model's logits at the 1 + k positions decide (`verify`). Greedy: keep a
  draft while it equals the argmax. Sampling: keep draft x with probability
  min(1, p(x)/q(x)), and at the first rejection draw from the residual
  max(0, p - q), normalised (`rejection_sample`). Either way one more token
  comes free: the correction at the first rejection, or a bonus token after
  the last draft. The output distribution is exactly the model's;
- rejected drafts leave K/V behind in the paged cache. `rollback` sets the
  request's computed count back and returns the blocks past it. No prefix
  cache key ever covers a draft: the scheduler keys only blocks of real tokens.

The scheduler (minicb/scheduler.py) asks `Speculator.propose` for each decoding
request's drafts and schedules 1 + len(drafts) tokens for it under the step's
token budget, like a chunk of a prompt (chapter 08's offset mask does the rest);
the engine (minicb/engine.py) verifies the drafts from those positions' logits;
the scheduler's postprocess appends what was accepted and rolls back the rest.
Chapter text: chapters/11-speculative-decoding/README.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minicb.sampling import SamplingParams, draw, greedy_tokens, probabilities

if TYPE_CHECKING:
    from minicb.block_allocator import BlockAllocator
    from minicb.scheduler import Sequence


def propose_ngram(token_ids: list[int], n: int, k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier match of the last n tokens.

    The match must start before the last n tokens themselves. Returns fewer than
    k tokens when the match sits near the end, and [] when the last n tokens
    appear nowhere earlier (or the context has no more than n tokens).

        propose_ngram([5, 6, 7, 8, 5, 6], n=2, k=3) -> [7, 8, 5]
    """
    if len(token_ids) <= n:
        return []
    tail = token_ids[-n:]
    for start in range(len(token_ids) - n - 1, -1, -1):  # latest match first
        if token_ids[start] == tail[0] and token_ids[start:start + n] == tail:
            return token_ids[start + n:start + n + k]
    return []


def accept_greedy(argmax: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy verification. argmax[i] is the model's choice after draft i (argmax[0]: after the newest token).

    Keep drafts while each equals the model's choice at its position; then add
    the model's choice where the first draft failed (or after the last draft).
    Returns 1 .. len(drafts) + 1 tokens: exactly what greedy decoding one token
    at a time would produce.

        accept_greedy([7, 8, 3], [7, 9]) -> [7, 8]
    """
    tokens = []
    for i, draft in enumerate(draft_token_ids):
        if draft != argmax[i]:
            break
        tokens.append(draft)
    tokens.append(argmax[len(tokens)])
    return tokens


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Lossless verification of k drafts against the target distribution.

    target_probs [k + 1, V]: the model's distribution after the newest token and
    after each draft. draft_probs [k, V]: the distribution each draft was drawn
    from (one-hot for a proposer that is sure, like prompt lookup). For draft i,
    with p = target_probs[i], q = draft_probs[i] and x = draft_token_ids[i]:
    accept x with probability min(1, p(x) / q(x)); at the first rejection, draw
    from max(0, p - q) normalised and stop; if all k are accepted, draw a bonus
    token from target_probs[k]. Every draw uses `generator`, so a seed repeats.
    Returns 1 .. k + 1 tokens, distributed exactly as sampling from p one token
    at a time would be.
    """
    tokens = []
    for i, x in enumerate(draft_token_ids):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[x] < p[x]:  # u < p(x) / q(x), without dividing by a q(x) of 0
            tokens.append(x)
            continue
        residual = (p - q).clamp(min=0)
        tokens.append(draw(residual / residual.sum(), generator))
        return tokens
    tokens.append(draw(target_probs[len(draft_token_ids)], generator))
    return tokens


def verify(logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens one speculating request yields this step. logits [k + 1, V] fp32, k = len(drafts).

    Greedy requests keep drafts that equal the argmax; sampled ones go through
    rejection_sample against the request's own distribution (temperature, top-k,
    top-p and min-p applied), with the n-gram proposer's point mass as the draft
    distribution. The engine has applied the request's history rules (penalties,
    min_tokens: minicb/sampling.py's apply_rules) to each row already.
    """
    if params.greedy:
        return accept_greedy(greedy_tokens(logits), draft_token_ids)
    target = probabilities(logits, params)  # [k + 1, V]
    drafts = torch.tensor(draft_token_ids, device=logits.device)
    point_mass = torch.nn.functional.one_hot(drafts, logits.shape[-1]).to(target.dtype)  # [k, V]
    return rejection_sample(target, draft_token_ids, point_mass, generator)


def rollback(allocator: BlockAllocator, seq: Sequence, num_rejected: int) -> None:
    """Forget the K/V of `seq`'s last `num_rejected` computed tokens: rejected drafts.

    Its computed count steps back by num_rejected, and the allocator keeps token
    slots for the computed tokens only (allocator.truncate), so blocks that held
    nothing but rejected drafts go back to the pool. The K/V left in a kept block
    past the computed count is garbage that the next step overwrites.
    """
    allocator.truncate(seq.seq_id, seq.num_computed_tokens - num_rejected)  # raises first if that is wrong
    seq.num_computed_tokens -= num_rejected


class Speculator:
    """Chapter 11's settings and its three steps, as the engine and the scheduler call them.

    n: how many of the newest tokens to look up; k: how many tokens to propose at most.
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

    # The module's functions, looked up when called (a grader may swap one for the reference's).
    def verify(self, logits: torch.Tensor, draft_token_ids: list[int], params: SamplingParams,
               generator: torch.Generator | None) -> list[int]:
        return verify(logits, draft_token_ids, params, generator)

    def rollback(self, allocator: BlockAllocator, seq: Sequence, num_rejected: int) -> None:
        rollback(allocator, seq, num_rejected)
