"""Chapter 01: turning logits into the next token, and deciding when to stop.

In this file you will learn:
- greedy decoding (argmax) and sampling with temperature, top-k and top-p;
- why each request gets its own seeded `torch.Generator`: a batch then never
  changes what a seeded request says, because no request consumes random
  numbers from another's stream;
- how one token is drawn from a distribution: a uniform number, and the first
  token where the running sum of probabilities passes it (`draw`);
- the three ways a sequence ends: EOS, a stop token, or max_tokens;
- the rules a client may add on top, each a change to the logits row before
  the choice: min_tokens, a repetition penalty and OpenAI's presence and
  frequency penalties (`apply_rules`: these read what the row has seen so
  far, its *history*), and min_p beside top-k and top-p (`probabilities`).

Used by every engine, from chapter 01's loop to chapter 06's scheduler.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


STRUCTURED_KINDS = ("json_schema", "regex", "choice", "json_object")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's text must be (chapter 12): every token is sampled under the grammar's mask.

    kind "json_schema" (spec: a JSON schema, a dict), "regex" (spec: a pattern),
    "choice" (spec: a list of strings, the text is one of them) or "json_object"
    (any JSON object, no spec). minicb/structured/ compiles it.
    """

    kind: str
    spec: object = None

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured.kind={self.kind!r}; it must be one of {', '.join(STRUCTURED_KINDS)}")


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
    # Rules that change the logits before the choice (apply_rules; min_p in probabilities). Off by default.
    min_tokens: int = 0  # EOS and the stop tokens cannot be chosen until this many tokens were generated
    repetition_penalty: float = 1.0  # > 1 makes every token of prompt + output less likely; 1 = off
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far; 0 = off
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far; 0 = off
    min_p: float = 0.0  # sampled rows drop tokens less likely than min_p times the top token; 0 = off
    # Scores (minicb/logprobs.py), the model's own distribution before any sampling rule:
    logprobs: int | None = None  # each generated token's logprob, with the top k (0..20) of its row; None: none
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none); None: none
    # Structured output (chapter 12): the text must match this grammar; None: any text.
    structured: StructuredOutput | None = None

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
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens={self.min_tokens!r}; it must be an integer in [0, max_tokens], "
                             f"here [0, {self.max_tokens}]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}; it must be a finite number > 0 "
                             f"(1 means no penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)!r}; it must be in [-2, 2] (0 means no penalty)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r}; it must be in [0, 1] (0 means no limit)")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured={self.structured!r}; it must be a StructuredOutput or None")
            # The grammar ends the text with EOS once it is complete: a request may not forbid that.
            if self.ignore_eos:
                raise ValueError("ignore_eos=True with structured output: the grammar ends the text with EOS "
                                 "when it is complete; leave ignore_eos False")
            if self.min_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} with structured output: EOS must stay allowed "
                                 f"whenever the grammar is complete; leave min_tokens 0")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
                raise ValueError(f"{name}={k!r}; it must be None (no scores) or an integer in [0, 20] (the top "
                                 f"tokens to list beside each token's own logprob)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def history_rules(self) -> list[str]:
        """The fields set here that read the row's history (apply_rules); [] for most requests."""
        return [name for name, off in (("min_tokens", 0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                       ("frequency_penalty", 0.0)) if getattr(self, name) != off]


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


def apply_rules(logits: torch.Tensor, params: list[SamplingParams],
                histories: list[tuple[list[int], list[int]]] | None,
                eos_token_ids: list[int] | None) -> torch.Tensor:
    """The rules that read a row's history, applied to its logits. logits [R, V] fp32 -> [R, V].

    Row r is scored with params[r], after histories[r] = (prompt ids, output ids so
    far): the tokens the row has seen. Each rule a request sets, in this order:
      min_tokens          while the output has fewer tokens, EOS (unless ignore_eos)
                          and the stop tokens get -inf: the row cannot end yet;
      repetition_penalty  every token id of prompt or output: a positive logit is
                          divided by it, a negative one multiplied (HF's and vLLM's
                          rule: above 1, a seen token gets less likely whatever its sign);
      presence_penalty,   over the output only (OpenAI's rule), with count the times a
      frequency_penalty   token was generated: logit -= presence * (count > 0) + frequency * count.
    The three rules commute (-inf stays -inf), and all of them come before greedy's
    argmax and before temperature, so greedy text obeys them too. For example, with
    logits [2.0, -1.0, 0.5], prompt [0], output [1, 1], repetition_penalty 2 and
    frequency_penalty 0.5: token 0 -> 2.0 / 2 = 1.0, token 1 -> -1.0 * 2 - 0.5 * 2 = -3.0,
    token 2 stays 0.5.

    When no row sets a rule this returns `logits` itself and reads no history at
    all: that is every request that did not ask. Otherwise it returns a changed
    copy. A row with a rule and no history to read is refused (ValueError naming
    the field), never served without its rule.
    """
    rule_rows = [r for r, p in enumerate(params) if p.history_rules]
    if not rule_rows:
        return logits
    first = params[rule_rows[0]]
    if histories is None or len(histories) != len(params):
        name = first.history_rules[0]
        raise ValueError(f"{name}={getattr(first, name)!r} needs the tokens each row has seen: pass sample() one "
                         f"(prompt ids, output ids) per row as histories (got "
                         f"{'none' if histories is None else len(histories)} for {len(params)} rows)")
    logits = logits.clone()
    vocab = logits.shape[-1]
    for r in rule_rows:
        p, (prompt_ids, output_ids) = params[r], histories[r]
        row = logits[r]  # [V], a view into the copy: the rules write through it
        if len(output_ids) < p.min_tokens:
            if eos_token_ids is None and not p.ignore_eos:
                raise ValueError(f"min_tokens={p.min_tokens!r} masks EOS, so it needs the model's eos_token_ids")
            ends = p.stop_token_ids + ([] if p.ignore_eos else list(eos_token_ids))
            row[[t for t in ends if 0 <= t < vocab]] = float("-inf")  # an id past the vocabulary never comes
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_ids).union(output_ids)), dtype=torch.long, device=row.device)
            scores = row[seen]  # [S]
            row[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=row.device),
                                    minlength=vocab).to(row.dtype)  # [V]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        # A penalty far from 1 (1e-250) sends a logit past float32's range. +inf would make the
        # softmax NaN (inf - inf), so it becomes the largest finite logit; -inf (a mask, or an
        # overflow downwards) stays: that token just cannot come.
        torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max, neginf=float("-inf"), out=row)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set everything outside the top-k / top-p / min-p set to -inf, in that order. logits [V] fp32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # The nucleus: the most likely tokens, in order, until their probabilities reach top_p.
        # On SmolLM2's chat logits it held 1 to 902 of the 49,152 (top_p 0.9 and 0.95), so look at
        # the top 64 first and at 4 times as many only while they fall short: a top-k is one pass
        # over the row, where torch.sort of the whole row took 7.6 ms on a CPU.
        probs = logits.softmax(-1)
        k = min(64, len(probs))
        while True:
            top, order = torch.topk(probs, k)  # [k], most likely first
            before = top.cumsum(-1, dtype=torch.float64) - top  # [k]: the probability of the tokens ahead of each
            if k == len(probs) or before[-1] + top[-1] >= top_p:  # every token after these is dropped
                break
            k = min(4 * k, len(probs))
        # Drop a token when the tokens before it already reach top_p; the first always stays
        # (set outright: a top_p below float32's smallest number rounds to 0, and 0 >= 0).
        keep = before < top_p
        keep[0] = True
        drop = torch.ones_like(logits, dtype=torch.bool)
        drop[order[keep]] = False
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        # Keep a token at least min_p times as likely as the top one. A ratio of two
        # probabilities, so it reads the same before or after the filters above renormalise.
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: temperature, then top-k, top-p and min-p. [..., V] -> [..., V].

    Not for greedy params (temperature 0). Chapter 11's rejection sampler
    verifies drafts against exactly this distribution.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    # Shift each row's largest logit to 0 before dividing: the distribution is the same, and a
    # tiny temperature sends the others to -inf instead of every logit to +-inf (NaN). One below
    # the dtype's smallest normal number (1e-300 is 0 in float32) is taken as that number.
    temperature = max(params.temperature, torch.finfo(rows.dtype).tiny)
    rows = (rows - rows.amax(-1, keepdim=True)) / temperature
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        rows = torch.stack([filter_logits(row, params.top_k, params.top_p, params.min_p) for row in rows])
    return rows.softmax(-1).reshape(logits.shape)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution probs [V], with one uniform number u from `generator`.

    Lay the probabilities end to end on [0, total): token i owns the stretch from the sum
    of those before it to that sum plus probs[i]. The token whose stretch holds u * total
    is the draw, found by binary search in the running sums; a token of probability 0 owns
    no stretch and never comes. The sums are float64, so that 49,152 small terms add up
    without losing the tail.

    torch.multinomial draws the same distribution, but on a CPU took 1.2-1.3 ms a row
    (without replacement, its default, it draws a random number for every token of the
    vocabulary; with replacement it was no faster) against 75 us here: 32 sampled
    requests spent 40 ms of each step on it (docs/results.md, "Sampling at the cost of
    one random number").

        draw(torch.tensor([0.5, 0.0, 0.5]), g)   # u < 0.5 -> 0, else 2; never 1
    """
    cumulative = probs.cumsum(0, dtype=torch.float64)  # [V]
    target = torch.rand((), generator=generator, device=probs.device, dtype=torch.float64) * cumulative[-1]
    # The first running sum past the target. u < 1 (torch.rand's largest float64 is 1 - 2^-53), and
    # u * total rounds below the total, so the last sum is always past it: no index falls off the end.
    return int(torch.searchsorted(cumulative, target, right=True))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: logits [B, V] -> B token ids; the first of equal maxima, and a NaN
    counts as the largest, as in torch.argmax.

    On a CPU, in float32, NumPy's argmax: on an Intel Xeon torch's took 3.0 ms over the
    32 x 49,152 logits of a decode step, NumPy's 0.7-0.9 (the same rules, one vectorised pass).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[tuple[list[int], list[int]]] | None = None,
           eos_token_ids: list[int] | None = None) -> list[int]:
    """One token per row. logits [B, V] (fp32); params and generators have B entries.

    histories: each row's (prompt ids, output ids so far), and eos_token_ids: the
    model's, for the rules that read them (apply_rules). A caller whose requests set
    none of those rules may leave both out, as the loops of chapters 01, 02 and 04 do; a
    request that sets one is then refused with a ValueError naming the field.
    """
    logits = apply_rules(logits, params, histories, eos_token_ids)  # itself when no row has a rule
    # Greedy rows (the common case in tests and benchmarks) share one argmax.
    tokens = greedy_tokens(logits)
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        tokens[row] = draw(probabilities(logits[row], p), g)
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
