"""Chapter 01: naive generation, first with no cache, then with a contiguous KV cache.

In this file you will learn:
- the generation loop: forward, pick a token, append it, check whether to stop;
- why recomputing the whole sequence every step costs O(T^2) over a generation:
  step t runs the model over t tokens, although only the last one is new;
- the fix every engine uses: keep each layer's keys and values (the KV cache).
  A *prefill* runs the prompt once and fills the cache; each *decode* step then
  runs one token and attends over the cache.

Both loops give the same greedy tokens (tests/chapters/test_ch01_naive.py checks this on
the tiny model and on SmolLM2). The benchmark at the bottom shows the step time
against sequence length: growing for the no-cache loop, flat for the cache.

    python -m minicb.naive            # table + naive_step_time.png

Chapter text: chapters/01-naive-generation/README.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minicb.model import DenseAttention, Model, attend
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens, including the EOS/stop token that ended them
    finish_reason: str  # "stop" | "length"


def check_prompt(prompt_ids: list[int], max_context: int) -> None:
    """Reject prompts no engine could serve, with a message that says why."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_ids) >= max_context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {max_context}; "
                         f"it must be shorter than that so at least one token can be generated")


def first_difference(got: list[int], want: list[int], names: tuple[str, str] = ("got", "want")) -> str:
    """Where two token lists part ways, in words a failing test or benchmark can print.

    Every later chapter is checked against this chapter's tokens, so the
    message names the first token that differs (and shows short lists whole).
    """
    a, b = names
    where = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
    if where is None:
        text = f"same first {min(len(got), len(want))} tokens, then lengths differ: {a} {len(got)}, {b} {len(want)}"
    else:
        text = f"first difference at token {where}: {a} {got[where]}, {b} {want[where]}"
    if len(got) <= 40 and len(want) <= 40:
        text += f"\n  {a:>8} {got}\n  {b:>8} {want}"
    return text


# ----------------------------------------------------------------------------
# Version 1: no cache. Every step runs the model over the whole sequence.


def generate_no_cache(model: Model, prompt_ids: list[int], params: SamplingParams) -> Generation:
    cfg = model.config
    check_prompt(prompt_ids, cfg.max_position_embeddings)
    generator = make_generator(params, model.device)
    tokens = list(prompt_ids)
    out: list[int] = []
    while True:
        ids = torch.tensor([tokens], device=model.device)  # [1, T]: everything, every step
        positions = torch.arange(len(tokens), device=model.device)[None]  # [1, T]
        last = torch.tensor([[len(tokens) - 1]], device=model.device)
        logits = model(ids, positions, DenseAttention(), logits_at=last)  # [1, 1, V]
        token = sample(logits[:, -1], [params], [generator])[0]
        out.append(token)
        tokens.append(token)
        reason = finish_reason(token, len(out), params, cfg.eos_token_ids, len(tokens), cfg.max_position_embeddings)
        if reason:
            return Generation(out, reason)


# ----------------------------------------------------------------------------
# Version 2: a contiguous KV cache, one [B, max_len] slab per layer.


class ContiguousKVCache:
    """The `attention` object for a cached forward.

    k, v: one tensor each for all layers, [num_layers, B, max_len, n_kv_heads, hd].
    `seq_len` tokens are already stored. A forward over T new tokens writes their
    K/V at [seq_len, seq_len + T) and attends over [0, seq_len + T) causally;
    the caller then calls `advance(T)`. The whole max_len is reserved up front,
    used or not: chapter 03 measures how much that wastes.
    """

    def __init__(self, model: Model, batch_size: int, max_len: int):
        cfg = model.config
        shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.max_len = max_len
        self.seq_len = 0

    def key_mask(self, end: int) -> torch.Tensor | None:
        """Which cached keys may be attended at all, [B, end] bool; None = all. Chapter 02 overrides it."""
        return None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B, T, n_heads, hd]; k, v [B, T, n_kv_heads, hd]
        T = q.shape[1]
        start, end = self.seq_len, self.seq_len + T
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} tokens do not fit in max_len={self.max_len}")
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        keys, values = self.k[layer, :, :end], self.v[layer, :, :end]  # [B, end, n_kv, hd]
        # Query i (absolute position start + i) sees keys 0 .. start + i.
        causal = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(diagonal=start)  # [T, end]
        mask = causal[None, None]  # [1, 1, T, end]
        key_mask = self.key_mask(end)
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :]
        if T == 1 and key_mask is None:
            mask = None  # a single new token may see the whole cache
        return attend(q, keys, values, mask)

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens


def generate_with_cache(model: Model, prompt_ids: list[int], params: SamplingParams) -> Generation:
    cfg = model.config
    check_prompt(prompt_ids, cfg.max_position_embeddings)
    generator = make_generator(params, model.device)
    max_len = min(len(prompt_ids) + params.max_tokens, cfg.max_position_embeddings)
    cache = ContiguousKVCache(model, batch_size=1, max_len=max_len)

    # Prefill: the whole prompt in one forward; only the last position needs logits.
    ids = torch.tensor([prompt_ids], device=model.device)  # [1, P]
    positions = torch.arange(len(prompt_ids), device=model.device)[None]
    last = torch.tensor([[len(prompt_ids) - 1]], device=model.device)
    logits = model(ids, positions, cache, logits_at=last)  # [1, 1, V]
    cache.advance(len(prompt_ids))

    out: list[int] = []
    while True:
        token = sample(logits[:, -1], [params], [generator])[0]
        out.append(token)
        reason = finish_reason(token, len(out), params, cfg.eos_token_ids,
                               len(prompt_ids) + len(out), cfg.max_position_embeddings)
        if reason:
            return Generation(out, reason)
        # Decode: one token in, attending over everything cached so far.
        ids = torch.tensor([[token]], device=model.device)  # [1, 1]
        positions = torch.tensor([[cache.seq_len]], device=model.device)
        logits = model(ids, positions, cache)  # [1, 1, V]
        cache.advance(1)


# ----------------------------------------------------------------------------
# Benchmark: time per generated token against sequence length.


def step_times(model: Model, lengths: list[int]) -> dict[str, list[float]]:
    """Seconds for the step that produces token number L, for each L, with and without a cache."""
    import time

    vocab = model.config.vocab_size
    # Any tokens will do (step time does not depend on which); a private generator
    # makes them the same every call without reseeding the caller's global RNG.
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (1, max(lengths) + 1), generator=generator).to(model.device)
    results = {"no cache": [], "kv cache": []}
    for L in lengths:
        # No cache: the step at length L is a forward over all L tokens.
        t0 = time.perf_counter()
        model(tokens[:, :L], torch.arange(L, device=model.device)[None], DenseAttention(),
              logits_at=torch.tensor([[L - 1]], device=model.device))
        results["no cache"].append(time.perf_counter() - t0)
        # Cache: prefill L-1 tokens (not timed), then time the single decode step.
        cache = ContiguousKVCache(model, 1, L)
        model(tokens[:, :L - 1], torch.arange(L - 1, device=model.device)[None], cache,
              logits_at=torch.tensor([[L - 2]], device=model.device))
        cache.advance(L - 1)
        t0 = time.perf_counter()
        model(tokens[:, L - 1:L], torch.tensor([[L - 1]], device=model.device), cache)
        results["kv cache"].append(time.perf_counter() - t0)
    return results


if __name__ == "__main__":
    import argparse

    from minicb.weights import load_model

    ap = argparse.ArgumentParser(description="Step time against sequence length, with and without a KV cache")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--lengths", default="16,64,128,256,512,768,1024")
    ap.add_argument("--png", default="naive_step_time.png")
    args = ap.parse_args()
    model = load_model(args.model, device=args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    step_times(model, lengths[:2])  # warm-up
    res = step_times(model, lengths)
    print(f"{'seq len':>8} | {'no cache (ms)':>13} | {'kv cache (ms)':>13} | ratio")
    for i, L in enumerate(lengths):
        a, b = res["no cache"][i] * 1e3, res["kv cache"][i] * 1e3
        print(f"{L:>8} | {a:>13.1f} | {b:>13.1f} | {a / b:5.1f}x")
    # A bare Figure, not pyplot: saving it to a file needs no GUI backend and no backend switch.
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for name, ys in res.items():
        ax.plot(lengths, [y * 1e3 for y in ys], marker="o", label=name)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("time for one new token (ms)")
    ax.set_title(f"{model.config.architecture}, {model.device}, {model.dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"saved {args.png}")
