"""Chapter 09 exercise: the engine thread of an HTTP server -- commands in, each step's events out.

Fill in the stubs below, task by task. The text is chapters/09-serving/README.md;
the tests are tests/chapters/test_ch09_*.py. Run them against this file with

    python -m minicb check 9
    MINICB_IMPL=student MINICB_IMPL_ONLY=serve.loop python -m minicb serve     # the real server, on your code

Given (from minicb/serve/events.py; you make and fill them, you do not write them):
- the events a handle receives, plain dataclasses: Token(completion, token_id),
  Finished(completion, reason) with reason "stop", "length" or "abort", and
  Failed(message) when the engine refused or broke;
- RequestHandle: one HTTP request. It carries prompt_token_ids, params (its
  SamplingParams; params.n completions) and arrival (a perf_counter time); your
  functions set its request_id (None until added) and fill its `ended` set, the
  completions that will produce nothing more. Handles compare by identity, so
  they can be dict keys;
- Command: what a handler puts into the inbox, a typed (kind, handle, completion)
  tuple: ("add", handle, None), ("abort", handle, completion) or ("stop", None, None).
  Unpack it (`for kind, handle, completion in commands:`); a plain tuple of the
  same three compares equal to it;
- Owners: the engine thread's dict, engine request id -> RequestHandle;
- Applied: what apply_commands reports, Applied() empty to start: stop (bool),
  aborted (a list of (handle, completion) pairs) and failed (a dict handle ->
  list of Failed);
and EngineLoop, which runs the engine thread. EngineLoop takes these three
functions from the engine's parts when it is made (`engine.parts.serve_loop()`:
this file under check 9) and calls them in this order, every step:

    commands = take_commands(inbox, wait=not engine.has_unfinished())
    applied = apply_commands(engine, owners, commands)     # then reports applied
    out = engine.step()                                    # if anything is unfinished
    batches = group_step(out, owners)                      # one hand-off to the event loop

`owners` is the engine thread's map: engine request id (what engine.add_request returned) -> handle.
A request with n > 1 completions is one handle and one engine request id; the engine names every
new token and every finished sequence by that id and the completion's index (0 .. n - 1).
"""
from __future__ import annotations

import queue

from minicb.engine import Engine, StepOutput
from minicb.serve.events import Applied, Command, Failed, Finished, Owners, RequestHandle, Token  # noqa: F401  # given


def take_commands(inbox: queue.Queue, wait: bool) -> list[Command]:
    """Task 2: every Command in `inbox` now, oldest first, each a (kind, handle, completion) tuple.

    wait=True (the engine is idle): block until one command comes (inbox.get()), then take the
    rest without waiting. wait=False (the engine is busy): never block; [] when the inbox is empty.
    """
    raise NotImplementedError("Chapter 9, task 2: take_commands() — see chapters/09-serving/README.md#task-2")


def apply_commands(engine: Engine, owners: Owners, commands: list[Command]) -> Applied:
    """Task 2: carry out the commands in order; return an Applied.

    ("add", handle, None): rid = engine.add_request(handle.prompt_token_ids, handle.params,
        arrival_time=handle.arrival); handle.request_id = rid; owners[rid] = handle.
        add_request returns the new id, or raises (a ValueError for a request the engine can never
        serve) and queues nothing. If it raises, applied.failed[handle] = [Failed(f"{type(e).__name__}: {e}")]
        and the next commands still run.
    ("abort", handle, completion): skip it if handle.request_id is not in `owners` (the request
        ended already). Otherwise engine.abort(handle.request_id, completion) stops that one
        completion, or every live one when completion is None, frees their blocks now, and returns
        the aborted Sequences; a KeyError from it (nothing of the request is live) is not an error:
        nothing was aborted. For each returned seq: add seq.completion to handle.ended and append
        (handle, seq.completion) to applied.aborted -- one entry per completion the engine returned,
        also when completion is None: an n = 2 request still waiting has only completion 0 (1 is
        not forked yet), so it gives [(handle, 0)]; one that runs both gives one entry for each.
        Then the request leaves `owners` if completion is None, or if all handle.params.n
        completions have ended.
    ("stop", None, None): set applied.stop and return at once, applying nothing after it.
    """
    raise NotImplementedError("Chapter 9, task 2: apply_commands() — see chapters/09-serving/README.md#task-2")


def group_step(out: StepOutput, owners: Owners) -> dict[RequestHandle, list[Token | Finished]]:
    """Task 1: one engine step as each handle's list of events, in the step's order.

    1. out.new_tokens, NewTokens t (t.request_id, t.completion, t.token):
       Token(t.completion, t.token) for the handle owners[t.request_id].
    2. out.finished, Sequences: Finished(seq.completion, seq.finish_reason) for owners[seq.request_id];
       add seq.completion to handle.ended, and once all handle.params.n completions have ended,
       the request leaves `owners`.
    Requests not in `owners` are skipped; handles with no events are left out of the result.
    """
    raise NotImplementedError("Chapter 9, task 1: group_step() — see chapters/09-serving/README.md#task-1")
