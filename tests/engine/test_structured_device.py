"""Guided requests on the test device (CUDA where there is one: make gpu-check runs this file there).

The grammar's masks live on the CPU (minicb/structured/token_mask.py) and the
logits on the device; the engine moves each step's mask across once. On the tiny
model with tests/engine/engine_support.py's vocabulary, greedy guided text on
the device, with its decode runner and jump-forward, must be the CPU engine's.
"""
from __future__ import annotations

import re

from engine_support import TinyTokenizer, tiny_grammars

from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.sampling import SamplingParams, StructuredOutput

GRAMMARS = [StructuredOutput("regex", r"[a-h]{2,6}(!|\?)"), StructuredOutput("regex", r'\{"k": [1-9][0-9]{0,2}\}'),
            StructuredOutput("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                             "required": ["a"]})]


def generate(device: str, **config) -> list[list[int]]:
    engine = Engine(random_model(seed=3).to(device), EngineConfig(**config),
                    grammars=tiny_grammars(config.get("jump_forward", False)))
    ids = [engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=24, n=2, structured=s)) for s in GRAMMARS]
    done = {}
    while engine.has_unfinished():
        for seq in engine.step().finished:
            done[(seq.request_id, seq.completion)] = seq.output_token_ids
    return [done[(rid, c)] for rid in ids for c in range(2)]


def test_guided_text_on_the_device_is_the_cpus(device):
    want = generate("cpu")
    got = generate(device, cuda_graphs=device == "cuda" or None, jump_forward=True)
    assert got == want, f"on {device}: {got} against the CPU's {want}"
    spell, ended = TinyTokenizer().token_bytes, 0
    for structured, tokens in zip([g for g in GRAMMARS for _ in range(2)], got):
        text = b"".join(spell[t] for t in tokens if t != 2).decode()
        if structured.kind == "regex" and tokens[-1] == 2:  # it ended by itself: a whole match
            assert re.fullmatch(structured.spec, text), (structured.spec, text)
            ended += 1
    assert ended, f"no regex request ended by itself within 24 tokens: {got}"
