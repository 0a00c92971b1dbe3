"""Chapter 01 exercises: the generation loop, without and then with a KV cache.

Fill in each stub, then run `python -m minicb check 1`. The chapter text
(chapters/01-naive-generation/README.md) explains every task.

What you call (all given):
- `model(input_ids, positions, attention, logits_at=None)` from chapter 00:
  input_ids, positions [B, T] long -> logits [B, T, vocab] fp32, or
  [B, K, vocab] when `logits_at` [B, K] names the K positions you need.
- `DenseAttention()`: attention over exactly the tokens of this forward, causal.
- `attend(q, k, v, mask)`: grouped-query attention in [B, T, heads, hd] layout;
  mask broadcasts to [B, 1, Tq, Tk], True = may attend, None = attend to all.
- `make_generator(params, device)` once per request, then
  `sample(logits [B, V], [params], [generator]) -> [token]` once per step.
- `finish_reason(token, num_generated, params, eos_token_ids, num_tokens, max_model_len)`
  -> "stop" | "length" | None. `num_generated` and `num_tokens` (prompt +
  generated) both count `token` itself; `max_model_len` is
  model.config.max_position_embeddings, so a full context ends with "length" too.
- `check_prompt(prompt_ids, max_context)` returns None for a prompt that fits and
  raises ValueError for an empty prompt (the message says "the prompt is empty")
  and for a prompt of max_context tokens or more (the message names its length).
  Call it first and let its errors through.
- `Generation(token_ids, finish_reason)`: what both loops return, the generated
  tokens (not the prompt) and "stop" or "length".
"""
from __future__ import annotations

import torch  # noqa: F401  (you will need it)

from minicb import naive as _reference
from minicb.model import DenseAttention, Model, attend  # noqa: F401  # given (chapter 00)
from minicb.naive import Generation, check_prompt  # noqa: F401  # given
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample  # noqa: F401  # given


def generate_no_cache(model: Model, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Generate by running the model over the *whole* sequence at every step.

    Check the prompt first (check_prompt). Each step: a forward over all tokens
    so far with positions 0..T-1 and a fresh DenseAttention(); sample from the
    last position's logits; append; stop when finish_reason says so (it also
    says "length" when prompt + generated tokens fill the model's context,
    model.config.max_position_embeddings). The token that ended the sequence
    stays in Generation.token_ids.
    """
    raise NotImplementedError(
        "Chapter 1, task 1: generate_no_cache() — see chapters/01-naive-generation/README.md#task-1")


class ContiguousKVCache(_reference.ContiguousKVCache):
    """The `attention` object of a cached forward. Given: __init__, key_mask, advance.

    self.k, self.v   [num_layers, B, max_len, n_kv_heads, head_dim], zeros at first
    self.seq_len     how many tokens are stored already (the same for every row)
    self.max_len     how many fit
    key_mask(end)    None here; chapter 02 returns a [B, end] bool mask of real tokens
    advance(n)       the caller's "n more tokens are stored now", after each forward
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this forward's keys and values, then attend over everything cached.

        q [B, T, n_heads, hd]; k, v [B, T, n_kv_heads, hd] -> out [B, T, n_heads, hd].
        The T new tokens go to columns [seq_len, seq_len + T) of layer `layer`
        (do not advance seq_len here: every layer sees the same seq_len, and the
        caller advances once per forward). If they do not fit, raise
        RuntimeError with the value of max_len in the message. New token i sits at column seq_len + i and may see
        columns 0 .. seq_len + i: a lower-triangular mask shifted right by
        seq_len. Combine it with key_mask(seq_len + T) when that is not None,
        so that chapter 02's subclass works unchanged.
        """
        raise NotImplementedError(
            "Chapter 1, task 2: ContiguousKVCache.__call__() — see chapters/01-naive-generation/README.md#task-2")


def generate_with_cache(model: Model, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """The same tokens as generate_no_cache, with one prefill and then one-token decodes.

    Size the cache for prompt + max_tokens (but no more than the context). Prefill:
    one forward over the whole prompt, logits only at its last position, then
    advance. Decode: a forward over the one newest token at position seq_len,
    then advance. Same stopping rules as task 1, including the full context:
    prompt + generated tokens never exceed max_position_embeddings.
    """
    raise NotImplementedError(
        "Chapter 1, task 3: generate_with_cache() — see chapters/01-naive-generation/README.md#task-3")
