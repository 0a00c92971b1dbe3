"""The routes: an OpenAI-compatible API, metrics and a dashboard, on FastAPI.

In this file you will learn the life of a request in a server, in order:

1. **Parse.** FastAPI reads the body into a pydantic model (minicb/serve/protocol.py).
   Bad JSON or a wrong type never reaches our code: `invalid_request` turns
   pydantic's complaint into OpenAI's error shape with status 400.
2. **Check.** `_prepare` turns the request into prompt token ids and a
   SamplingParams, and refuses, with a 400 that names the field, anything the
   engine could never serve: an unknown model, max_tokens < 1, n beyond the
   slots, a prompt that fills the context, a request whose KV cache could never
   fit in the pool (the engine's own `check_request`). A bad request costs the
   engine nothing, and the server keeps serving.
3. **Submit.** The engine loop (minicb/serve/loop.py) queues it, or answers
   QueueFull: 503 with Retry-After, so a client backs off instead of piling on.
4. **Follow.** ServedRequest (minicb/serve/request.py) yields each step's
   deltas. A streaming request sends them as server-sent events as they come
   (`data: {chunk}` ... `data: [DONE]`); a plain one gathers them into one answer.
   Either way, a client that disconnects has its request aborted: however the
   response ends, `ServedRequest.close()` runs after it and frees what is left.

Everything here runs on the event loop's thread and never blocks it: the
engine steps on its own thread.

    app = create_app(llm, model_name="SmolLM2-135M-Instruct")   # llm: minicb.LLM, keep_traces=1
    uvicorn.run(app, host="127.0.0.1", port=8000)               # or `python -m minicb serve`
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from minicb.sampling import SamplingParams
from minicb.serve import protocol as p
from minicb.serve.dashboard import dashboard_events
from minicb.serve.loop import EngineLoop, NotServing, QueueFull
from minicb.serve.metrics import CONTENT_TYPE, ServerMetrics
from minicb.serve.request import EngineError, ServedRequest

RETRY_AFTER_S = 1  # what a 503 tells the client to wait


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


def create_app(llm, model_name: str, max_waiting: int = 256) -> FastAPI:
    """A FastAPI app serving `llm` (a minicb.LLM built with keep_traces=1) as `model_name`.

    The engine thread starts with the app (lifespan) and stops with it: whatever
    is still waiting or running then ends as an abort.
    """
    engine, tokenizer = llm.engine, llm.tokenizer
    metrics = ServerMetrics()
    loop = EngineLoop(engine, max_waiting=max_waiting, metrics=metrics)
    max_model_len = engine.scheduler.max_model_len
    decode = tokenizer.decode if tokenizer is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.warm_up()  # before the first request: compiles kernels (blocks startup, not a user)
        loop.start(asyncio.get_running_loop())
        metrics.engine_state(engine)
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="minicb", summary="minicb's continuous-batching engine behind the OpenAI API",
                  lifespan=lifespan)
    app.state.loop, app.state.metrics, app.state.model_name = loop, metrics, model_name

    # ---- errors: always OpenAI's shape ------------------------------------------------

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        metrics.rejected_request(e.status)
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        error = e.errors()[0]
        where = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}", None
        else:
            # pydantic names the union member in the location ("prompt", "str"); keep the field.
            param = where[0] if where else None
            field = ".".join(w for w in where if w not in ("str", "list[int]", "list[str]", "list[TextPart]"))
            message = f"{field or 'body'}: {error['msg']}"
            if "input" in error and error["input"] is not None and len(repr(error["input"])) < 80:
                message += f" (got {error['input']!r})"
        metrics.rejected_request(400)
        return APIError(400, message, param, code=error.get("type")).response()

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, e: EngineError):
        return APIError(500, str(e), kind="server_error", code="engine_failed").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):  # a bug: still OpenAI's shape (uvicorn logs the traceback)
        return APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), kind="not_found_error" if e.status_code == 404 else
                        "invalid_request_error").response()

    # ---- checking a request -------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(400, f"the model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")

    def encode(prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids", param)
            ids = tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty; give at least one token", param)
        vocab = engine.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param)
        if len(ids) >= max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context is {max_model_len}; "
                                f"it must be shorter so that at least one token can be generated", param,
                           "context_length_exceeded")
        return ids

    def sampling_params(req: p._Sampling, prompt_ids: list[int], max_tokens: int | None,
                        max_tokens_field: str) -> SamplingParams:
        unsupported = req.unsupported()
        if unsupported:
            raise APIError(400, f"minicb does not support {', '.join(unsupported)}; leave it unset", unsupported[0])
        if req.n > engine.config.max_num_seqs:
            raise APIError(400, f"n={req.n} completions need {req.n} slots at once, but the server has "
                                f"{engine.config.max_num_seqs}", "n")
        if any(not s for s in req.stop_strings()):
            raise APIError(400, "stop strings must not be empty", "stop")
        if max_tokens is None:  # as many as the context and the pool leave after the prompt
            pool_tokens = engine.allocator.num_blocks * engine.allocator.block_size
            max_tokens = min(max_model_len, pool_tokens) - len(prompt_ids)
            if max_tokens < 1:
                raise APIError(400, f"the prompt's {len(prompt_ids)} tokens leave no room in the KV pool "
                                    f"({pool_tokens} tokens)", "messages")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=max(req.top_k, 0),
                                    top_p=req.top_p, seed=req.seed, n=req.n, ignore_eos=req.ignore_eos,
                                    stop_token_ids=list(req.stop_token_ids or []))
        except ValueError as e:  # SamplingParams names the field first: "max_tokens=0; it must be ..."
            field = str(e).split("=", 1)[0]
            raise APIError(400, str(e), max_tokens_field if field == "max_tokens" else field) from None
        try:
            engine.check_request(prompt_ids, params)  # reads only sizes fixed at start: safe off the engine thread
        except ValueError as e:
            raise APIError(400, str(e), max_tokens_field) from None
        return params

    def submit(prompt_ids: list[int], params: SamplingParams, stop: list[str]) -> ServedRequest:
        try:
            handle = loop.submit(prompt_ids, params)
        except QueueFull as e:
            raise APIError(503, str(e), kind="server_overloaded", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except NotServing as e:
            raise APIError(503, str(e), kind="server_unavailable", code="not_serving") from None
        metrics.accepted(len(prompt_ids))
        return ServedRequest(loop, handle, decode, stop)

    # ---- answering ------------------------------------------------------------------------

    async def gather(served: ServedRequest, request: Request) -> tuple[list[str], list[list[int]]]:
        """Run a request to its end; abort it if the client disconnects first."""
        texts = [""] * served.handle.params.n
        ids: list[list[int]] = [[] for _ in texts]

        async def collect():
            async for deltas in served.deltas():
                for d in deltas:
                    texts[d.completion] += d.text
                    ids[d.completion] += d.token_ids

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
            served.close()
        if work.cancelled():
            raise asyncio.CancelledError  # nobody is left to read an answer
        work.result()  # re-raises an engine failure
        return texts, ids

    def sse(data) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"

    async def stream(served: ServedRequest, chunk, first=None, include_usage: bool = False, send_ids: bool = False):
        """Server-sent events: `first` chunks, one chunk per completion per step, usage, [DONE].
        A step that added no text (half a character, a held-back stop string) sends nothing,
        unless the client asked for token ids."""
        try:
            for c in first or []:
                yield sse(c)
            async for deltas in served.deltas():
                for d in deltas:
                    if d.text or d.finish_reason is not None or (send_ids and d.token_ids):
                        yield sse(chunk(d))
            if include_usage:
                prompt_tokens, completion_tokens = served.usage()
                yield sse({**chunk(None), "choices": [],
                           "usage": p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                                total_tokens=prompt_tokens + completion_tokens).model_dump()})
        except EngineError as e:
            yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(e), type="server_error", code=500)).model_dump())
        yield sse("[DONE]")

    def usage(served: ServedRequest) -> p.UsageInfo:
        prompt_tokens, completion_tokens = served.usage()
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)

    # ---- the API ----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if loop.error is not None:
            raise APIError(503, loop.error, kind="server_error", code="engine_failed")
        return {"status": "ok"}

    @app.get("/v1/models", response_model=p.ModelList)
    async def models():
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request):
        check_model(req.model)
        prompt_ids = encode(req.prompt, "prompt")
        params = sampling_params(req, prompt_ids, req.max_tokens if req.max_tokens is not None else 16, "max_tokens")
        served = submit(prompt_ids, params, req.stop_strings())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        ids_if = (lambda ids: ids if req.return_token_ids else None)

        if req.stream:
            def chunk(d):
                choices = [] if d is None else [p.CompletionChoice(
                    index=d.completion, text=d.text, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                    token_ids=ids_if(d.token_ids))]
                return p.CompletionResponse(id=rid, created=created, model=model_name, choices=choices).model_dump()
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(served, chunk, None, include_usage, req.return_token_ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(served.close))
        texts, ids = await gather(served, request)
        choices = [p.CompletionChoice(index=i, text=texts[i], finish_reason=served.finish_reasons[i],
                                      stop_reason=served.stop_reasons[i], token_ids=ids_if(ids[i]))
                   for i in range(len(texts))]
        return p.CompletionResponse(id=rid, created=created, model=model_name, choices=choices, usage=usage(served))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: p.ChatCompletionRequest, request: Request):
        check_model(req.model)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template; use /v1/completions "
                                "with token ids", "messages")
        try:
            prompt = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages])
        except Exception as e:  # the template's own complaint (e.g. roles in an order it refuses)
            raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None
        prompt_ids = encode(prompt, "messages")
        limit, field = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
        params = sampling_params(req, prompt_ids, limit, field)
        served = submit(prompt_ids, params, req.stop_strings())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        ids_if = (lambda ids: ids if req.return_token_ids else None)

        if req.stream:
            def chunk(d):
                choices = [] if d is None else [p.ChatStreamChoice(
                    index=d.completion, delta=p.DeltaMessage(content=d.text), finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason, token_ids=ids_if(d.token_ids))]
                return p.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=choices).model_dump()
            # OpenAI's first chunk of each choice names the role, with empty content.
            first = [p.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[
                p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))]).model_dump()
                for i in range(params.n)]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(served, chunk, first, include_usage, req.return_token_ids),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(served.close))
        texts, ids = await gather(served, request)
        choices = [p.ChatChoice(index=i, message=p.AssistantMessage(content=texts[i]),
                                finish_reason=served.finish_reasons[i], stop_reason=served.stop_reasons[i],
                                token_ids=ids_if(ids[i])) for i in range(len(texts))]
        return p.ChatCompletionResponse(id=rid, created=created, model=model_name, choices=choices,
                                        usage=usage(served))

    # ---- observability -------------------------------------------------------------------

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse)
    async def dashboard():
        return HTMLResponse(resources.files("minicb.serve").joinpath("dashboard.html").read_text(encoding="utf-8"))

    @app.get("/v1/dashboard/steps")
    async def dashboard_steps():
        hello = {"model": model_name, "num_slots": engine.config.max_num_seqs,
                 "num_blocks": engine.allocator.num_blocks, "block_size": engine.allocator.block_size,
                 "max_waiting": max_waiting}
        return StreamingResponse(dashboard_events(loop, hello), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
