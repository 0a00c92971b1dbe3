"""The request rules live in one place, the engine's `check_request`; LLM and the server pass its verdict on.

The engine raises one error, RequestRejected (a ValueError), with the field at
fault (`param`) and a code. Here each rule is broken three ways: by the engine
itself (the oracle: its message, param and code), through `LLM.generate`
(a ValueError saying which prompt), and over HTTP (a 400 in OpenAI's shape, the
engine's message, its code, and its param as the route names it). A patched
engine check shows the server no longer restates the rules; a 100,000-id prompt
is refused before the engine sees it; a body over the size limit gets 413.

Servers run on the tiny model at 127.0.0.1 on a free port (tests/serve/serve_support.py),
every request has a deadline, and each server is stopped by its test.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from minicb.sampling import SamplingParams
from minicb.scheduler import RequestRejected
from minicb.serve.app import MAX_BODY_BYTES, create_app
from minicb.serve.server import serve_in_thread
from serve_support import TINY, ByteTokenizer, metric, tiny_llm, tiny_server

ERROR_KEYS = {"message", "type", "param", "code"}
# 4 slots and 24 blocks of 16 tokens (384) under a 512-token context: every rule can be broken.
ENGINE = {"max_num_seqs": 4, "num_blocks": 24}
CHAT = [{"role": "user", "content": "hi"}]


def chat_ids(messages) -> list[int]:
    return ByteTokenizer().apply_chat_template(messages)


# name: (prompt ids, SamplingParams fields, the param and code the engine must name)
BROKEN = {
    "empty prompt": ([], {}, "prompt", "empty_prompt"),
    "token id out of the vocabulary": ([5, 999, 7], {}, "prompt", "token_id_out_of_range"),
    "prompt over the context": ([5] * 600, {}, "prompt", "context_length_exceeded"),
    "prompt as long as the context": ([5] * 512, {}, "prompt", "context_length_exceeded"),
    "n beyond the slots": ([1, 2], {"n": 5}, "n", "too_many_completions"),
    "max_tokens beyond the KV pool": ([5] * 10, {"max_tokens": 400}, "max_tokens", "kv_cache_too_small"),
    "prompt beyond the KV pool": ([5] * 400, {"max_tokens": 1}, "prompt", "kv_cache_too_small"),
}


def engine_verdict(llm, prompt_ids, params) -> RequestRejected:
    """What the engine itself says of a request (the oracle for LLM and the server)."""
    with pytest.raises(RequestRejected) as refused:
        llm.engine.check_request(prompt_ids, params)
    return refused.value


def error_of(response: httpx.Response, status: int, name: str) -> dict:
    assert response.status_code == status, f"{name}: want {status}, got {response.status_code} {response.text}"
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error", f"{name}: {error}"
    return error


# ---- the engine names the field and the code ------------------------------------------------------


@pytest.mark.parametrize("name", BROKEN)
def test_the_engine_check_raises_request_rejected_with_param_and_code(name):
    prompt, fields, param, code = BROKEN[name]
    llm = tiny_llm(**ENGINE)
    e = engine_verdict(llm, prompt, SamplingParams(**fields))
    assert isinstance(e, ValueError), f"{name}: RequestRejected must be a ValueError"
    assert (e.param, e.code) == (param, code), f"{name}: want param {param!r}, code {code!r}; got {e.param!r}, " \
                                               f"{e.code!r} ({e})"
    assert str(e) and not llm.engine.has_unfinished(), f"{name}: a check queues nothing"


def test_sampling_params_changed_after_construction_are_refused_with_their_field():
    llm, params = tiny_llm(**ENGINE), SamplingParams()
    params.top_p = 0.0
    e = engine_verdict(llm, [1, 2], params)
    assert (e.param, e.code) == ("top_p", "invalid_value") and "top_p=0.0" in str(e), (e.param, e.code, str(e))


# ---- LLM: the same verdict, as a ValueError that says which prompt ----------------------------------


@pytest.mark.parametrize("name", BROKEN)
def test_llm_generate_raises_the_engines_verdict_as_a_value_error(name):
    prompt, fields, param, code = BROKEN[name]
    llm = tiny_llm(**ENGINE)
    want = engine_verdict(llm, prompt, SamplingParams(**fields))
    good = [3, 4, 5]
    with pytest.raises(ValueError) as refused:  # the bad one second: all or nothing
        llm.generate([good, prompt], [SamplingParams(max_tokens=4), SamplingParams(**fields)], use_tqdm=False)
    e = refused.value
    assert str(e) == f"prompt 1: {want}", f"{name}: got {str(e)!r}, the engine says {str(want)!r}"
    assert isinstance(e, RequestRejected) and (e.param, e.code) == (param, code), f"{name}: {e!r}"
    assert not llm.engine.has_unfinished() and llm.engine.num_steps == 0, f"{name}: nothing may be queued or run"


# ---- HTTP: a 400 with the engine's message, param and code --------------------------------------------


def test_each_engine_check_answers_400_with_its_param_and_code():
    llm_check = tiny_llm(**ENGINE)  # the oracle: a twin of the served engine
    with tiny_server(**ENGINE) as (url, app), httpx.Client(base_url=url, timeout=10) as client:
        for name, (prompt, fields, param, code) in BROKEN.items():
            want = engine_verdict(llm_check, prompt, SamplingParams(**{"max_tokens": 16, **fields}))
            body = {"prompt": prompt, "max_tokens": 16, **fields}
            error = error_of(client.post("/v1/completions", json=body), 400, name)
            assert (error["param"], error["code"], error["message"]) == (param, code, str(want)), f"{name}: {error}"
        # A text prompt that encodes to nothing is the engine's empty prompt too.
        error = error_of(client.post("/v1/completions", json={"prompt": ""}), 400, "empty text prompt")
        assert (error["param"], error["code"]) == ("prompt", "empty_prompt"), error
        # Chat names the prompt "messages", and the limit as the client sent it.
        chat_cases = {
            "chat over the context": ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages",
                                      "context_length_exceeded"),
            "chat prompt beyond the pool": ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages",
                                            "kv_cache_too_small"),
            "max_completion_tokens beyond the pool": ({"messages": CHAT, "max_completion_tokens": 400},
                                                      "max_completion_tokens", "kv_cache_too_small"),
            "chat max_tokens beyond the pool": ({"messages": CHAT, "max_tokens": 400}, "max_tokens",
                                                "kv_cache_too_small"),
            "chat n beyond the slots": ({"messages": CHAT, "n": 5}, "n", "too_many_completions"),
        }
        for name, (body, param, code) in chat_cases.items():
            error = error_of(client.post("/v1/chat/completions", json=body), 400, name)
            assert (error["param"], error["code"]) == (param, code), f"{name}: {error}"
            ids = chat_ids(body["messages"])
            if param == "messages":  # the templated prompt is what the engine measured
                assert f"{len(ids)}" in error["message"], f"{name}: the message must name the prompt's " \
                                                          f"{len(ids)} tokens: {error['message']}"
        # Still serving, nothing left behind, every refusal counted.
        good = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert good.status_code == 200, good.text
        text = client.get("/metrics").text
        assert metric(text, "minicb_requests_rejected_total", 'status="400"') == len(BROKEN) + 1 + len(chat_cases)
        engine = app.state.loop.engine
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_the_server_asks_the_engine_instead_of_restating_its_rules():
    # A patched engine check with a rule of its own: every request the engine could refuse gets
    # the engine's answer, code and param included. Had the server kept a copy of a rule, that
    # request would be refused by the copy, with the copy's code, before the engine was asked.
    seen = []

    def check_request(prompt_ids, params):
        seen.append(list(prompt_ids))
        raise RequestRejected(f"a new rule refuses {len(prompt_ids)} tokens", "prompt", "new_rule")

    with tiny_server(**ENGINE) as (url, app), httpx.Client(base_url=url, timeout=10) as client:
        app.state.loop.engine.check_request = check_request
        for name, (prompt, fields, _, _) in {**BROKEN, "a good request": ([1, 2, 3], {}, None, None)}.items():
            seen.clear()
            error = error_of(client.post("/v1/completions", json={"prompt": prompt, **fields}), 400, name)
            assert (error["param"], error["code"]) == ("prompt", "new_rule"), f"{name}: the server answered on " \
                                                                              f"its own: {error}"
            assert error["message"] == f"a new rule refuses {len(prompt)} tokens" and seen == [prompt], (name, seen)
        error = error_of(client.post("/v1/chat/completions", json={"messages": CHAT}), 400, "chat")
        assert (error["param"], error["code"]) == ("messages", "new_rule"), error
        # The checks only the server can make still come first: the engine is not asked.
        seen.clear()
        server_only = {"unknown model": ({"prompt": [1], "model": "gpt-4"}, "model"),
                       "empty stop string": ({"prompt": [1], "stop": [""]}, "stop"),
                       "logit_bias": ({"prompt": [1], "logit_bias": {"5": 1.0}}, "logit_bias"),
                       "top_p 0": ({"prompt": [1], "top_p": 0}, "top_p")}
        for name, (body, param) in server_only.items():
            assert error_of(client.post("/v1/completions", json=body), 400, name)["param"] == param, name
        assert seen == [], f"server-only checks must not reach the engine: {seen}"


# ---- a huge prompt is refused before any work ----------------------------------------------------


def test_a_100k_token_prompt_is_refused_fast_and_the_engine_never_sees_it():
    with tiny_server() as (url, app), httpx.Client(base_url=url, timeout=10) as client:
        loop, engine = app.state.loop, app.state.loop.engine
        submitted, added = [], []
        submit, add_request = loop.submit, engine.add_request
        loop.submit = lambda *a, **k: submitted.append(a) or submit(*a, **k)
        engine.add_request = lambda *a, **k: added.append(a) or add_request(*a, **k)
        steps = engine.num_steps
        body = json.dumps({"prompt": [5] * 100_000, "max_tokens": 4}).encode()
        assert len(body) < MAX_BODY_BYTES, "the body itself is within the size limit: the prompt is what is refused"
        began = time.perf_counter()
        response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        seconds = time.perf_counter() - began
        error = error_of(response, 400, "100k-token prompt")
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded"), error
        assert "100000 tokens" in error["message"], error["message"]
        assert seconds < 2.0, f"refusing it took {seconds:.3f} s"
        assert submitted == [] and added == [], "the engine loop must never see a refused request"
        assert engine.num_steps == steps and not engine.has_unfinished(), "no engine step ran for it"
        # The same server then serves a real request, through the spies.
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
        assert len(submitted) == len(added) == 1


# ---- bodies over the size limit: 413 ------------------------------------------------------------------


def padded_body(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes (JSON allows trailing spaces)."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    assert len(body) <= size
    return body + b" " * (size - len(body))


def chunks(body: bytes, size: int = 1000):
    for i in range(0, len(body), size):  # a generator body: sent chunked, with no Content-Length
        yield body[i:i + size]


def test_a_body_over_the_limit_gets_413_and_one_at_the_limit_is_served():
    limit = 2000
    app = create_app(tiny_llm(keep_traces=1), TINY, max_body_bytes=limit)
    headers = {"Content-Type": "application/json"}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        at, over = padded_body(limit), padded_body(limit + 1)
        assert client.post("/v1/completions", content=at, headers=headers).status_code == 200
        error = error_of(client.post("/v1/completions", content=over, headers=headers), 413, "Content-Length")
        assert error["code"] == "request_too_large" and f"{limit + 1} bytes" in error["message"], error
        # Sent in chunks, the size is not declared: counted as it arrives.
        assert client.post("/v1/completions", content=chunks(at), headers=headers).status_code == 200
        error = error_of(client.post("/v1/completions", content=chunks(over), headers=headers), 413, "chunked")
        assert error["code"] == "request_too_large" and str(limit) in error["message"], error
        # Both counted; the server keeps serving; a chat body is limited too.
        chat = json.dumps({"messages": [{"role": "user", "content": "y" * limit}]}).encode()
        error_of(client.post("/v1/chat/completions", content=chat, headers=headers), 413, "chat")
        assert metric(client.get("/metrics").text, "minicb_requests_rejected_total", 'status="413"') == 3
        assert client.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 2}).status_code == 200


def test_the_default_limit_refuses_a_body_just_over_it():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=20) as client:
        headers = {"Content-Type": "application/json"}
        over = padded_body(MAX_BODY_BYTES + 1)
        error = error_of(client.post("/v1/completions", content=over, headers=headers), 413, "default limit")
        assert error["code"] == "request_too_large", error
        error = error_of(client.post("/v1/completions", content=chunks(over, 64 * 1024), headers=headers), 413,
                         "default limit, chunked")
        assert client.post("/v1/completions", content=padded_body(MAX_BODY_BYTES), headers=headers).status_code == 200
