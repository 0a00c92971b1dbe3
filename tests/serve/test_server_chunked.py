"""Chunked prefill over HTTP: a long prompt arriving mid-stream must not stall the other streams.

`serve`'s flags (parsed by its own parser, so `--enable-chunked-prefill
--max-num-batched-tokens 64` is exactly what a user types) build the engine of a
server on a random model big enough that a 3,000-token prefill takes a visible
time. Two streams decode; a long prompt arrives; the largest gap between two
tokens of either stream while the long prompt is served is compared with a
bound: a third of what that prompt's prefill costs as one step, measured here
first on the same model. Without the flag, that prefill runs as one step, and
the streams wait through it (gap > bound); with it, the prompt is cut into
64-token chunks that share each step with the decodes (gap < bound).
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from minicb import SamplingParams
from minicb.cli_args import engine_config
from minicb.llm import LLM
from minicb.model import random_model, tiny_config
from minicb.serve.app import create_app
from minicb.serve.server import build_parser, serve_in_thread
from serve_support import ByteTokenizer

LONG_PROMPT = list(range(1, 250)) * 12  # 2,988 token ids


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                                    num_kv_heads=4, head_dim=32, max_position_embeddings=4096))


def whole_prefill_seconds(model) -> float:
    """One step computing LONG_PROMPT whole, as a server without chunking would (after a warm-up)."""
    engine = LLM.from_model(model, max_num_seqs=4).engine
    seconds = []
    for _ in range(2):
        engine.add_request(LONG_PROMPT, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return seconds[-1]


def largest_gap_during_the_long_prompt(model, flags: list[str]) -> float:
    args = build_parser().parse_args(["--max-num-seqs", "4", *flags])
    llm = LLM.from_model(model, ByteTokenizer(), **engine_config(args))
    times: list[list[float]] = [[], []]
    window = {}

    def stream(i):
        body = {"prompt": [5 + i, 6, 7], "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    times[i].append(time.perf_counter())
                if "end" in window and time.perf_counter() > window["end"] + 0.5:
                    break  # enough after the long prompt; hanging up aborts the rest

    with serve_in_thread(create_app(llm, "tiny-chunked")) as url:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while min(map(len, times)) < 10:  # both streams are decoding
            assert time.monotonic() < deadline, f"the streams did not start: {[len(t) for t in times]} tokens"
            time.sleep(0.01)
        window["start"] = time.perf_counter()
        answer = httpx.post(url + "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}, timeout=60)
        window["end"] = time.perf_counter()
        assert answer.status_code == 200, answer.text
        for thread in threads:
            thread.join(60)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if b > window["start"] and a < window["end"]]
    assert gaps, "no token of the streams arrived while the long prompt was served"
    return max(gaps)


def test_chunked_prefill_keeps_the_streams_flowing_while_a_long_prompt_arrives(model):
    bound = whole_prefill_seconds(model) / 3
    plain = largest_gap_during_the_long_prompt(model, [])
    chunked = largest_gap_during_the_long_prompt(model, ["--enable-chunked-prefill", "--max-num-batched-tokens", "64"])
    assert plain > bound, (f"without chunking the 2,988-token prefill is one step, so a stream should wait through "
                           f"it: largest gap {plain:.3f} s, bound {bound:.3f} s")
    assert chunked < bound, (f"with --enable-chunked-prefill --max-num-batched-tokens 64 the largest gap between two "
                             f"tokens of a stream was {chunked:.3f} s, over the bound {bound:.3f} s (a third of the "
                             f"whole prefill); without the flag it was {plain:.3f} s")
