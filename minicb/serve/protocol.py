"""The wire format: OpenAI's completions and chat completions, as pydantic models.

In this file you will learn what an OpenAI-compatible server promises its
clients, field by field, and where minicb's engine meets it:

- A request is checked *twice* before it reaches the engine. Here, its shape:
  every field has a type, and a wrong one ("max_tokens": "many", a body that is
  not JSON) becomes a 400 with OpenAI's error shape (minicb/serve/app.py turns
  pydantic's error into it). Then, in the routes, its meaning: SamplingParams'
  own ranges, the prompt against the context, the request against the KV pool.
- The models are *strict*: "5" is not an integer and 1 is not a boolean, as in
  OpenAI's API. But 2.0 is the integer 2: JSON has one kind of number, and
  "integer" in the OpenAPI document (JSON Schema's word) means one with no
  fractional part. NaN and Infinity are not numbers either (JSON has neither, but
  Python's parser reads them), a seed is a 64-bit integer as OpenAI's document
  says, and what the model reads is Unicode text: a JSON escape can spell half
  of a UTF-16 surrogate pair ("\\ud800"), which no tokenizer can encode. A
  client that sends a field the API does not have is not refused (extra fields
  are ignored), but the fields below that minicb cannot honour (logprobs, echo,
  penalties, ...) are refused when set, rather than silently ignored.
- Sampling maps one to one onto SamplingParams (minicb/sampling.py):
  max_tokens, temperature, top_p, seed, n, and two of vLLM's extensions, top_k
  and stop_token_ids (plus ignore_eos, which benchmarks use for fixed lengths).
  `stop` strings are the server's job (minicb/serve/text.py).
- `return_token_ids` (a vLLM extension) adds the generated token ids to every
  choice and chunk; a model without a tokenizer serves only those.

Responses are built from these models too, so the JSON a client gets is exactly
what is declared here.
"""
from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

# ---- requests -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _unicode(value):
    """`value` (a string, a list of them, or anything else, unchecked) if its strings are Unicode text.

    A lone surrogate ("\\ud800" in JSON) is refused here, as a 400 naming the
    field, rather than in the tokenizer's encode, as a 500.
    """
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for text in (t for t in texts if isinstance(t, str)):  # a list of TextPart is checked part by part
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PydanticCustomError("lone_surrogate", "a lone UTF-16 surrogate {char} at {index} is not Unicode "
                                      "text", {"char": repr(text[e.start]), "index": e.start}) from None
    return value


def _integral(value):
    """`value` with each float that has no fractional part (2.0, and in a list too) made an int.

    JSON Schema's "integer" is any number with a zero fractional part, so a
    client may send 2.0 where the document says integer; 2.5, "2" and true are
    left for the strict int to refuse.
    """
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with "usage" and no choices


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None  # None: the one model this server serves
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension; 0 or -1 = no limit
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # a 64-bit integer, as in OpenAI's document
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM extension
    user: str | None = None  # accepted, unused
    # OpenAI fields minicb does not implement: refused unless left at their "off" value.
    logprobs: Union[bool, int, None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    _stop_is_text = field_validator("stop")(lambda cls, stop: _unicode(stop))
    _ints = field_validator("top_k", "seed", "n", "stop_token_ids", mode="before")(lambda cls, v: _integral(v))

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> list[str]:
        """Names of fields set to something minicb cannot do."""
        off = {"logprobs": (None, False, 0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
               "logit_bias": (None, {})}
        return [name for name, allowed in off.items() if getattr(self, name) not in allowed]


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt` is text, or token ids (as vLLM accepts)."""

    prompt: Union[str, list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _prompt_is_text = field_validator("prompt")(lambda cls, prompt: _unicode(prompt))
    _more_ints = field_validator("prompt", "max_tokens", "best_of", mode="before")(lambda cls, v: _integral(v))

    def unsupported(self) -> list[str]:
        extra = [name for name, ok in (("echo", not self.echo), ("best_of", self.best_of in (None, self.n)),
                                       ("suffix", not self.suffix)) if not ok]
        return super().unsupported() + extra


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    _is_text = field_validator("text")(lambda cls, text: _unicode(text))


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None

    _is_text = field_validator("content")(lambda cls, content: _unicode(content))

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. The messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the current name
    max_tokens: int | None = None  # the older name; both mean new tokens at most
    # None for both: as many as the context and the KV pool leave after the prompt.

    _more_ints = field_validator("max_completion_tokens", "max_tokens", mode="before")(lambda cls, v: _integral(v))


# ---- responses ----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # all n completions, each up to (and with) the token that ended it
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None  # "stop" | "length" | "abort"; None while a stream goes on
    stop_reason: Union[int, str, None] = None  # vLLM: the stop string or stop token id, None for EOS
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # always set on a whole answer; streamed chunks carry it only at the end


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None
    stop_reason: Union[int, str, None] = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minicb"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str  # "invalid_request_error", "server_overloaded", ...
    param: str | None = None  # the request field at fault
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
