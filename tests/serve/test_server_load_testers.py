"""The request bodies that load testers send, replayed: guidellm and aiperf against `minicb serve`.

Neither tool is installed here; the bodies below are written from their
documented request formats (guidellm's OpenAI HTTP backend, aiperf's chat and
completions endpoints), field for field, so a change in the server that would
break them shows here first. What both measure rests on three things: the
stream's text, the usage chunk at its end (`stream_options.include_usage`),
whose completion_tokens they take as the output length, and exact output
lengths (`ignore_eos`, `min_tokens`). The README's "Serving over HTTP" shows
the commands.

Three of these lean on vLLM features that came to minicb with them: a list of
prompts (aiperf's completions), `min_tokens`, and
`stream_options.continuous_usage_stats` (the usage so far on every chunk, which
guidellm always asks for; as in vLLM, a chat stream's opening chunk, the
assistant's role, carries it too, with completion_tokens 0).
"""
from __future__ import annotations

import httpx
import pytest

from minicb.bench.sse import sse_events

from serve_support import TINY, tiny_server

MAX_TOKENS = 16
PROMPT = "Write a short story about a lighthouse keeper. " * 3


@pytest.fixture(scope="module")
def client():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        yield client


def model_of(client: httpx.Client) -> str:
    """The served model's id, as both tools find it when not told (GET /v1/models)."""
    return client.get("/v1/models").json()["data"][0]["id"]


# guidellm: fixed output lengths are max_tokens (chat: max_completion_tokens) with stop null and ignore_eos;
# streaming always asks for usage, at the end and on every chunk.
def guidellm_completions(model: str) -> dict:
    return {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": MAX_TOKENS, "stop": None, "ignore_eos": True, "prompt": PROMPT}


def guidellm_chat(model: str) -> dict:
    # Its text column becomes content parts of one user message; a prefix column, a system message.
    return {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": MAX_TOKENS, "stop": None, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You are a storyteller."},
                         {"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}


# aiperf: one string content for a single text; --extra-inputs merged into the body as they are.
def aiperf_chat(model: str, **extra_inputs) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}], "model": model, "stream": True,
            "max_completion_tokens": MAX_TOKENS, "stream_options": {"include_usage": True}, **extra_inputs}


def aiperf_completions(model: str, **extra_inputs) -> dict:
    # Its prompt is a list of the turn's texts: one string here.
    return {"prompt": [PROMPT], "model": model, "stream": True, "max_tokens": MAX_TOKENS,
            "stream_options": {"include_usage": True}, **extra_inputs}


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[list[dict], dict]:
    """(the chunks with choices, the last chunk's usage) of a stream that ends with [DONE]."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read().decode()
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]", events[-3:]
    *chunks, last = events[:-1]
    assert last["choices"] == [] and last["usage"] is not None, f"no usage chunk at the end: {last}"
    return chunks, last["usage"]


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content") or ""
                   for c in chunks)


def prompt_tokens_of(client: httpx.Client, body: dict) -> int:
    """What the prompt of `body` is in tokens, by the server's own count (/tokenize)."""
    if "messages" in body:
        return client.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
    prompt = body["prompt"][0] if isinstance(body["prompt"], list) else body["prompt"]
    return client.post("/tokenize", json={"prompt": prompt}).json()["count"]


def check_fixed_length(client: httpx.Client, body: dict, chunks: list[dict], usage: dict) -> None:
    """The usage a load tester reads: the prompt as /tokenize counts it, exactly MAX_TOKENS out."""
    assert usage == {"prompt_tokens": prompt_tokens_of(client, body), "completion_tokens": MAX_TOKENS,
                     "total_tokens": prompt_tokens_of(client, body) + MAX_TOKENS}, usage
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert text_of(chunks), "the stream carried no text"


# ---- guidellm -----------------------------------------------------------------------------------------


def test_guidellm_completions_stream(client):
    body = guidellm_completions(model_of(client))
    assert body["model"] == TINY
    chunks, usage = streamed(client, "/v1/completions", body)
    check_fixed_length(client, body, chunks, usage)


def test_guidellm_chat_stream(client):
    body = guidellm_chat(model_of(client))
    chunks, usage = streamed(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    check_fixed_length(client, body, chunks[1:], usage)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client, path):
    body = (guidellm_completions if path == "/v1/completions" else guidellm_chat)(model_of(client))
    chunks, usage = streamed(client, path, body)
    so_far = [c["usage"] for c in chunks]
    assert all(u is not None for u in so_far), f"chunks without usage: {sum(u is None for u in so_far)}"
    assert all(u["prompt_tokens"] == usage["prompt_tokens"] for u in so_far)
    counts = [u["completion_tokens"] for u in so_far]
    assert counts == sorted(counts) and counts[-1] == usage["completion_tokens"] == MAX_TOKENS, counts
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in so_far)


# ---- aiperf -------------------------------------------------------------------------------------------


def test_aiperf_chat_stream_with_extra_inputs_for_a_fixed_length(client):
    # aiperf profile ... --extra-inputs ignore_eos:true --extra-inputs min_tokens:16
    body = aiperf_chat(model_of(client), ignore_eos=True, min_tokens=MAX_TOKENS)
    chunks, usage = streamed(client, "/v1/chat/completions", body)
    check_fixed_length(client, body, chunks[1:], usage)


def test_aiperf_chat_without_streaming(client):
    body = {**aiperf_chat(model_of(client), ignore_eos=True), "stream": False}
    del body["stream_options"]  # aiperf asks for usage only in a stream (a whole answer always has it)
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens_of(client, body), MAX_TOKENS)


def test_older_aiperf_names_each_message_and_the_prompt_is_unchanged(client):
    # Earlier aiperf releases put the text's name on the message; it is "" unless the data set names it.
    body = aiperf_chat(model_of(client), ignore_eos=True)
    named = {**body, "messages": [{**body["messages"][0], "name": ""}]}
    _, usage = streamed(client, "/v1/chat/completions", named)
    assert usage["prompt_tokens"] == prompt_tokens_of(client, body), "an empty name adds nothing to the prompt"


def test_aiperf_completions_stream_of_a_one_prompt_list(client):
    body = aiperf_completions(model_of(client), ignore_eos=True)
    chunks, usage = streamed(client, "/v1/completions", body)
    assert {c["choices"][0]["index"] for c in chunks} == {0}
    check_fixed_length(client, body, chunks, usage)


# ---- min_tokens, as vLLM does it -------------------------------------------------------------------------


def test_min_tokens_holds_back_stop_tokens_until_that_many_were_made(client):
    # Greedy's first token, made a stop token: without min_tokens the answer is that one token.
    base = {"prompt": [40, 41, 42, 43], "temperature": 0, "max_tokens": 10, "return_token_ids": True}
    first = client.post("/v1/completions", json={**base, "max_tokens": 1}).json()["choices"][0]["token_ids"][0]
    alone = client.post("/v1/completions", json={**base, "stop_token_ids": [first]}).json()["choices"][0]
    assert (alone["token_ids"], alone["finish_reason"]) == ([first], "stop")
    # vLLM: neither EOS nor a stop token id can be generated before min_tokens tokens.
    held = client.post("/v1/completions", json={**base, "stop_token_ids": [first], "min_tokens": 5}).json()
    ids = held["choices"][0]["token_ids"]
    assert len(ids) >= 5 and first not in ids[:5], ids
    after = held["choices"][0]["finish_reason"] == "length" or ids[-1] in (first, 2)  # 2: the tiny model's EOS
    assert after, f"after min_tokens a stop token (or EOS, or max_tokens) ends it: {held['choices'][0]}"
