"""The server when the engine fails inside a step: its requests end with an error, the server goes on.

A test hook stands in for a broken model: the engine's runner (the forward of
one step) raises once, on a chosen call. The requests in the engine at that
moment must end with OpenAI's error shape (a 500 for a whole answer, an error
event then [DONE] for a stream); afterwards every KV block is free, /health
counts the failure, and new requests get the same tokens as a fresh engine,
with prefix caching on, so no block key can survive that names K/V the failed
forward never wrote.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from minicb import SamplingParams
from minicb.bench.sse import sse_events

from serve_support import tiny_llm, tiny_server


class FlakyRunner:
    """The engine's runner, raising once: on the first step, after arming, whose batch holds `rows` rows.

    Until then each armed step waits PACE seconds, so a fast CPU cannot finish the
    first request before the second one has arrived (the steps before it are the
    ones that wait; none after).
    """

    PACE = 0.05  # s a step while waiting for the rows: 40 tokens give the second request 2 s to arrive

    def __init__(self, runner):
        self.runner, self.rows, self.failed = runner, None, False

    def arm(self, rows: int) -> None:
        self.rows = rows

    def __call__(self, inputs):
        if self.rows is not None and not self.failed:
            if len(inputs.block_tables) >= self.rows:  # a row a sequence: no drafts here
                self.failed = True
                raise RuntimeError("injected: the forward failed")
            time.sleep(self.PACE)
        return self.runner(inputs)


def test_a_step_that_raises_fails_its_requests_and_the_server_keeps_serving():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 17 tokens: four full blocks of 4
    with tiny_server(max_num_seqs=4, block_size=4, enable_prefix_caching=True) as (url, app), \
            httpx.Client(base_url=url, timeout=30) as client:
        engine = app.state.loop.engine
        flaky = engine.runner = FlakyRunner(engine.runner)
        body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        answers = {}

        def whole():
            answers["whole"] = client.post("/v1/completions", json=body)

        flaky.arm(rows=2)  # the first step that runs both requests
        thread = threading.Thread(target=whole)
        thread.start()
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = sse_events(response.iter_lines())
        thread.join(30)
        assert not thread.is_alive(), "the whole-answer request never came back"

        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and events[-1] == "[DONE]", f"the stream should end with an error event, then [DONE]: {events[-3:]}"
        assert "injected" in errors[0]["error"]["message"], errors[0]
        whole = answers["whole"]
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_failed", (whole.status_code,
                                                                                               whole.text)

        answer = client.get("/health")
        assert answer.status_code == 200, f"after a failed step the server must still serve: {answer.text}"
        health = answer.json()
        assert health["status"] == "ok" and health["step_failures"] == 1, health
        assert "injected" in health["last_step_failure"], health
        assert health["kv_blocks_free"] == health["kv_blocks"], f"blocks left held after the failure: {health}"

        # The server goes on, and a request for the very prompt the failed step was computing gets a
        # fresh engine's tokens: nothing cached from the failed step is reused.
        got = client.post("/v1/completions", json={**body, "max_tokens": 12}).json()
        want = tiny_llm(block_size=4).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True),
                                               use_tqdm=False)[0]
        assert got["choices"][0]["text"] == want.outputs[0].text, (got["choices"][0]["text"], want.outputs[0].text)
        assert client.get("/health").json()["step_failures"] == 1


def test_the_warm_up_runs_on_the_engine_thread_and_a_failed_one_fails_startup():
    import asyncio

    from minicb.serve.loop import EngineLoop

    llm = tiny_llm(max_num_seqs=2, keep_traces=1)
    threads = []

    class Recording:
        def __init__(self, runner, fail):
            self.runner, self.fail = runner, fail

        def __call__(self, inputs):
            threads.append(threading.current_thread().name)
            if self.fail:
                raise RuntimeError("injected: the warm-up failed")
            return self.runner(inputs)

    async def start(fail: bool):
        llm.engine.runner = Recording(runner, fail)
        loop = EngineLoop(llm.engine)
        try:
            loop.start(asyncio.get_running_loop(), warm_up=True)
        finally:
            loop.stop()

    runner = llm.engine.runner
    asyncio.run(start(fail=False))
    assert threads and set(threads) == {"minicb-engine"}, f"warm-up steps ran on {set(threads)}"
    with pytest.raises(RuntimeError, match="injected: the warm-up failed"):
        asyncio.run(start(fail=True))
