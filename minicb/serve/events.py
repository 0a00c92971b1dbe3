"""What crosses between the event loop and the engine thread: handles, commands, their results, events.

In this file you will learn the vocabulary of minicb/serve/loop.py. The HTTP
handlers and the engine thread share nothing but these objects:

- a RequestHandle is one HTTP request as the engine loop sees it; the handler
  keeps it and reads its `events` queue;
- the handler's commands travel through the inbox as Commands, typed
  (kind, handle, completion) tuples: Command.add(handle) is ("add", handle, None),
  Command.abort(handle, completion) is ("abort", handle, completion or None),
  Command.stop() is ("stop", None, None);
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
from typing import Literal, NamedTuple, get_args

from minicb.sampling import SamplingParams


# ---- what a handle receives ------------------------------------------------------------


@dataclass
class Token:
    completion: int  # which of the request's n completions
    token_id: int
    # Scores (minicb/logprobs.py), when the request asked; the engine loop attaches them from the
    # StepOutput after group_step (loop.py's attach_scores), so group_step need not know of them:
    logprobs: object = None  # this token's TokenLogprob
    prompt_logprobs: list | None = None  # on the request's first token: its prompt's (None first)


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
    touched the request, in order. It is bounded: a reader that falls
    `max_buffered_steps` lists behind (EngineLoop's) has its request aborted,
    `too_slow` set, and one last list of Finished(c, "abort") (loop.py's
    `_deliver`). Fields after `events` belong to the engine thread (request_id,
    ended) or to the event loop (queued, too_slow).

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
    too_slow: bool = False  # its reader fell too far behind; it was aborted (event-loop side)


# ---- what a handler asks of the engine thread --------------------------------------------

CommandKind = Literal["add", "abort", "stop"]


class _CommandFields(NamedTuple):
    kind: CommandKind
    handle: RequestHandle | None  # None for "stop"
    completion: int | None  # "abort": one completion, or None for all of them; None otherwise


class Command(_CommandFields):
    """One message to the engine thread, through EngineLoop's inbox.

    A tuple, so the engine thread can unpack it (`for kind, handle, completion in
    commands:`) and a plain ("add", handle, None) compares equal to it; the
    constructors, and Command(...) itself, refuse a kind or a shape that the
    engine thread would not understand.

        Command.add(handle)                  # ("add", handle, None): queue the request in the engine
        Command.abort(handle, completion)    # ("abort", handle, completion): None stops all of it
        Command.stop()                       # ("stop", None, None): end the engine thread
    """

    __slots__ = ()

    def __new__(cls, kind: CommandKind, handle: RequestHandle | None = None, completion: int | None = None):
        if kind not in get_args(CommandKind):
            raise ValueError(f"a command's kind is {kind!r}; it must be one of {get_args(CommandKind)}")
        if (handle is None) != (kind == "stop"):
            raise ValueError(f"the {kind!r} command {'takes no' if kind == 'stop' else 'needs a'} handle; got "
                             f"{type(handle).__name__ if handle is not None else None}")
        if completion is not None and kind != "abort":
            raise ValueError(f"only an abort names a completion; the {kind!r} command got completion={completion!r}")
        return super().__new__(cls, kind, handle, completion)

    @classmethod
    def add(cls, handle: RequestHandle) -> Command:
        return cls("add", handle)

    @classmethod
    def abort(cls, handle: RequestHandle, completion: int | None = None) -> Command:
        return cls("abort", handle, completion)

    @classmethod
    def stop(cls) -> Command:
        return cls("stop")


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
