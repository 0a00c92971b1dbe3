"""The engine loop: one thread owns the engine; requests come in, tokens go out.

In this file you will learn how a synchronous engine (chapter 06's
`Engine.step()`, which blocks for a whole forward pass) serves an asynchronous
web server that holds thousands of connections on one asyncio event loop.

    HTTP handlers (asyncio thread)            engine thread
    ------------------------------            -------------
    submit(prompt, params) -> handle --inbox--> engine.add_request
    abort(handle)          ----------inbox--> engine.abort
                                               engine.step()
    handle.events.get()    <--call_soon_threadsafe-- one batch of events per step

Three rules keep it correct:

1. **One owner.** Only the engine thread touches the engine, the scheduler and
   the allocator. Handlers never call them; they put commands into `inbox`, a
   thread-safe `queue.Queue`. The thread drains the inbox before every step, so an
   abort (a client that hung up, a stop string) frees the request's blocks before
   the next step runs: within one step.
2. **One hand-off per step.** The thread groups the step's new tokens and
   finished completions per request and hands the whole step to the event loop
   with a single `loop.call_soon_threadsafe`; each handle's asyncio queue then gets
   one list of events. Waking the event loop once per token would cost more than
   the tokens.
3. **The engine thread never waits for a client.** Asyncio queues are unbounded,
   and a slow reader only delays itself.

A request with n > 1 completions (parallel sampling) is one handle: the engine
forks its completions in the step after its prefill (StepOutput.forked) and the
loop maps each child id back to the handle and the completion's index, as
`LLM.stream` does.

Admission control: at most `max_waiting` requests may wait for their first
token; beyond that `submit` raises QueueFull and the server answers 503 with
Retry-After. The count lives on the event-loop thread only, so it needs no lock.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from minicb.engine import Engine, StepOutput
from minicb.sampling import SamplingParams
from minicb.trace import StepTrace


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


class QueueFull(RuntimeError):
    """More requests wait for their first token than the server accepts."""


class NotServing(RuntimeError):
    """The engine loop is shutting down, or stopped after an error."""


@dataclass(eq=False)  # handles are dict keys by identity
class RequestHandle:
    """One HTTP request as the engine loop sees it.

    `events` gets one list of Token / Finished / Failed per engine step that
    touched the request, in order. Fields after `events` belong to the engine
    thread (request_ids) or to the event loop (queued).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    id: int
    arrival: float = field(default_factory=time.perf_counter)
    request_ids: dict[int, int] = field(default_factory=dict)  # completion -> engine request id
    queued: bool = True  # counted against max_waiting until its first token (event-loop side)


# ---- what the dashboard and the metrics receive ------------------------------------------


@dataclass
class StepRecord:
    """One step, as the dashboard feed sees it: the engine's StepTrace plus the server's clock."""

    trace: StepTrace
    time: float  # time.time() at the end of the step
    tokens_per_s: float  # generated tokens per second over the last `RATE_WINDOW_S`


RATE_WINDOW_S = 2.0


class EngineLoop:
    """Owns `engine` on a background thread. Create and use it on the event loop's thread.

        loop = EngineLoop(engine, max_waiting=256)
        loop.start(asyncio.get_running_loop())
        handle = loop.submit(prompt_ids, SamplingParams(max_tokens=32))
        events = await handle.events.get()        # [Token(0, 1042), ...]
        loop.abort(handle)                        # the client went away
        loop.stop()                               # aborts what is left, joins the thread

    metrics: a ServerMetrics (minicb/serve/metrics.py), told on the engine thread
    what every step did, with the time to first token and the gaps between tokens
    measured here, where the tokens leave the engine.
    """

    def __init__(self, engine: Engine, max_waiting: int = 256, metrics=None):
        if engine.traces.maxlen is None:
            raise ValueError("the engine keeps every step's trace (keep_traces=None), which a server running for "
                             "days cannot afford; build it with keep_traces=1 (the dashboard needs the last one)")
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting}; it must be >= 1")
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = metrics
        self.inbox: queue.Queue = queue.Queue()
        self.num_queued = 0  # handles waiting for their first token (event-loop side)
        self.error: str | None = None  # set if the engine raised; the loop has stopped
        self.subscribers: set[asyncio.Queue] = set()  # dashboard feeds, one per open page
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Engine-thread state.
        self._owner: dict[int, tuple[RequestHandle, int]] = {}  # engine request id -> (handle, completion)
        self._last_token: dict[int, float] = {}  # engine request id -> when its previous token came out
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._rate_lock = threading.Lock()

    # ---- the event-loop side ----------------------------------------------------------

    def warm_up(self) -> None:
        """Run one tiny request through the engine before serving (on the caller's thread).

        The first prefill and decode compile kernels (Numba's CPU decode, Triton's
        on a GPU) and allocate; that can take seconds, and the first user should not
        wait for it. Call before start().
        """
        if self._thread is not None:
            raise RuntimeError("warm_up() must run before start(): only one thread may touch the engine")
        self.engine.add_request([0, 0], SamplingParams(max_tokens=2, ignore_eos=True))
        while self.engine.has_unfinished():
            self.engine.step()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="minicb-engine", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        """True while new requests are taken: started, not draining or stopped, no engine failure."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.error is None

    def drain(self) -> None:
        """Take no new requests; those already in keep running (the first half of a graceful shutdown)."""
        self._stopping = True

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request that `engine.check_request` accepted. Raises QueueFull or NotServing."""
        if not self.serving:
            raise NotServing(self.error or "the server is shutting down")
        if self.num_queued >= self.max_waiting:
            raise QueueFull(f"{self.num_queued} requests are already waiting for their first token "
                            f"(the limit is {self.max_waiting}); retry shortly")
        handle = RequestHandle(list(prompt_token_ids), params, asyncio.Queue(), next(self._ids))
        self.num_queued += 1
        self.inbox.put(("add", handle, None))
        return handle

    def abort(self, handle: RequestHandle, completion: int | None = None) -> None:
        """Stop one completion of a request, or all of it (None). Its blocks are free before the next step."""
        if completion is None:
            self._leave_queue(handle)
        self.inbox.put(("abort", handle, completion))

    def close(self) -> None:
        """Abort every request still waiting or running and end the thread, without waiting for it.

        The second half of a graceful shutdown (`drain` is the first): each aborted
        request's handle gets Finished(..., "abort"), so its stream still ends with a
        last chunk and [DONE] rather than a cut connection.
        """
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self.inbox.put(("stop", None, None))

    def close_after(self, seconds: float) -> None:
        """close() in `seconds`, on the event loop. Safe to call from any thread (a signal handler)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self.close)

    def stop(self, timeout: float = 10.0) -> None:
        """close(), then wait for the engine thread to end."""
        self.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def subscribe(self, maxsize: int = 2000) -> asyncio.Queue:
        """A queue that receives a StepRecord after every step (the dashboard feed).
        A reader that falls `maxsize` steps behind loses steps, never the engine's time."""
        feed: asyncio.Queue = asyncio.Queue(maxsize)
        self.subscribers.add(feed)
        return feed

    def unsubscribe(self, feed: asyncio.Queue) -> None:
        self.subscribers.discard(feed)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds (0 when idle)."""
        now = time.perf_counter()
        with self._rate_lock:
            recent = [(t, n) for t, n in self._rate if now - t <= RATE_WINDOW_S]
        return sum(n for _, n in recent) / RATE_WINDOW_S

    def _leave_queue(self, handle: RequestHandle) -> None:
        if handle.queued:
            handle.queued = False
            self.num_queued -= 1

    def _deliver(self, batches: dict[RequestHandle, list], record: StepRecord | None) -> None:
        """Runs on the event loop: hand each request its events of one step, and the dashboards the step."""
        for handle, events in batches.items():
            self._leave_queue(handle)  # it has produced a token, or it has ended
            handle.events.put_nowait(events)
        if record is not None:
            for feed in list(self.subscribers):
                try:
                    feed.put_nowait(record)
                except asyncio.QueueFull:
                    pass  # a page that cannot keep up misses steps

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                # Idle: sleep until a command comes. Busy: take what came during the step.
                commands = [self.inbox.get()] if not self.engine.has_unfinished() else []
                while True:
                    try:
                        commands.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                if not self._apply(commands):
                    break
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                if self.metrics is not None:  # after an abort with nothing left to step, too
                    self.metrics.engine_state(self.engine)
        except Exception as e:  # the engine is in an unknown state: fail every request, serve no more
            self.error = f"the engine failed: {type(e).__name__}: {e}"
            self._send({handle: [Failed(self.error)] for handle, _ in self._owner.values()}, None)
            self._owner.clear()
            return
        # Stopping: whatever is still waiting or running ends now, as an abort.
        batches: dict[RequestHandle, list] = collections.defaultdict(list)
        for rid, (handle, completion) in list(self._owner.items()):
            self._abort_id(rid)
            batches[handle].append(Finished(completion, "abort"))
        self._send(batches, None)

    def _apply(self, commands: list) -> bool:
        """Carry out the handlers' commands. False on "stop"."""
        for kind, handle, completion in commands:
            if kind == "stop":
                return False
            if kind == "add":
                try:
                    rid = self.engine.add_request(handle.prompt_token_ids, handle.params, arrival_time=handle.arrival)
                except Exception as e:  # checked before submit, so this is a bug; fail this request only
                    self._send({handle: [Failed(f"{type(e).__name__}: {e}")]}, None)
                    continue
                handle.request_ids[0] = rid
                self._owner[rid] = (handle, 0)
            elif kind == "abort":
                targets = handle.request_ids if completion is None else {completion: handle.request_ids.get(completion)}
                for rid in list(targets.values()):
                    if rid is not None and rid in self._owner:
                        self._abort_id(rid)
        return True

    def _abort_id(self, rid: int) -> None:
        del self._owner[rid]
        self._last_token.pop(rid, None)
        try:
            self.engine.abort(rid)
        except KeyError:
            return  # it finished in the step that just ran
        if self.metrics is not None:
            self.metrics.finished("abort")

    def _dispatch(self, out: StepOutput) -> None:
        now = time.perf_counter()
        batches: dict[RequestHandle, list] = collections.defaultdict(list)
        for parent, child in out.forked:  # n > 1: completions are born in their prompt's step
            handle, _ = self._owner[parent]
            siblings = [c for p, c in out.forked if p == parent]
            completion = 1 + siblings.index(child)
            handle.request_ids[completion] = child
            self._owner[child] = (handle, completion)
        ttfts, itls = [], []  # seconds: arrival -> first token of a request; token -> next token of a completion
        for rid, token in out.new_tokens:
            if rid in self._owner:
                handle, completion = self._owner[rid]
                batches[handle].append(Token(completion, token))
                if rid in self._last_token:
                    itls.append(now - self._last_token[rid])
                elif completion == 0:
                    ttfts.append(now - handle.arrival)
                self._last_token[rid] = now
        for seq in out.finished:
            self._last_token.pop(seq.request_id, None)
            if seq.request_id in self._owner:
                handle, completion = self._owner.pop(seq.request_id)
                batches[handle].append(Finished(completion, seq.finish_reason))
        with self._rate_lock:
            self._rate.append((now, len(out.new_tokens)))
            while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
                self._rate.popleft()
        if self.metrics is not None:
            self.metrics.step(self.engine, out, ttfts, itls)
        record = None
        if out.trace is not None and self.subscribers:
            record = StepRecord(out.trace, time.time(), self.tokens_per_s())
        self._send(batches, record)

    def _send(self, batches: dict, record: StepRecord | None) -> None:
        if (batches or record is not None) and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, dict(batches), record)
            except RuntimeError:
                pass  # the event loop closed while we were stepping: nobody is listening any more
