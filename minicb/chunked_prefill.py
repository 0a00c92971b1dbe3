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

The scheduler is chapter 06's, with one rule changed (`tokens_to_compute`):
where chapter 06 makes a prompt that does not fit the budget wait, this one
gives it what is left. The blocks for the whole prompt are allocated when the
request is admitted, as in chapter 06; only the computing is spread over steps. A chunk attends to the
earlier chunks' K/V through the block table, with a causal mask shifted by the
number of tokens already computed (chapter 04's `paged_prefill_attention`
already takes `context_lens > q_len`).

The engine (minicb/engine.py) uses this scheduler when
`EngineConfig.enable_chunked_prefill` is on; chapter 06's rule, which admits
prompts whole, stays the default for comparison.
"""
from __future__ import annotations

import math

import torch

from minicb.scheduler import Scheduler

# ---- the causal mask of a chunk ------------------------------------------------------
#
# A chunk is q_len new tokens at the END of a context of context_len tokens (the
# earlier chunks, and any cached prefix, are already in the KV cache). New token r
# sits at position context_len - q_len + r and sees every key at a position <= its own:
#
#     context_len 7, q_len 3 (positions 4, 5, 6 are new)      keys 0 1 2 3 4 5 6
#         new token 0 = position 4                                 x x x x x . .
#         new token 1 = position 5                                 x x x x x x .
#         new token 2 = position 6                                 x x x x x x x
#
# A whole prompt is the case q_len = context_len (the usual lower triangle); a
# decode is q_len = 1 (one row that sees everything).


def _check_lengths(q_len, context_len) -> None:
    for name, value in (("q_len", q_len), ("context_len", context_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if q_len > context_len:
        raise ValueError(f"q_len={q_len} new tokens cannot follow from a context of context_len={context_len}; "
                         f"the new tokens are the last q_len of the context, so q_len <= context_len")


def offset_causal_mask(q_len: int, context_len: int, device=None) -> torch.Tensor:
    """[q_len, context_len] bool: True where new token r may attend to key position j."""
    _check_lengths(q_len, context_len)
    positions = torch.arange(context_len - q_len, context_len, device=device)  # [q_len] the new tokens' positions
    keys = torch.arange(context_len, device=device)  # [context_len]
    return keys[None, :] <= positions[:, None]


def _check_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"want q [q_len, n_heads, head_dim] and k, v [context_len, n_kv_heads, head_dim] of one "
                         f"shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"head_dim must match ({q.shape[2]} vs {k.shape[2]}) and n_heads ({q.shape[1]}) must be "
                         f"a multiple of n_kv_heads ({k.shape[1]})")
    _check_lengths(q.shape[0], k.shape[0])


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of a chunk's new tokens to the whole context so far, in PyTorch.

    q [q_len, n_heads, head_dim]: the new tokens' queries (the last q_len positions).
    k, v [context_len, n_kv_heads, head_dim]: every position's keys and values, the
    new tokens' included. Returns [q_len, n_heads, head_dim]. GQA: query head h
    reads KV head h // (n_heads // n_kv_heads).
    """
    _check_chunk(q, k, v)
    q_len, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [n_heads, context_len, head_dim]
    values = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = (q.transpose(0, 1).float() @ keys.transpose(1, 2)) * scale  # [n_heads, q_len, context_len]
    scores = scores.masked_fill(~offset_causal_mask(q_len, k.shape[0], q.device), float("-inf"))
    out = scores.softmax(-1) @ values  # [n_heads, q_len, head_dim]
    return out.transpose(0, 1).to(q.dtype)


def chunk_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """chunk_attention in Triton: the same shapes and the same answer.

    The reference hands the chunk to the query-tile kernel of minicb/tile_attention.py,
    whose programs apply the same offset causal mask to a tile of new tokens: the
    context becomes a pool of ONE block of context_len tokens, with block table [[0]].
    (The exercise asks for a kernel of your own over dense K/V.)
    """
    from minicb import tile_attention  # here: importing it imports triton, which the scheduler never needs

    _check_chunk(q, k, v)
    q_len, context_len = q.shape[0], k.shape[0]
    if q_len == 0:
        return q.clone()
    int32 = dict(dtype=torch.int32, device=q.device)
    return tile_attention.paged_attention_tiles(
        q.contiguous(), k[None].contiguous(), v[None].contiguous(), torch.zeros(1, 1, **int32),
        torch.tensor([context_len], **int32), torch.tensor([0, q_len], **int32), scale)


# ---- the scheduler: one rule changed ---------------------------------------------------------


def chunk_size(num_remaining: int, budget: int) -> int:
    """Tokens of a request to compute this step: all it still needs, or what is left of the budget."""
    return max(0, min(num_remaining, budget))


class ChunkedScheduler(Scheduler):
    """Chapter 06's scheduler with its one rule changed: a prompt may be cut to the budget.

    Everything else is chapter 06's loop: running requests first (decodes, then
    the next chunk of each prompt still being computed, oldest first), then new
    requests from the front of the queue, each given tokens_to_compute(what it
    still needs, what is left of the budget). Here that is a chunk, so no step
    computes more than `max_num_batched_tokens` tokens, and a long prompt fills
    what the decodes leave over several steps.
    """

    def tokens_to_compute(self, num_remaining: int, budget: int, step_is_empty: bool) -> int:
        return chunk_size(num_remaining, budget)
