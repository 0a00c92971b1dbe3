"""The benchmark's workloads: which requests arrive, and when.

In this file you will learn how a serving benchmark builds its load. A request
is prompt token ids, its own output budget, and whether EOS ends it:
    chat     the bundled prompts in the chat template; answers end at EOS or --max-tokens
    random   random token prompts; long-tailed output lengths, EOS ignored (HF has no
             ignore_eos, so its engines forbid EOS instead: the same work, other tokens)
    poisson  the chat prompts (random ones if the model has no tokenizer), arriving
             at --rate requests/s, as a Poisson process: independent users, so the gaps
             between arrivals are exponential and sometimes several come at once.
    shared-prefix  chat questions behind one long system prompt, and every third
             request a conversation that resends an earlier turn, arriving as the
             poisson workload's do: the traffic prefix caching is for (compare
             minicb-continuous with minicb-prefix-cache).
    long-prompt  chat requests decoding while long prompts (1,000+ tokens: the chat
             prompts' questions pasted together) arrive, one every few requests, at
             --rate: the traffic chunked prefill is for (compare minicb-continuous
             with minicb-chunked, and read the ITL p99).
    repeat   requests whose answers copy spans of their prompts: fix the typos in a
             paragraph, rewrite it, continue a list. The traffic prompt-lookup
             speculative decoding is for (compare minicb-continuous with minicb-spec).
    --rate 0 makes poisson, shared-prefix and long-prompt arrive all at once.

Each is seeded (--seed), so every engine sees exactly the same requests.

    python -m minicb bench --workload random --num-prompts 32 --max-tokens 128
    python -m minicb bench --workload poisson --rate 0.5
    python -m minicb bench --workload shared-prefix --engines minicb-continuous,minicb-prefix-cache
    python -m minicb bench --workload shared-prefix --rate 0 --engines minicb-continuous,minicb-prefix-cache
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from minicb.sampling import SamplingParams

WORKLOADS = ("chat", "random", "poisson", "shared-prefix", "long-prompt", "repeat")

# The shared-prefix workload's system prompt: long, as deployed assistants' are.
SYSTEM_PROMPT = (
    "You are the help desk assistant of a small public library. Answer the visitor's question in two or "
    "three short sentences, in plain words, without lists or headings. If the question is about opening "
    "hours, fines, renewals or membership, say that the details can change and that the front desk has "
    "the current rules. If the question is about a book, say whether it is fiction or non-fiction when "
    "you know, and never invent titles, authors or page numbers. If you do not know the answer, say so "
    "and suggest asking a librarian. Be friendly, be brief, and do not repeat the question back. Do not "
    "give medical, legal or financial advice; suggest a professional instead. Visitors of every age ask "
    "questions here, so keep every answer suitable for children.")
# What the assistant "said" in the first turn of a resent conversation: fixed text, so
# every engine sees the same prompts whatever it answered.
EARLIER_ANSWER = "Here is a short answer to that. Let me know if you would like more detail."


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)


def chat_conversations(num_prompts: int) -> list[list[dict]]:
    """The chat workload's conversations: one user message each, the first `num_prompts` bundled prompts.
    `python -m minicb bench-serve` sends these very messages to a server, which applies its template."""
    from minicb.data import load_chat_prompts
    return [[{"role": "user", "content": text}] for text in load_chat_prompts(num_prompts)]


def chat_requests(tokenizer, num_prompts: int, max_tokens: int) -> list[Request]:
    return [Request(tokenizer.apply_chat_template(conversation), max_tokens)
            for conversation in chat_conversations(num_prompts)]


def shared_prefix_requests(tokenizer, num_prompts: int, max_tokens: int) -> list[Request]:
    """Chat questions behind SYSTEM_PROMPT; every third request is a second turn that
    resends the conversation of the request before it (its question, an answer, a new question)."""
    from minicb.data import load_chat_prompts

    questions = load_chat_prompts(num_prompts + 1)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    requests = []
    for i in range(num_prompts):
        turn = [{"role": "user", "content": questions[i]}]
        if i % 3 == 2:  # a returning user: the previous request's turn, then a follow-up
            turn = [{"role": "user", "content": questions[i - 1]},
                    {"role": "assistant", "content": EARLIER_ANSWER}, *turn]
        requests.append(Request(tokenizer.apply_chat_template([system, *turn]), max_tokens))
    return requests


def long_prompt_requests(tokenizer, num_prompts: int, max_tokens: int, every: int = 4,
                         min_len: int = 1000) -> list[Request]:
    """Chat requests; every `every`-th one is a long document to summarise instead: the bundled
    questions pasted together until the prompt has at least min_len tokens, a different
    stretch of them each time. Long prompts get 16 new tokens at most: they are here to
    prefill, and the short requests around them to decode."""
    from minicb.data import load_chat_prompts

    questions = load_chat_prompts(None)
    requests = []
    for i in range(num_prompts):
        if i % every == every - 1:
            parts, k = [], i
            while True:
                parts.append(questions[k % len(questions)])
                k += 1
                prompt = tokenizer.apply_chat_template(
                    [{"role": "user", "content": "Summarise these questions:\n" + "\n".join(parts)}])
                if len(prompt) >= min_len:
                    break
            requests.append(Request(prompt, min(max_tokens, 16)))
        else:
            requests.append(Request(tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[i % len(questions)]}]), max_tokens))
    return requests


# The repeat workload: tasks whose answers copy their text, over short passages.
REPEAT_TASKS = (
    "Fix the spelling mistakes in this text and write it out again:\n\n{typos}",
    "Repeat this paragraph exactly:\n\n{text}",
    "Rewrite this text, word for word:\n\n{text}",
    "Here is a list. Write it out again, then add three more items like it:\n\n{numbered}",
)
REPEAT_TEXTS = (
    "The engine keeps a queue of waiting requests and a fixed number of slots. Each step, it computes one new "
    "token for every running request, and lets a waiting request into any slot that became free. A request "
    "that finishes leaves at once, so no slot stays idle while work is waiting.",
    "A river starts as rain on a hill. The water runs down into small streams, the streams meet and grow, and "
    "after many miles the river reaches the sea. On the way it carries sand and stones, and it shapes the "
    "valley it flows through.",
    "To make bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes, then let it rise "
    "in a warm place for an hour. Shape the loaf, let it rise again, and bake it in a hot oven until the crust "
    "is brown and the bottom sounds hollow.",
    "The library opens at nine in the morning and closes at six in the evening. Children can borrow five books "
    "at a time, and adults can borrow ten. Books are due back after three weeks, and a book that comes back "
    "late costs ten cents a day.",
)


def add_typos(text: str, rng: random.Random, every: int = 6) -> str:
    """Swap two neighbouring letters in about one word in `every`."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 3 and rng.randrange(every) == 0:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def repeat_requests(tokenizer, num_prompts: int, max_tokens: int, seed: int = 0) -> list[Request]:
    """REPEAT_TASKS in turn, each over the next of REPEAT_TEXTS (typos seeded by `seed`)."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_prompts):
        text = REPEAT_TEXTS[(i + i // len(REPEAT_TASKS)) % len(REPEAT_TEXTS)]  # every task meets every text
        task = REPEAT_TASKS[i % len(REPEAT_TASKS)].format(
            typos=add_typos(text, rng), text=text,
            numbered="\n".join(f"{k + 1}. {line.strip()}." for k, line in enumerate(text.split(".")) if line.strip()))
        requests.append(Request(tokenizer.apply_chat_template([{"role": "user", "content": task}]), max_tokens))
    return requests


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


def replay_lengths(requests: list[Request], path: str, max_tokens: int) -> list[Request]:
    """The same prompts, each generating exactly output_lengths[i] tokens of the JSON at `path`
    (capped at max_tokens), EOS ignored: the real model's answer lengths, for weights that are not its own."""
    import json

    with open(path) as f:
        lengths = json.load(f)["output_lengths"]
    if len(lengths) < len(requests):
        raise ValueError(f"{path} has output lengths for {len(lengths)} prompts; {len(requests)} were asked for")
    return [Request(r.prompt_ids, max(1, min(max_tokens, n)), ignore_eos=True) for r, n in zip(requests, lengths)]


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
    elif workload == "shared-prefix":
        requests = shared_prefix_requests(tokenizer, args.num_prompts, args.max_tokens)
        first, second = requests[0].prompt_ids, requests[min(1, len(requests) - 1)].prompt_ids
        shared = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
        description = (f"{len(requests)} chat prompts sharing their first {shared} tokens (the system prompt), every third a "
                       f"resent conversation; greedy, EOS or {args.max_tokens} tokens")
    elif workload == "repeat":
        requests = repeat_requests(tokenizer, args.num_prompts, args.max_tokens, args.seed)
        description = (f"{len(requests)} prompts whose answers copy them (fix typos, rewrite, continue a list), "
                       f"greedy, EOS or {args.max_tokens} tokens")
    elif workload == "long-prompt":
        requests = long_prompt_requests(tokenizer, args.num_prompts, args.max_tokens)
        longest = max(len(r.prompt_ids) for r in requests)
        description = (f"{len(requests)} chat prompts, every 4th a long one ({longest} tokens at most, 16 new "
                       f"tokens), greedy, EOS or {args.max_tokens} tokens")
    else:
        requests = chat_requests(tokenizer, args.num_prompts, args.max_tokens)
        description = f"{len(requests)} chat prompts, greedy, EOS or {args.max_tokens} tokens"
        if getattr(args, "lengths_json", None):
            requests = replay_lengths(requests, args.lengths_json, args.max_tokens)
            description = (f"{len(requests)} chat prompts, greedy, each as long as the real model's answer "
                           f"({args.lengths_json}), EOS ignored, at most {args.max_tokens} tokens")
    if workload not in ("poisson", "shared-prefix", "long-prompt"):
        return requests, None, description
    if args.rate == 0:  # everyone at once: the burst a server sees when a class starts the same exercise
        return requests, None, description + ", all arriving at once"
    # Traffic that arrives over time: independent users, Poisson arrivals.
    return (requests, poisson_arrivals(len(requests), args.rate, args.seed),
            description + f", Poisson arrivals at {args.rate:g} req/s")
