"""The HTTP server on the tiny random model: answers, concurrency, aborts, errors, overload, shutdown.

Every test starts its own server on 127.0.0.1 at a free port (tests/serve/serve_support.py)
and stops it on the way out; every wait has a deadline. The tiny model steps in
milliseconds, so the whole file takes seconds; SmolLM2 and the official openai
client are in tests/serve/test_server_openai.py.

The oracle is the offline API: greedy (or seeded) completions over HTTP must be
`LLM.generate`'s, token for token and character for character.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from minicb.bench.sse import parse_event, sse_events
from minicb.sampling import SamplingParams
from minicb.serve.loop import EngineLoop, Finished, Token
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread

from serve_support import TINY, ByteTokenizer, metric, paced, tiny_llm, tiny_server, wait_for

ERROR_KEYS = {"message", "type", "param", "code"}


def offline(prompts, params, **engine_config):
    return tiny_llm(**engine_config).generate(prompts, params, use_tqdm=False)


def stream_post(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


# ---- answers equal the offline API's ---------------------------------------------------------


def test_completions_and_chat_equal_offline_generate():
    prompts = [[5, 17, 99, 3], [200, 201], list(b"hello there")]
    max_tokens = [20, 7, 33]
    want = offline(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    chat = [{"role": "user", "content": "Ça va? 😀"}]
    want_chat = tiny_llm().chat([chat], SamplingParams(max_tokens=25), use_tqdm=False)[0]
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        for prompt, m, w in zip(prompts, max_tokens, want):
            body = {"model": TINY, "prompt": prompt, "max_tokens": m, "temperature": 0, "return_token_ids": True}
            answer = client.post("/v1/completions", json=body).json()
            choice = answer["choices"][0]
            assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == (w.token_ids, w.text,
                                                                                       w.finish_reason)
            assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(w.token_ids),
                                       "total_tokens": len(prompt) + len(w.token_ids)}
            events = stream_post(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]"
            *chunks, usage = events[:-1]
            assert usage["choices"] == [] and usage["usage"] == answer["usage"]
            assert all(c["usage"] is None and c["id"] == usage["id"] for c in chunks)
            assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == w.token_ids
            assert "".join(c["choices"][0]["text"] for c in chunks) == w.text
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [w.finish_reason]
        # A text prompt is tokenized as LLM.generate does it.
        text_want = offline(["hello there"], SamplingParams(max_tokens=33))[0]
        assert text_want.token_ids == want[2].token_ids
        # Chat: the template applied on the server, max_completion_tokens, non-streaming and streaming.
        body = {"model": TINY, "messages": chat, "max_completion_tokens": 25, "temperature": 0}
        answer = client.post("/v1/chat/completions", json=body).json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": want_chat.text}
        assert answer["usage"]["completion_tokens"] == len(want_chat.token_ids)
        events = stream_post(client, "/v1/chat/completions", body)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(e["choices"][0]["delta"]["content"] or "" for e in events[1:-1]) == want_chat.text
        assert events[-2]["choices"][0]["finish_reason"] == want_chat.finish_reason


def test_n_seeded_completions_equal_offline():
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3)
    want = offline([[9, 8, 7]], params)[0].outputs
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        body = {"prompt": [9, 8, 7], "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3, "return_token_ids": True}
        answer = client.post("/v1/completions", json=body).json()
        assert [c["token_ids"] for c in answer["choices"]] == [w.token_ids for w in want]
        assert answer["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
        got = {0: [], 1: [], 2: []}
        for event in stream_post(client, "/v1/completions", body)[:-1]:
            for choice in event["choices"]:
                got[choice["index"]] += choice["token_ids"]
        assert [got[i] for i in range(3)] == [w.token_ids for w in want]


def test_stop_strings_cut_the_text_and_end_the_request():
    prompt = [40, 41, 42, 43]
    full = offline([prompt], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    # A stop string from the middle of the greedy text, away from replacement characters.
    start = next(i for i in range(6, len(full.text) - 2) if "\ufffd" not in full.text[i:i + 2])
    stop = full.text[start:start + 2]
    expected_text = full.text[:full.text.find(stop)]
    tokenizer = ByteTokenizer()
    with tiny_server() as (url, app), httpx.Client(base_url=url, timeout=30) as client:
        body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stop": [stop, "\x00\x01"],
                "return_token_ids": True}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected_text, "stop", stop)
        ids = choice["token_ids"]
        assert ids == full.token_ids[:len(ids)], "the tokens before the stop are greedy's"
        assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])
        events = stream_post(client, "/v1/completions", body)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        # The engine was told: nothing runs on, and the abort freed the blocks.
        engine = app.state.loop.engine
        wait_for(lambda: engine.allocator.num_free_blocks == engine.allocator.num_blocks, 5, "blocks to be freed")


def test_a_stop_string_in_completion_0_ends_it_alone():
    # n = 2 seeded: completion 0 is cut by a stop string that completion 1's text never holds, and
    # completion 1 runs on to max_tokens. The abort of completion 0 must not stop its sibling.
    prompt, params = [40, 41, 42], SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5, n=2)
    first, second = offline([prompt], params)[0].outputs
    start = next(i for i in range(4, len(first.text) - 2) if "\ufffd" not in first.text[i:i + 2]
                 and first.text[i:i + 2] not in second.text)
    stop = first.text[start:start + 2]
    with tiny_server() as (url, app), httpx.Client(base_url=url, timeout=30) as client:
        body = {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 1.0, "seed": 5, "n": 2,
                "stop": [stop], "return_token_ids": True}
        choices = client.post("/v1/completions", json=body).json()["choices"]
        got = [(c["text"], c["finish_reason"]) for c in choices]
        want = [(first.text[:first.text.find(stop)], "stop"), (second.text, "length")]
        assert got == want, f"completions (text, finish_reason): {got}, want {want}"
        assert choices[1]["token_ids"] == second.token_ids, "completion 1 runs on after completion 0's stop"
        engine = app.state.loop.engine
        wait_for(lambda: engine.allocator.num_free_blocks == engine.allocator.num_blocks, 5, "blocks to be freed")


# ---- many clients at once ------------------------------------------------------------------------


def test_64_concurrent_streams_get_exactly_their_own_tokens():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 24))] for _ in range(64)]
    max_tokens = [rng.randint(1, 40) for _ in range(64)]
    delays = sorted(rng.uniform(0, 1.0) for _ in range(64))  # staggered arrivals over a second
    want = offline(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])

    async def clients(url):
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            async def one(i):
                await asyncio.sleep(delays[i])
                body = {"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "stream": True,
                        "return_token_ids": True, "stream_options": {"include_usage": True}}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    return sse_events([line async for line in response.aiter_lines()])
            return await asyncio.gather(*(one(i) for i in range(64)))

    with tiny_server(max_num_seqs=8) as (url, app):
        results = asyncio.run(asyncio.wait_for(clients(url), 90))
        engine = app.state.loop.engine
        wait_for(lambda: engine.allocator.num_free_blocks == engine.allocator.num_blocks, 5, "every block free")
    ids = set()
    for i, (events, w) in enumerate(zip(results, want)):
        assert events[-1] == "[DONE]", f"stream {i} did not end with [DONE]"
        *chunks, usage = events[:-1]
        ids |= {c["id"] for c in events[:-1]}
        tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert tokens == w.token_ids, f"stream {i}: tokens lost, duplicated or mixed with another's"
        assert "".join(c["choices"][0]["text"] for c in chunks) == w.text, f"stream {i}: text"
        assert chunks[-1]["choices"][0]["finish_reason"] == w.finish_reason
        assert usage["usage"]["completion_tokens"] == len(w.token_ids)
    assert len(ids) == 64, "every request has its own id, shared by all its chunks"


# ---- aborts: a client that goes away frees its blocks ------------------------------------------------


def test_engine_loop_abort_takes_effect_before_the_next_step():
    """Directly on the loop: after abort(), no step that starts later holds the request."""
    llm = tiny_llm(keep_traces=1, max_num_seqs=4)
    engine = paced(llm.engine)  # 400 steps last 4 s: the request still runs when it is aborted

    async def scenario():
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        feed = loop.subscribe()
        try:
            handle = loop.submit([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
            for _ in range(3):
                events = await asyncio.wait_for(handle.events.get(), 10)
                assert all(isinstance(e, Token) for e in events)
            rid = handle.request_id
            in_progress = engine.num_steps  # the step running now (if any) has this number
            loop.abort(handle)
            await asyncio.sleep(0.5)  # with its only request gone, the engine goes idle
            records = []
            while not feed.empty():
                records.append(feed.get_nowait())
            late = [r.trace.step for r in records
                    if r.trace.step > in_progress and any(s.seq_id == rid for s in r.trace.slots)]
            assert not late, f"steps {late} still ran the aborted request"
            assert not engine.has_unfinished()
            assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
            assert loop.num_queued == 0
        finally:
            loop.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def wait_until_aborted_and_free(client: httpx.Client, max_tokens: int) -> None:
    """Through /metrics: one abort, nothing running, no KV block used, and far fewer than max_tokens generated."""
    def settled():
        text = client.get("/metrics").text
        idle = metric(text, "minicb_requests_running") == 0 and metric(text, "minicb_kv_blocks_used") == 0
        return text if idle and metric(text, "minicb_completions_finished_total", 'reason="abort"') == 1 else None
    text = wait_for(settled, 10, "the request to be aborted and its blocks freed")
    assert metric(text, "minicb_generation_tokens_total") < max_tokens, "it was stopped, not run to max_tokens"


def test_client_disconnecting_mid_stream_aborts_the_request():
    with tiny_server(max_num_seqs=4) as (url, app), httpx.Client(base_url=url, timeout=10) as client:
        paced(app.state.loop.engine)  # 480 steps last 4.8 s: the hang-up comes long before the end
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break  # hang up mid-stream: closing the response closes the connection
        wait_until_aborted_and_free(client, 480)
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["kv_blocks_free"] == health["kv_blocks"], health
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}).status_code == 200


def test_client_giving_up_on_a_whole_answer_aborts_the_request():
    with tiny_server(max_num_seqs=4) as (url, app), httpx.Client(base_url=url, timeout=10) as client:
        paced(app.state.loop.engine)  # 480 steps last 4.8 s, the client waits 0.3
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 480, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
        wait_until_aborted_and_free(client, 480)


# ---- bad requests: 400 in OpenAI's shape, and the server keeps serving ----------------------------------

CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {
    "bad JSON": ("/v1/completions", b'{"prompt": [1, 2', None),
    "not an object": ("/v1/completions", [1, 2], None),
    "max_tokens a string": ("/v1/completions", {"prompt": [1], "max_tokens": "many"}, "max_tokens"),
    "prompt a number": ("/v1/completions", {"prompt": 42}, "prompt"),
    "temperature a string": ("/v1/completions", {"prompt": [1], "temperature": "hot"}, "temperature"),
    "stream a string": ("/v1/completions", {"prompt": [1], "stream": "yes"}, "stream"),
    "messages a string": ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    "max_tokens 0": ("/v1/completions", {"prompt": [1], "max_tokens": 0}, "max_tokens"),
    "max_completion_tokens 0": ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0},
                                "max_completion_tokens"),
    "prompt over the context": ("/v1/completions", {"prompt": [5] * 600}, "prompt"),
    "never fits the KV pool": ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 400}, "max_tokens"),
    "n 0": ("/v1/completions", {"prompt": [1], "n": 0}, "n"),
    "n beyond the slots": ("/v1/completions", {"prompt": [1], "n": 5}, "n"),
    "unknown model": ("/v1/completions", {"prompt": [1], "model": "gpt-4"}, "model"),
    "top_p 0": ("/v1/completions", {"prompt": [1], "top_p": 0}, "top_p"),
    "empty stop string": ("/v1/completions", {"prompt": [1], "stop": [""]}, "stop"),
    "token id out of vocab": ("/v1/completions", {"prompt": [999]}, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, "prompt"),
    "logprobs over 20": ("/v1/completions", {"prompt": [1], "logprobs": 21}, "logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    "a field the API does not have": ("/v1/completions", {"prompt": [1], "temprature": 0.5}, "temprature"),
    "logit_bias": ("/v1/completions", {"prompt": [1], "logit_bias": {"5": 10}}, "logit_bias"),
    "a tool that is not a function": ("/v1/chat/completions", {"messages": CHAT, "tools": [
        {"type": "custom", "custom": {"name": "f"}}]}, "tools"),
    "a response_format with no grammar": ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "grammar"}}, "response_format"),
}


def test_bad_requests_get_400_in_openai_shape_and_the_server_keeps_serving():
    # 24 blocks of 16 tokens: a 10-token prompt with max_tokens 400 needs 26, so it could never finish.
    with tiny_server(max_num_seqs=4, num_blocks=24) as (url, _), httpx.Client(base_url=url, timeout=10) as client:
        for name, (path, body, param) in BAD_REQUESTS.items():
            if isinstance(body, bytes):
                response = client.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                response = client.post(path, json=body)
            assert response.status_code == 400, f"{name}: {response.status_code} {response.text}"
            error = response.json()["error"]
            assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error", f"{name}: {error}"
            assert error["message"] and error["param"] == param, f"{name}: {error}"
        assert client.post("/v1/completions", json={"prompt": [1], "stream": True, "max_tokens": 0}).status_code == 400
        # Still serving, and nothing was left behind.
        good = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
        text = client.get("/metrics").text
        assert metric(text, "minicb_requests_rejected_total", 'status="400"') == len(BAD_REQUESTS) + 1
        assert metric(text, "minicb_kv_blocks_used") == 0
        not_found = client.get("/v1/nothing-here")
        assert not_found.status_code == 404 and set(not_found.json()["error"]) == ERROR_KEYS


def test_overload_answers_503_with_retry_after():
    with tiny_server(max_num_seqs=1, max_waiting=2) as (url, app), httpx.Client(base_url=url, timeout=20) as client:
        paced(app.state.loop.engine)  # the long request holds its slot for 5 s
        long = {"prompt": [5, 6, 7, 8], "max_tokens": 500, "ignore_eos": True, "stream": True}
        short = {"prompt": [9, 10], "max_tokens": 3, "stream": True}
        with client.stream("POST", "/v1/completions", json=long) as running:
            # Keep the line iterator: a dropped one is closed by the garbage collector, and
            # closing it closes the connection, which would abort the request.
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it holds the one slot
            with client.stream("POST", "/v1/completions", json=short) as b, \
                    client.stream("POST", "/v1/completions", json=short) as c:
                assert b.status_code == c.status_code == 200  # both queued: 2 waiting, the limit
                refused = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
                assert refused.status_code == 503
                assert refused.headers["Retry-After"] == "1"
                error = refused.json()["error"]
                assert set(error) == ERROR_KEYS and error["type"] == "server_overloaded"
                running.close()  # the long one goes; the two queued ones run and finish
                for queued in (b, c):
                    events = sse_events(queued.iter_lines())
                    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] is not None
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
        assert metric(client.get("/metrics").text, "minicb_requests_rejected_total", 'status="503"') == 1


# ---- shutdown ----------------------------------------------------------------------------------------------


def test_shutdown_lets_short_requests_finish_and_aborts_the_rest():
    results = {}

    def read(url, name, body):
        try:
            with httpx.Client(base_url=url, timeout=30) as client, \
                    client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                results[name] = sse_events(response.iter_lines())
        except httpx.HTTPError as e:  # the server closed the stream under us
            results[name] = e

    with tiny_server(max_num_seqs=4, shutdown_timeout=0.3) as (url, app):  # drains for 0.3 s on the way out
        engine = paced(app.state.loop.engine)  # 10 ms a step: 500 steps take 5 s, 5 steps well under 0.3 s
        readers = [threading.Thread(target=read, args=(url, "long", {"prompt": [3, 4], "max_tokens": 500,
                                                                     "ignore_eos": True})),
                   threading.Thread(target=read, args=(url, "short", {"prompt": [3, 4], "max_tokens": 5,
                                                                      "ignore_eos": True}))]
        for reader in readers:
            reader.start()
        accepted = lambda: metric(httpx.get(url + "/metrics").text, "minicb_prompt_tokens_total") == 4  # noqa: E731
        wait_for(accepted, 10, "both requests to be accepted")
        # Leaving the block runs the SIGTERM handler: no new requests, the short one
        # finishes during the drain, and the long one is aborted when it ends, with a
        # last chunk that says so.
    for reader in readers:
        reader.join(15)
    short, long = results["short"], results["long"]
    assert isinstance(short, list) and short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert isinstance(long, list) and long[-1] == "[DONE]" and long[-2]["choices"][0]["finish_reason"] == "abort"
    assert not app.state.loop._thread.is_alive(), "the engine thread ended"
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and not engine.has_unfinished()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_engine_loop_close_ends_every_completion_even_those_not_forked_yet():
    """stop() aborts what is left: each completion of each request gets Finished(..., "abort"), including
    those of a waiting n = 2 request, which the engine has not forked, so its streams end too."""
    llm = tiny_llm(keep_traces=1, max_num_seqs=2)
    engine = paced(llm.engine)  # 400 steps last 4 s: both requests are still there when the loop stops
    params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=1.0, seed=3, n=2)

    async def ended(handle) -> dict[int, str]:
        reasons = {}
        while len(reasons) < handle.params.n:
            for event in await asyncio.wait_for(handle.events.get(), 10):
                if isinstance(event, Finished):
                    assert event.completion not in reasons, f"completion {event.completion} ended twice"
                    reasons[event.completion] = event.reason
        return reasons

    async def scenario():
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        running = loop.submit([5, 6, 7], params)
        first = await asyncio.wait_for(running.events.get(), 10)
        assert {e.completion for e in first} == {0, 1}, f"both completions start in the prompt's step: {first}"
        waiting = loop.submit([8, 9], params)  # both slots are taken: it waits, unforked
        await asyncio.sleep(0.05)
        loop.stop()
        got = await ended(running), await ended(waiting)
        assert got == ({0: "abort", 1: "abort"},) * 2, f"Finished reasons (running, waiting): {got}"
        assert engine.allocator.num_free_blocks == engine.allocator.num_blocks and not engine.has_unfinished()

    asyncio.run(asyncio.wait_for(scenario(), 30))


# ---- observability ------------------------------------------------------------------------------------------


def test_models_health_metrics_and_dashboard_feed():
    with tiny_server(max_num_seqs=4) as (url, _), httpx.Client(base_url=url, timeout=20) as client:
        health = client.get("/health").json()
        from minicb.bench.machine import cpu_model
        assert health == {"status": "ok", "device": f"cpu ({cpu_model()})", "step_failures": 0,
                          "linear_backend": "auto: no packed layers, so every matmul is MKL's (or the GPU's)",
                          "cpu_ops": "compiled", "last_step_failure": None, "kv_blocks_free": health["kv_blocks"],
                          "kv_blocks": health["kv_blocks"]}, health
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [TINY]
        page = client.get("/")
        assert page.status_code == 200 and "EventSource" in page.text and "<canvas" in page.text

        with client.stream("GET", "/v1/dashboard/steps") as feed:
            lines = feed.iter_lines()
            hello = next(e for e in map(parse_event, lines) if e is not None)
            assert hello["type"] == "hello" and hello["num_slots"] == 4 and hello["model"] == TINY
            answer = client.post("/v1/completions", json={"prompt": [7, 7, 7], "max_tokens": 30, "ignore_eos": True})
            seen_slot, seen_blocks, deadline = False, False, time.monotonic() + 15
            for message in map(parse_event, lines):
                if message is None:
                    continue
                seen_slot |= any(cell is not None for s in message["steps"] for cell in s["slots"])
                seen_blocks |= "blocks" in message and len(message["blocks"]["owners"]) == hello["num_blocks"]
                if (seen_slot and seen_blocks) or time.monotonic() > deadline:
                    break
            assert seen_slot and seen_blocks, "the feed showed a busy slot and a block map"

        text = client.get("/metrics").text
        for name in ("minicb_requests_running", "minicb_requests_waiting", "minicb_kv_blocks_used",
                     "minicb_kv_blocks_cached", "minicb_kv_blocks_total"):
            metric(text, name)
        assert metric(text, "minicb_generation_tokens_total") == 30 == answer.json()["usage"]["completion_tokens"]
        assert metric(text, "minicb_prompt_tokens_total") == 3
        assert metric(text, "minicb_time_to_first_token_seconds_count") == 1
        assert metric(text, "minicb_inter_token_latency_seconds_count") == 29


def test_metrics_count_cached_blocks_with_prefix_caching():
    with tiny_server(max_num_seqs=4, enable_prefix_caching=True) as (url, _), \
            httpx.Client(base_url=url, timeout=20) as client:
        prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16, computed once, then kept
        for _ in range(2):
            assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).status_code == 200
        text = client.get("/metrics").text
        assert metric(text, "minicb_kv_blocks_used") == 0
        assert metric(text, "minicb_kv_blocks_cached") >= 2


def test_metrics_report_the_acceptance_rate_with_speculation():
    with tiny_server(max_num_seqs=4, speculative_ngram=1, num_speculative_tokens=3) as (url, _), \
            httpx.Client(base_url=url, timeout=20) as client:
        before = metric(client.get("/metrics").text, "minicb_spec_acceptance_rate")
        # Every token id is in the prompt, so whatever the model writes first, prompt lookup (n = 1)
        # finds it earlier and proposes drafts at the first decode step.
        reply = client.post("/v1/completions", json={"prompt": list(range(256)), "max_tokens": 24})
        assert reply.status_code == 200, reply.text
        text = client.get("/metrics").text
        drafts, accepted = metric(text, "minicb_spec_draft_tokens_total"), metric(text, "minicb_spec_accepted_tokens_total")
        assert before == 0 and drafts > 0, f"acceptance rate {before} before any request; {drafts} drafts after"
        assert metric(text, "minicb_spec_acceptance_rate") == pytest.approx(accepted / drafts), (accepted, drafts)


def test_speculation_counters_need_no_traces():
    """The counters come from each step's output, not from a trace: with serve's flags
    `--keep-traces 0 --speculative-ngram 2` (no dashboard open, so no step builds a trace)
    they still count the drafts of a prompt that copies itself."""
    from minicb.cli_args import engine_config
    from minicb.serve.server import parse_args

    flags = engine_config(parse_args(["--keep-traces", "0", "--speculative-ngram", "2", "--max-num-seqs", "4"]))
    app = create_app(tiny_llm(**flags), TINY)
    assert app.state.loop.engine.config.keep_traces == 0 and app.state.loop.engine.speculator is not None
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        prompt = list(range(60, 120)) * 2  # the second half repeats the first: its pairs were seen before
        reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 48, "ignore_eos": True,
                                                     "temperature": 0})
        assert reply.status_code == 200, reply.text
        text = client.get("/metrics").text
        drafts, accepted = metric(text, "minicb_spec_draft_tokens_total"), metric(text, "minicb_spec_accepted_tokens_total")
        assert drafts > 0 and accepted > 0, f"no trace kept, yet the counters must count: {drafts} drafts, {accepted} accepted"
        assert not app.state.loop.engine.traces, "keep_traces=0: the engine kept a trace"


def test_serve_takes_the_speculative_settings():
    from minicb.serve.server import parse_args

    args = parse_args(["--speculative-ngram", "2", "--num-speculative-tokens", "5"])
    assert (args.speculative_ngram, args.num_speculative_tokens) == (2, 5)
    assert parse_args([]).speculative_ngram is None, "speculation must be off by default"
