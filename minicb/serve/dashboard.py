"""The dashboard's feed: engine steps as server-sent events, for dashboard.html.

In this file you will learn how to watch an engine live without slowing it
down. The pictures are chapter 06's (minicb/viz.py): a slot timeline (rows =
slots, one column per step, a colour per request) and the KV block map. Both
are drawn from StepTraces, which the engine builds for a step when asked: the
engine loop asks while at least one page is open, and not otherwise. So the
feed only has to move traces from the engine thread to the browser:

- the engine loop hands each step's StepRecord to every open page's queue
  (EngineLoop.subscribe), on the event loop's thread; a page that falls far
  behind loses steps, and the engine never waits for it;
- this generator wakes at most `MAX_MESSAGES_PER_S` times a second and sends
  every step that came since as one event: the slot timeline needs every step,
  each a few dozen numbers;
- the block map is the big part (one entry per block, ~1,500 for SmolLM2 on a
  CPU), and only its latest state is worth drawing, so it goes at most
  `MAX_BLOCK_MAPS_PER_S` times a second, and once more when the engine goes idle
  so the page ends on the true final state.

    GET /v1/dashboard/steps
    data: {"type": "hello", "num_slots": 32, "num_blocks": 1456, ...}
    data: {"type": "steps", "steps": [{"step": 0, "slots": [[0, "prefill"], null, ...], ...}],
           "blocks": {"step": 0, "owners": [0, 0, null, ...], "shared": [], "cached_free": []},
           "tokens_per_s": 41.5, "queued": 3}
"""
from __future__ import annotations

import asyncio
import json
import time

from minicb.serve.loop import EngineLoop, StepRecord

MAX_MESSAGES_PER_S = 20
MAX_BLOCK_MAPS_PER_S = 4
IDLE_HEARTBEAT_S = 1.0  # an idle engine still sends this often, so the page's tokens/s falls to 0


def step_summary(record: StepRecord) -> dict:
    """What the slot timeline and the queues need from one step."""
    t = record.trace
    return {
        "step": t.step, "time": record.time, "step_s": t.time_s,
        # One entry per slot: [request id, "prefill" | "decode"], or null when empty.
        "slots": [None if s.seq_id is None or s.phase == "empty" else [s.seq_id, s.phase] for s in t.slots],
        "admitted": t.admitted, "finished": [list(f) for f in t.finished], "preempted": t.preempted,
        "running": t.running, "waiting": t.waiting,
        "num_tokens": t.num_tokens, "new_tokens": len(t.new_tokens),
        "num_free_blocks": t.num_free_blocks, "num_blocks": t.num_blocks,
        "tokens_per_s": record.tokens_per_s,
    }


def block_map(record: StepRecord) -> dict:
    """Who holds each physical KV block after the step (the lowest id if shared), and which are shared or cached."""
    t = record.trace
    return {"step": t.step, "owners": t.block_owners, "shared": t.shared_blocks, "cached_free": t.cached_free_blocks,
            "num_free_blocks": t.num_free_blocks}


def _sse(message: dict) -> str:
    return f"data: {json.dumps(message, separators=(',', ':'))}\n\n"


async def dashboard_events(loop: EngineLoop, hello: dict):
    """The SSE stream of one open dashboard page; ends when the page goes away (the task is cancelled)."""
    feed = loop.subscribe()
    try:
        yield _sse({"type": "hello", **hello})
        last_map, unsent_map = 0.0, None
        while loop.serving:  # a draining server closes its pages, so they do not hold the shutdown up
            try:
                records = [await asyncio.wait_for(feed.get(), IDLE_HEARTBEAT_S)]
            except asyncio.TimeoutError:
                records = []
            while not feed.empty():
                records.append(feed.get_nowait())
            message = {"type": "steps", "steps": [step_summary(r) for r in records],
                       "tokens_per_s": loop.tokens_per_s(), "queued": loop.num_queued}
            if records:
                unsent_map = records[-1]
            now = time.perf_counter()
            # A map when it is due, or when the engine has gone quiet (the last state must be shown).
            if unsent_map is not None and (now - last_map >= 1 / MAX_BLOCK_MAPS_PER_S or not records):
                message["blocks"], last_map, unsent_map = block_map(unsent_map), now, None
            yield _sse(message)
            await asyncio.sleep(1 / MAX_MESSAGES_PER_S)
    finally:
        loop.unsubscribe(feed)
