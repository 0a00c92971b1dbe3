"""The HTTP server under hostile clients: one that stops reading, one that vanishes, many that say nothing.

Real sockets against a real server on the tiny random model (tests/serve/serve_support.py):

- a client that reads one chunk of its stream and then stops reading, without
  closing, must not stall the engine or the other streams, and must not make the
  server hold its events forever: once `max_buffered_steps` steps wait for it,
  its request is aborted and its blocks freed;
- a client whose socket dies mid-stream without a goodbye (an RST) is aborted
  within a few steps, and the server goes on serving;
- 200 connections that send nothing, or half a request, keep nobody waiting.

The oracle for every answer that completes is the offline API's greedy output.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import httpx

from minicb.bench.sse import sse_events
from minicb.sampling import SamplingParams
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread

from serve_support import TINY, metric, paced, tiny_llm, tiny_server, wait_for


def greedy(prompts, max_tokens, ignore_eos=None):
    """What the offline API answers, as token id lists (all in one batch)."""
    ignore_eos = ignore_eos or [False] * len(prompts)
    params = [SamplingParams(max_tokens=m, ignore_eos=i) for m, i in zip(max_tokens, ignore_eos)]
    return [out.token_ids for out in tiny_llm().generate(prompts, params, use_tqdm=False)]


def http_request(url: str, body: dict) -> bytes:
    """A POST /v1/completions as raw bytes; the server closes the connection after the answer."""
    data = json.dumps(body).encode()
    host = url.removeprefix("http://")
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def connect(url: str, options: dict | None = None) -> socket.socket:
    """A TCP connection to the server; options: {(level, name): value}, set before connecting."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for (level, name), value in (options or {}).items():
        sock.setsockopt(level, name, value)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def read_first_chunk(sock: socket.socket) -> bytes:
    """Read a little at a time until the first server-sent event has begun; return what came."""
    got = b""
    while b"data: " not in got:
        more = sock.recv(256)
        assert more, f"the server closed the connection before the first chunk: {got!r}"
        got += more
    return got


def sse_of_raw(raw: bytes) -> list:
    """The server-sent events of a whole raw HTTP/1.1 response with a chunked body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower(), head
    data = b""
    while True:  # each chunk: its size in hex, CRLF, the bytes, CRLF; a size of 0 ends the body
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data, body = data + body[:size], body[size + 2:]
    return sse_events(data.decode().split("\n"))


def stream_tokens(client: httpx.Client, body: dict) -> tuple[list[int], float]:
    """Stream one completion; its token ids, and the seconds from the request to [DONE]."""
    began = time.monotonic()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]", events[-2:]
    return [t for event in events[:-1] for t in event["choices"][0]["token_ids"]], time.monotonic() - began


# ---- 1. a client that stops reading ----------------------------------------------------------


# The slow client shrinks what TCP holds for it: a 1 KiB receive buffer, and a 536-byte segment
# size (as over a small-MTU link), which keeps the kernel from growing the server's send buffer
# to megabytes on loopback. Then ~100 KB (the kernel's ~40 KB and uvicorn's 64 KiB write buffer)
# fill after about 100 steps of 4 completions, uvicorn stops pulling chunks from the stream, and
# the steps pile up in the request's queue, as they would behind any client that stops reading.
SLOW_CLIENT = {(socket.SOL_SOCKET, socket.SO_RCVBUF): 1024, (socket.IPPROTO_TCP, socket.TCP_MAXSEG): 536}


def test_a_client_that_stops_reading_is_aborted_and_holds_up_nobody():
    buffered = 8  # max_buffered_steps: the slow request is aborted when 8 steps wait for it
    slow_prompt, slow_n, slow_max = [5, 6, 7], 4, 480  # 3 + 480 tokens: within the 512-token context
    prompts = [[40, 41, 42], [100, 7], [9, 9, 9, 9]]
    max_tokens = [150, 150, 150]
    want_slow, *want = greedy([slow_prompt, *prompts], [slow_max, *max_tokens], [True] + [False] * len(prompts))

    app = create_app(tiny_llm(keep_traces=1, max_num_seqs=8), TINY, max_buffered_steps=buffered)
    # 10 ms a step: 8 steps are then 80 ms, not the 4 of a fast CPU, in which a normal reader that
    # the OS or the GIL keeps waiting (the server runs in this process) falls 8 behind and is aborted.
    paced(app.state.loop.engine)
    with serve_in_thread(app, shutdown_timeout=2.0) as url, httpx.Client(base_url=url, timeout=30) as client:
        slow = connect(url, SLOW_CLIENT)
        try:
            slow.sendall(http_request(url, {"prompt": slow_prompt, "n": slow_n, "max_tokens": slow_max,
                                            "ignore_eos": True, "temperature": 0, "stream": True,
                                            "return_token_ids": True}))
            raw = read_first_chunk(slow)  # ... and not one byte more, until the end of the test

            # Meanwhile three clients stream normally.
            results: dict[int, tuple] = {}

            def normal(i):
                results[i] = stream_tokens(client, {"prompt": prompts[i], "max_tokens": max_tokens[i],
                                                    "temperature": 0})
            threads = [threading.Thread(target=normal, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "a normal stream did not finish within 30 s"

            # The slow request was aborted while its client still reads nothing, and freed its blocks.
            def aborted_and_freed():
                text = client.get("/metrics").text
                too_slow = metric(text, "minicb_requests_too_slow_total") == 1
                return text if too_slow and metric(text, "minicb_kv_blocks_used") == 0 else None
            text = wait_for(aborted_and_freed, 20, "the slow request to be aborted as too slow and its blocks freed")
            health = client.get("/health").json()
            assert health["kv_blocks_free"] == health["kv_blocks"], health
            assert metric(text, "minicb_completions_finished_total", 'reason="abort"') == slow_n, \
                "each of the slow request's completions ended as an abort in the engine"
            assert metric(text, "minicb_requests_running") == 0
            generated = metric(text, "minicb_generation_tokens_total")
            # The engine kept stepping: no token of any completion, the slow one's included, waited
            # more than 1.6 s for the one before it (the engine thread's own measure).
            slowest = metric(text, "minicb_inter_token_latency_seconds_count") - \
                metric(text, "minicb_inter_token_latency_seconds_bucket", 'le="1.6"')
            assert slowest == 0, f"{slowest} tokens came over 1.6 s after the previous one"

            # Now it reads on: what the server had buffered, then an "abort" for each completion, and [DONE].
            while more := slow.recv(65536):
                raw += more
        finally:
            slow.close()
        # The server still serves.
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}).status_code == 200

    # The normal streams: exactly their own greedy tokens, in about the time the engine needs.
    for i, w in enumerate(want):
        tokens, seconds = results[i]
        assert tokens == w, f"normal stream {i}: {tokens[:10]}... != greedy {w[:10]}..."
        assert seconds < 10, f"normal stream {i} took {seconds:.1f} s for {len(w)} tokens"
    print("normal streams took " + ", ".join(f"{results[i][1] * 1000:.0f}" for i in range(len(want)))
          + f" ms for {', '.join(str(len(w)) for w in want)} tokens")

    events = sse_of_raw(raw)
    assert events[-1] == "[DONE]", events[-3:]
    got: dict[int, list[int]] = {c: [] for c in range(slow_n)}
    finish: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            got[choice["index"]] += choice["token_ids"]
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    assert finish == {c: "abort" for c in range(slow_n)}, finish
    for c, tokens in got.items():
        assert tokens == want_slow[:len(tokens)], f"slow completion {c}: not greedy's prefix"
        assert len(tokens) < slow_max, f"slow completion {c} ran to max_tokens: it was never aborted"
    # What the engine made for the slow request and its client never got: the steps dropped
    # between the queue filling and the abort taking effect (a step or two, each of slow_n tokens).
    made_for_slow = generated - sum(len(w) for w in want)
    lost_steps = (made_for_slow - sum(len(t) for t in got.values())) / slow_n
    print(f"slow client: got {len(got[0])} steps of {slow_max}; {lost_steps:.0f} steps made and dropped")
    assert 0 <= lost_steps <= 10, f"{lost_steps} steps ran for the slow request after its queue was full"


# ---- 2. a client that vanishes ------------------------------------------------------------------


def test_a_client_that_vanishes_mid_stream_is_aborted_within_steps():
    max_tokens = 480
    with tiny_server(max_num_seqs=4) as (url, app), httpx.Client(base_url=url, timeout=10) as client:
        engine = paced(app.state.loop.engine)  # 10 ms a step: "within 20 steps" means 200 ms on any CPU
        sock = connect(url)
        sock.sendall(http_request(url, {"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True,
                                        "temperature": 0, "stream": True}))
        read_first_chunk(sock)
        # Linger on, with a timeout of 0: close() sends an RST and drops the socket, no FIN, no goodbye.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        steps_at_reset, reset_at = engine.num_steps, time.monotonic()
        sock.close()

        def settled():
            text = client.get("/metrics").text
            freed = metric(text, "minicb_kv_blocks_used") == 0 and metric(text, "minicb_requests_running") == 0
            aborted = ('reason="abort"' in text
                       and metric(text, "minicb_completions_finished_total", 'reason="abort"') == 1)
            return text if freed and aborted else None
        text = wait_for(settled, 5, "the vanished client's request to be aborted and its blocks freed")
        seconds = time.monotonic() - reset_at
        # Its only request gone, the engine is idle: every step since the reset ran it.
        steps_after = engine.num_steps - steps_at_reset
        print(f"vanished client: freed {seconds * 1000:.0f} ms and {steps_after} steps after the reset")
        assert metric(text, "minicb_generation_tokens_total") < max_tokens, "it ran to max_tokens: never aborted"
        assert steps_after <= 20, f"{steps_after} steps ran after the client's connection was reset"
        health = client.get("/health").json()
        assert health["kv_blocks_free"] == health["kv_blocks"], health

        # The next client is served, with greedy's tokens.
        answer = client.post("/v1/completions", json={"prompt": [40, 41], "max_tokens": 12, "temperature": 0,
                                                       "return_token_ids": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == greedy([[40, 41]], [12])[0]


# ---- 3. many clients that say nothing ------------------------------------------------------------


def test_200_silent_connections_do_not_keep_others_waiting():
    prompt, max_tokens = [40, 41, 42], 30
    want = greedy([prompt], [max_tokens])[0]
    with tiny_server(max_num_seqs=4) as (url, _), httpx.Client(base_url=url, timeout=5) as client:
        idle: list[socket.socket] = []
        try:
            for i in range(200):
                sock = connect(url)
                idle.append(sock)
                if i % 3 == 1:  # half a header
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
                elif i % 3 == 2:  # a whole header, then half the body it announced
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 100\r\n\r\n{\"prompt\": [1, 2],")
                # i % 3 == 0: connected, and not a byte
            time.sleep(0.2)  # the server has accepted them, and the half-requests have reached the app

            began = time.monotonic()
            answer = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                           "temperature": 0, "return_token_ids": True})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["token_ids"] == want
            tokens, _ = stream_tokens(client, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            assert tokens == want
            seconds = time.monotonic() - began
            print(f"with 200 silent connections open, an answer and a stream took {seconds * 1000:.0f} ms")
            assert seconds < 5, f"a normal client waited {seconds:.1f} s behind 200 silent connections"
            health = client.get("/health").json()
            assert health["status"] == "ok" and health["kv_blocks_free"] == health["kv_blocks"], health
        finally:
            for sock in idle:
                sock.close()
