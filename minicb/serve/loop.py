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
   the allocator. Handlers never call them; they put Commands (`Command.add`,
   `Command.abort`, `Command.stop`) into `inbox`, a thread-safe `queue.Queue`.
   The thread drains the inbox before every step, so an abort (a client that
   hung up, a stop string) frees the request's blocks before the next step
   runs: within one step.
2. **One hand-off per step.** The thread groups the step's new tokens and
   finished completions per request and hands the whole step to the event loop
   with a single `loop.call_soon_threadsafe`; each handle's asyncio queue then gets
   one list of events. Waking the event loop once per token would cost more than
   the tokens.
3. **The engine thread never waits for a client, and a client never holds the
   engine's memory.** A handle's queue holds at most `max_buffered_steps` lists
   (1024 by default). A client that reads so slowly that it fills them (its
   TCP buffers are full and it does not read on) has its request aborted at
   once: its KV blocks are free before the next step, later steps are dropped
   for it, and if it ever reads on, its stream ends with finish_reason "abort"
   and [DONE]. /metrics counts it in minicb_requests_too_slow_total.

A request with n > 1 completions (parallel sampling) is one handle and one
engine request id: the engine names each new token and each finished sequence
by the id add_request returned and the completion's index, so the loop needs
nothing but a map from that id to the handle. The request stays in the map
until all n of its completions have ended (finished, or aborted).

Admission control: at most `max_waiting` requests may wait for their first
token; beyond that `submit` raises QueueFull and the server answers 503 with
Retry-After. The count lives on the event-loop thread only, so it needs no lock.

The engine thread's work is three module-level functions (chapter 09's
exercise), which EngineLoop takes from the engine's parts once, when it is made
(`engine.parts.serve_loop()`: this module, or a student's file under
MINICB_IMPL=student; minicb/parts.py):
`take_commands` drains the inbox, `apply_commands` adds and aborts requests in
the engine, and `group_step` turns a StepOutput into each handle's events.
Everything else here (threads, the hand-off, metrics) is given. The objects
they pass around (Command, RequestHandle, Token, Finished, Failed, Applied) are in
minicb/serve/events.py and re-exported here.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
import weakref
from dataclasses import dataclass

from minicb.engine import Engine, EngineStats, StepOutput
from minicb.sampling import SamplingParams
# re-exported: the chapter's code and the server import them from here
from minicb.serve.events import Applied, Command, Failed, Finished, Owners, RequestHandle, Token  # noqa: F401
from minicb.trace import StepTrace


# ---- errors of submit ---------------------------------------------------------------------


class QueueFull(RuntimeError):
    """More requests wait for their first token than the server accepts."""


class NotServing(RuntimeError):
    """The engine loop is shutting down, or stopped after an error."""


# ---- the engine thread's three jobs (chapter 09's exercise) -------------------------------

def take_commands(inbox: queue.Queue, wait: bool) -> list[Command]:
    """Everything in `inbox` now, oldest first: a list of Commands, each a (kind, handle, completion) tuple.

    wait=True (the engine is idle, nothing to step): block until one command comes,
    then take whatever else is there without waiting. wait=False (the engine is
    busy): never block; [] when the inbox is empty. Draining it all before a step
    is what makes an abort take effect within one step.
    """
    commands = [inbox.get()] if wait else []
    while True:
        try:
            commands.append(inbox.get_nowait())
        except queue.Empty:
            return commands


def apply_commands(engine: Engine, owners: Owners, commands: list[Command]) -> Applied:
    """Carry out the handlers' commands, in order, on the engine (engine thread only).

    Each is a Command, unpacked as (kind, handle, completion):
    ("add", handle, None): engine.add_request(handle.prompt_token_ids, handle.params,
    arrival_time=handle.arrival); its id becomes handle.request_id, and owners[id] = handle.
    If the engine raises, the handle gets [Failed("TypeName: message")] in `failed`
    and the other commands still run.
    ("abort", handle, completion): if the handle's request is in `owners`,
    engine.abort(request_id, completion) stops that completion, or every live one
    (completion None), and frees their blocks now. Each sequence it returns is a
    completion that has ended: it goes into handle.ended and, as (handle, its
    completion), into `aborted`. A KeyError (nothing of it was live any more) is
    not an error. The request leaves `owners` when the abort was of all of it
    (nothing of it can come any more, not even completions it has not forked yet)
    or when all n of its completions have now ended. A request not in `owners`
    (it ended already, or was refused) is skipped.
    ("stop", None, None): stop here; set `stop`, and apply nothing after it.
    """
    applied = Applied()
    for kind, handle, completion in commands:
        if kind == "stop":
            applied.stop = True
            break
        if kind == "add":
            try:
                rid = engine.add_request(handle.prompt_token_ids, handle.params, arrival_time=handle.arrival)
            except Exception as e:  # checked before submit, so this is a bug; fail this request only
                applied.failed[handle] = [Failed(f"{type(e).__name__}: {e}")]
                continue
            handle.request_id = rid
            owners[rid] = handle
        elif kind == "abort":
            rid = handle.request_id
            if rid not in owners:
                continue  # it has ended already (a client hanging up after the answer, or twice), or was refused
            try:
                aborted = engine.abort(rid, completion)
            except KeyError:
                aborted = []  # nothing of it (or of that completion) is live: it has finished already
            for seq in aborted:
                handle.ended.add(seq.completion)
                applied.aborted.append((handle, seq.completion))
            if completion is None or len(handle.ended) == handle.params.n:
                del owners[rid]
    return applied


def group_step(out: StepOutput, owners: Owners) -> dict[RequestHandle, list[Token | Finished]]:
    """One step's output as each handle's list of events, in the step's order.

    A Token(t.completion, t.token) for every t in out.new_tokens, then a
    Finished(seq.completion, seq.finish_reason) for every seq in out.finished;
    t.request_id and seq.request_id name the request, the key of `owners`. A
    finished completion goes into handle.ended; once all handle.params.n have
    ended (apply_commands adds the aborted ones), the request leaves `owners`.
    Requests not in `owners` (not the server's) are skipped. A handle the step
    did not touch is not in the result.
    """
    batches: dict[RequestHandle, list] = {}
    for t in out.new_tokens:
        if t.request_id in owners:
            batches.setdefault(owners[t.request_id], []).append(Token(t.completion, t.token))
    for seq in out.finished:
        handle = owners.get(seq.request_id)
        if handle is None:
            continue
        batches.setdefault(handle, []).append(Finished(seq.completion, seq.finish_reason))
        handle.ended.add(seq.completion)
        if len(handle.ended) == handle.params.n:  # not before: its other completions still make tokens
            del owners[seq.request_id]
    return batches


def scored_handles(out: StepOutput, owners: Owners) -> dict[int, RequestHandle]:
    """request_id -> handle, for the step's requests that asked for scores (logprobs or prompt logprobs)."""
    ids = {t.request_id for t in out.new_tokens if t.logprobs is not None} | set(out.prompt_logprobs)
    return {rid: owners[rid] for rid in ids if rid in owners}


def attach_scores(out: StepOutput, batches: dict[RequestHandle, list], scored: dict[int, RequestHandle]):
    """Give group_step's Token events their scores, in step order, and the request's first Token
    its prompt's, in the step that scored the prompt. Given, not chapter 09's: the events
    group_step makes stay Token(completion, token_id)."""
    for rid, handle in scored.items():
        tokens = [event for event in batches.get(handle, []) if isinstance(event, Token)]
        for event, entry in zip(tokens, [t.logprobs for t in out.new_tokens if t.request_id == rid]):
            event.logprobs = entry
        if rid in out.prompt_logprobs and tokens:
            tokens[0].prompt_logprobs = out.prompt_logprobs[rid]
    return batches


# ---- what the dashboard and the metrics receive ------------------------------------------


@dataclass
class StepRecord:
    """One step, as the dashboard feed sees it: the engine's StepTrace plus the server's clock."""

    trace: StepTrace
    time: float  # time.time() at the end of the step
    tokens_per_s: float  # generated tokens per second over the last `RATE_WINDOW_S`


RATE_WINDOW_S = 2.0
# Step lists a request's reader may fall behind before the request is aborted (EngineLoop's
# max_buffered_steps): 10 s of not reading at a GPU's 10 ms a step, nearly two minutes at a
# CPU's 0.1 s. A list is a few small objects, so even a full queue costs kilobytes.
MAX_BUFFERED_STEPS = 1024


class EngineLoop:
    """Owns `engine` on a background thread. Create and use it on the event loop's thread.

        loop = EngineLoop(engine, max_waiting=256)
        loop.start(asyncio.get_running_loop())
        handle = loop.submit(prompt_ids, SamplingParams(max_tokens=32))
        events = await handle.events.get()        # [Token(0, 1042), ...]
        loop.abort(handle)                        # the client went away
        loop.stop()                               # aborts what is left, joins the thread

    metrics: a ServerMetrics (minicb/serve/metrics.py), told on the engine thread
    what every step did (the StepOutput alone), with the time to first token and
    the gaps between tokens measured here, where the tokens leave the engine.
    snapshot: the engine's EngineStats after its latest step (or aborts), published
    by the engine thread for readers on other threads (/health): nobody else
    touches the engine while it runs.
    max_buffered_steps: step lists a request's reader may fall behind before its
    request is aborted (rule 3 above; `_deliver`).
    """

    def __init__(self, engine: Engine, max_waiting: int = 256, metrics=None,
                 max_buffered_steps: int = MAX_BUFFERED_STEPS):
        if engine.traces.maxlen is None:
            raise ValueError("the engine keeps every step's trace (keep_traces=None), which a server running for "
                             "days cannot afford; leave keep_traces at 0 (an open dashboard asks for each "
                             "step's trace) or keep the last N")
        if max_buffered_steps < 1:
            raise ValueError(f"max_buffered_steps={max_buffered_steps}; it must be >= 1")
        self.max_buffered_steps = max_buffered_steps
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting}; it must be >= 1")
        self.engine, self.max_waiting = engine, max_waiting
        self.chapter = engine.parts.serve_loop()  # take_commands, apply_commands, group_step
        self.metrics = metrics
        self.snapshot: EngineStats = engine.stats()  # replaced, never changed, by the engine thread
        self.inbox: queue.Queue[Command] = queue.Queue()  # Commands only: see minicb/serve/events.py
        self.num_queued = 0  # handles waiting for their first token (event-loop side)
        self.error: str | None = None  # set if the engine raised; the loop has stopped
        self.num_step_failures = 0  # steps that raised: their requests failed, the loop went on
        self.last_step_failure: str | None = None
        self.exception: BaseException | None = None  # what it raised (for tests and debugging)
        self.warm_up_error: BaseException | None = None  # what the warm-up raised, if it did
        self.subscribers: set[asyncio.Queue] = set()  # dashboard feeds, one per open page
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._handles: weakref.WeakSet[RequestHandle] = weakref.WeakSet()  # submitted ones (event-loop side)
        # Engine-thread state.
        self._owners: Owners = {}  # engine request id -> handle, until all its completions have ended
        # (handle, completion) -> when its previous token came out
        self._last_token: dict[tuple[RequestHandle, int], float] = {}
        self._rate: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self._rate_lock = threading.Lock()

    # ---- the event-loop side ----------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, warm_up: bool = False) -> None:
        """Start the engine thread. With warm_up, it first runs one tiny request through the
        engine, and this returns once it has.

        The first prefill and decode compile kernels (Numba's CPU decode, Triton's on a
        GPU) and allocate; that can take seconds, and the first user should not wait for
        it. The warm-up runs on the engine thread, like every step after it: torch's
        OpenMP runtime (libgomp) keeps a pool of worker threads for each thread that runs
        operators, and once the pools hold more threads than the machine has cores it
        stops spinning between operators. With spinning on (libgomp's default) a decode
        step ran 20-30% slower on a second thread than on the first one here, until
        only one thread ran operators.
        """
        self._loop = loop
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(warm_up, ready), name="minicb-engine", daemon=True)
        self._thread.start()
        ready.wait()
        # The warm-up failed: the thread has ended, and startup fails here. (A failure after it,
        # in the loop, may already be in self.exception by now: the server reports that one.)
        if self.warm_up_error is not None:
            raise self.warm_up_error

    def _warm_up(self) -> None:
        self.engine.add_request([0, 0], SamplingParams(max_tokens=2, ignore_eos=True))
        while self.engine.has_unfinished():
            self.engine.step()

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
        # Room for max_buffered_steps lists, and the one that ends a request that fell behind (_deliver).
        handle = RequestHandle(list(prompt_token_ids), params, asyncio.Queue(self.max_buffered_steps + 1),
                               next(self._ids))
        self.num_queued += 1
        self._handles.add(handle)
        self.inbox.put(Command.add(handle))
        return handle

    def abort(self, handle: RequestHandle, completion: int | None = None) -> None:
        """Stop one completion of a request, or all of it (None). Its blocks are free before the next step.

        One completion is stopped once it has produced a token (a stop string in its
        text): by then the engine has forked the request's completions. Completion 0
        of an n > 1 request aborted alone before that would take its unforked
        siblings with it, and no Finished would ever come for them: stop such a
        request whole (None).
        """
        if completion is None:
            self._leave_queue(handle)
        self.inbox.put(Command.abort(handle, completion))

    def close(self) -> None:
        """Abort every request still waiting or running and end the thread, without waiting for it.

        The second half of a graceful shutdown (`drain` is the first): each aborted
        request's handle gets Finished(..., "abort"), so its stream still ends with a
        last chunk and [DONE] rather than a cut connection.
        """
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self.inbox.put(Command.stop())

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
        """Runs on the event loop: hand each request its events of one step, and the dashboards the step.

        A request whose reader is `max_buffered_steps` lists behind gets this step's
        list no more: it is aborted (`_too_slow`), and the lists of steps that ran
        before its abort took effect are dropped.
        """
        for handle, events in batches.items():
            self._leave_queue(handle)  # it has produced a token, or it has ended
            if handle.too_slow:
                continue
            if handle.events.qsize() >= self.max_buffered_steps:
                self._too_slow(handle)
                continue
            handle.events.put_nowait(events)
        if record is not None:
            for feed in list(self.subscribers):
                try:
                    feed.put_nowait(record)
                except asyncio.QueueFull:
                    pass  # a page that cannot keep up misses steps

    def _too_slow(self, handle: RequestHandle) -> None:
        """Abort a request whose reader fell too far behind (event loop). Its blocks are free before
        the next step; its queue ends with one Finished(c, "abort") per completion (a reader skips
        those of completions it saw end), so a client that reads on still gets a last chunk and [DONE]."""
        handle.too_slow = True
        handle.events.put_nowait([Finished(c, "abort") for c in range(handle.params.n)])
        self.abort(handle)
        if self.metrics is not None:
            self.metrics.too_slow_request()
            self.metrics.engine_state(self.snapshot)

    def _fail_all(self, message: str) -> None:
        """Runs on the event loop after the engine failed: every request still waiting for events ends.
        (A handle that had already ended gets one more list, which nobody reads; one aborted as
        too slow has its last list already.)"""
        for handle in list(self._handles):
            self._leave_queue(handle)
            if not handle.too_slow:
                handle.events.put_nowait([Failed(message)])

    # ---- the engine thread ------------------------------------------------------------

    def _run(self, warm_up: bool, ready: threading.Event) -> None:
        try:
            if warm_up:
                self._warm_up()
        except Exception as e:
            self.exception = self.warm_up_error = e  # start() raises it
            return
        finally:
            ready.set()
        try:
            chapter = self.chapter
            while True:
                # Idle: sleep until a command comes. Busy: take what came during the step.
                commands = chapter.take_commands(self.inbox, wait=not self.engine.has_unfinished())
                applied = chapter.apply_commands(self.engine, self._owners, commands)
                self._report(applied)
                if applied.stop:
                    break
                if self.engine.has_unfinished():
                    try:
                        # A trace only while a dashboard page is open: it is the page's picture.
                        out = self.engine.step(trace=bool(self.subscribers))
                    except Exception as e:  # this step's requests fail; the server goes on
                        self._step_failed(e)
                        continue
                    self._publish(out.stats)
                    scored = scored_handles(out, self._owners)  # before group_step lets finished ones go
                    self._dispatch(out, attach_scores(out, chapter.group_step(out, self._owners), scored))
                elif applied.aborted:  # the aborts emptied the engine: no step will say so
                    self._publish(self.engine.stats())
        except Exception as e:  # outside a step (a command, the chapter's code): fail everything, serve no more
            self.exception = e
            self.error = f"the engine failed: {type(e).__name__}: {e}"
            self._owners.clear()
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(self._fail_all, self.error)
                except RuntimeError:
                    pass  # the event loop closed meanwhile
            return
        # Stopping: whatever is still waiting or running ends now, as an abort.
        batches: dict[RequestHandle, list] = {}
        for rid, handle in list(self._owners.items()):
            del self._owners[rid]
            try:
                aborted = self.engine.abort(rid)
            except KeyError:
                aborted = []  # the engine has already let go of it
            self._report(Applied(aborted=[(handle, seq.completion) for seq in aborted]))
            # Every completion not ended yet, including those a waiting request has not forked:
            # each stream must see its completion end.
            batches[handle] = [Finished(c, "abort") for c in range(handle.params.n) if c not in handle.ended]
        self._send(batches, None)

    def _step_failed(self, error: Exception) -> None:
        """A step raised (a model bug, out of memory): end every request the engine held with
        Failed, reset the engine to empty, and keep serving.

        A step can stop anywhere between scheduling and postprocessing, so which of the
        engine's requests it left intact cannot be told: all of them end, each with an
        error its client sees (a 500, or an error event in a stream). Engine.reset frees
        every block and drops the prefix cache, whose keys may name K/V never written.
        """
        self.num_step_failures += 1
        self.last_step_failure = f"{type(error).__name__}: {error}"
        self.engine.reset()
        message = f"the engine failed in a step and dropped this request: {self.last_step_failure}"
        failed = {handle: [Failed(message)] for handle in self._owners.values()}
        self._owners.clear()
        self._last_token = {key: t for key, t in self._last_token.items() if key[0] not in failed}
        self._send(failed, None)
        self._publish(self.engine.stats())

    def _publish(self, stats: EngineStats) -> None:
        """The engine thread's word on the queues and the pool, for /health and the gauges."""
        self.snapshot = stats
        if self.metrics is not None:
            self.metrics.engine_state(stats)

    def _report(self, applied: Applied) -> None:
        """Tell the refused requests, count the aborts, forget the aborted completions' token times."""
        if applied.failed:
            self._send(applied.failed, None)
        for handle, completion in applied.aborted:
            self._last_token.pop((handle, completion), None)
            if self.metrics is not None:
                self.metrics.finished("abort")

    def _dispatch(self, out: StepOutput, batches: dict[RequestHandle, list]) -> None:
        """Measure the step's latencies, then hand `batches` (group_step's) to the event loop."""
        now = time.perf_counter()
        ttfts, itls = [], []  # seconds: arrival -> first token of a request; token -> next token of a completion
        for handle, events in batches.items():
            for event in events:
                key = (handle, event.completion)
                if isinstance(event, Finished):
                    self._last_token.pop(key, None)
                    continue
                if key in self._last_token:
                    itls.append(now - self._last_token[key])
                elif event.completion == 0:
                    ttfts.append(now - handle.arrival)
                self._last_token[key] = now
        with self._rate_lock:
            self._rate.append((now, len(out.new_tokens)))
            while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
                self._rate.popleft()
        if self.metrics is not None:
            self.metrics.step(out, ttfts, itls)
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
