"""The server on SmolLM2, driven by the official `openai` client; and a real SIGTERM.

What a user of the OpenAI SDK gets must be what `LLM.generate` and `LLM.chat`
give offline, as text: greedy, the same prompts, streaming or not. The
requests of each comparison run concurrently, so the server batches them as the
offline call does.
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import minicb
from minicb.data import load_chat_prompts
from minicb.llm import LLM
from minicb.sampling import SamplingParams
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread

openai = pytest.importorskip("openai")

NAME = "SmolLM2-135M-Instruct"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def smol_server(smollm2):
    model, tokenizer, _ = smollm2
    app = create_app(LLM.from_model(model, tokenizer, keep_traces=1, max_num_seqs=8), NAME)
    with serve_in_thread(app, shutdown_timeout=2.0) as url:
        yield url, LLM.from_model(model, tokenizer, max_num_seqs=8)


async def _gather(calls):
    return await asyncio.wait_for(asyncio.gather(*calls), 120)


async def _stream_text(stream, usage: dict) -> str:
    text = ""
    async for chunk in stream:
        if chunk.usage is not None:
            usage.update(chunk.usage.model_dump())
        for choice in chunk.choices:
            text += getattr(choice, "text", None) or (choice.delta.content if hasattr(choice, "delta") else "") or ""
    return text


@pytest.mark.slow
def test_openai_completions_equal_generate(smol_server):
    url, llm = smol_server
    prompts = load_chat_prompts(3)
    want = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        whole = await _gather(client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                              for p in prompts)
        usages = [{} for _ in prompts]
        streams = await _gather(client.completions.create(model=NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                          stream=True, stream_options={"include_usage": True})
                                for p in prompts)
        streamed = await _gather(_stream_text(s, u) for s, u in zip(streams, usages))
        await client.close()
        return whole, streamed, usages

    whole, streamed, usages = asyncio.run(run())
    for w, answer, text, usage in zip(want, whole, streamed, usages):
        assert answer.choices[0].text == w.text and text == w.text
        assert answer.choices[0].finish_reason == w.finish_reason
        assert answer.usage.prompt_tokens == len(w.prompt_token_ids) == usage["prompt_tokens"]
        assert answer.usage.completion_tokens == len(w.token_ids) == usage["completion_tokens"]


@pytest.mark.slow
def test_openai_chat_completions_equal_chat(smol_server):
    url, llm = smol_server
    conversations = [[{"role": "user", "content": q}] for q in load_chat_prompts(6)[3:]]
    want = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        whole = await _gather(client.chat.completions.create(model=NAME, messages=c, max_completion_tokens=MAX_TOKENS,
                                                             temperature=0) for c in conversations)
        usages = [{} for _ in conversations]
        streams = await _gather(client.chat.completions.create(model=NAME, messages=c, max_tokens=MAX_TOKENS,
                                                               temperature=0, stream=True,
                                                               stream_options={"include_usage": True})
                                for c in conversations)
        streamed = await _gather(_stream_text(s, u) for s, u in zip(streams, usages))
        models = await client.models.list()
        await client.close()
        return whole, streamed, usages, models

    whole, streamed, usages, models = asyncio.run(run())
    assert [m.id for m in models.data] == [NAME]
    for w, answer, text, usage in zip(want, whole, streamed, usages):
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content == w.text and text == w.text
        assert answer.choices[0].finish_reason == w.finish_reason
        assert answer.usage.completion_tokens == len(w.token_ids) == usage["completion_tokens"]
    # The SDK raises its own typed errors from our error bodies.
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="hi", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_finishes_or_aborts_running_requests_and_exits():
    """A real `python -m minicb serve` process: SIGTERM while one request streams."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    root = str(pathlib.Path(minicb.__file__).resolve().parent.parent)  # run this checkout's minicb
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "minicb", "serve", "--port", str(port), "--max-num-seqs", "4",
                               "--shutdown-timeout", "2", "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=root)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"the server exited while starting:\n{server.stdout.read()}"
            assert time.monotonic() < deadline, "the server did not answer /health within 180 s"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"model": NAME, "prompt": "Tell me a long story about a lighthouse.", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it is running
            server.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        server.wait(30)
        assert server.returncode in (0, -signal.SIGTERM), server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
