"""Logprobs: what the model thought of each token, which an engine has already computed.

In this file you will learn that scoring text costs an engine almost nothing
beyond what generating it costs:

- **A sampled token's logprob** is one entry of log_softmax over the logits row
  the sampler drew it from. The row is there anyway; a request that asks for
  logprobs only adds the log_softmax of its own rows. We return the model's own
  distribution, before the request's temperature, penalties or top-k/top-p
  (vLLM's default, its "raw" logprobs): a score of the text, not of the sampler.
- **Prompt logprobs** (`echo` in the completions API, what evaluation harnesses
  ask for) need the logits at every prompt position, and a generating step
  computes logits only at the last one (the lm_head is the largest matmul of
  the model). They are one lm_head away from the last layer's output, so the
  pool keeps that output for every computed token beside its K/V
  (KVPool.store_hidden). When a request's prompt is computed, its logprobs are
  read from its own blocks: prefix-cached blocks (computed for another request),
  chunks of earlier steps (chapter 08) and this step's tokens alike, so the
  answer is the same with prefix caching or chunking on or off. (vLLM, whose
  blocks hold K/V only, cannot score a prefix it took from its cache.)

Position p's logits predict the token at p + 1, so a prompt of P tokens has
P - 1 logprobs; the first token has none (None in our lists, null in OpenAI's).

    entries = token_logprobs(logits [R, V], token_ids [R], k=5)
    entries[0].logprob, entries[0].rank, entries[0].top     # top: [(token_id, logprob)] * 5
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from minicb.prefix_cache import block_keys

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs; SamplingParams refuses more
PROMPT_ROWS_AT_ONCE = 256  # prompt positions scored per lm_head call: bounds the [rows, V] logits held at once


@dataclass
class TokenLogprob:
    """One token's score: its logprob, its rank in the distribution, and the k most likely tokens there."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, logprob) of the k most likely, most likely first; [] for k = 0


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """The logprob of token_ids[i] under row i, with the top k of each row. logits [R, V] -> R entries.

    log_softmax(x)[t] = x[t] - logsumexp(x), so only the R chosen entries and the
    R * k top ones are shifted: no [R, V] tensor of logprobs is written, which
    matters when a prompt of hundreds of positions is scored against 49,152 tokens.
    """
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(token_ids)} tokens; give one row per token")
    if not token_ids:
        return []
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    chosen = logits.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])  # [R, 1]
    ranks = (logits > chosen).sum(-1) + 1  # [R]
    top_values, top_ids = logits.topk(k, dim=-1) if k > 0 else (logits[:, :0], logits[:, :0].long())  # [R, k]
    chosen, ranks = (chosen - norm)[:, 0].tolist(), ranks.tolist()
    top_values, top_ids = (top_values - norm).tolist(), top_ids.tolist()
    return [TokenLogprob(t, chosen[i], ranks[i], list(zip(top_ids[i], top_values[i])))
            for i, t in enumerate(token_ids)]


class PromptScoreCache:
    """The scores of full prompt blocks, kept by the block's key (chapter 07's block_keys), least
    recently used out first.

    A token's score depends on the tokens before it and on nothing else, and a
    block's key names exactly those (its tokens and every block before it). So a
    block scored once is scored for every later prompt that starts the same way:
    a multiple-choice question's shared context is scored once, each choice only
    its own tokens. Holds `max_blocks` blocks' entries (block_size TokenLogprobs each,
    with the top k they were made with; a request asking for fewer gets them cut).
    """

    def __init__(self, block_size: int, max_blocks: int = 4096):
        self.block_size, self.max_blocks = block_size, max_blocks
        self._blocks: OrderedDict[int, tuple[int, list[TokenLogprob | None]]] = OrderedDict()  # key -> (k, entries)
        self.hits = 0  # blocks whose scores a lookup handed out instead of their being computed again

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, prompt_token_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """The entries of the prompt's leading blocks kept with at least k top tokens: tokens
        [0, len(result)), the first None. [None] when the first block is not kept."""
        entries: list[TokenLogprob | None] = []
        for key in block_keys(prompt_token_ids, self.block_size):
            kept = self._blocks.get(key)
            if kept is None or kept[0] < k:
                break
            self._blocks.move_to_end(key)
            self.hits += 1
            entries += [e if e is None else TokenLogprob(e.token_id, e.logprob, e.rank, e.top[:k]) for e in kept[1]]
        return entries or [None]

    def store(self, prompt_token_ids: list[int], entries: list[TokenLogprob | None], k: int) -> None:
        """Keep the entries of each full block of the prompt (entries: one per prompt token)."""
        b = self.block_size
        for i, key in enumerate(block_keys(prompt_token_ids, b)):
            if key not in self._blocks or self._blocks[key][0] < k:
                self._blocks[key] = (k, entries[i * b:(i + 1) * b])
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


def prompt_logprobs(model, hidden_at, prompt_token_ids: list[int], k: int,
                    cache: PromptScoreCache | None = None) -> list[TokenLogprob | None]:
    """Every prompt token's score: [None, entry for token 1, ..., entry for token P - 1].

    hidden_at(start, end) -> [end - start, hidden_size]: the last layer's output at
    positions [start, end) (KVPool.hidden at the prompt's slots); position p's
    logits, model.logits of it (the final norm and lm_head, as in every forward),
    score token p + 1. Tokens whose blocks `cache` keeps are not scored again;
    the rest are, PROMPT_ROWS_AT_ONCE positions at a time, and their blocks kept.
    """
    entries = cache.lookup(prompt_token_ids, k) if cache is not None else [None]
    for first in range(len(entries), len(prompt_token_ids), PROMPT_ROWS_AT_ONCE):
        last = min(first + PROMPT_ROWS_AT_ONCE, len(prompt_token_ids))
        logits = model.logits(hidden_at(first - 1, last - 1)[None])[0]  # [last - first, V]
        entries += token_logprobs(logits, prompt_token_ids[first:last], k)
    if cache is not None:
        cache.store(prompt_token_ids, entries, k)
    return entries


# ----------------------------------------------------------------------------
# What scores cost: python -m minicb.logprobs [--slots 32] [--rounds 3]
#
# A 32-slot decode step of SmolLM2 on the CPU, timed with nobody asking for
# scores, with one request asking (logprobs=5), and with every request asking;
# and the same step without the pool's copy of each token's hidden state (the
# price every request pays so that prompts can be scored from cached blocks).
# Then a prefill of the same prompts with and without one asking for its
# prompt's scores. The cases run in turns, `rounds` times, each keeping its
# median step, so a busy machine slows them alike.

if __name__ == "__main__":
    import argparse
    import statistics
    import time

    from minicb.bench.machine import cpu_model
    from minicb.data import load_chat_prompts
    from minicb.llm import LLM
    from minicb.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(device="cpu", max_num_seqs=args.slots)
    engine = llm.engine
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in load_chat_prompts(args.slots)]

    def params(asks: bool, prompt: bool = False) -> SamplingParams:
        return SamplingParams(max_tokens=100, ignore_eos=True, logprobs=5 if asks and not prompt else None,
                              prompt_logprobs=5 if asks and prompt else None)

    def run(asking: int, prompt: bool = False, keep_hidden: bool = True) -> tuple[float, float]:
        """(prefill step s, median decode step s) with `asking` of the requests asking for scores."""
        hidden = engine.pool.hidden
        engine.pool.hidden = hidden if keep_hidden else None
        try:
            for i, ids in enumerate(prompts):
                engine.add_request(ids, params(i < asking, prompt))
            began = time.perf_counter()
            while any(not s.output_token_ids for s in engine.sequences.values()):
                engine.step()
            prefill = time.perf_counter() - began
            steps = [engine.step().time_s for _ in range(args.steps)]
            return prefill, statistics.median(steps)
        finally:
            for rid in {s.request_id for s in engine.sequences.values()}:
                engine.abort(rid)
            engine.pool.hidden = hidden

    cases = {"nobody asks": dict(asking=0), "one asks logprobs=5": dict(asking=1),
             f"all {args.slots} ask logprobs=5": dict(asking=args.slots),
             "nobody asks, no hidden-state copy": dict(asking=0, keep_hidden=False),
             "one asks prompt_logprobs=5": dict(asking=1, prompt=True)}
    run(0)  # warm-up: kernels compiled, memory touched
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            times[name].append(run(**case))
    base_prefill = statistics.median(p for p, _ in times["nobody asks"])
    base_decode = statistics.median(d for _, d in times["nobody asks"])
    print(f"SmolLM2-135M, fp32, {args.slots} chat prompts, CPU: {cpu_model()}, {args.rounds} rounds in turns")
    print("| case | prefill s | vs nobody | decode step ms | vs nobody |\n|---|---:|---:|---:|---:|")
    for name, runs in times.items():
        prefill, decode = statistics.median(p for p, _ in runs), statistics.median(d for _, d in runs)
        print(f"| {name} | {prefill:.2f} | {prefill / base_prefill:.3f} | {decode * 1e3:.1f} | "
              f"{decode / base_decode:.3f} |")
