"""Logprobs, echo and lists of prompts over HTTP, against LLM.generate on the same engine.

The engine's scores are held to HF transformers in tests/engine/test_logprobs.py;
here the oracle is `LLM.generate` with the SamplingParams the server should have
made, and the question is whether the wire format carries them whole: the
completions API's parallel lists (with the prompt first under echo), the chat
API's objects, a stream's pieces put back together, and a list of prompts as
one choice per prompt per completion, in OpenAI's order.
"""
from __future__ import annotations

import httpx
import pytest

from minicb.bench.sse import sse_events
from minicb.sampling import SamplingParams

from serve_support import tiny_llm, tiny_server

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 30, 31],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 40], [50, 51, 52]]
CHAT = [{"role": "user", "content": "hello there"}]
CLOSE = 1e-5  # the same engine code either way; only the batch around a request differs


@pytest.fixture(scope="module")
def client():
    with tiny_server(enable_prefix_caching=True) as (url, _), httpx.Client(base_url=url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def oracle():
    return tiny_llm(enable_prefix_caching=True)


def streamed(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [event for event in sse_events(response.iter_lines()) if event != "[DONE]"]


def assert_close(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} entries, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= CLOSE), f"{what}[{i}]: {a} != {b}"


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(client, oracle):
    body = {"prompt": PROMPTS, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    outs = oracle.generate(PROMPTS, SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True),
                           use_tqdm=False)
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice, out in zip(choices, outs):
        scores = choice["logprobs"]
        want = [None] + [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in out.outputs[0].logprobs]
        assert_close(scores["token_logprobs"], want, f"prompt {out.index}")
        assert scores["top_logprobs"][0] is None and all(len(t) <= 2 for t in scores["top_logprobs"][1:])
        assert len(scores["tokens"]) == len(scores["text_offset"]) == len(out.prompt_token_ids) + 3
        assert scores["text_offset"] == sorted(scores["text_offset"]) and scores["text_offset"][0] == 0
        assert choice["text"].startswith(oracle.tokenizer.decode(out.prompt_token_ids))


def test_max_tokens_0_with_echo_scores_without_generating(client, oracle):
    """What lm-eval's loglikelihood asks: the prompt's logprobs and nothing new."""
    body = {"prompt": PROMPTS[:2], "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}
    answer = client.post("/v1/completions", json=body).json()
    outs = oracle.generate(PROMPTS[:2], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for choice, out in zip(answer["choices"], outs):
        assert choice["text"] == oracle.tokenizer.decode(out.prompt_token_ids) and choice["finish_reason"] == "length"
        assert_close(choice["logprobs"]["token_logprobs"], [None] + [e.logprob for e in out.prompt_logprobs[1:]],
                     f"prompt {out.index}")
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == sum(len(p) for p in PROMPTS[:2])


def test_a_list_of_prompts_is_one_choice_per_prompt_per_completion(client):
    texts = ["abc", "de", "fghij"]
    body = {"prompt": texts, "n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    together = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in together["choices"]] == list(range(6))
    for i, text in enumerate(texts):
        alone = client.post("/v1/completions", json={**body, "prompt": text}).json()["choices"]
        assert [c["text"] for c in together["choices"][2 * i:2 * i + 2]] == [c["text"] for c in alone], text
    assert together["usage"]["prompt_tokens"] == sum(len(t) for t in texts)
    assert together["usage"]["completion_tokens"] == 6 * 4
    ids = client.post("/v1/completions", json={**body, "prompt": [list(t.encode()) for t in texts]}).json()
    assert [c["text"] for c in ids["choices"]] == [c["text"] for c in together["choices"]]


def test_a_stream_carries_the_same_scores_as_the_answer(client):
    body = {"prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()["choices"]
    pieces: dict[int, dict] = {}
    for chunk in streamed(client, "/v1/completions", body):
        for choice in chunk["choices"]:
            got = pieces.setdefault(choice["index"], {"text": "", "token_logprobs": [], "tokens": []})
            got["text"] += choice["text"]
            if choice["logprobs"]:
                got["token_logprobs"] += choice["logprobs"]["token_logprobs"]
                got["tokens"] += choice["logprobs"]["tokens"]
    for choice in whole:
        got = pieces[choice["index"]]
        assert got["text"] == choice["text"] and got["tokens"] == choice["logprobs"]["tokens"]
        assert_close(got["token_logprobs"], choice["logprobs"]["token_logprobs"], f"choice {choice['index']}")


def test_chat_logprobs_are_openai_s_objects(client, oracle):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "ignore_eos": True}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    out = oracle.chat(CHAT, SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    content = choice["logprobs"]["content"]
    assert_close([c["logprob"] for c in content], [e.logprob for e in out.outputs[0].logprobs], "chat")
    assert [c["bytes"] for c in content] == [[t] for t in out.token_ids]  # the byte tokenizer: id = byte
    for entry, want in zip(content, out.outputs[0].logprobs):
        assert [t["bytes"] for t in entry["top_logprobs"]] == [[t] for t, _ in want.top]
    streamed_content = [c for chunk in streamed(client, "/v1/chat/completions", body) for choice in chunk["choices"]
                        if choice["logprobs"] for c in choice["logprobs"]["content"]]
    assert_close([c["logprob"] for c in streamed_content], [c["logprob"] for c in content], "chat stream")


def test_without_logprobs_there_are_none(client):
    choice = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "echo": True}).json()["choices"][0]
    assert choice["logprobs"] is None and choice["text"].startswith("\x05\x06")
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()["choices"][0]
    assert chat["logprobs"] is None


def test_penalties_reach_the_sampler(client, oracle):
    """presence/frequency/repetition penalties, min_p and min_tokens over HTTP give LLM.generate's tokens."""
    rules = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3, "min_p": 0.02,
             "min_tokens": 3}
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "return_token_ids": True, **rules}
    got = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    want = oracle.generate([PROMPTS[2]], SamplingParams(max_tokens=12, **rules), use_tqdm=False)[0].token_ids
    plain = oracle.generate([PROMPTS[2]], SamplingParams(max_tokens=12), use_tqdm=False)[0].token_ids
    assert got == want, f"over HTTP {got}, LLM.generate {want}"
    assert want != plain, "the penalties changed nothing here: the test would not see them ignored"
