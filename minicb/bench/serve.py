"""`python -m minicb bench-serve`: load-test a server through the OpenAI API alone.

In this file you will learn how a serving benchmark measures what users feel,
from the outside. It speaks only the OpenAI API (streamed chat completions, or
completions), so the same command measures minicb's server, vLLM or any other:

    python -m minicb serve --port 8000 &
    python -m minicb bench-serve --url http://127.0.0.1:8000 --num-prompts 48 --request-rate inf
    python -m minicb bench-serve --url http://127.0.0.1:8000 --request-rate 2 --max-concurrency 8 \\
        --json build/bench/serve.json

The load:
- prompts are the chat workload's conversations (minicb/bench/workloads.py), the
  ones `python -m minicb bench --workload chat` feeds the engine directly, so the
  two benches do the same work and their throughputs can be compared;
- requests arrive as a Poisson process at --request-rate per second (independent
  users: exponential gaps), or all at once with `inf`; --max-concurrency caps how
  many are in flight, as a fixed pool of users would;
- greedy decoding, EOS or --max-tokens, like the offline bench.

What is measured, per request, on the client's clock:
    TTFT     request sent -> first chunk that carries text (queueing + prefill)
    ITL      gap between two consecutive chunks with text (a stream's stutter)
    TPOT     (latency - TTFT) / (output tokens - 1): the mean decode pace after the first token
    latency  request sent -> the stream's end (end-to-end)
Output tokens come from the server's own count (`stream_options.include_usage`),
not from counting chunks: a chunk may carry more than one token (a character
split over two tokens, or a held-back stop string) or none. Throughput is
requests and output tokens per second over the whole run (first request sent
to last finished).

One function sends a request and reads its answer, `request()`: the status, each
event of the stream with its arrival time, or the body. bench-serve times its
chunks from that; tools/soak.py sends its whole mix through it (aborts included:
it can stop reading after a few events), so the two clients are one.

The report is a markdown table on stdout and, with --json, every number and
every request's record in one file.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import pathlib
import sys
import time
from dataclasses import asdict, dataclass, field

from minicb.bench.metrics import percentile
from minicb.bench.sse import DONE, parse_event


@dataclass
class RequestRecord:
    index: int  # which prompt
    sent: float  # seconds since the run started
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minicb bench-serve",
                                 description="Load-test an OpenAI-compatible server: TTFT, TPOT, ITL, latency and "
                                             "throughput, from streamed responses.")
    ap.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model id to ask for (default: the first of GET /v1/models)")
    ap.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                    help="chat: /v1/chat/completions with the chat workload's messages (the server applies its "
                         "template); completions: /v1/completions with the bare question text")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens at most per request")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrivals per second; inf (the default) sends every request at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true", help="vLLM/minicb extension: always generate --max-tokens")
    ap.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    ap.add_argument("--warmup", type=int, default=1, help="short requests sent before the clock starts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--json", default=None, help="write the summary and every request's record here")
    args = ap.parse_args(argv)
    for name in ("num_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error(f"--max-concurrency={args.max_concurrency}; it must be >= 1")
    if not args.request_rate > 0:
        ap.error(f"--request-rate={args.request_rate}; it must be > 0 (or inf)")
    if args.warmup < 0:
        ap.error(f"--warmup={args.warmup}; it must be >= 0")
    return args


# ---- one request ---------------------------------------------------------------------------


def request_body(args, model: str, conversation: list[dict], max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": conversation}
    return "/v1/completions", {**body, "prompt": conversation[-1]["content"]}


@dataclass
class Reply:
    """What one request got back: its HTTP status and, for a stream answered 200, its events in the order
    they came ("[DONE]" stays a string), each with the seconds from sending to its arrival; otherwise the
    body's text."""
    status: int
    events: list[dict | str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: str = ""
    latency: float = 0.0  # seconds from sending to the answer's end (or to hanging up)

    def json(self):
        return json.loads(self.text)


async def request(client, path: str, body: dict | None = None, *, content: bytes | None = None,
                  headers: dict | None = None, stream: bool = False, limit: int | None = None) -> Reply:
    """POST one request (`body` as JSON, or raw `content`) and read its answer. With `stream`, read the
    server-sent events as they come, and with `limit` stop after that many: leaving the block then closes
    the connection, as a client that hangs up mid-stream does. Raises what httpx raises (refused, reset,
    timed out), and ValueError for an event that is not JSON."""
    began = time.perf_counter()
    async with client.stream("POST", path, json=body, content=content, headers=headers) as response:
        reply = Reply(response.status_code)
        if not stream or response.status_code != 200:
            reply.text = (await response.aread()).decode(errors="replace")
        else:
            async for line in response.aiter_lines():
                event = parse_event(line)
                if event is None:
                    continue  # blank separators, SSE comments
                reply.events.append(event)
                reply.times.append(time.perf_counter() - began)
                if limit is not None and len(reply.events) >= limit:
                    break
    reply.latency = time.perf_counter() - began
    return reply


async def send(client, path: str, body: dict, record: RequestRecord, start: float) -> RequestRecord:
    """Stream one request and time its chunks. Never raises: a failure is recorded."""
    record.sent = time.perf_counter() - start
    try:
        reply = await request(client, path, body, stream=True)
    except Exception as e:  # a refused connection, a timeout, a broken stream: one failed request
        record.error = f"{type(e).__name__}: {e}"
        return record
    if reply.status != 200:
        record.error = f"HTTP {reply.status}: {reply.text[:300]}"
        return record
    last = None
    for chunk, arrived in zip(reply.events, reply.times):
        if chunk == DONE:
            break
        if "error" in chunk:
            record.error = f"error event: {chunk['error']}"
            return record
        if chunk.get("usage"):
            record.prompt_tokens = chunk["usage"].get("prompt_tokens")
            record.output_tokens = chunk["usage"].get("completion_tokens", 0)
        for choice in chunk.get("choices", []):
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if not text:
                continue
            if last is None:
                record.ttft = arrived
            else:
                record.itls.append(arrived - last)
            last = arrived
            record.text += text
    record.latency = reply.latency
    if record.ttft is None:  # an empty answer (EOS first): its first token came with the end
        record.ttft = record.latency
    if not record.output_tokens:  # a server without include_usage: count chunks instead
        record.output_tokens = len(record.itls) + (1 if record.text else 0)
    record.ok = True
    return record


# ---- the run -------------------------------------------------------------------------------


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * num
    from minicb.bench.workloads import poisson_arrivals
    return poisson_arrivals(num, rate, seed)


async def run(args, conversations: list[list[dict]]) -> tuple[list[RequestRecord], float, str]:
    """Warm up, then send every request at its arrival time. Returns (records, wall seconds, model id)."""
    import httpx

    pool = args.max_concurrency or len(conversations)
    limits = httpx.Limits(max_connections=pool + 4, max_keepalive_connections=pool + 4)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=httpx.Timeout(args.timeout),
                                 limits=limits) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        for i in range(args.warmup):  # off the clock: first-call compiles, connection setup
            path, body = request_body(args, model, conversations[i % len(conversations)], 4)
            await send(client, path, body, RequestRecord(-1, 0.0), time.perf_counter())

        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        arrivals = arrival_times(len(conversations), args.request_rate, args.seed)
        start = time.perf_counter()

        async def user(i: int) -> RequestRecord:
            delay = arrivals[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            path, body = request_body(args, model, conversations[i], args.max_tokens)
            if gate is None:
                return await send(client, path, body, RequestRecord(i, 0.0), start)
            async with gate:  # the request is sent (and timed) once a place is free
                return await send(client, path, body, RequestRecord(i, 0.0), start)

        records = await asyncio.gather(*(user(i) for i in range(len(conversations))))
        wall = max((r.sent + r.latency for r in records if r.ok), default=0.0) - min(r.sent for r in records)
    return list(records), wall, model


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarize(records: list[RequestRecord], wall: float) -> dict:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall > 0 else None,
        "output_token_throughput": output_tokens / wall if wall > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok), "output_tokens": output_tokens,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _stats([gap for r in ok for gap in r.itls]),
        "latency_s": _stats([r.latency for r in ok]),
    }


def markdown(summary: dict) -> str:
    ms = (lambda v: "n/a" if v is None else f"{v * 1000:,.1f}")
    lines = ["| metric | mean | p50 | p99 |", "|---|---|---|---|"]
    for key, name in (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("itl_s", "ITL (ms)"),
                      ("latency_s", "end-to-end latency (ms)")):
        s = summary[key]
        lines.append(f"| {name} | {ms(s['mean'])} | {ms(s['p50'])} | {ms(s['p99'])} |")
    rate = (lambda v, unit: "n/a" if v is None else f"{v:.2f} {unit}")
    lines += ["", "| throughput | |", "|---|---|",
              f"| requests | {rate(summary['request_throughput'], 'req/s')} |",
              f"| output tokens | {rate(summary['output_token_throughput'], 'tok/s')} |",
              f"| completed / failed | {summary['completed']} / {summary['failed']} |",
              f"| prompt / output tokens | {summary['prompt_tokens']:,} / {summary['output_tokens']:,} |",
              f"| wall time | {summary['wall_s']:.2f} s |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from minicb.bench.workloads import chat_conversations

    conversations = chat_conversations(args.num_prompts)
    try:
        records, wall, model = asyncio.run(run(args, conversations))
    except Exception as e:  # the server is not there, or /v1/models failed
        print(f"error: could not benchmark {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    summary = summarize(records, wall)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(f"\n{summary['completed']} of {summary['requests']} requests to {args.url} ({model}, {args.endpoint}, "
          f"rate {rate}/s, max concurrency {args.max_concurrency or 'none'}, max_tokens {args.max_tokens})\n")
    print(markdown(summary))
    for r in records:
        if not r.ok:
            print(f"request {r.index} failed: {r.error}", file=sys.stderr)
            break
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": "python -m minicb bench-serve " + " ".join(argv), "url": args.url, "model": model,
                "endpoint": args.endpoint, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                "max_concurrency": args.max_concurrency, "temperature": args.temperature}
        path.write_text(json.dumps({"meta": meta, "summary": summary,
                                    "requests": [{**asdict(r), "tpot": r.tpot} for r in records]}, indent=2))
        print(f"\nwrote {path}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
