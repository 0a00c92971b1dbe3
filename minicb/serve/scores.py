"""Logprobs in OpenAI's two shapes, from the engine's TokenLogprob entries (minicb/logprobs.py).

In this file you will learn what a client gets when it asks for logprobs, and
that both shapes are the same numbers written two ways:

- /v1/completions (`"logprobs": k`) gives parallel lists, one entry per token:
  `tokens` (each token's text), `token_logprobs`, `top_logprobs` (a dict of the
  k most likely tokens' texts to their logprobs) and `text_offset` (where each
  token's text starts in the choice's text). With `"echo": true` the prompt's
  tokens come first, and the very first token has null for both: nothing came
  before it to predict it. This is what evaluation harnesses read (lm-eval sums
  the continuation's token_logprobs, and checks that each was the top one).
- /v1/chat/completions (`"logprobs": true, "top_logprobs": k`) gives a list of
  objects, `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
  `bytes` matters because a byte-level BPE token may be half of a character:
  its text alone shows U+FFFD, its bytes are exact.

The numbers are the model's own distribution, before temperature, penalties or
top-k/top-p: what the model thinks of the text, not what the sampler did.
"""
from __future__ import annotations

from minicb.logprobs import TokenLogprob
from minicb.serve import protocol as p


class TokenTexts:
    """Each token's text and bytes, for the scores' `token` fields. A model without a tokenizer
    names a token by its id ("token_id:42"), as vLLM does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            self._bytes[token_id] = (f"token_id:{token_id}".encode() if self.tokenizer is None
                                     else self.tokenizer.token_bytes(token_id))
        return self._bytes[token_id]

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[TokenLogprob | None],
                        offset: int = 0) -> p.CompletionLogprobs:
    """The completions API's lists for these tokens; `offset`: where the first one's text starts."""
    tokens = [texts.text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return p.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else e.logprob for e in entries],
        top_logprobs=[None if e is None else {texts.text(t): lp for t, lp in e.top} for e in entries],
        text_offset=offsets)


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> p.ChatLogprobs:
    """The chat API's objects for these tokens."""
    def top(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.bytes(token_id))}

    return p.ChatLogprobs(content=[p.TokenLogprobEntry(**top(e.token_id, e.logprob),
                                                       top_logprobs=[p.TopLogprob(**top(t, lp)) for t, lp in e.top])
                                   for e in entries])


def merge_completion_logprobs(a: p.CompletionLogprobs | None, b: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """Two runs of the lists, one after the other (a choice's pieces gathered into one answer)."""
    if a is None:
        return b
    return p.CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                                top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)
