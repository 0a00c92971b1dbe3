"""The benchmark's workloads: which requests arrive, and when.

In this file you will learn how a serving benchmark builds its load. A request
is prompt token ids, its own output budget, and whether EOS ends it:
    chat     the bundled prompts in the chat template; answers end at EOS or --max-tokens
    random   random token prompts; long-tailed output lengths, EOS ignored (HF has no
             ignore_eos, so its engines forbid EOS instead: the same work, other tokens)
    poisson  the chat prompts (random ones if the model has no tokenizer), arriving
             at --rate requests/s, as a Poisson process: independent users, so the gaps
             between arrivals are exponential and sometimes several come at once.

Each is seeded (--seed), so every engine sees exactly the same requests.

    python -m minicb bench --workload random --num-prompts 32 --max-tokens 128
    python -m minicb bench --workload poisson --rate 0.5
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from minicb.sampling import SamplingParams

WORKLOADS = ("chat", "random", "poisson")


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)


def chat_requests(tokenizer, num_prompts: int, max_tokens: int) -> list[Request]:
    from minicb.data import load_chat_prompts
    return [Request(tokenizer.apply_chat_template([{"role": "user", "content": text}]), max_tokens)
            for text in load_chat_prompts(num_prompts)]


def random_requests(vocab_size: int, num_prompts: int, max_tokens: int, max_prompt_len: int,
                    seed: int) -> list[Request]:
    """Uniform prompt lengths in [8, max_prompt_len]; output lengths lognormal with median
    max_tokens / 4 and sigma 1, capped at max_tokens: most answers are short, a few run to the cap."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)  # skip the first ids: in real vocabularies they are special tokens
    requests = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(low, vocab_size) for _ in range(rng.randint(8, max(8, max_prompt_len)))]
        out_len = min(max_tokens, max(1, round(rng.lognormvariate(math.log(max(1, max_tokens / 4)), 1.0))))
        requests.append(Request(prompt, out_len, ignore_eos=True))
    return requests


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` requests/s; the first arrives at 0."""
    if rate <= 0:
        raise ValueError(f"rate={rate} requests/s; it must be > 0")
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def build_requests(workload: str, args, tokenizer, vocab_size: int) -> tuple[list[Request], list[float] | None, str]:
    """The requests, their arrival times (None = all at once) and a one-line description."""
    if workload == "random" or tokenizer is None:
        requests = random_requests(vocab_size, args.num_prompts, args.max_tokens, args.random_max_prompt, args.seed)
        description = (f"{len(requests)} random prompts of 8-{args.random_max_prompt} tokens, lognormal output "
                       f"lengths capped at {args.max_tokens}, EOS ignored")
    else:
        requests = chat_requests(tokenizer, args.num_prompts, args.max_tokens)
        description = f"{len(requests)} chat prompts, greedy, EOS or {args.max_tokens} tokens"
    if workload != "poisson":
        return requests, None, description
    return (requests, poisson_arrivals(len(requests), args.rate, args.seed),
            description + f", Poisson arrivals at {args.rate:g} req/s")
