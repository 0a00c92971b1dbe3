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
from typing import Callable

import torch

from minicb.prefix_cache import block_keys

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs; SamplingParams refuses more
PROMPT_ROWS_AT_ONCE = 256  # prompt positions scored per lm_head call: bounds the [rows, V] logits held at once
ROWS_PER_PASS = 16  # logits rows token_logprobs takes at a time: 16 x 49,152 fp32 is 3 MB, a CPU cache's size


@dataclass
class TokenLogprob:
    """One token's score: its logprob, its rank in the distribution, and the k most likely tokens there."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, logprob) of the k most likely, most likely first; [] for k = 0


def cut(entry: TokenLogprob | None, k: int) -> TokenLogprob | None:
    """The entry with its top list cut to k (None stays None: the first prompt token has no score)."""
    return entry if entry is None or len(entry.top) <= k else TokenLogprob(entry.token_id, entry.logprob,
                                                                          entry.rank, entry.top[:k])


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """The logprob of token_ids[i] under row i, with the top k of each row. logits [R, V] -> R entries.

    The rows go ROWS_PER_PASS at a time through log_softmax, which a [16, V] block
    of logprobs then still finds in the CPU's cache for the three reads that
    follow: the chosen entry, the count of tokens more likely than it (its rank)
    and the top k. Scoring 256 rows of 49,152 this way took 13 ms here, against
    20 ms for the shortcut x[t] - logsumexp(x), which rounds differently, by up
    to 1.5e-5 a token: summed over a sentence, more than an evaluation harness
    comparing with HF's log_softmax allows. This is log_softmax's own rounding.
    """
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(token_ids)} tokens; give one row per token")
    entries = []
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)[:, None]  # [R, 1]
    for first in range(0, len(token_ids), ROWS_PER_PASS):
        logprobs = torch.log_softmax(logits[first:first + ROWS_PER_PASS].float(), dim=-1)  # [r, V]
        chosen = logprobs.gather(1, ids[first:first + ROWS_PER_PASS])  # [r, 1]
        ranks = (logprobs > chosen).sum(-1, dtype=torch.int32) + 1  # [r]: 1 + the tokens more likely than it
        top_values, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
        rows = zip(chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist())
        for i, (logprob, rank, top_ids_i, top_values_i) in enumerate(rows):
            entries.append(TokenLogprob(token_ids[first + i], logprob, rank, list(zip(top_ids_i, top_values_i))))
    return entries


class PromptScoreCache:
    """The scores of prompt blocks already scored, so that a prompt starting the same way is not scored again.

    A token's score depends on the tokens before it and on nothing else. So the
    cache keeps each scored block (chapter 07's blocks of block_size tokens, full
    or the partial last one) under its parent: the key of the full block before it
    (chapter 07's block_keys, which names the whole prefix), None for the first.
    A lookup walks a prompt's blocks from the first; in each it takes the entries
    of the kept block under the same parent that shares the longest run of leading
    tokens with it, and it goes on to the next block only after a whole match.
    So a multiple-choice question's context is scored once, the last partial block
    of it too, and each choice only its own tokens.

    Each parent keeps its CHILDREN_KEPT latest blocks (the choices of a question
    differ in their last block), each with the top k it was scored with (a request
    asking for fewer gets them cut; one asking for more finds nothing); the
    least recently used parents go first once more than max_blocks blocks are kept.
    """

    CHILDREN_KEPT = 4

    def __init__(self, block_size: int, max_blocks: int = 4096):
        self.block_size, self.max_blocks = block_size, max_blocks
        # parent key -> up to CHILDREN_KEPT (k, block tokens, their entries), the latest first
        self._children: OrderedDict[int | None, list[tuple[int, tuple[int, ...], list[TokenLogprob | None]]]] = \
            OrderedDict()
        self._num_blocks = 0  # blocks kept, under all parents
        self.hits = 0  # prompt positions a lookup handed out instead of their being scored again

    def __len__(self) -> int:
        return self._num_blocks

    def _blocks(self, prompt_token_ids: list[int]):
        """(parent key, the block's tokens) for each block of the prompt, the partial last one too."""
        b = self.block_size
        parents = [None] + block_keys(prompt_token_ids, b)
        for i, start in enumerate(range(0, len(prompt_token_ids), b)):
            yield parents[i], tuple(prompt_token_ids[start:start + b])

    def lookup(self, prompt_token_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """The kept entries of the prompt's first tokens, scored with at least k top tokens: tokens
        [0, len(result)), the first None. [None] when none is kept."""
        entries: list[TokenLogprob | None] = []
        for parent, tokens in self._blocks(prompt_token_ids):
            best, best_entries = 0, []
            for kept_k, kept_tokens, kept_entries in self._children.get(parent, ()):
                n = common_prefix(kept_tokens, tokens) if kept_k >= k else 0
                if n > best:
                    best, best_entries = n, kept_entries
            if best == 0:
                break
            self._children.move_to_end(parent)
            entries += [cut(e, k) for e in best_entries[:best]]
            if best < len(tokens):
                break
        self.hits += max(0, len(entries) - 1)
        return entries or [None]

    def store(self, prompt_token_ids: list[int], entries: list[TokenLogprob | None], k: int) -> None:
        """Keep the entries of each block of the prompt (entries: one per prompt token)."""
        b = self.block_size
        for i, (parent, tokens) in enumerate(self._blocks(prompt_token_ids)):
            kept = self._children.get(parent, [])
            if not any(kept_k >= k and kept_tokens[:len(tokens)] == tokens for kept_k, kept_tokens, _ in kept):
                # It replaces the blocks it covers: a start of it, scored with no more top tokens.
                mine = [(k, tokens, entries[i * b:i * b + len(tokens)])]
                mine += [c for c in kept if not (c[0] <= k and tokens[:len(c[1])] == c[1])][:self.CHILDREN_KEPT - 1]
                self._num_blocks += len(mine) - len(kept)
                self._children[parent] = mine
            self._children.move_to_end(parent)
        while self._num_blocks > self.max_blocks:
            self._num_blocks -= len(self._children.popitem(last=False)[1])


def common_prefix(a, b) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PromptToScore:
    """One prompt whose scores a step wants: its tokens, the top k it asked for, and where its hidden states are."""

    token_ids: list[int]
    k: int
    hidden_at: Callable[[int, int], torch.Tensor]  # (start, end) -> [end - start, hidden]: positions [start, end)


def prompt_logprobs(model, prompts: list[PromptToScore],
                    cache: PromptScoreCache | None = None) -> list[list[TokenLogprob | None]]:
    """Every prompt token's score, for each prompt: [None, entry for token 1, ..., entry for token P - 1].

    hidden_at gives the last layer's output at a prompt's positions (KVPool.hidden
    at its slots); position p's logits, model.logits of it (the final norm and
    lm_head, as in every forward), score token p + 1. A token is scored once:
      - the positions `cache` keeps for a prompt's start come from it;
      - so do those it shares with an earlier prompt of the same call (the four
        choices of a question, admitted in one step): their entries are copied;
      - the rest of every prompt go through one lm_head, PROMPT_ROWS_AT_ONCE
        positions at a time (a matmul of many rows runs near the CPU's peak, one of
        a few rows far below it), and are kept in the cache.
    """
    plans = []  # per prompt: (entries it has, the earlier prompt it copies from, positions shared with it)
    for j, prompt in enumerate(prompts):
        have = cache.lookup(prompt.token_ids, prompt.k) if cache is not None else [None]
        donor, shared = None, len(have)
        for i in range(j):
            n = common_prefix(prompts[i].token_ids, prompt.token_ids) if prompts[i].k >= prompt.k else 0
            if n > shared:
                donor, shared = i, n
        plans.append((have, donor, shared))
    # The positions to score, all prompts together: hidden [N, hidden] and the token each row scores.
    hidden, tokens = [], []
    for prompt, (_, _, shared) in zip(prompts, plans):
        if shared < len(prompt.token_ids):
            hidden.append(prompt.hidden_at(shared - 1, len(prompt.token_ids) - 1))  # row p scores token p + 1
            tokens += prompt.token_ids[shared:]
    k = max((p.k for p in prompts), default=0)
    scored: list[TokenLogprob] = []
    if tokens:
        hidden = torch.cat(hidden)  # [N, hidden]
        for first in range(0, len(tokens), PROMPT_ROWS_AT_ONCE):
            logits = model.logits(hidden[None, first:first + PROMPT_ROWS_AT_ONCE])[0]  # [rows, V]
            scored += token_logprobs(logits, tokens[first:first + PROMPT_ROWS_AT_ONCE], k)
    results, start = [], 0
    for prompt, (have, donor, shared) in zip(prompts, plans):
        own = scored[start:start + len(prompt.token_ids) - shared]
        start += len(own)
        before = have if donor is None else [cut(e, prompt.k) for e in results[donor][:shared]]
        entries = before + [cut(e, prompt.k) for e in own]
        if cache is not None:
            cache.store(prompt.token_ids, entries, prompt.k)
        results.append(entries)
    return results


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
