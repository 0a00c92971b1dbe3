"""Chapter 12 in the engine: your grammar code composes with every feature, and changes no token.

The oracle is the reference's engine (`EngineParts.reference`: minicb's own
code for every part) serving the same guided requests, plain: no speculation,
no jump-forward, a pool and slots for everyone. On the tiny random model, whose
tokens tests/engine/engine_support.py spells as bytes (single bytes, and pairs
of letters, so one token may be two steps of the automaton), your engine runs:

- chapter 11's prompt lookup on prompts that repeat themselves: its drafts are
  cut to the longest prefix the grammar allows, the verify rows are masked
  along the drafts (the state walks over them and rolls back), and rejected
  drafts roll the state back;
- jump-forward: the tokens a grammar forces verified as drafts, in fewer steps;
- a small pool with prefix caching and chunked prefill, so requests are
  preempted and recomputed: the state after the output tokens is kept;
- n = 3 seeded completions: each forks its parent's state;
- logprobs: the scores come from the logits before the mask.

Greedy tokens, seeded tokens (the same masks give the same draws), finish
reasons and logprobs must be the oracle's; after every step a decoding request
holds exactly its computed tokens' slots, and at the end every block is free.
On SmolLM2 (marked slow), a JSON schema with jump-forward and speculation.
"""
from __future__ import annotations

import json
import re

import pytest

from engine_support import TinyTokenizer, tiny_grammars
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.naive import first_difference
from minicb.parts import EngineParts
from minicb.sampling import SamplingParams, StructuredOutput

MODEL = random_model(seed=3)  # 256 tokens, EOS 2
SPELL = TinyTokenizer().token_bytes
GRAMMARS = [
    StructuredOutput("regex", r"[a-h]{2,12}(!|\?)"),
    StructuredOutput("choice", ["yes", "no", "maybe so"]),
    StructuredOutput("regex", r'\{"key": (0|[1-9][0-9]{0,2}), "flag": (true|false)\}'),  # fixed keys: forced text
    StructuredOutput("json_schema", {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}}, "required": ["a", "b"]}),
]
# Prompts that repeat themselves (prompt lookup finds drafts), in the tokens the grammars speak.
PROMPTS = [[97, 98, 99, 100] * 4, list(b'{"key": 12, "flag": true} {"key": '), [101, 102] * 6 + [130, 131],
           list(b'{"a": 1, "b": false} {"a": ')]


def text_of(tokens: list[int]) -> str:
    return b"".join(SPELL[t] for t in tokens if t != 2).decode("utf-8", errors="replace")


def is_valid(structured: StructuredOutput, text: str) -> bool:
    """Whether a finished text is what the grammar asked for."""
    if structured.kind == "regex":
        return re.fullmatch(structured.spec, text) is not None
    if structured.kind == "choice":
        return text in structured.spec
    value = json.loads(text)
    return set(value) == {"a", "b"} and value["a"] in range(100) and isinstance(value["b"], bool)


def serve(requests, reference: bool = False, check_each_step=None, **config) -> tuple[dict, Engine]:
    """Serve (prompt, SamplingParams) requests; -> ({(index, completion): finished Sequence}, the engine).
    reference: on the reference's code (the oracle), else on what the environment loads (your file)."""
    config = EngineConfig(**{"block_size": 4, "max_num_seqs": 8, "num_blocks": 128, **config})
    grammars = tiny_grammars(config.jump_forward)
    engine = (Engine(MODEL, parts=EngineParts.reference(config), grammars=grammars) if reference
              else Engine(MODEL, config, grammars=grammars))
    index_of = {engine.add_request(prompt, params): i for i, (prompt, params) in enumerate(requests)}
    finished = {}
    while engine.has_unfinished():
        for seq in engine.step().finished:
            key = (index_of[seq.request_id], seq.completion)
            assert key not in finished, f"request {key[0]} completion {key[1]} finished twice"
            assert seq.finish_reason in ("stop", "length"), (
                f"request {key[0]} ended {seq.finish_reason!r} ({seq.error or 'no error'})")
            finished[key] = seq
        if check_each_step:
            check_each_step(engine)
        assert engine.num_steps < 2000, f"the engine stopped making progress: {len(finished)} finished"
    want = sorted((i, c) for i, (_, p) in enumerate(requests) for c in range(p.n))
    assert sorted(finished) == want, f"completions that never finished: {sorted(set(want) - set(finished))}"
    free, total = engine.allocator.num_free_blocks, engine.allocator.num_blocks
    assert free == total, f"every block must be free after the run, but only {free} of {total} are"
    return finished, engine


def requests(max_tokens: int = 28, **params) -> list:
    return [(prompt, SamplingParams(max_tokens=max_tokens, structured=structured, **params))
            for prompt, structured in zip(PROMPTS, GRAMMARS)]


def assert_same(got: dict, want: dict, what: str, reqs=None) -> None:
    for key in sorted(want):
        a, b = got[key], want[key]
        assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason), (
            f"request {key[0]} completion {key[1]} ({GRAMMARS[key[0] % len(GRAMMARS)].spec!r}), {what}: "
            f"{text_of(a.output_token_ids)!r} ({a.finish_reason}) against the reference's "
            f"{text_of(b.output_token_ids)!r} ({b.finish_reason}); "
            f"{first_difference(a.output_token_ids, b.output_token_ids, ('yours', 'reference'))}")
    for (i, _), seq in got.items():
        if seq.finish_reason == "stop":
            structured = GRAMMARS[i % len(GRAMMARS)]
            assert is_valid(structured, text_of(seq.output_token_ids)), (
                f"request {i} ended with EOS on {text_of(seq.output_token_ids)!r}, which {structured.spec!r} "
                f"does not allow")


def no_slot_behind(engine: Engine) -> None:
    for seq in engine.scheduler.running:
        if seq.is_decoding:
            held = engine.allocator.num_tokens(seq.seq_id)
            assert held == seq.num_computed_tokens, (
                f"sequence {seq.seq_id} holds {held} KV slots but has {seq.num_computed_tokens} computed tokens")
        if seq.guide is not None:
            assert seq.guide.matcher.num_accepted == len(seq.output_token_ids), (
                f"sequence {seq.seq_id} has {len(seq.output_token_ids)} output tokens, but its grammar state "
                f"accepted {seq.guide.matcher.num_accepted}: drafts were not rolled back, or a token was lost")


@pytest.fixture(scope="module")
def oracle():
    """The reference engine's answers, plain: greedy and seeded, n = 1 and n = 3."""
    return {"greedy": serve(requests(), reference=True)[0],
            "seeded": serve(requests(temperature=1.0, seed=5, n=3), reference=True, max_num_seqs=12)[0]}


@pytest.mark.task("all")
def test_speculation_cuts_drafts_to_the_grammar_and_changes_no_token(oracle):
    got, engine = serve(requests(), check_each_step=no_slot_behind, speculative_ngram=2, num_speculative_tokens=4)
    drafts = sum(s.num_draft_tokens for s in got.values())
    accepted = sum(s.num_accepted_tokens for s in got.values())
    assert 0 < accepted < drafts, f"{accepted} of {drafts} drafts accepted; the test needs accepted and rejected ones"
    assert_same(got, oracle["greedy"], "with speculation")


@pytest.mark.task("all")
def test_jump_forward_gives_the_same_tokens_in_fewer_steps(oracle):
    got, engine = serve(requests(), check_each_step=no_slot_behind, jump_forward=True)
    assert_same(got, oracle["greedy"], "with jump-forward")
    _, plain = serve(requests())
    assert engine.num_steps < plain.num_steps, (
        f"jump-forward took {engine.num_steps} steps, without it {plain.num_steps}: the forced keys were not verified "
        f"as drafts")


@pytest.mark.task("all")
def test_preemption_prefix_caching_and_chunks_keep_the_state(oracle):
    got, engine = serve(requests(), check_each_step=no_slot_behind, num_blocks=20, enable_prefix_caching=True,
                        enable_chunked_prefill=True, max_num_batched_tokens=12, speculative_ngram=1,
                        num_speculative_tokens=3, jump_forward=True)
    assert sum(s.num_preemptions for s in got.values()) > 0, "the small pool was meant to force a preemption"
    assert_same(got, oracle["greedy"], "preempted, with prefix caching, chunks, speculation and jump-forward")


@pytest.mark.task("all")
def test_forked_completions_sample_the_references_tokens(oracle):
    got, _ = serve(requests(temperature=1.0, seed=5, n=3), check_each_step=no_slot_behind, max_num_seqs=12)
    assert_same(got, oracle["seeded"], "seeded, n = 3")
    texts = {text_of(got[(3, c)].output_token_ids) for c in range(3)}
    assert len(texts) > 1, f"three seeded completions of one request gave one text {texts}: did they fork?"


@pytest.mark.task("all")
def test_logprobs_come_from_the_logits_before_the_mask():
    reqs = [(prompt, SamplingParams(max_tokens=16, structured=s, logprobs=2)) for prompt, s in zip(PROMPTS, GRAMMARS)]
    want, _ = serve(reqs, reference=True)
    got, _ = serve(reqs, jump_forward=True, speculative_ngram=2)
    for key in sorted(want):
        a = [(e.token_id, round(e.logprob, 4), e.rank) for e in got[key].logprobs]
        b = [(e.token_id, round(e.logprob, 4), e.rank) for e in want[key].logprobs]
        assert a == b, (f"request {key[0]}: the scores of the sampled tokens differ from the reference's (the "
                        f"model's own distribution, before the mask): {first_difference(a, b, ('yours', 'reference'))}")


@pytest.mark.slow
@pytest.mark.task("all")
def test_smollm2_writes_the_references_json(smollm2):
    from minicb.llm import grammars_for

    model, tokenizer, _ = smollm2
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "likes_tea": {"type": "boolean"}},
              "required": ["name", "age", "likes_tea"]}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    params = SamplingParams(max_tokens=48, structured=StructuredOutput("json_schema", schema))
    outputs = []
    for reference, config in ((True, EngineConfig()), (False, EngineConfig(jump_forward=True, speculative_ngram=2))):
        grammars = grammars_for(tokenizer, model, config)
        engine = (Engine(model, parts=EngineParts.reference(config), grammars=grammars) if reference
                  else Engine(model, config, grammars=grammars))
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            for seq in engine.step().finished:
                outputs.append(seq.output_token_ids)
    want, got = outputs
    assert got == want, (f"SmolLM2 under the schema: yours {tokenizer.decode(got)!r}, the reference's "
                         f"{tokenizer.decode(want)!r}; {first_difference(got, want, ('yours', 'reference'))}")
    value = json.loads(tokenizer.decode(got[:-1]))
    assert set(value) == {"name", "age", "likes_tea"}, value
