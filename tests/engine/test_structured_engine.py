"""Structured output in the engine, on SmolLM2 (chapter 12; minicb/structured/guide.py).

- Validity: every test schema of tests/structured/schemas.py (69), sampled at
  temperature 1 in three random streams (n = 3), gives text that parses and
  passes jsonschema.validate whenever it ends by itself; regexes give text that
  re.fullmatch accepts.
- The two backends held to each other: greedy text under minicb's grammar and
  under xgrammar's is the same, token for token, for regexes, choices and schemas
  (both write json.dumps' layout).
- Composition on the real model: greedy guided text is the same with
  speculation, jump-forward, chunked prefill, prefix caching and n = 2.
- A grammar that compiles slowly does not hold up the others.
- What is refused, and how.
The tiny model's fuzzer (tests/engine/test_engine_fuzz.py) draws guided
requests too, beside every other feature.
"""
from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from minicb.engine import Engine, EngineConfig
from minicb.llm import grammars_for
from minicb.sampling import SamplingParams, StructuredOutput
from minicb.scheduler import RequestRejected

sys.path.insert(0, str(Path(__file__).parents[1] / "structured"))
from schemas import ACCEPTED  # noqa: E402  (tests/structured/schemas.py: the test set of schemas)

pytestmark = pytest.mark.slow
VALIDATOR = jsonschema.Draft202012Validator  # with its own format checker: the one that knows "time" and the rest

REGEXES = [r"(yes|no), because [a-z ]{3,30}\.", r"[0-9]{3}-[0-9]{4}", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}",
           r"(red|green|blue)( and (red|green|blue)){0,2}", r"#[0-9a-f]{6}"]
GREEDY = [StructuredOutput("regex", REGEXES[0]), StructuredOutput("choice", ["positive", "negative", "neutral"]),
          StructuredOutput("json_schema", {"type": "object", "properties": {
              "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
              "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
              "required": ["name", "age", "tags"]}),
          StructuredOutput("json_object")]


def engine(smollm2, **config) -> Engine:
    model, tokenizer, _ = smollm2
    config = EngineConfig(**config)
    return Engine(model, config, grammars=grammars_for(tokenizer, model, config))


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Every completion's (tokens, finish reason), per request, in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done = {}
    while engine.has_unfinished():
        for seq in engine.step().finished:
            done.setdefault(seq.request_id, {})[seq.completion] = (seq.output_token_ids, seq.finish_reason)
    return [[done[rid][c] for c in sorted(done[rid])] for rid in ids]


def ask(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_sampled_json_is_valid_under_every_test_schema(smollm2):
    _, tokenizer, _ = smollm2
    prompt = ask(tokenizer, "Reply with one JSON value, nothing else.")
    requests = [(prompt, SamplingParams(max_tokens=96, temperature=1.0, seed=i, n=3,
                                        structured=StructuredOutput("json_schema", case.schema)))
                for i, case in enumerate(ACCEPTED)]
    results = run(engine(smollm2, max_num_seqs=128, cpu_kv_gib=2.0), requests)  # one wave: every completion at once
    ended = 0
    for case, completions in zip(ACCEPTED, results):
        for tokens, reason in completions:
            if reason != "stop":  # max_tokens cut it: a prefix of valid text, which need not parse
                continue
            ended += 1
            text = tokenizer.decode(tokens)
            try:
                VALIDATOR(case.schema, format_checker=VALIDATOR.FORMAT_CHECKER).validate(json.loads(text))
            except (ValueError, jsonschema.ValidationError) as e:
                pytest.fail(f"schema {case.name}: sampled {text!r} is not valid: {e}")
    total = 3 * len(ACCEPTED)
    assert ended >= 0.8 * total, f"only {ended} of {total} completions ended by themselves within 96 tokens"


def test_sampled_text_matches_every_regex(smollm2):
    _, tokenizer, _ = smollm2
    prompt = ask(tokenizer, "Answer briefly.")
    requests = [(prompt, SamplingParams(max_tokens=48, temperature=1.0, seed=7, n=3,
                                        structured=StructuredOutput("regex", pattern))) for pattern in REGEXES]
    for pattern, completions in zip(REGEXES, run(engine(smollm2), requests)):
        for tokens, reason in completions:
            text = tokenizer.decode(tokens)
            assert reason == "stop" and re.fullmatch(pattern, text, re.ASCII), (
                f"{pattern!r}: {text!r} (finish {reason!r})")


def test_the_two_backends_give_the_same_greedy_text(smollm2):
    pytest.importorskip("xgrammar")
    _, tokenizer, _ = smollm2
    prompt = ask(tokenizer, "Describe a person, briefly.")
    requests = [(prompt, SamplingParams(max_tokens=64, structured=s)) for s in GREEDY]
    ours = run(engine(smollm2), requests)
    theirs = run(engine(smollm2, structured_backend="xgrammar"), requests)
    for structured, a, b in zip(GREEDY, ours, theirs):
        assert a == b, (f"{structured}: minicb {tokenizer.decode(a[0][0])!r} ({a[0][1]}), "
                        f"xgrammar {tokenizer.decode(b[0][0])!r} ({b[0][1]})")


@pytest.mark.parametrize("config", [
    dict(speculative_ngram=2), dict(jump_forward=True, speculative_ngram=1),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True)],
    ids=["speculation", "speculation and jump-forward", "chunked and prefix caching"])
def test_guided_greedy_text_is_the_same_with_every_feature(smollm2, config):
    _, tokenizer, _ = smollm2
    prompt = ask(tokenizer, "Describe a person, briefly.")
    requests = [(prompt, SamplingParams(max_tokens=40, n=2, structured=s)) for s in GREEDY[1:3]]
    plain = run(engine(smollm2), requests)
    if config.get("enable_prefix_caching"):  # the second run takes the first one's blocks
        featured = engine(smollm2, **config)
        run(featured, requests)
        got = run(featured, requests)
    else:
        got = run(engine(smollm2, **config), requests)
    for structured, a, b in zip(GREEDY[1:3], plain, got):
        assert a == b, f"{structured}: plain {tokenizer.decode(a[0][0])!r}, with {config} {tokenizer.decode(b[0][0])!r}"


def test_jump_forward_takes_fewer_forwards_for_the_same_tokens(smollm2):
    _, tokenizer, _ = smollm2
    schema = {"type": "object", "properties": {"customer_full_name": {"type": "string", "maxLength": 20},
                                               "customer_is_returning": {"type": "boolean"}},
              "required": ["customer_full_name", "customer_is_returning"]}
    params = SamplingParams(max_tokens=64, structured=StructuredOutput("json_schema", schema))
    prompt = ask(tokenizer, "Describe a customer as JSON.")
    steps = {}
    for jump in (False, True):
        e = engine(smollm2, jump_forward=jump)
        tokens = run(e, [(prompt, params)])[0]
        steps[jump] = (tokens, e.num_steps)
    assert steps[True][0] == steps[False][0], "jump-forward changed the tokens"
    assert steps[True][1] < steps[False][1], f"steps with jump-forward {steps[True][1]}, without {steps[False][1]}"


def test_a_slow_compile_holds_up_nobody(smollm2):
    _, tokenizer, prompts = smollm2
    e = engine(smollm2)
    release, compile_now = threading.Event(), e.grammars._compile
    e.grammars._compile = lambda structured: (release.wait(30), compile_now(structured))[1]
    guided = e.add_request(prompts[0], SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "[a-z]+")))
    plain = e.add_request(prompts[1], SamplingParams(max_tokens=4))
    firsts = []
    for _ in range(4):
        firsts += [t.request_id for t in e.step().new_tokens]
    assert plain in firsts and guided not in firsts, f"tokens came for {firsts} while the grammar compiled"
    assert guided in e.compiling
    release.set()
    run(e, [])  # the rest, until done
    assert not e.compiling and not e.sequences


def test_what_is_refused(smollm2):
    model, tokenizer, prompts = smollm2
    e = engine(smollm2)
    with pytest.raises(RequestRejected, match="multipleOf") as refused:
        e.check_request(prompts[0], SamplingParams(structured=StructuredOutput(
            "json_schema", {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}})))
    assert refused.value.param == "structured"
    with pytest.raises(RequestRejected, match="lookaround|\\(\\?="):
        e.check_request(prompts[0], SamplingParams(structured=StructuredOutput("regex", "a(?=b)")))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("regex", "a+"))
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("yaml", "a: 1")
    bare = Engine(model, EngineConfig())  # no tokenizer given: no vocabulary to mask
    with pytest.raises(RequestRejected, match="tokenizer"):
        bare.check_request(prompts[0], SamplingParams(structured=StructuredOutput("regex", "a+")))
    assert not e.sequences and not e.compiling  # checking queues nothing
