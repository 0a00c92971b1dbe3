"""What crosses between the event loop and the engine thread: handles, commands' results, events.

In this file you will learn the vocabulary of minicb/serve/loop.py. The HTTP
handlers and the engine thread share nothing but these objects:

- a RequestHandle is one HTTP request as the engine loop sees it; the handler
  keeps it and reads its `events` queue;
- the handler's commands travel through the inbox as (kind, handle, completion)
  tuples: ("add", handle, None), ("abort", handle, completion or None),
  ("stop", None, None);
- the engine thread answers with lists of events, one list per step that touched
  the request: Token, Finished, or Failed when the engine itself broke;
- `Owners` is the engine thread's own map from engine request ids (what
  `Engine.add_request` returned) back to handles, and `Applied` reports what a
  batch of commands did.

They live in a file of their own so that every copy of the engine thread's
functions (yours under `python -m minicb check 9`, the reference's) speaks the
very same classes: `isinstance(event, Token)` in minicb/serve/request.py must
hold for the events your code makes.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from minicb.sampling import SamplingParams


# ---- what a handle receives ------------------------------------------------------------


@dataclass
class Token:
    completion: int  # which of the request's n completions
    token_id: int


@dataclass
class Finished:
    completion: int
    reason: str  # "stop" | "length" | "abort" (the engine's finish_reason)


@dataclass
class Failed:
    message: str  # the engine raised; nothing more will come


@dataclass(eq=False)  # handles are dict keys by identity
class RequestHandle:
    """One HTTP request as the engine loop sees it.

    `events` gets one list of Token / Finished / Failed per engine step that
    touched the request, in order. Fields after `events` belong to the engine
    thread (request_id, ended) or to the event loop (queued).

    A request with n > 1 completions is one handle and one engine request id:
    the engine names every token by that id and the completion's index.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    id: int
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int | None = None  # what engine.add_request returned (None until added, or if refused)
    # Completions that will produce nothing more: finished in the engine, or aborted. When all
    # params.n have ended, the request leaves `owners`.
    ended: set[int] = field(default_factory=set)
    queued: bool = True  # counted against max_waiting until its first token (event-loop side)


# engine request id (what add_request returned) -> its handle, while any of its completions may still
# produce a token
Owners = dict[int, RequestHandle]


@dataclass
class Applied:
    """What apply_commands did, for the loop to report."""

    stop: bool = False  # a "stop" command came; the commands after it were not applied
    # (handle, completion) for each completion the engine aborted (engine.abort's returned sequences)
    aborted: list[tuple[RequestHandle, int]] = field(default_factory=list)
    failed: dict[RequestHandle, list[Failed]] = field(default_factory=dict)  # adds the engine refused
