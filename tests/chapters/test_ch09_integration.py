"""Chapter 09, all tasks together: your engine-thread functions inside the real HTTP server.

The server (minicb/serve/app.py) runs on the tiny random model at 127.0.0.1 on a
free port (tests/serve/serve_support.py), and its engine loop gets take_commands,
apply_commands and group_step through `impl.load("serve.loop")`: yours, under
`check 9`. Eight requests stream at once through 4 slots, one of them with n = 2
seeded completions; every completion's tokens and finish reason must equal
`LLM.generate`'s, the oracle. Then a client hangs up mid-stream: its request must
be aborted and every KV block free again. `check 9` shows it as the row "all".

If the engine thread raised (a stub, a bug), the test re-raises that exception,
so the grade names it instead of a bare HTTP failure.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from minicb.bench.sse import sse_events
from minicb.sampling import SamplingParams

from serve_support import metric, tiny_llm, tiny_server

PROMPTS = [[5, 17, 99, 3], [200, 201], [9] * 13, [33, 34, 35], [70, 71, 72, 73, 74], [120], [3, 4, 5, 6, 7, 8],
           [250, 251, 252]]
MAX_TOKENS = [12, 3, 20, 7, 16, 30, 1, 9]
N2 = 2  # PROMPTS[N2] asks for 2 seeded completions


def body(i: int) -> dict:
    b = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0, "stream": True,
         "return_token_ids": True, "stream_options": {"include_usage": True}}
    if i == N2:
        b.update(n=2, temperature=0.8, seed=11)
    return b


def params(i: int) -> SamplingParams:
    if i == N2:
        return SamplingParams(max_tokens=MAX_TOKENS[i], n=2, temperature=0.8, seed=11)
    return SamplingParams(max_tokens=MAX_TOKENS[i])


def raise_engine_failure(app) -> None:
    """The engine thread's own exception, if it died: a clearer grade than the 500 a client saw."""
    if app.state.loop.exception is not None:
        raise app.state.loop.exception


STREAMS_TIMEOUT_S = 15  # the tiny model serves all eight in about a second


async def stream_all(url: str) -> list[tuple[int, list]]:
    async with httpx.AsyncClient(base_url=url, timeout=STREAMS_TIMEOUT_S) as client:
        async def one(i):
            async with client.stream("POST", "/v1/completions", json=body(i)) as response:
                return response.status_code, sse_events([line async for line in response.aiter_lines()])
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def hang_up_mid_stream(client: httpx.Client) -> None:
    request = {"prompt": [5, 6, 7, 8], "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200, f"HTTP {response.status_code}: {response.read()[:300]}"
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leaving the block closes the connection: the client is gone


@pytest.mark.task("all")
def test_your_engine_thread_serves_concurrent_streams_and_frees_a_disconnected_request():
    with tiny_server(max_num_seqs=4) as (url, app):
        try:
            results = asyncio.run(asyncio.wait_for(stream_all(url), STREAMS_TIMEOUT_S))
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise_engine_failure(app)
            raise AssertionError(f"the eight streams had not all ended after {STREAMS_TIMEOUT_S} s: a completion "
                                 f"that never gets its Finished event keeps its stream open") from None
        raise_engine_failure(app)
        want = tiny_llm(max_num_seqs=4).generate(PROMPTS, [params(i) for i in range(len(PROMPTS))], use_tqdm=False)
        for i, ((status, events), w) in enumerate(zip(results, want)):
            assert status == 200, f"request {i}: HTTP {status}"
            assert events and events[-1] == "[DONE]", f"request {i}: the stream did not end with [DONE]"
            *chunks, usage = events[:-1]
            for c in w.outputs:
                got = [t for chunk in chunks for choice in chunk["choices"] if choice["index"] == c.index
                       for t in choice["token_ids"] or []]
                assert got == c.token_ids, (f"request {i} completion {c.index}: streamed tokens {got}, "
                                            f"LLM.generate's {c.token_ids}")
                reasons = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]
                           if choice["index"] == c.index and choice["finish_reason"] is not None]
                assert reasons == [c.finish_reason], (f"request {i} completion {c.index}: finish reasons "
                                                      f"{reasons}, want [{c.finish_reason!r}] once")
            sent = sum(len(c.token_ids) for c in w.outputs)
            assert usage["usage"]["completion_tokens"] == sent, f"request {i}: usage {usage['usage']}, {sent} tokens"

        engine = app.state.loop.engine
        with httpx.Client(base_url=url, timeout=10) as client:
            hang_up_mid_stream(client)
            deadline, text = time.monotonic() + 10, ""
            while time.monotonic() < deadline:
                raise_engine_failure(app)
                text = client.get("/metrics").text
                aborted = 'minicb_completions_finished_total{reason="abort"} 1.0' in text  # no sample before one
                if aborted and metric(text, "minicb_requests_running") == 0:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"10 s after the client hung up, the request was not aborted:\n{text[:1500]}")
            assert metric(text, "minicb_generation_tokens_total") < sum(MAX_TOKENS) + 480 - 100, \
                "the abandoned request ran on to max_tokens"
        free, total = engine.allocator.num_free_blocks, engine.allocator.num_blocks
        assert free == total, f"after the hang-up {total - free} of {total} KV blocks are still held"
