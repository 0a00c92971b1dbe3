"""The server against its own OpenAPI document: requests generated from /openapi.json by schemathesis.

tests/serve/test_server.py and tests/serve/test_server_rules.py send the requests a person
thought of. Here schemathesis reads the document the server publishes and
writes the requests itself: each field at its edges and past them, wrong types,
missing fields, unexpected methods (its coverage phase), then random bodies
(Hypothesis, its fuzzing phase). For every request to every operation:

(a) no 5xx: whatever a client sends, the server answers it or refuses it;
(b) every 4xx carries OpenAI's error shape,
    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}};
(c) every answer is one the document declares: its status, its content type,
    and a body that validates against its schema (schemathesis' own checks);
    a body the schema refuses is refused; a stream ends with [DONE] and no error;
and afterwards (d) the server is healthy: no engine step failed (a step that
fails under a stream is a 200 with an error event, which (a) cannot see) and
every KV block is free once the requests are done.

Two things keep the fuzzing fast and aimed, each applied to the generated body
before it is sent (`bounded`, `aimed_at_the_engine`):
- The length limit. The document, like OpenAI's, gives max_tokens no upper
  bound, and the random model rarely samples EOS, so a generated max_tokens of
  10**9 would run to the end of the context: values over MAX_TOKENS become
  MAX_TOKENS (the schema allows it, so the request stays valid or invalid as it
  was), and a chat request without one, whose default is "as much as the context
  leaves", gets MAX_TOKENS too. n needs no cap: past the slots it is refused at once.
- In the fuzzing phase's valid bodies only: no `model`, none of the fields
  minicb refuses when set (logit_bias, ...) or that ask for a grammar (tools,
  response_format, guided_*, ...), and prompt ids in the vocabulary. A random
  body almost always sets one of them, and would be refused before the engine
  sees it (a random schema or regex nearly always has something minicb does not
  build); the coverage phase and the invalid bodies still send them all.

MAX_EXAMPLES bounds the fuzzing phase per operation: 713 requests in all, and
about 13 s for the whole file on two shared CPU cores. The seed and derandomize
make every run send the same requests. The requests that once made the server
fail are pinned at the end.
"""
from __future__ import annotations

import collections
import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from minicb.bench.sse import sse_events
from minicb.serve.app import create_app

from serve_support import TINY, tiny_llm, tiny_server

MAX_EXAMPLES = 100  # per operation, in the fuzzing phase (valid and invalid bodies together)
MAX_TOKENS = 4  # the most tokens a generated request may ask for (see `bounded`)
SEED = 20240501
VOCAB = 256  # the tiny model's
REFUSED_WHEN_SET = ("logit_bias", "best_of", "suffix", "response_format", "tools", "tool_choice", "parallel_tool_calls",
                    "skip_special_tokens", "include_stop_str_in_output", "top_logprobs", "stream_options",
                    "guided_json", "guided_regex", "guided_choice", "structured_outputs")
ERROR_TYPES = {"message": str, "type": str, "param": (str, type(None)), "code": (str, int, type(None))}
# Not positive_data_acceptance: the document states types, not ranges (those are the
# engine's check_request's to say), so a body the schema allows, temperature -1 say,
# is rightly a 400.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]

cases_sent: collections.Counter = collections.Counter()  # (operation, phase) -> requests sent


def published_document() -> dict:
    """The OpenAPI document of a server on the tiny model, as /openapi.json serves it.

    Read at import, from an app that is built but not started (a few ms): schemathesis
    makes one test per operation when pytest collects them, before any server runs.
    (Its lazy loader, schemathesis.pytest.from_fixture, would read the running server's,
    but in schemathesis 4.32 it sets pytest's Node._nodeid, which pytest 9 no longer has.)
    test_the_fuzzed_document_is_the_one_served checks that the running server serves it.
    """
    return create_app(tiny_llm(keep_traces=1), TINY).openapi()


DOCUMENT = published_document()
# A completion's stream is read to its end (n <= 8 completions of MAX_TOKENS tokens, a role
# chunk each, usage and [DONE]: under 64 events); the dashboard's never ends, so only its first.
CONFIG = schemathesis.Config.from_dict({
    "seed": SEED, "generation": {"deterministic": True}, "max-stream-events": 64,
    "operations": [{"include-path": "/v1/dashboard/steps", "max-stream-events": 1}]})
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


@pytest.fixture(scope="module")
def server():
    with tiny_server() as (url, app):
        yield url


def bounded(path: str, body):
    """The generated body, asking for MAX_TOKENS at most (ints only: a wrong type stays wrong)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for field in ("max_tokens", "max_completion_tokens"):
        if type(body.get(field)) is int and body[field] > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_TOKENS
    return body


def aimed_at_the_engine(body):
    """A valid generated body without what the server refuses before the engine sees it."""
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k not in ("model",) + REFUSED_WHEN_SET}
    if isinstance(body.get("prompt"), list):  # ids, or a list of prompts of ids
        body["prompt"] = [t % VOCAB if type(t) is int else [u % VOCAB if type(u) is int else u for u in t]
                          if isinstance(t, list) else t for t in body["prompt"]]
    return body


def check_error_shape(response) -> None:
    """(b): a 4xx body is {"error": {...}} with OpenAI's four fields, each of its type."""
    body = response.json()
    assert set(body) == {"error"}, f"{response.status_code} without OpenAI's error shape: {body}"
    wrong = {k: body["error"].get(k, "<missing>") for k, t in ERROR_TYPES.items()
             if not isinstance(body["error"].get(k, ...), t)}
    assert not wrong, f"{response.status_code}: fields of the wrong type {wrong} in {body}"


def check_stream(text: str) -> None:
    """A streamed 200 ends with [DONE] and carries no error event (a failure after the status was sent)."""
    events = sse_events(text.splitlines())
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {text[-300:]!r}"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert not errors, f"the stream carried an error: {errors}"


# Hypothesis' health checks time the generation of one body; the document's large request
# bodies are slow by that measure, and MAX_EXAMPLES bounds the run anyway.
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@schema.parametrize()
def test_every_generated_request_gets_a_declared_answer(case, server):
    phase, mode = case.meta.phase.name.value, case.meta.generation.mode.value
    if case.method == "POST":
        case.body = bounded(case.path, case.body)
        if phase == "fuzzing" and mode == "positive":
            case.body = aimed_at_the_engine(case.body)
    cases_sent[(case.operation.label, phase)] += 1
    response = case.call_and_validate(base_url=server, checks=CHECKS, timeout=30)  # (a) and (c)
    if 400 <= response.status_code < 500:
        check_error_shape(response)
    content_type = (response.headers.get("content-type") or [""])[0]
    if case.path != "/v1/dashboard/steps" and response.status_code == 200 and content_type.startswith(
            "text/event-stream"):
        check_stream(response.text)


def test_the_fuzzed_document_is_the_one_served(server):
    served = httpx.get(f"{server}/openapi.json", timeout=10).json()
    assert served == DOCUMENT, "the running server publishes another document than the one the requests came from"


def wait_until_idle(client: httpx.Client, timeout: float = 10.0) -> dict:
    """/health once every KV block is free (in-flight requests done), or the last answer after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        health = client.get("/health").json()
        if health.get("kv_blocks_free") == health.get("kv_blocks") or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_after_fuzzing_the_server_is_healthy_and_every_block_is_free(server):
    per_operation = collections.Counter()
    for (operation, phase), count in sorted(cases_sent.items()):
        per_operation[operation] += count
        print(f"{operation:28} {phase:9} {count:4} requests")
    print(f"{sum(cases_sent.values())} requests in all")
    fuzzed = {f"{method.upper()} {path}" for path, item in DOCUMENT["paths"].items() for method in item}
    assert set(per_operation) == fuzzed, f"operations never sent a request: {fuzzed - set(per_operation)}"
    with httpx.Client(base_url=server, timeout=10) as client:
        health = wait_until_idle(client)
    assert health["status"] == "ok" and health["kv_blocks_free"] == health["kv_blocks"], \
        f"10 s after the last request, /health says {json.dumps(health)}"
    assert health["step_failures"] == 0, f"engine steps failed during the fuzzing: {health['last_step_failure']}"


# ---- what the fuzzing found, pinned -------------------------------------------------------------
# Each of these once got a 500 (or, streamed, a 200 with an error event and a failed step):
# schema-valid values the server let through to the tokenizer or the engine. Sent as raw
# bytes, since NaN and a lone surrogate are what Python's own json parser accepts.

ONCE_FAILED = {
    "seed past 64 bits": ('{"prompt": "hi", "seed": 18446744073709551616, "temperature": 1.0}', 400, "seed"),
    "seed past 64 bits, streamed": ('{"prompt": "hi", "seed": 18446744073709551616, "temperature": 1.0, '
                                    '"stream": true}', 400, "seed"),
    "temperature NaN": ('{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "top_p Infinity": ('{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    "a lone surrogate in the prompt": ('{"prompt": "a\\ud800"}', 400, "prompt"),
    "a lone surrogate in a stop string": ('{"prompt": "a", "stop": ["\\udc00"]}', 400, "stop"),
    "a lone surrogate in a message": ('{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    "a lone surrogate in a text part": ('{"messages": [{"role": "user", "content": [{"type": "text", '
                                        '"text": "\\ud800"}]}]}', 400, "messages"),
    # Refused as "not an integer", though the document says integer, and 2.0 is one.
    "integers written 2.0": ('{"prompt": [5, 6], "n": 2.0, "seed": 7.0, "temperature": 1.0, "max_tokens": 3.0, '
                             '"stop_token_ids": [2.0]}', 200, None),
    "max_completion_tokens 3.0": ('{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3.0}',
                                  200, None),
}


def test_requests_that_once_failed_get_a_400_naming_the_field_or_an_answer():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        for name, (body, status, param) in ONCE_FAILED.items():
            path = "/v1/chat/completions" if '"messages"' in body else "/v1/completions"
            response = client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
            assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
            if status == 400:
                error = response.json()["error"]
                assert error["param"] == param and error["type"] == "invalid_request_error", f"{name}: {error}"
            else:  # read as the integers they are: n completions of at most max_tokens each
                n, answer = json.loads(body).get("n", 1), response.json()
                assert len(answer["choices"]) == n, f"{name}: {answer}"
                assert answer["usage"]["completion_tokens"] <= 3 * n, f"{name}: {answer}"
        health = wait_until_idle(client)
        assert health["step_failures"] == 0 and health["kv_blocks_free"] == health["kv_blocks"], f"{health}"


# These once made a step fail, and every request in it with a 500 (a tiny temperature overflowed
# the logits; a top_p that rounds to 0 in float32 dropped every token; a repetition penalty of
# 1e-252, found by the fuzzing above, sent the prompt's logits to inf): minicb/sampling.py now
# shifts the logits before dividing, always keeps the most likely token, and keeps a penalized
# logit finite.
ENGINE_FAILS = {"temperature 1e-300": {"temperature": 1e-300}, "top_p 5e-324": {"temperature": 1.0, "top_p": 5e-324},
                "repetition_penalty 1e-252": {"temperature": 1.0, "repetition_penalty": 1.2327768416713013e-252},
                "repetition_penalty 1e300, greedy": {"temperature": 0.0, "repetition_penalty": 1e300}}


def test_sampling_at_the_edge_of_float32_gets_an_answer_or_a_400():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        for name, fields in ENGINE_FAILS.items():
            response = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, **fields})
            assert response.status_code in (200, 400), f"{name}: {response.status_code} {response.text[:300]}"
        health = wait_until_idle(client)
        assert health["step_failures"] == 0, f"engine steps failed: {health['last_step_failure']}"
