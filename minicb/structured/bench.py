"""What structured output costs, measured side by side in one run: python -m minicb.structured.bench

In this file you will learn where the time of a guided request goes, in four
figures (chapter 12's text quotes them):

1. TPOT, every request guided against none, at 1 and 32 requests, after a warm
   mask cache (the grammar compiled and its states' masks met once). The mask
   is a [V] bool per state, looked up, copied into the row and applied with one
   masked_fill; the goal is at most 10% on the time per output token.
2. Compile time per schema, for the test set of tests/structured/schemas.py:
   median and worst, schema -> regex -> DFA (the masks are made per state as
   they are met, and timed in 4).
3. Forwards per output token with jump-forward, on a schema with long fixed
   keys: the keys' tokens are verified as drafts, several per forward; the goal
   is at most 0.6.
4. Per-token mask time, minicb's (the cached lookup, and a first visit's
   vectorized walk) against xgrammar's fill_next_token_bitmask, on the same
   grammar and the same tokens.

Each case runs in turns with the others, `--rounds` times, and the median is
kept, so a busy stretch of a shared machine falls on all of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from minicb.bench.machine import cpu_model
from minicb.sampling import SamplingParams, StructuredOutput

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"]}
# Long keys the model cannot choose: after '{' and after each value the grammar forces '", "next_key": '.
LONG_KEYS = {"type": "object", "properties": {
    "customer_full_legal_name": {"type": "string", "maxLength": 16},
    "customer_is_a_returning_customer": {"type": "boolean"},
    "customer_preferred_contact_method": {"enum": ["email", "phone"]},
    "customer_loyalty_programme_member": {"type": "boolean"}},
    "required": ["customer_full_legal_name", "customer_is_a_returning_customer",
                 "customer_preferred_contact_method", "customer_loyalty_programme_member"]}


def tpot(llm, prompts: list[list[int]], structured, max_tokens: int) -> float:
    """Seconds per output token of one batch of prompts, all decoding together: decode steps only."""
    params = SamplingParams(max_tokens=max_tokens, structured=structured,
                            ignore_eos=structured is None)  # a free request runs its full length
    engine = llm.engine
    for ids in prompts:
        engine.add_request(ids, params)
    decode_time = tokens = 0
    while engine.has_unfinished():
        out = engine.step()
        if out.num_computed_tokens == len(out.new_tokens) and out.new_tokens:  # a decode-only step
            decode_time, tokens = decode_time + out.time_s, tokens + len(out.new_tokens)
    return decode_time / max(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from minicb.llm import LLM
    llm = LLM(device="cpu", max_num_seqs=32)
    tok = llm.tokenizer
    print(f"SmolLM2-135M, fp32, CPU: {cpu_model()}, {args.rounds} rounds in turns")

    # 1. TPOT guided against free, 1 and 32 requests. Warm-up: compile, and meet the states once.
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    guided = StructuredOutput("json_schema", PERSON)
    for _ in range(2):
        tpot(llm, [prompt] * 32, guided, args.max_tokens)
    cases = {(n, g): [] for n in (1, 32) for g in (False, True)}
    for _ in range(args.rounds):
        for n, g in cases:
            cases[(n, g)].append(tpot(llm, [prompt] * n, guided if g else None, args.max_tokens))
    print("\n| requests | free ms/token | guided ms/token | guided / free |\n|---:|---:|---:|---:|")
    for n in (1, 32):
        free, with_grammar = statistics.median(cases[(n, False)]), statistics.median(cases[(n, True)])
        print(f"| {n} | {free * 1e3:.2f} | {with_grammar * 1e3:.2f} | {with_grammar / free:.3f} |")

    # 2. Compile time per schema of the test set (a cold cache each: a new compiler).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "structured"))
    from schemas import ACCEPTED

    from minicb.structured.backend import MinicbCompiler
    from minicb.structured.token_mask import TokenVocabulary
    vocab = TokenVocabulary.from_tokenizer(tok, llm.model.config.eos_token_ids, llm.model.config.vocab_size)
    compiler = MinicbCompiler(vocab)
    times = []
    for case in ACCEPTED:
        began = time.perf_counter()
        compiler.compile("json_schema", case.schema)
        times.append((time.perf_counter() - began, case.name))
    times.sort()
    print(f"\ncompile, {len(times)} schemas (schema -> regex -> DFA): median {statistics.median(t for t, _ in times) * 1e3:.1f} "
          f"ms, worst {times[-1][0] * 1e3:.0f} ms ({times[-1][1]})")

    # 3. Forwards per output token with jump-forward, on the long keys (greedy: the same tokens either way).
    ask = tok.apply_chat_template([{"role": "user", "content": "Describe a customer as JSON."}])
    params = SamplingParams(max_tokens=120, structured=StructuredOutput("json_schema", LONG_KEYS))
    rows = []
    for jump in (False, True):
        spec = LLM.from_model(llm.model, tok, jump_forward=jump, num_speculative_tokens=8)
        spec.generate([ask], params, use_tqdm=False)  # warm: compiled, states met
        before = spec.engine.num_steps
        out = spec.generate([ask], params, use_tqdm=False)[0]
        forwards = spec.engine.num_steps - before - 1  # the prefill step is not an output token's forward
        rows.append((jump, forwards, len(out.token_ids), out.token_ids))
    assert rows[0][3] == rows[1][3], "jump-forward changed the tokens"
    print("\n| jump-forward | forwards | output tokens | forwards per token |\n|---|---:|---:|---:|")
    for jump, forwards, tokens, _ in rows:
        print(f"| {'on' if jump else 'off'} | {forwards} | {tokens} | {forwards / tokens:.2f} |")

    # 4. Per-token mask time on the same grammar and tokens: minicb (cached and first visit) and xgrammar.
    from minicb.structured.backend import make_compiler
    text_ids = rows[0][3][:-1]  # the greedy JSON, without its EOS
    grammar = compiler.compile("json_schema", LONG_KEYS)
    warm = grammar.matcher()
    for token in text_ids:  # meet every state once: the cached row is what a warm server pays
        warm.mask()
        warm.accept(token)
    timings = {"minicb, cached": [], "minicb, first visit": [], "xgrammar": []}
    try:
        xgrammar = make_compiler(vocab, "xgrammar").compile("json_schema", LONG_KEYS)
    except ImportError:
        xgrammar = None
        del timings["xgrammar"]
    for _ in range(args.rounds):
        fresh = compiler.compile("json_schema", json.loads(json.dumps(LONG_KEYS)))  # no states met yet
        for name, g in (("minicb, first visit", fresh), ("minicb, cached", grammar), ("xgrammar", xgrammar)):
            if g is None:
                continue
            matcher = g.matcher()
            began = time.perf_counter()
            for token in text_ids:
                matcher.mask()
                matcher.accept(token)
            timings[name].append((time.perf_counter() - began) / len(text_ids))
    print("\n| mask | us per token |\n|---|---:|")
    for name, values in timings.items():
        print(f"| {name} | {statistics.median(values) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
