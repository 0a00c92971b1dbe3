"""Honour or refuse: every field of OpenAI's request schema, one at a time.

The schema is the `openai` package's own (its TypedDicts of the create
parameters, what the official client can send). Each field is sent alone, set to
something other than its default, and the server must either

- refuse it: a 400 whose `param` names the field (code "unsupported_field" for a
  field minicb does not have, "unsupported_value" for one it has but cannot do
  at that value), or
- honour it: it is in HONOURED below, each with the test that shows its effect, or
- be OpenAI's platform bookkeeping, accepted and ignored as the README says
  (protocol.IGNORED_METADATA).

A field accepted with a 200 that is none of these is the defect this test
exists for: a client that relies on it gets an answer that does not honour it.
And the other way round: every field minicb's request models declare is in one
of the lists, so a field added later must say which it is.
"""
from __future__ import annotations

import typing

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from minicb.serve import protocol as p

from serve_support import tiny_server

# field -> where its effect is tested (both endpoints unless the name says which)
HONOURED = {
    "model": "test_server.py: an unknown model is refused",
    "prompt": "test_server.py, test_server_logprobs.py (lists of prompts)",
    "messages": "test_server.py, test_server_chat_tools.py",
    "max_tokens": "test_server.py", "max_completion_tokens": "test_server.py",
    "temperature": "test_server_openai.py (seeded sampling)", "top_p": "test_server.py (top_p 0 refused)",
    "n": "test_server.py", "seed": "test_server_openai.py", "stop": "test_server.py (stop strings)",
    "stream": "test_server.py", "stream_options": "test_server_load_testers.py (include_usage, continuous)",
    "echo": "test_server_logprobs.py", "logprobs": "test_server_logprobs.py", "top_logprobs": "test_server_logprobs.py",
    "presence_penalty": "test_server_logprobs.py (penalties reach the sampler)",
    "frequency_penalty": "test_server_logprobs.py (penalties reach the sampler)",
    "best_of": "refused unless equal to n (this file)",
    "response_format": "test_server_structured.py (json_object, json_schema; both endpoints)",
    "tools": "test_server_structured.py (chat)", "tool_choice": "test_server_structured.py (none, auto, required, "
                                                                 "a named function)",
    "parallel_tool_calls": "test_server_structured.py (one call per choice, which false asks and true allows)",
}
# minicb's own and vLLM's extensions, each honoured (or accepted only at the one value minicb does)
EXTENSIONS = {"top_k", "min_p", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
              "return_token_ids", "skip_special_tokens", "include_stop_str_in_output",
              "guided_json", "guided_regex", "guided_choice", "structured_outputs"}  # test_server_structured.py
# Refused when set, until minicb can do them
REFUSED_WHEN_SET = {"logit_bias", "suffix"}

# A value other than the default for each field minicb's models declare, valid in type, so that a 400
# means "refused", not "mistyped".
VALUES = {
    "model": "tiny-random", "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "n": 2,
    "seed": 7, "stop": ["zz"], "stream": True, "stream_options": {"include_usage": True}, "echo": True, "logprobs": 2,
    "top_logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "best_of": 3, "logit_bias": {"5": 3.0},
    "suffix": "end", "user": "someone", "store": True, "metadata": {"k": "v"}, "service_tier": "flex",
    "safety_identifier": "hash", "prompt_cache_key": "key", "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required",
    "parallel_tool_calls": False,
}
BASE = {"/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
SCHEMAS = {"/v1/completions": completion_params.CompletionCreateParamsBase,
           "/v1/chat/completions": chat_params.CompletionCreateParamsBase}
MODELS = {"/v1/completions": p.CompletionRequest, "/v1/chat/completions": p.ChatCompletionRequest}


@pytest.fixture(scope="module")
def client():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        yield c


def openai_fields(path: str) -> list[str]:
    return sorted(typing.get_type_hints(SCHEMAS[path]))


@pytest.mark.parametrize("path", list(SCHEMAS))
def test_every_openai_field_is_honoured_refused_or_named_bookkeeping(client, path):
    declared = MODELS[path].model_fields
    accepted_and_unlisted, wrong_refusals = [], []
    for name in openai_fields(path):
        if name in BASE[path] and name not in VALUES:
            continue  # the request's own prompt or messages
        value = True if (path, name) == ("/v1/chat/completions", "logprobs") else VALUES.get(name, "x")
        body = {**BASE[path], name: value}
        if name == "echo":
            body["logprobs"] = 1  # the completions endpoint needs nothing else; logprobs just shows more
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        response = client.post(path, json=body)
        if response.status_code == 400:
            error = response.json()["error"]
            expected = "unsupported_value" if name in declared else "unsupported_field"
            if error["param"] != name or error["code"] != expected:
                wrong_refusals.append((name, error))
        elif name not in HONOURED and name not in p.IGNORED_METADATA:
            accepted_and_unlisted.append((name, response.status_code))
        if name in declared and name not in VALUES:
            wrong_refusals.append((name, "declared by minicb but this test has no value to send"))
    assert not accepted_and_unlisted, f"{path}: accepted but neither honoured nor bookkeeping: {accepted_and_unlisted}"
    assert not wrong_refusals, f"{path}: refused without naming the field (or untestable): {wrong_refusals}"


@pytest.mark.parametrize("path", list(SCHEMAS))
def test_every_field_minicb_declares_says_what_it_is(path):
    known = set(HONOURED) | EXTENSIONS | REFUSED_WHEN_SET | set(p.IGNORED_METADATA)
    unlisted = sorted(set(MODELS[path].model_fields) - known)
    assert not unlisted, f"{path}: fields of {MODELS[path].__name__} in no list of this file: {unlisted}"


@pytest.mark.parametrize("name", sorted(REFUSED_WHEN_SET))
def test_the_fields_minicb_cannot_do_yet_are_refused_by_name(client, name):
    path = "/v1/completions" if name == "suffix" or name == "logit_bias" else "/v1/chat/completions"
    error = client.post(path, json={**BASE[path], name: VALUES[name]}).json()["error"]
    assert (error["param"], error["code"]) == (name, "unsupported_value"), error


def test_best_of_is_honoured_only_as_n(client):
    body = {**BASE["/v1/completions"], "n": 2}
    assert client.post("/v1/completions", json={**body, "best_of": 2}).status_code == 200
    error = client.post("/v1/completions", json={**body, "best_of": 3}).json()["error"]
    assert error["param"] == "best_of", error
