"""A soak test of the HTTP server: many mixed requests for a long while, then did anything leak?

    .venv/bin/python tools/soak.py --duration 600                       # the tiny model, 10 minutes
    .venv/bin/python tools/soak.py --requests 2000 --json build/soak.json -- --threads 1
    .venv/bin/python tools/soak.py --model embedded --duration 600       # SmolLM2 (slow on a CPU)
    .venv/bin/python tools/soak.py --url http://127.0.0.1:8000 --pid 1234 --duration 600

In this file you will learn what a server must survive besides answering well:
thousands of requests of every kind, one after the other and side by side, with
nothing left behind. Each request that ends must give back what it held: its KV
blocks, its slot, its socket, its thread, its Python objects. A leak of one of
them per request is invisible in a unit test and fatal after a day.

The tool starts its own server in a child process (or soaks --url), with prefix
caching and chunked prefill on and a small token budget (64), so that shared
prefixes hit the cache and prompts are cut into chunks. Then --clients clients
(8), side by side on one asyncio loop, each one request at a time on its own
connections, send requests until --duration seconds or --requests requests have
gone, each drawn from a mix:

    completion, completion_stream, chat, chat_stream
            good requests: n of 1-3, greedy or sampled, some with a stop string;
            each answer is checked (n choices, a finish reason each, [DONE])
    abort   a long stream whose client reads 1-3 chunks and hangs up
    bad_empty_prompt, bad_max_tokens, bad_model, bad_json
            must get a 4xx in OpenAI's error shape, and cost the server nothing

Every request goes through bench-serve's `request()` (minicb/bench/serve.py),
the one place that sends a request and reads its stream; the soak only
chooses what to send and checks what came back.

Every few seconds it reads the server process's resident memory (VmRSS) and
threads from /proc/PID/status, and counts /proc/PID/fd. Three samples make the
verdict, two of them taken *at rest*: after the warm-up requests (the caches
and pools have grown to their working size), and after the soak. At rest means
no client connection is open and the server has been idle for --rest seconds,
then served one probe: Starlette runs a streaming response's clean-up on
AnyIO's worker threads, and AnyIO retires an idle worker only when the next
job comes more than 10 s later, so the probe makes the pool as small at the
end as at the start. The verdict passes when

    memory  end RSS <= start RSS * 1.05 (memory flat after warm-up);
    fds, threads  end <= start (back where they were);
    errors  no 5xx, no unexpected 4xx, no connection error, no wrong answer;
    /health  at the end, every KV block free and no step failed;
    exit    our own server stops on SIGTERM (exit code 0, or -15: uvicorn re-raises the signal).

The exit code is 0 on a pass, 1 on a fail, 2 when the server never started.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx

from minicb.bench.serve import Reply, request
from minicb.bench.sse import DONE

GOOD_KINDS = ("completion", "completion_stream", "chat", "chat_stream")
BAD_KINDS = ("bad_empty_prompt", "bad_max_tokens", "bad_model", "bad_json")
KINDS = GOOD_KINDS + ("abort",) + BAD_KINDS
# How often each kind is drawn: mostly good requests, a request in 5 an abort or a bad one.
WEIGHTS = {"completion": 3, "completion_stream": 3, "chat": 3, "chat_stream": 3, "abort": 2,
           "bad_empty_prompt": 1, "bad_max_tokens": 1, "bad_model": 1, "bad_json": 1}
# Errors by kind; "expected_4xx" is a bad request refused as it should be, every other one fails the soak.
ERROR_KINDS = ("expected_4xx", "unexpected_4xx", "5xx", "connection", "wrong_answer")
MEMORY_BOUND = 0.05  # end RSS may exceed the start's by 5% at most

# Shared prefixes (longer than a 16-token block, even for a subword tokenizer), so the prefix cache hits.
PREFIXES = [
    "You are a helpful assistant. Answer briefly and plainly, in one or two sentences at most. ",
    "Summarise the following notes for a busy reader who has no time for detail: ",
    "Translate into French, keeping the tone and the punctuation of the original text: ",
]
WORDS = "the server keeps every block it frees and hands it to the next request that asks for one".split()


# ---- the server's process, from outside ------------------------------------------------------


def read_process(pid: int) -> dict:
    """{rss_mib, fds, threads} of a process, from /proc (Linux)."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(fields["Threads"])}


class Sampler:
    """A thread that reads the process every `every` seconds; `samples` are {t, phase, rss_mib, fds, threads}."""

    def __init__(self, pid: int | None, every: float):
        self.pid, self.every, self.phase = pid, every, "warmup"
        self.samples: list[dict] = []
        self.began = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def take(self, phase: str | None = None) -> dict | None:
        if self.pid is None:
            return None
        try:
            sample = {"t": round(time.monotonic() - self.began, 2), "phase": phase or self.phase,
                      **read_process(self.pid)}
        except (FileNotFoundError, ProcessLookupError):  # the process has gone
            return None
        self.samples.append(sample)
        return sample

    def _run(self):
        while not self._stop.wait(self.every):
            self.take()

    def start(self):
        if self.pid is not None:
            self._thread.start()

    def stop(self):
        self._stop.set()


# ---- one request of each kind ---------------------------------------------------------------


def prompt_text(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))


def sampling(rng: random.Random) -> dict:
    """A good request's sampling fields: n of 1-3; several completions are sampled, one may be greedy."""
    n = rng.choice([1, 1, 2, 3])
    body = {"n": n, "max_tokens": rng.randint(1, 24), "temperature": 0.0 if n == 1 and rng.random() < 0.5 else 0.8,
            "seed": rng.randrange(2**31), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["\n", ".", "e"])]
    return body


def good_body(kind: str, model: str, rng: random.Random) -> tuple[str, dict]:
    body = {"model": model, **sampling(rng)}
    if kind.endswith("_stream"):
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if kind.startswith("chat"):
        messages = [{"role": "user", "content": prompt_text(rng)}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": PREFIXES[0]})
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": prompt_text(rng)}


def check_answer(kind: str, body: dict, answer: dict) -> str | None:
    """What is wrong with a good request's whole answer (None: nothing)."""
    n, choices = body["n"], answer.get("choices", [])
    if sorted(c.get("index") for c in choices) != list(range(n)):
        return f"asked for n={n}, got choices {[c.get('index') for c in choices]}"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"choice {c.get('index')} finished with {c.get('finish_reason')!r}"
        text = (c.get("message") or {}).get("content") if kind == "chat" else c.get("text")
        if not isinstance(text, str):
            return f"choice {c.get('index')} has no text: {c}"
    usage = answer.get("usage") or {}
    if not 0 <= usage.get("completion_tokens", -1) <= n * body["max_tokens"]:
        return f"usage {usage} for n={n}, max_tokens={body['max_tokens']}"
    return None


def check_stream(body: dict, events: list) -> str | None:
    """What is wrong with a good request's server-sent events (None: nothing)."""
    if not events or events[-1] != DONE:
        return f"the stream did not end with [DONE] (last event: {events[-1] if events else None!r})"
    finished = Counter()
    for event in events[:-1]:
        if "error" in event:
            return f"error event: {event['error']}"
        for c in event.get("choices", []):
            if c.get("finish_reason") is not None:
                finished[c.get("index")] += 1
                if c["finish_reason"] not in ("stop", "length"):
                    return f"choice {c.get('index')} finished with {c['finish_reason']!r}"
    if sorted(finished.elements()) != list(range(body["n"])):
        return f"asked for n={body['n']}; finish reasons came for choices {sorted(finished.elements())}"
    if body.get("stream_options") and not any(e.get("usage") for e in events[:-1]):
        return "include_usage was asked for, and no chunk carried usage"
    return None


def bad_request(kind: str, model: str, rng: random.Random) -> tuple[str, dict]:
    """(path, keyword arguments of `request()`) of a request the server must refuse."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    good = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    if kind == "bad_empty_prompt":  # (an empty chat message still has the template around it)
        return "/v1/completions", {"body": {"model": model, "prompt": "", "max_tokens": 4}}
    if kind == "bad_max_tokens":
        return path, {"body": {"model": model, **good, "max_tokens": 0}}
    if kind == "bad_model":
        return path, {"body": {"model": "no-such-model", **good, "max_tokens": 4}}
    return path, {"content": b'{"prompt": "hi", "max_tokens": ', "headers": {"content-type": "application/json"}}


def openai_error(reply: Reply) -> bool:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


async def send(client: httpx.AsyncClient, kind: str, model: str, rng: random.Random) -> str | tuple[str, str]:
    """Send one request of `kind`: "ok", or (error kind, what happened). Never raises."""
    try:
        if kind in BAD_KINDS:
            path, fields = bad_request(kind, model, rng)
            reply = await request(client, path, **fields)
            if 400 <= reply.status < 500 and openai_error(reply):
                return "expected_4xx"
            if reply.status >= 500:
                return "5xx", f"{kind}: HTTP {reply.status}: {reply.text[:200]}"
            category = "unexpected_4xx" if reply.status >= 400 else "wrong_answer"
            return category, f"{kind}: HTTP {reply.status} (expected a 4xx in OpenAI's shape): {reply.text[:200]}"
        if kind == "abort":  # a long stream, read for 1-3 events: then the client hangs up
            path, body = good_body(rng.choice(["completion_stream", "chat_stream"]), model, rng)
            body.update(max_tokens=256, ignore_eos=True)
            reply = await request(client, path, body, stream=True, limit=rng.randint(1, 3))
            if reply.status != 200:
                return status_error(kind, reply.status, reply.text)
            return "ok" if reply.events else ("wrong_answer", f"{kind}: the stream sent no event")
        path, body = good_body(kind, model, rng)
        reply = await request(client, path, body, stream=body.get("stream", False))
        if reply.status != 200:
            return status_error(kind, reply.status, reply.text)
        if body.get("stream"):
            events = reply.events
            if any(isinstance(e, dict) and "error" in e for e in events):  # an engine failure mid-stream
                return "5xx", f"{kind}: error event in the stream: {[e for e in events if 'error' in e][0]}"
            problem = check_stream(body, events)
        else:
            problem = check_answer(kind, body, reply.json())
        return "ok" if problem is None else ("wrong_answer", f"{kind}: {problem}")
    except (httpx.HTTPError, OSError) as e:  # refused, reset, timed out
        return "connection", f"{kind}: {type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not the shape promised
        return "wrong_answer", f"{kind}: {type(e).__name__}: {e}"


def status_error(kind: str, status: int, text: str) -> tuple[str, str]:
    category = "5xx" if status >= 500 else "unexpected_4xx" if status >= 400 else "wrong_answer"
    return category, f"{kind}: HTTP {status}: {text[:200]}"


# ---- the load --------------------------------------------------------------------------------


class Tally:
    """Requests sent and served by kind, errors by kind, the first few error messages (one loop adds to it)."""

    def __init__(self):
        self.sent, self.ok, self.errors = Counter(), Counter(), Counter()
        self.examples: list[str] = []

    def add(self, kind: str, outcome):
        self.sent[kind] += 1
        if outcome in ("ok", "expected_4xx"):
            self.ok[kind] += 1
            if outcome == "expected_4xx":
                self.errors["expected_4xx"] += 1
            return
        category, message = outcome
        self.errors[category] += 1
        if len(self.examples) < 10:
            self.examples.append(message)

    def as_dict(self) -> dict:
        return {"requests": {k: {"sent": self.sent[k], "ok": self.ok[k]} for k in KINDS},
                "errors": {k: self.errors[k] for k in ERROR_KINDS}, "error_examples": self.examples}


def run_clients(url: str, model: str, clients: int, seed: int, tally: Tally, requests: int | None = None,
                duration: float | None = None, timeout: float = 60.0) -> float:
    """`clients` clients send requests side by side until `requests` are sent or `duration` seconds pass.
    Returns the seconds."""
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    tickets = iter(range(requests)) if requests is not None else None
    began = time.monotonic()
    deadline = began + duration if duration is not None else None

    def another() -> bool:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        return tickets is None or next(tickets, None) is not None

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        # Each client its own connections, all closed when it ends (the server's fds go back).
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
            while another():
                kind = rng.choices(kinds, weights)[0]
                tally.add(kind, await send(http, kind, model, rng))

    async def every_client():
        await asyncio.gather(*(client(i) for i in range(clients)))

    asyncio.run(every_client())
    return time.monotonic() - began


def at_rest(url: str, model: str, sampler: Sampler, rest: float, phase: str) -> dict | None:
    """Wait `rest` idle seconds, serve one probe stream on a fresh connection, then sample (see the docstring)."""
    sampler.phase = "rest"
    time.sleep(rest)

    async def probe():
        async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Connection": "close"}) as http:
            await request(http, "/v1/completions", {"model": model, "prompt": "probe", "max_tokens": 1,
                                                    "stream": True}, stream=True)

    asyncio.run(probe())
    time.sleep(0.5)  # the server closes its side of the connection
    return sampler.take(phase)


# ---- our own server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, server_args: list[str], log_path: pathlib.Path, timeout: float):
    """(process, url) of a server in a child process, once /health answers; RuntimeError if it does not."""
    port = free_port()
    command = [sys.executable, "-m", "minicb.serve.tiny"] if model == "tiny" else [sys.executable, "-m", "minicb",
                                                                                   "serve"]
    if model not in ("tiny", "embedded"):
        command += ["--model", model]
    command += ["--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens", "64",
                "--port", str(port), "--log-level", "warning", "--shutdown-timeout", "5", *server_args]
    with open(log_path, "w") as log:  # the child keeps its own copy of the file
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}:\n{tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{tail(log_path)}")


def stop_server(process: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM, as an operator stops it; its exit code, or None if it had to be killed."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def tail(path: pathlib.Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---- the verdict -----------------------------------------------------------------------------


def verdict(start: dict | None, end: dict | None, errors: dict, health: dict, exit_code: int | None,
            own_server: bool) -> dict:
    """{check: {ok, detail}}; the soak passes when every check is ok."""
    checks = {}
    bad = {k: v for k, v in errors.items() if k != "expected_4xx" and v}
    checks["errors"] = {"ok": not bad, "detail": "none" if not bad else ", ".join(f"{v} {k}" for k, v in bad.items())}
    if start is not None and end is not None:
        growth = end["rss_mib"] / start["rss_mib"] - 1
        checks["memory"] = {"ok": growth <= MEMORY_BOUND, "detail": f"{start['rss_mib']:.1f} -> {end['rss_mib']:.1f} "
                                                                    f"MiB ({growth:+.1%}; bound +{MEMORY_BOUND:.0%})"}
        for name in ("fds", "threads"):
            checks[name] = {"ok": end[name] <= start[name], "detail": f"{start[name]} -> {end[name]}"}
    free, total = health.get("kv_blocks_free"), health.get("kv_blocks")
    checks["health"] = {"ok": free is not None and free == total and health.get("step_failures") == 0,
                        "detail": f"{free} of {total} KV blocks free, {health.get('step_failures')} step failures"}
    if own_server:
        # uvicorn re-raises the SIGTERM it handled once it has shut down, so -15 is a clean exit too.
        checks["exit"] = {"ok": exit_code in (0, -signal.SIGTERM), "detail": f"exit code {exit_code} on SIGTERM"}
    return checks


def report(result: dict) -> str:
    lines = [f"\n{result['soak_requests']:,} requests in {result['soak_seconds']:.1f} s to {result['url']} "
             f"({result['model']}), {result['clients']} clients, after {result['warmup_requests']} warm-up requests\n",
             "| kind | sent | ok |", "|---|---|---|"]
    lines += [f"| {k} | {v['sent']} | {v['ok']} |" for k, v in result["requests"].items()]
    lines += ["", "| errors | soak | warm-up |", "|---|---|---|"]
    lines += [f"| {k} | {result['errors'][k]} | {result['warmup']['errors'][k]} |" for k in ERROR_KINDS]
    if result["start"] is not None:
        lines += ["", "| server process | RSS (MiB) | fds | threads |", "|---|---|---|---|"]
        for name, label in (("start", "start (at rest, after warm-up)"), ("middle", "middle (under load)"),
                            ("end", "end (at rest)")):
            s = result[name]
            if s is not None:
                lines.append(f"| {label} | {s['rss_mib']:.1f} | {s['fds']} | {s['threads']} |")
    else:
        lines.append("\n(no --pid: the server's memory, fds and threads were not watched)")
    for example in result["error_examples"] + result["warmup"]["error_examples"]:
        lines.append(f"error: {example}")
    lines.append("")
    for name, check in result["checks"].items():
        lines.append(f"{'ok  ' if check['ok'] else 'FAIL'} {name}: {check['detail']}")
    lines.append(f"verdict: {'PASS' if result['passed'] else 'FAIL'}")
    return "\n".join(lines)


# ---- the command line ------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The tool's flags, and the server's: whatever follows `--` goes to `serve` as it is."""
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="tools/soak.py", description="Soak the HTTP server with a mix of requests "
                                 "and check that nothing leaks. Flags after `--` go to the server.")
    how_long = ap.add_mutually_exclusive_group()
    how_long.add_argument("--duration", type=float, default=None, help="seconds of soak (default 60)")
    how_long.add_argument("--requests", type=int, default=None, help="requests to send (instead of --duration)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--model", default="tiny", help="the server's model: tiny (the random model and a byte "
                       "tokenizer, minicb/serve/tiny.py), embedded (SmolLM2), or a checkpoint path (default tiny)")
    where.add_argument("--url", default=None, help="soak this already running server instead of starting one")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, to watch its memory")
    ap.add_argument("--clients", type=int, default=8, help="clients sending requests side by side")
    ap.add_argument("--warmup", type=int, default=64, help="requests of the same mix sent before the start sample")
    ap.add_argument("--rest", type=float, default=11.0,
                    help="idle seconds before each at-rest sample (more than AnyIO's 10 s worker idle time)")
    ap.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples of the server")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds the server may take to start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the counts, every sample and the verdict here")
    args = ap.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.duration = 60.0
    for name in ("requests", "duration", "clients"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name}={value}; it must be > 0")
    if args.pid is not None and args.url is None:
        ap.error("--pid goes with --url; without --url the tool watches the server it starts")
    if server_args and args.url is not None:
        ap.error("flags after `--` go to the server the tool starts; with --url there is none")
    return args, server_args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, server_args = parse_args(argv)
    process, log_path = None, pathlib.Path(tempfile.mkdtemp(prefix="minicb-soak-")) / "server.log"
    if args.url is None:
        try:
            process, url = start_server(args.model, server_args, log_path, args.start_timeout)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        pid = process.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    sampler = Sampler(pid, args.sample_every)
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        sampler.start()
        sampler.take()
        # Warm-up: the same mix, so every path has run and every pool has grown before the start sample.
        warmup = Tally()
        run_clients(url, model, args.clients, args.seed + 1, warmup, requests=args.warmup, timeout=args.timeout)
        start = at_rest(url, model, sampler, args.rest, "start")
        sampler.phase = "soak"
        tally = Tally()
        soak_began = time.monotonic() - sampler.began
        seconds = run_clients(url, model, args.clients, args.seed, tally, requests=args.requests,
                              duration=args.duration, timeout=args.timeout)
        middle = min((s for s in sampler.samples if s["phase"] == "soak"), default=None,
                     key=lambda s: abs(s["t"] - (soak_began + seconds / 2)))
        end = at_rest(url, model, sampler, args.rest, "end")
        health = httpx.get(url + "/health", timeout=30).json()
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:  # the server went away, or is not minicb's
        print(f"error: the soak of {url} stopped: {type(e).__name__}: {e}", file=sys.stderr)
        if process is not None:
            print(f"\nthe server's log ({log_path}), last lines:\n{tail(log_path)}", file=sys.stderr)
        return 1
    finally:
        sampler.stop()
        exit_code = stop_server(process) if process is not None else None
    counts = tally.as_dict()
    checks = verdict(start, end, {k: counts["errors"][k] + warmup.errors[k] for k in ERROR_KINDS}, health,
                     exit_code, own_server=process is not None)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "tools/soak.py " + " ".join(argv), "url": url, "model": model, "clients": args.clients,
              "warmup_requests": sum(warmup.sent.values()), "soak_requests": sum(tally.sent.values()),
              "soak_seconds": seconds, **counts, "warmup": warmup.as_dict(), "start": start, "middle": middle,
              "end": end, "health": health, "server_exit_code": exit_code, "samples": sampler.samples,
              "checks": checks, "passed": all(c["ok"] for c in checks.values())}
    print(report(result))
    if not result["passed"] and process is not None:
        print(f"\nthe server's log ({log_path}), last lines:\n{tail(log_path)}", file=sys.stderr)
    elif process is not None:
        shutil.rmtree(log_path.parent)  # a pass: nothing in the log to look at
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
