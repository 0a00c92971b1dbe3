"""Chapter 01: turning logits into the next token, and deciding when to stop.

In this file you will learn:
- greedy decoding (argmax) and sampling with temperature, top-k and top-p;
- why each request gets its own seeded `torch.Generator`: a batch then never
  changes what a seeded request says, because no request consumes random
  numbers from another's stream;
- the three ways a sequence ends: EOS, a stop token, or max_tokens.

Used by every engine, from chapter 01's loop to chapter 06's scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 128  # new tokens at most (the EOS/stop token counts as one)
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = no limit
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p
    seed: int | None = None  # per request: the same seed gives the same text whatever shares the batch
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past EOS (benchmarks use this for fixed lengths)
    n: int = 1  # completions of the same prompt (parallel sampling): the prompt is computed once

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}; it must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}; it must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}; it must be an integer >= 0 (0 means no limit)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}; it must be in (0, 1]")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n={self.n!r}; it must be an integer >= 1 (completions per prompt)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device | str, completion: int = 0) -> torch.Generator | None:
    """A private random stream for one request (None for greedy or unseeded).

    With n > 1 each completion gets its own stream, derived from the seed and its
    number, so the same seed gives the same n texts whatever else runs. Completion
    0 uses the seed itself, as a request with n = 1 does.
    """
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if completion == 0 else (params.seed * 1_000_003 + completion) % 2**63)
    return g


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set everything outside the top-k / top-p set to -inf. logits [V] fp32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays
        # (set outright: a top_p below float32's smallest number rounds to 0, and 0 >= 0).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: temperature, then top-k and top-p. [..., V] -> [..., V].

    Not for greedy params (temperature 0). Chapter 11's rejection sampler
    verifies drafts against exactly this distribution.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    # Shift each row's largest logit to 0 before dividing: the distribution is the same, and a
    # tiny temperature sends the others to -inf instead of every logit to +-inf (NaN). One below
    # the dtype's smallest normal number (1e-300 is 0 in float32) is taken as that number.
    temperature = max(params.temperature, torch.finfo(rows.dtype).tiny)
    rows = (rows - rows.max(-1, keepdim=True).values) / temperature
    filtered = torch.stack([filter_logits(row, params.top_k, params.top_p) for row in rows])
    return filtered.softmax(-1).reshape(logits.shape)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row. logits [B, V] (fp32); params and generators have B entries."""
    # Greedy rows (the common case in tests and benchmarks) share one argmax.
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        tokens[row] = int(torch.multinomial(probabilities(logits[row], p), 1, generator=g).item())
    return tokens


def finish_reason(token_id: int, num_generated: int, params: SamplingParams, eos_token_ids: list[int],
                  num_tokens: int, max_model_len: int) -> str | None:
    """Why a sequence ends after sampling `token_id`, or None if it goes on.

    The one stop rule every engine calls, from chapter 01's loop to chapter 06's
    scheduler:
      "stop"    token_id is EOS (unless params.ignore_eos) or one of params.stop_token_ids;
      "length"  num_generated reached params.max_tokens, or the sequence fills the
                model's context (num_tokens >= max_model_len), so no position is
                left for another token.
    `num_generated` and `num_tokens` (prompt + generated) both count `token_id`
    itself. The token that ended a sequence stays in its output, as in vLLM.
    """
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_generated >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
