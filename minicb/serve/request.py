"""One HTTP request, from the engine's events to the deltas a client is sent.

In this file you will learn what sits between the engine loop's raw events
(Token, Finished, one list per step; minicb/serve/loop.py) and a response:

- each of the request's n completions has its own text (minicb/serve/text.py),
  so a token becomes a text delta, and a stop string ends the completion: the
  server aborts it in the engine, and the tokens the engine made meanwhile (at
  most one step's) are dropped;
- a request always ends in the engine too: if the client goes away or the
  handler fails, `deltas()`'s `finally` aborts whatever is still running, so
  its KV blocks are free before the next step;
- usage is counted from the tokens a client actually got: the prompt, and each
  completion's tokens up to the one that ended it.

The routes (minicb/serve/app.py) turn the deltas into OpenAI's chunks, or
gather them into one answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from minicb.serve.loop import EngineLoop, Failed, Finished, RequestHandle, Token
from minicb.serve.text import CompletionText


class EngineError(RuntimeError):
    """The engine failed while this request ran."""


@dataclass
class Delta:
    """What one step added to one completion."""

    completion: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # each token's TokenLogprob, when the request asked
    finish_reason: str | None = None  # set on the completion's last delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


class ServedRequest:
    """The deltas of a submitted request, one list per engine step.

        served = ServedRequest(loop, loop.submit(prompt_ids, params), tokenizer.decode, stop=["\\n\\n"])
        async for deltas in served.deltas():
            ...                                   # stream them, or gather them
        served.usage()                            # (prompt_tokens, completion_tokens)
    """

    def __init__(self, loop: EngineLoop, handle: RequestHandle, decode, stop: list[str], score_only: bool = False):
        """score_only: the client asked for no new tokens (max_tokens 0 with echo), only the
        prompt's scores; the engine makes one token (its max_tokens is at least 1), dropped here."""
        self.loop, self.handle, self.score_only = loop, handle, score_only
        n = handle.params.n
        self.texts = [CompletionText(decode, stop) for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_reasons: list[int | str | None] = [None] * n
        self.closed = False  # aborted on the way out (close)
        self.prompt_logprobs: list | None = None  # the prompt's scores, once they came (params.prompt_logprobs)

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def close(self) -> None:
        """Abort whatever of the request still runs in the engine; safe to call twice.

        `deltas()` does this itself when it is left early, but a generator that never
        started (a client that hung up before the first byte) runs no `finally`, so the
        route calls this too once the response is over, whatever happened.
        """
        if not self.done and not self.closed:
            self.closed = True
            self.loop.abort(self.handle)

    def usage(self) -> tuple[int, int]:
        return len(self.handle.prompt_token_ids), 0 if self.score_only else sum(len(t.token_ids) for t in self.texts)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        try:
            while not self.done:
                events = await self.handle.events.get()
                deltas: dict[int, Delta] = {}  # completion -> this step's delta, in order of first event
                for event in events:
                    if isinstance(event, Failed):
                        raise EngineError(event.message)
                    if self.finish_reasons[event.completion] is not None:
                        continue  # a completion cut by a stop string: the engine's extra token is dropped
                    delta = deltas.setdefault(event.completion, Delta(event.completion))
                    if isinstance(event, Token) and event.prompt_logprobs is not None:
                        self.prompt_logprobs = event.prompt_logprobs
                    if isinstance(event, Token) and self.score_only:
                        self._end(delta, "length", None)  # its one token (max_tokens 1) is not the client's
                    elif isinstance(event, Token):
                        self._take_token(event, delta)
                    elif isinstance(event, Finished):
                        self._finish(event, delta)
                yield list(deltas.values())
        finally:
            self.close()  # if the client went away or something failed: free the engine's slots now

    def _take_token(self, event: Token, delta: Delta) -> None:
        text = self.texts[event.completion]
        delta.text += text.add(event.token_id)
        delta.token_ids.append(event.token_id)
        if event.logprobs is not None:
            delta.logprobs.append(event.logprobs)
        if text.stopped_by is not None:  # a stop string: end it here, and in the engine
            self.loop.abort(self.handle, event.completion)
            self._end(delta, "stop", text.stopped_by)

    def _finish(self, event: Finished, delta: Delta) -> None:
        text = self.texts[event.completion]
        delta.text += text.finish()
        if text.stopped_by is not None:  # the last token's text completed a stop string
            self._end(delta, "stop", text.stopped_by)
            return
        last = text.token_ids[-1] if text.token_ids else None
        stop_token = last if event.reason == "stop" and last in self.handle.params.stop_token_ids else None
        self._end(delta, event.reason, stop_token)

    def _end(self, delta: Delta, reason: str, stop_reason) -> None:
        delta.finish_reason = self.finish_reasons[delta.completion] = reason
        delta.stop_reason = self.stop_reasons[delta.completion] = stop_reason
