"""The routes: an OpenAI-compatible API, metrics and a dashboard, on FastAPI.

In this file you will learn the life of a request in a server, in order:

1. **Parse.** A body over `max_body_bytes` (create_app's; MAX_BODY_BYTES, 4 MiB,
   by default) gets 413 before any route reads it (`BodyLimit`): one whose
   Content-Length says so is refused unread, one sent in chunks at the first
   byte past the limit. FastAPI reads the rest into a pydantic model
   (minicb/serve/protocol.py). Bad JSON or a wrong type never reaches our code:
   `invalid_request` turns pydantic's complaint into OpenAI's error shape with
   status 400.
2. **Check.** `request_params` turns the request into prompt token ids and a
   SamplingParams, then asks the engine whether it could ever serve them
   (`engine.check_request`, the one place the rules live): an empty prompt, a
   token id outside the vocabulary, a prompt that fills the context, n beyond
   the slots, a request whose KV cache could never fit in the pool. The engine's
   RequestRejected names the field and a code, and the client gets both in a
   400. The server itself checks only what the engine cannot know: the model's
   name, a text prompt without a tokenizer, stop strings, fields minicb does not
   support, the chat template, and SamplingParams' own ranges. A bad request
   costs the engine nothing, and the server keeps serving.
3. **Submit.** The engine loop (minicb/serve/loop.py) queues it, or answers
   QueueFull: 503 with Retry-After, so a client backs off instead of piling on.
4. **Follow.** ServedRequest (minicb/serve/request.py) yields each step's
   deltas. A streaming request sends them as server-sent events as they come
   (`data: {chunk}` ... `data: [DONE]`); a plain one gathers them into one answer.
   Either way, a client that disconnects has its request aborted: however the
   response ends, `ServedRequest.close()` runs after it and frees what is left.
   So is a client that stops reading: once `max_buffered_steps` (create_app's;
   1024 by default) steps' events wait for it, the engine loop aborts its request,
   and its stream, if it ever reads on, ends with finish_reason "abort" and [DONE].

Everything here runs on the event loop's thread and never blocks it: the
engine steps on its own thread.

How this file is laid out: `ServerState` holds what every route reads (the
engine loop, the tokenizer, the model's name, the metrics); create_app builds
it and keeps it on `app.state.server`, and a route takes it as a parameter typed
`Server` (a FastAPI dependency). The checks (`check_model`, `encode`,
`request_params`, `submit`) are plain functions of it. `respond` is the tail both
completion routes share, the whole JSON answer or the stream: a route only says
how its objects look (`TextFormat`, `ChatFormat`). Then the routes, one function
each on `router`, and create_app, which puts the pieces together.

    app = create_app(llm, model_name="SmolLM2-135M-Instruct")   # llm: a minicb.LLM
    uvicorn.run(app, host="127.0.0.1", port=8000)               # or `python -m minicb serve`
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from minicb.bench.machine import device_name
from minicb.engine import Engine
from minicb.sampling import SamplingParams, StructuredOutput
from minicb.scheduler import RequestRejected
from minicb.serve import chat
from minicb.serve import protocol as p
from minicb.serve.dashboard import dashboard_events
from minicb.serve.loop import MAX_BUFFERED_STEPS, EngineLoop, NotServing, QueueFull
from minicb.serve.metrics import CONTENT_TYPE, ServerMetrics
from minicb.serve.request import EngineError, ServedRequest
from minicb.serve.scores import TokenTexts, chat_logprobs, completion_logprobs
from minicb.serve.tools import CallReader, ToolCalling, tool_calling

RETRY_AFTER_S = 1  # what a 503 tells the client to wait
# The largest request body accepted, in bytes (create_app's max_body_bytes). A token id
# under 100,000 takes at most 7 bytes of JSON ("49151, "), so a prompt filling a 128k-token
# context fits in 1 MiB; 4 leaves room for text and chat, and still bounds what a client
# can make the server hold and parse.
MAX_BODY_BYTES = 4 * 2**20


class APIError(Exception):
    """An error a client gets in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.kind, param=self.param,
                                                 code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413, in OpenAI's shape, before any route sees it.

    A body whose Content-Length is too large is refused unread. Any other body is
    read here, counted as it streams in, and refused at the first chunk past the
    limit; one that fits is handed to the route as it came. So the server never
    holds more than `max_bytes` of a body. `refused()` is called for each 413 (metrics).
    """

    def __init__(self, app, max_bytes: int, refused):
        self.app, self.max_bytes, self.refused = app, max_bytes, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.too_large(f"{declared} bytes", scope, receive, send)
        messages, size = [], 0  # the body's ASGI messages, kept to be replayed to the route
        while not messages or messages[-1].get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left mid-body: nobody to answer
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self.too_large(f"over {self.max_bytes} bytes", scope, receive, send)
            messages.append(message)

        async def replay():  # the body as it came, then the live channel (a disconnect, for the routes that watch)
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def too_large(self, size: str, scope, receive, send):
        self.refused()
        error = APIError(413, f"the request body is {size}; this server accepts at most {self.max_bytes} bytes",
                         code="request_too_large")
        await error.response()(scope, receive, send)


# ---- what every route reads -------------------------------------------------------------


@dataclass
class ServerState:
    """The server's state, made once by create_app and kept on `app.state.server`.

    A route takes it as a parameter typed `Server` (a FastAPI dependency), so
    each route reads on its own. Only the engine thread calls the engine; here
    the routes use just `engine.check_request` and the sizes fixed at start.
    """

    loop: EngineLoop
    tokenizer: object | None  # encode, decode, apply_chat_template; None: a model served by token ids only
    model_name: str
    metrics: ServerMetrics

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def decode(self):
        return self.tokenizer.decode if self.tokenizer is not None else None

    @functools.cached_property
    def device(self) -> str:
        """What the engine computes on, in words ("cpu (Intel(R) Xeon(R) ...)"), for /health."""
        return device_name(self.engine.model.device)

    @functools.cached_property
    def texts(self) -> TokenTexts:
        return TokenTexts(self.tokenizer)


async def server_state(request: Request) -> ServerState:
    return request.app.state.server  # async: a plain def would run on a worker thread, per request


Server = Annotated[ServerState, Depends(server_state)]


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine thread runs while the app does: whatever still waits or runs at the end ends as an abort."""
    server: ServerState = app.state.server
    # The warm-up compiles kernels before the first request (it blocks startup, not a user).
    server.loop.start(asyncio.get_running_loop(), warm_up=True)
    try:
        yield
    finally:
        server.loop.stop()


# ---- errors: always OpenAI's shape --------------------------------------------------------


async def api_error(request: Request, e: APIError):
    (await server_state(request)).metrics.rejected_request(e.status)
    return e.response()


async def invalid_request(request: Request, e: RequestValidationError):
    error = e.errors()[0]
    where = [str(part) for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == "json_invalid":
        message, param = f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
    elif error.get("type") == "extra_forbidden":  # a field this API does not have: refused, never ignored
        field = ".".join(where)
        message, param = (f"{field}: minicb does not know this field, so it cannot honour it; leave it out "
                          f"(the README's \"Serving over HTTP\" lists what is honoured)"), where[-1] if where else None
        (await server_state(request)).metrics.rejected_request(400)
        return APIError(400, message, param, code="unsupported_field").response()
    else:
        # pydantic names the union member in the location ("prompt", "str"); keep the field.
        param = where[0] if where else None
        field = ".".join(w for w in where if w not in ("str", "list[int]", "list[str]", "list[TextPart]"))
        message = f"{field or 'body'}: {error['msg']}"
        if "input" in error and error["input"] is not None and len(repr(error["input"])) < 80:
            message += f" (got {error['input']!r})"
    (await server_state(request)).metrics.rejected_request(400)
    return APIError(400, message, param, code=error.get("type")).response()


async def engine_error(request: Request, e: EngineError):
    return APIError(500, str(e), kind="server_error", code="engine_failed").response()


async def unexpected(request: Request, e: Exception):  # a bug: still OpenAI's shape (uvicorn logs the traceback)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").response()


async def http_error(request: Request, e: StarletteHTTPException):
    return APIError(e.status_code, str(e.detail), kind="not_found_error" if e.status_code == 404 else
                    "invalid_request_error").response()


ERROR_HANDLERS = {APIError: api_error, RequestValidationError: invalid_request, EngineError: engine_error,
                  Exception: unexpected, StarletteHTTPException: http_error}
# What /openapi.json says of errors: any route may answer a 4xx or a 5xx, always in OpenAI's
# shape. "4XX" also keeps FastAPI from listing the 422 it would add for a body: a body the
# models refuse gets a 400 here (`invalid_request`), as from OpenAI.
ERROR_RESPONSES = {"4XX": {"model": p.ErrorResponse, "description": "Refused: the request cannot be served"},
                   "5XX": {"model": p.ErrorResponse, "description": "The server failed, or is overloaded"}}
# A 200 that may be server-sent events (a route's "stream": true), beside its JSON.
EVENT_STREAM = {200: {"description": "The answer, or its server-sent events", "content": {"text/event-stream": {}}}}


# ---- checking a request -------------------------------------------------------------------


def check_model(server: ServerState, name: str | None) -> None:
    if name is not None and name != server.model_name:
        raise APIError(400, f"the model {name!r} does not exist; this server serves {server.model_name!r}", "model",
                       "model_not_found")


def encode(server: ServerState, prompt, param: str) -> list[int]:
    """Token ids, as they come; whether the engine can take them is its own check's to say."""
    if isinstance(prompt, str):
        if server.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids", param)
        return server.tokenizer.encode(prompt)
    return list(prompt)


def refuse_unsupported(req: p._Sampling) -> None:
    """A 400 naming the first field set to something minicb cannot do (protocol's `unsupported()`)."""
    unsupported = req.unsupported()
    if unsupported:
        name, why = unsupported[0]
        raise APIError(400, f"minicb does not support {name} as sent: {why}", name, "unsupported_value")


def request_params(server: ServerState, req: p._Sampling, prompt_ids: list[int], max_tokens: int | None,
                   prompt_field: str, max_tokens_field: str, prompt_logprobs: int | None = None,
                   structured: tuple[str, StructuredOutput] | None = None) -> SamplingParams:
    """The request's SamplingParams, once the engine has said it could serve them (else a 400).
    prompt_field, max_tokens_field: what this route calls the prompt and the length limit.
    prompt_logprobs: score the prompt too, with this many top tokens (echo with logprobs).
    structured: (the field that asked, its grammar), for every token to be sampled under; the
    engine's refusal of the grammar (a schema keyword it cannot hold a model to) names that field."""
    refuse_unsupported(req)
    if any(not s for s in req.stop_strings()):
        raise APIError(400, "stop strings must not be empty", "stop")
    engine = server.engine
    if max_tokens is None:  # as many as the context and the pool leave after the prompt
        max_tokens = engine.limits.default_max_tokens(len(prompt_ids))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=max(req.top_k, 0),
                                top_p=req.top_p, min_p=req.min_p, seed=req.seed, n=req.n, ignore_eos=req.ignore_eos,
                                stop_token_ids=list(req.stop_token_ids or []), min_tokens=req.min_tokens,
                                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                repetition_penalty=req.repetition_penalty, logprobs=req.score_count(),
                                prompt_logprobs=prompt_logprobs, structured=structured[1] if structured else None)
    except ValueError as e:  # SamplingParams names the field first: "max_tokens=0; it must be ..."
        field = str(e).split("=", 1)[0]
        if field == "max_tokens" and isinstance(req, p.CompletionRequest) and max_tokens == 0:
            raise APIError(400, "max_tokens=0 generates nothing: it is allowed only with \"echo\": true, to score "
                                "the prompt; otherwise it must be an integer >= 1", "max_tokens") from None
        fields = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs" if isinstance(req.logprobs, bool)
                  else "logprobs", "prompt_logprobs": "logprobs"}
        raise APIError(400, str(e), fields.get(field, field)) from None
    try:
        engine.check_request(prompt_ids, params)  # reads only sizes fixed at start: safe off the engine thread
    except RequestRejected as e:  # the engine names fields as /v1/completions does; this route may not
        asked = structured[0].split(".")[0] if structured else None  # "structured_outputs.json": its field
        param = {"prompt": prompt_field, "max_tokens": max_tokens_field, "structured": asked}.get(e.param, e.param)
        raise APIError(400, str(e), param, e.code) from None
    return params


def submit(server: ServerState, requests: list[tuple[list[int], SamplingParams]], stop: list[str],
           score_only: bool = False) -> list[ServedRequest]:
    """Queue each (prompt ids, params) as a request of the engine; all of them, or none (a 503)."""
    served: list[ServedRequest] = []
    try:
        for prompt_ids, params in requests:
            handle = server.loop.submit(prompt_ids, params)
            served.append(ServedRequest(server.loop, handle, server.decode, stop, score_only))
            server.metrics.accepted(len(prompt_ids))
    except (QueueFull, NotServing) as e:
        close_all(served)  # the prompts already queued go too: the client gets one answer, a 503
        if isinstance(e, QueueFull):
            raise APIError(503, str(e), kind="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        raise APIError(503, str(e), kind="server_unavailable", code="not_serving") from None
    return served


def close_all(served: list[ServedRequest]) -> None:
    for one in served:
        one.close()


# ---- answering: the tail both completion routes share --------------------------------------


@dataclass
class Piece:
    """One choice's text and tokens: a whole answer's, or what one step added to it (a stream's).

    A choice is index prompt * n + completion (OpenAI's order for a list of prompts).
    `scored` pairs each token whose score the client gets with its TokenLogprob:
    the generated tokens when the request asked for logprobs, and the prompt's
    before them with echo (the first with None). `token_ids` are the generated ones.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    scored: list[tuple[int, object]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0  # where this piece's first scored token starts in the choice's text (completions' text_offset)

    def then(self, later: Piece) -> Piece:
        """This piece followed by a later one of the same choice."""
        return Piece(self.index, self.text + later.text, self.token_ids + later.token_ids, self.scored + later.scored,
                     later.finish_reason, later.stop_reason, self.offset)


def step_piece(index: int, delta, offset: int = 0) -> Piece:
    """A Piece from one step's Delta of a completion (minicb/serve/request.py)."""
    return Piece(index, delta.text, list(delta.token_ids), list(zip(delta.token_ids, delta.logprobs)),
                 delta.finish_reason, delta.stop_reason, offset)


@dataclass
class AnswerFormat:
    """How a completion route writes OpenAI's objects from Pieces; `respond` does everything else.

    `choice` writes a whole answer's choice, `piece` what one step added (inside a
    stream's chunk). token_ids go out only if the client asked (return_token_ids),
    logprobs only if it asked for them (`scoring`).
    """

    id: str
    created: int
    model: str
    texts: TokenTexts
    send_ids: bool = False
    scoring: bool = False

    def opening(self, n: int) -> list[dict]:
        """The chunks a stream of n choices starts with, before any text."""
        return []

    def ids(self, piece: Piece) -> list[int] | None:
        return piece.token_ids if self.send_ids else None

    def shows(self, piece: Piece) -> bool:
        """Whether a step's piece has anything for the client: text, the end, or ids or scores it asked for.
        (A step may add nothing to show: half a character, a held-back stop string.)"""
        return bool(piece.text or piece.finish_reason is not None or (self.send_ids and piece.token_ids)
                    or (self.scoring and piece.scored))

    def pieces(self, piece: Piece) -> list:
        """The stream choices one step of a choice sends, a chunk each: one, or none if it shows nothing."""
        return [self.piece(piece)] if self.shows(piece) else []


class TextFormat(AnswerFormat):
    """/v1/completions: a choice is text, whole or one step's piece of it."""

    def choice(self, piece: Piece) -> p.CompletionChoice:
        ids, entries = [t for t, _ in piece.scored], [e for _, e in piece.scored]
        logprobs = completion_logprobs(self.texts, ids, entries, piece.offset) if self.scoring else None
        return p.CompletionChoice(index=piece.index, text=piece.text, logprobs=logprobs,
                                  finish_reason=piece.finish_reason, stop_reason=piece.stop_reason,
                                  token_ids=self.ids(piece))

    piece = choice

    def answer(self, choices: list, usage: p.UsageInfo) -> p.CompletionResponse:
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage)

    def chunk(self, pieces: list) -> dict:
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=pieces).model_dump()


@dataclass
class ChatFormat(AnswerFormat):
    """/v1/chat/completions: a whole choice is the assistant's message, a piece a delta of its content.

    calling: the request's tools, when it may call one (minicb/serve/tools.py). Each
    choice's text is then read by a CallReader: a call becomes `tool_calls` (content
    null, finish_reason "tool_calls"), streamed in OpenAI's delta shape; other text
    stays content. `readers` holds a stream's, one per choice.
    """

    calling: ToolCalling | None = None
    readers: dict[int, CallReader] = field(default_factory=dict)

    def logprobs(self, piece: Piece) -> p.ChatLogprobs | None:
        return chat_logprobs(self.texts, [e for _, e in piece.scored]) if self.scoring else None

    def choice(self, piece: Piece) -> p.ChatChoice:
        message, finish_reason = p.AssistantMessage(content=piece.text), piece.finish_reason
        if self.calling is not None:
            reader = self.calling.reader()
            finish_reason = reader.read(piece.text, piece.finish_reason).finish_reason
            if reader.kind == "call":
                call = p.ToolCall(id=reader.call_id, type="function",
                                  function=p.FunctionCall(name=reader.name, arguments=reader.arguments))
                message = p.AssistantMessage(content=None, tool_calls=[call])
        return p.ChatChoice(index=piece.index, message=message, logprobs=self.logprobs(piece),
                            finish_reason=finish_reason, stop_reason=piece.stop_reason, token_ids=self.ids(piece))

    def piece(self, piece: Piece, delta: p.DeltaMessage | None = None, last: bool = True) -> p.ChatStreamChoice:
        """A stream choice with `delta` (the piece's text, if None); only the `last` of a step's carries its
        ids, scores and end."""
        return p.ChatStreamChoice(index=piece.index, delta=delta or p.DeltaMessage(content=piece.text),
                                  logprobs=self.logprobs(piece) if last else None,
                                  finish_reason=piece.finish_reason if last else None,
                                  stop_reason=piece.stop_reason if last else None,
                                  token_ids=self.ids(piece) if last else None)

    def pieces(self, piece: Piece) -> list[p.ChatStreamChoice]:
        if self.calling is None:
            return super().pieces(piece)
        reader = self.readers.setdefault(piece.index, self.calling.reader())
        read = reader.read(piece.text, piece.finish_reason)
        deltas = []
        if read.opened:  # OpenAI's first delta of a call: its id, type and name, and no arguments yet
            deltas.append(p.DeltaMessage(tool_calls=[p.DeltaToolCall(
                index=0, id=reader.call_id, type="function", function=p.DeltaFunctionCall(name=reader.name,
                                                                                        arguments=""))]))
        if read.arguments:
            deltas.append(p.DeltaMessage(tool_calls=[p.DeltaToolCall(
                index=0, function=p.DeltaFunctionCall(arguments=read.arguments))]))
        if read.content:
            deltas.append(p.DeltaMessage(content=read.content))
        shown = Piece(piece.index, read.content + read.arguments, piece.token_ids, piece.scored,
                      read.finish_reason, piece.stop_reason)
        if not deltas and self.shows(shown):  # the end, or ids or scores, with no text to go with them
            deltas.append(p.DeltaMessage())
        return [self.piece(shown, delta, last=i == len(deltas) - 1) for i, delta in enumerate(deltas)]

    def answer(self, choices: list, usage: p.UsageInfo) -> p.ChatCompletionResponse:
        return p.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=usage)

    def chunk(self, pieces: list) -> dict:
        return p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=pieces).model_dump()

    def opening(self, n: int) -> list[dict]:
        # OpenAI's first chunk of each choice names the role, with empty content (null: a forced call has none).
        content = None if self.calling is not None and self.calling.forced else ""
        return [self.chunk([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=content))])
                for i in range(n)]


@dataclass
class Echo:
    """The prompt a completions choice starts with (`echo`): its text, and its tokens for scoring."""

    text: str
    token_ids: list[int]

    def piece(self, index: int, served: ServedRequest) -> Piece:
        """The prompt as a choice's first piece, with the prompt's scores when they were asked for."""
        scores = served.prompt_logprobs
        return Piece(index, self.text, [], list(zip(self.token_ids, scores)) if scores is not None else [])


async def respond(served: list[ServedRequest], request: Request, req: p._Sampling, form: AnswerFormat,
                  echoes: list[Echo] | None = None):
    """The answer to submitted requests (one per prompt): server-sent events if req.stream, else one JSON
    object at the end. Either way every request is closed (aborted in the engine if unfinished) once the
    response is over. echoes: the prompts to put before each of their choices (completions' echo)."""
    if req.stream:
        return StreamingResponse(stream(served, form, req, echoes), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(close_all, served))
    pieces = await gather(served, request)
    n = req.n
    if echoes is not None:
        pieces = [echoes[i // n].piece(i, served[i // n]).then(piece) for i, piece in enumerate(pieces)]
    return form.answer([form.choice(piece) for piece in pieces], usage(served))


async def merged(served: list[ServedRequest]):
    """(i, deltas) for each step of each of the requests, as they come, until all have ended."""
    if len(served) == 1:  # the common case needs no tasks
        async for deltas in served[0].deltas():
            yield 0, deltas
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int):
        try:
            async for deltas in served[i].deltas():
                await queue.put((i, deltas, None))
            await queue.put((i, None, None))
        except Exception as e:  # an engine failure: re-raised below, in the reader
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(served))]
    try:
        running = len(tasks)
        while running:
            i, deltas, error = await queue.get()
            if error is not None:
                raise error
            if deltas is None:
                running -= 1
                continue
            yield i, deltas
    finally:
        for task in tasks:
            task.cancel()
        close_all(served)


async def gather(served: list[ServedRequest], request: Request) -> list[Piece]:
    """Run the requests to their end, each choice gathered into one Piece; abort them all if the
    client disconnects first."""
    n = served[0].handle.params.n
    pieces = [Piece(i) for i in range(len(served) * n)]

    async def collect():
        async for i, deltas in merged(served):
            for d in deltas:
                index = i * n + d.completion
                pieces[index] = pieces[index].then(step_piece(index, d))

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(collect()), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client is gone (or this handler was cancelled): abort, and wait for it
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        close_all(served)
    if work.cancelled():
        raise asyncio.CancelledError  # nobody is left to read an answer
    work.result()  # re-raises an engine failure
    return pieces


def sse(data) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def stream(served: list[ServedRequest], form: AnswerFormat, req: p._Sampling, echoes: list[Echo] | None):
    """Server-sent events: the opening chunks, one chunk per choice per step, usage, [DONE].

    A step that added nothing to show (half a character, a held-back stop string,
    a tool call's name not yet whole) sends nothing, unless the client asked for
    token ids or scores; the step that completes a call's name sends two (the
    call's first delta, then its first arguments: `form.pieces`). A choice's
    first chunk starts with its prompt, with echo. With stream_options'
    continuous_usage_stats, every chunk carries the usage so far.
    """
    n = req.n
    options = req.stream_options or p.StreamOptions()
    offsets: dict[int, int] = {}  # choice -> characters of its scored tokens' texts sent so far
    try:
        for chunk in form.opening(len(served) * n):
            yield sse({**chunk, "usage": usage(served).model_dump()} if options.continuous_usage_stats else chunk)
        async for i, deltas in merged(served):
            for d in deltas:
                index = i * n + d.completion
                piece = step_piece(index, d, offsets.get(index, 0))
                if index not in offsets and echoes is not None:
                    piece = echoes[i].piece(index, served[i]).then(piece)
                offsets[index] = piece.offset + sum(len(form.texts.text(t)) for t, _ in piece.scored)
                for choice in form.pieces(piece):
                    chunk = form.chunk([choice])
                    if options.continuous_usage_stats:
                        chunk["usage"] = usage(served).model_dump()
                    yield sse(chunk)
        if options.include_usage:
            yield sse({**form.chunk([]), "usage": usage(served).model_dump()})
    except EngineError as e:
        yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(e), type="server_error", code=500)).model_dump())
    yield sse("[DONE]")


def usage(served: list[ServedRequest]) -> p.UsageInfo:
    prompt_tokens = sum(one.usage()[0] for one in served)
    completion_tokens = sum(one.usage()[1] for one in served)
    return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


# ---- the API --------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health(server: Server):
    loop = server.loop
    if loop.error is not None:
        raise APIError(503, loop.error, kind="server_error", code="engine_failed")
    # Steps that raised: their requests got a 500 (or an error event) and the engine was reset.
    # The pool as the engine thread last published it: this thread never reads the engine.
    stats = loop.snapshot
    return {"status": "ok", "device": server.device, "linear_backend": server.engine.linear_choice.describe(),
            "cpu_ops": server.engine.cpu_ops, "step_failures": loop.num_step_failures,
            "last_step_failure": loop.last_step_failure,
            "kv_blocks_free": stats.num_free_blocks, "kv_blocks": stats.num_blocks}


@router.get("/v1/models", response_model=p.ModelList)
async def models(server: Server):
    return p.ModelList(data=[p.ModelCard(id=server.model_name, max_model_len=server.max_model_len)])


@router.get("/v1/models/{model_id:path}", response_model=p.ModelCard)  # :path: a name like "org/model"
async def model_card(model_id: str, server: Server):
    if model_id != server.model_name:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {server.model_name!r}",
                       "model", "model_not_found")
    return p.ModelCard(id=server.model_name, max_model_len=server.max_model_len)


@router.post("/v1/completions", response_model=p.CompletionResponse, responses=EVENT_STREAM)
async def completions(req: p.CompletionRequest, request: Request, server: Server):
    """One engine request per prompt (a list of prompts batches in the engine like any other requests)."""
    check_model(server, req.model)
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    score_only = req.echo and max_tokens == 0  # score the prompt, generate nothing (lm-eval's loglikelihood)
    prompt_logprobs = req.logprobs if req.echo else None
    prompts = req.prompts()
    refuse_unsupported(req)  # before the grammar is read: two structured fields are one 400
    sources = req.structured_sources()  # response_format, guided_*, structured_outputs: one at most
    requests = []
    for prompt in prompts:  # every prompt checked before any is queued
        prompt_ids = encode(server, prompt, "prompt")
        requests.append((prompt_ids, request_params(server, req, prompt_ids, 1 if score_only else max_tokens,
                                                    "prompt", "max_tokens", prompt_logprobs,
                                                    sources[0] if sources else None)))
    served = submit(server, requests, req.stop_strings(), score_only)
    echoes = None
    if req.echo:
        echoes = [Echo(prompt if isinstance(prompt, str) else server.decode(ids) if server.decode else "", ids)
                  for prompt, (ids, _) in zip(prompts, requests)]
    form = TextFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()), server.model_name, server.texts,
                      req.return_token_ids, req.logprobs is not None)
    return await respond(served, request, req, form, echoes)


@router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=EVENT_STREAM)
async def chat_completions(req: p.ChatCompletionRequest, request: Request, server: Server):
    check_model(server, req.model)
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it has no chat template; use /v1/completions "
                            "with token ids", "messages")
    refuse_unsupported(req)  # before the tools and the grammar are read
    calling = tool_calling(req)  # None: no tool may be called (none given, or tool_choice "none")
    try:
        # Tool calls, results and names included; the tools too, when one may be called.
        prompt = chat.render(server.tokenizer, req.messages, tools=req.tools if calling else None)
    except Exception as e:  # the template's own complaint (e.g. roles in an order it refuses)
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None
    prompt_ids = encode(server, prompt, "messages")
    limit, field = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                    else (req.max_tokens, "max_tokens"))
    sources = req.structured_sources()
    structured = sources[0] if sources else None
    if calling is not None:  # the answer's grammar is the call's (with auto: beside text or the format)
        try:
            structured = ("tools", calling.grammar(structured))
        except RequestRejected as e:  # a tool's schema keyword minicb cannot hold a model to, named
            raise APIError(400, str(e), e.param, e.code) from None
    params = request_params(server, req, prompt_ids, limit, "messages", field, structured=structured)
    served = submit(server, [(prompt_ids, params)], req.stop_strings())
    form = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), server.model_name, server.texts,
                      req.return_token_ids, req.logprobs, calling=calling)
    return await respond(served, request, req, form)


# ---- observability ----------------------------------------------------------------------------


@router.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
async def prometheus(server: Server):
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/", response_class=HTMLResponse)
async def dashboard():
    return HTMLResponse(resources.files("minicb.serve").joinpath("dashboard.html").read_text(encoding="utf-8"))


@router.get("/v1/dashboard/steps", responses=EVENT_STREAM)
async def dashboard_steps(server: Server):
    limits = server.engine.limits
    hello = {"model": server.model_name, "num_slots": limits.max_num_seqs, "num_blocks": limits.num_blocks,
             "block_size": limits.block_size, "max_waiting": server.loop.max_waiting}
    return StreamingResponse(dashboard_events(server.loop, hello), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ---- the app ------------------------------------------------------------------------------------


def create_app(llm, model_name: str, max_waiting: int = 256, max_body_bytes: int = MAX_BODY_BYTES,
               max_buffered_steps: int = MAX_BUFFERED_STEPS) -> FastAPI:
    """A FastAPI app serving `llm` as `model_name`: a minicb.LLM, or what minicb.llm.build returns
    (the server's); either way its `.engine` and `.tokenizer`.

    The engine thread starts with the app (lifespan) and stops with it: whatever
    is still waiting or running then ends as an abort.
    """
    metrics = ServerMetrics()
    loop = EngineLoop(llm.engine, max_waiting=max_waiting, metrics=metrics, max_buffered_steps=max_buffered_steps)
    app = FastAPI(title="minicb", summary="minicb's continuous-batching engine behind the OpenAI API",
                  lifespan=lifespan, responses=ERROR_RESPONSES)
    app.state.server = ServerState(loop, llm.tokenizer, model_name, metrics)
    app.state.loop = loop  # what the shutdown (minicb/serve/server.py) drains and closes
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, refused=lambda: metrics.rejected_request(413))
    for kind, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(kind, handler)
    from minicb.serve.tokenize_routes import router as tokenizer_router  # here: it imports this module

    app.include_router(router)
    app.include_router(tokenizer_router)
    return app
