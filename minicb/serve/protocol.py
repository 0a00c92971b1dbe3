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
  of a UTF-16 surrogate pair ("\\ud800"), which no tokenizer can encode.
- Honour or refuse, never ignore. A field the API does not have is refused by
  name (extra="forbid"; app.py words the 400), and a field minicb has but cannot
  do at the value sent (`unsupported()`: logit_bias, a tool_choice naming no
  tool, ...) is refused too. Only OpenAI's platform bookkeeping (IGNORED_METADATA) is accepted and
  left alone. A client that sets a field it relies on must never get a 200
  that did not honour it.
- Sampling maps one to one onto SamplingParams (minicb/sampling.py):
  max_tokens, temperature, top_p, seed, n, the penalties, and vLLM's extensions
  top_k, min_p, min_tokens, repetition_penalty, stop_token_ids and ignore_eos.
  `stop` strings are the server's job (minicb/serve/text.py).
- Scores: `logprobs` (a count on /v1/completions, a flag with `top_logprobs` on
  chat) and completions' `echo` become SamplingParams.logprobs and
  prompt_logprobs; minicb/serve/scores.py writes them in OpenAI's shapes.
- `return_token_ids` (a vLLM extension) adds the generated token ids to every
  choice and chunk; a model without a tokenizer serves only those.
- Structured output (chapter 12) has five spellings, OpenAI's `response_format`
  and vLLM's `guided_json`, `guided_regex`, `guided_choice` and
  `structured_outputs`; `structured_sources()` reads each as the one
  StructuredOutput (minicb/sampling.py) the engine knows, and a request may use
  one of them. A chat's `tools` and `tool_choice` are read here and become a
  grammar in minicb/serve/tools.py.

Responses are built from these models too, so the JSON a client gets is exactly
what is declared here.
"""
from __future__ import annotations

import re
import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from minicb.sampling import StructuredOutput

# ---- requests -----------------------------------------------------------------------------


class _Strict(BaseModel):
    # extra="forbid": a field the API does not have is refused by name (a 400), never ignored.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


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
    continuous_usage_stats: bool = False  # vLLM extension: "usage" so far on every chunk too


# ---- structured output: the five ways to ask for it ----------------------------------------------


class JsonSchemaFormat(_Strict):
    """response_format's json_schema: OpenAI's {"name", "description", "schema", "strict"}.

    `strict` is accepted at either value and means the same here: minicb always
    samples under the schema's grammar, so every answer that ends (finish_reason
    "stop") is valid, strict or not. OpenAI's strict=false is "follow it if you
    can"; minicb's is the same guarantee as true, which a client can only gain by.
    """

    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # "schema" is pydantic's own method's name
    strict: bool | None = None


class ResponseFormat(_Strict):
    # "text" (no constraint), "json_object" or "json_schema"; any other type is refused by name in unsupported()
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: one of json (a schema), regex, choice or json_object: true."""

    json_: Union[dict, str, None] = Field(None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None  # vLLM's EBNF/Lark grammars: refused, minicb compiles regular languages only

    _texts = field_validator("regex", "choice")(lambda cls, value: _unicode(value))


class FunctionDefinition(_Strict):
    """A tool's function: a name the model may write, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict | None = None  # None: the function takes no arguments ({} is what the model writes)
    strict: bool | None = None  # as response_format's: a forced call always follows `parameters`

    _is_text = field_validator("name", "description")(lambda cls, text: _unicode(text))


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: the answer is a call of that tool."""

    type: Literal["function"]
    function: ToolChoiceFunction


def _function_tools_only(tools):
    """`tools` as they came, unless one is not a function tool: then a 400 naming its type (OpenAI also has
    "custom" tools, free text a model writes for a tool; minicb calls functions with JSON arguments only)."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise PydanticCustomError("unsupported_value", "tools[{i}] has type {kind}; minicb calls function "
                                      "tools only ({\"type\": \"function\", \"function\": {...}})",
                                      {"i": i, "kind": repr(kind)})
    return tools


def _choice_of_a_function(choice):
    """tool_choice as it came, unless it is an object that does not name a function ("allowed_tools",
    "custom"): then a 400 saying what minicb takes."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise PydanticCustomError("unsupported_value", "tool_choice type {kind} is not supported; minicb takes "
                                  "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                                  "{\"name\": ...}}", {"kind": repr(kind)})
    return choice


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # what OpenAI allows a function's name to be

# Fields accepted and not acted on, because they change nothing a client can see from minicb:
# OpenAI's bookkeeping for its own platform. Every other field of the API is honoured or refused.
IGNORED_METADATA = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None  # None: the one model this server serves
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension; 0 or -1 = no limit
    min_p: float = 0.0  # vLLM extension
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # a 64-bit integer, as in OpenAI's document
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = 0  # vLLM extension: EOS and stop tokens are masked until this many were generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM extension
    # vLLM extensions that minicb does only one way: accepted at that value, refused at the other.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output (structured_sources): OpenAI's field, then vLLM's.
    response_format: ResponseFormat | None = None
    guided_json: Union[dict, str, None] = None  # a JSON schema, or its JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Refused unless empty: minicb has no per-token bias (yet).
    logit_bias: dict[str, float] | None = None
    # OpenAI's platform bookkeeping (IGNORED_METADATA): accepted, and ignored as the docs say.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    _stop_is_text = field_validator("stop", "guided_regex", "guided_choice")(lambda cls, value: _unicode(value))
    _ints = field_validator("top_k", "seed", "n", "stop_token_ids", "min_tokens", mode="before")(
        lambda cls, v: _integral(v))

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to something minicb cannot do."""
        refused = []
        if self.logit_bias:
            refused.append(("logit_bias", "minicb has no per-token logit bias; leave it unset or {}"))
        if not self.skip_special_tokens:
            refused.append(("skip_special_tokens", "minicb's text always leaves special tokens out"))
        if self.include_stop_str_in_output:
            refused.append(("include_stop_str_in_output", "minicb cuts the text before a stop string, as OpenAI"))
        if self.stream_options is not None and not self.stream:
            refused.append(("stream_options", "stream_options needs \"stream\": true"))
        refused += self._unsupported_formats()
        sources = self.structured_sources()
        if len(sources) > 1:  # two grammars for one text: which one would hold? Neither is dropped quietly.
            (first, _), (second, _) = sources[:2]
            refused.append((second.split(".")[0], f"{first} and {second} both ask for structured output; a "
                                                  f"request may use one of response_format, guided_json, "
                                                  f"guided_regex, guided_choice and structured_outputs (one key)"))
        return refused

    def _unsupported_formats(self) -> list[tuple[str, str]]:
        """response_format and structured_outputs at a value minicb has no grammar for."""
        refused, form = [], self.response_format
        if form is not None:
            if form.type not in ("text", "json_object", "json_schema"):
                refused.append(("response_format", f"response_format type {form.type!r} is not supported; minicb "
                                                   f"takes \"text\", \"json_object\" or \"json_schema\""))
            elif form.type == "json_schema" and (form.json_schema is None or form.json_schema.schema_ is None):
                refused.append(("response_format", "response_format type \"json_schema\" needs json_schema: "
                                                   "{\"name\": ..., \"schema\": {...}}, the schema to follow"))
            elif form.type != "json_schema" and form.json_schema is not None:
                refused.append(("response_format", f"response_format.json_schema is for type \"json_schema\"; "
                                                   f"this one's type is {form.type!r}"))
        outputs = self.structured_outputs
        if outputs is not None:
            if outputs.grammar is not None:
                refused.append(("structured_outputs", "structured_outputs.grammar: minicb compiles regular "
                                                      "languages only (a regex, a JSON schema), not EBNF or Lark"))
            if outputs.json_object is False:
                refused.append(("structured_outputs", "structured_outputs.json_object: false asks for nothing; "
                                                      "leave it out"))
            if not [key for key, _ in self._vllm_outputs()] and outputs.grammar is None:
                refused.append(("structured_outputs", "structured_outputs names no grammar; give one of json, "
                                                      "regex, choice or json_object: true"))
        return refused

    def _vllm_outputs(self) -> list[tuple[str, StructuredOutput]]:
        outputs = self.structured_outputs
        if outputs is None:
            return []
        keys = [("json", StructuredOutput("json_schema", outputs.json_)) if outputs.json_ is not None else None,
                ("regex", StructuredOutput("regex", outputs.regex)) if outputs.regex is not None else None,
                ("choice", StructuredOutput("choice", outputs.choice)) if outputs.choice is not None else None,
                ("json_object", StructuredOutput("json_object")) if outputs.json_object else None]
        return [key for key in keys if key is not None]

    def structured_sources(self) -> list[tuple[str, StructuredOutput]]:
        """(field, StructuredOutput) for each field that asks for structured output; [] for free text.

        A field of structured_outputs is named with its key ("structured_outputs.regex";
        the 400's param is "structured_outputs"). More than one source is refused
        (unsupported). response_format "text" asks for nothing. The engine checks each grammar (a schema keyword or a regex
        construct it does not honour is a 400 naming it, under this field).
        """
        sources, form = [], self.response_format
        if form is not None and form.type == "json_object" and form.json_schema is None:
            sources.append(("response_format", StructuredOutput("json_object")))
        if form is not None and form.type == "json_schema" and form.json_schema and form.json_schema.schema_ is not None:
            sources.append(("response_format", StructuredOutput("json_schema", form.json_schema.schema_)))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice")):
            if getattr(self, name) is not None:
                sources.append((name, StructuredOutput(kind, getattr(self, name))))
        # structured_outputs with two keys is two sources, refused like any other two.
        sources += [(f"structured_outputs.{key}", output) for key, output in self._vllm_outputs()]
        return sources

    def score_count(self) -> int | None:
        """How many top tokens to list beside each generated token's logprob; None: no logprobs.
        Each endpoint spells it its own way."""
        return None


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt` is text or token ids, or a list of either: one request each."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 with echo scores the prompt only
    echo: bool = False  # the prompt (and its logprobs, with logprobs) before the completion
    logprobs: int | None = Field(None, ge=0, le=20)  # the top k beside each token's own logprob
    best_of: int | None = None
    suffix: str | None = None

    _prompt_is_text = field_validator("prompt")(lambda cls, prompt: _unicode(prompt))
    _more_ints = field_validator("prompt", "max_tokens", "best_of", "logprobs", mode="before")(
        lambda cls, v: _integral(v))

    def prompts(self) -> list:
        """The prompts, one per request: a string or a list of ids is one, a list of either is several."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt) or [self.prompt]  # [] is one (empty) prompt, for the engine to refuse

    def unsupported(self) -> list[tuple[str, str]]:
        refused = super().unsupported()
        if self.best_of not in (None, self.n):
            refused.append(("best_of", "minicb returns every completion it makes; best_of must be unset or n"))
        if self.suffix:
            refused.append(("suffix", "minicb does not fill in the middle"))
        return refused

    def score_count(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    _is_text = field_validator("text")(lambda cls, text: _unicode(text))


def _text_parts_only(content):
    """`content` as it came, unless a part of it is not text: then a 400 that says so, naming the
    part's type, rather than pydantic's complaint about a union ("Input should be a valid string")."""
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise PydanticCustomError("unsupported_content_part", "minicb serves a text-only model; content part "
                                      "type {kind} is not supported", {"kind": repr(kind)})
    return content


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON, as the model wrote it (OpenAI sends a string, not an object)

    _is_text = field_validator("name", "arguments")(lambda cls, text: _unicode(text))


class ToolCall(_Strict):
    """One of an assistant message's `tool_calls`, as a client sends it back with the tool's result."""

    id: str
    type: Literal["function"]
    function: FunctionCall

    _is_text = field_validator("id")(lambda cls, text: _unicode(text))


class ChatMessage(_Strict):
    """One message of a chat. Besides text, a chat with tools has an assistant message's
    `tool_calls` (its content may be null then) and a "tool" message with one call's result,
    `tool_call_id` naming the call. minicb/serve/chat.py writes every field into the prompt."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None  # who wrote it, among several of one role
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only, and there required

    _text_only = field_validator("content", mode="before")(lambda cls, content: _text_parts_only(content))
    _is_text = field_validator("content", "name", "tool_call_id")(lambda cls, value: _unicode(value))

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        """tool_calls and tool_call_id belong to one role each; a tool result has content."""
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls_not_allowed", "only an assistant message has tool_calls; this "
                                      "one's role is {role}", {"role": repr(self.role)})
        if self.role == "tool" and (self.tool_call_id is None or self.content is None):
            raise PydanticCustomError("tool_message_incomplete", "a tool message needs tool_call_id (the id of the "
                                      "call it answers) and content (the call's result)")
        if self.role != "tool" and self.tool_call_id is not None:
            raise PydanticCustomError("tool_call_id_not_allowed", "only a tool message has tool_call_id; this one's "
                                      "role is {role}", {"role": repr(self.role)})
        return self

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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with logprobs: the top k beside each token's own
    # Tools (minicb/serve/tools.py): the functions the model may call, and whether it must.
    tools: list[Tool] | None = None
    tool_choice: Union[str, NamedToolChoice, None] = None  # "none" | "auto" | "required" | a function; None: auto
    parallel_tool_calls: bool | None = None  # minicb writes one call per choice, which any value allows

    _more_ints = field_validator("max_completion_tokens", "max_tokens", "top_logprobs", mode="before")(
        lambda cls, v: _integral(v))
    _function_tools = field_validator("tools", mode="before")(lambda cls, tools: _function_tools_only(tools))
    _function_choice = field_validator("tool_choice", mode="before")(lambda cls, choice: _choice_of_a_function(choice))

    def tool_mode(self) -> str:
        """What the tools mean for the answer: "none" (text, the tools out of the prompt), "auto" (text or
        a call, the model's pick) or "required" (a call of one of `callable_tools()`)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "required"
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if self.tools else "none"

    def callable_tools(self) -> list[Tool]:
        """The tools the answer may call: all of them, or the one tool_choice names."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools or [] if t.function.name == self.tool_choice.function.name]
        return list(self.tools or []) if self.tool_mode() != "none" else []

    def unsupported(self) -> list[tuple[str, str]]:
        refused = super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            refused.append(("top_logprobs", "top_logprobs needs \"logprobs\": true"))
        return refused + self._unsupported_tools()

    def _unsupported_tools(self) -> list[tuple[str, str]]:
        refused, names = [], [tool.function.name for tool in self.tools or []]
        for i, name in enumerate(names):
            if not TOOL_NAME.fullmatch(name):  # OpenAI's rule; the call's text relies on it (no quote to escape)
                refused.append(("tools", f"tools[{i}].function.name is {name!r}; a function's name is 1 to 64 "
                                         f"letters, digits, _ and -"))
            elif name in names[:i]:
                refused.append(("tools", f"tools[{i}].function.name {name!r} names an earlier tool too; each "
                                         f"tool needs its own name, the one the model writes to call it"))
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            refused.append(("tool_choice", f"tool_choice={choice!r}; it must be \"none\", \"auto\", \"required\" "
                                           f"or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))
        elif choice not in (None, "none", "auto") and not self.tools:
            refused.append(("tool_choice", "tool_choice asks for a tool call, and the request has no tools; "
                                           "list them in \"tools\""))
        elif isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            refused.append(("tool_choice", f"tool_choice names the function {choice.function.name!r}, which is "
                                           f"not among the tools ({', '.join(map(repr, names))})"))
        sources = self.structured_sources()
        if self.tool_mode() == "required" and sources:
            # A forced call is the whole answer: a format for the same text would be a second grammar.
            forced, field = "required" if choice == "required" else f"naming {choice.function.name!r}", sources[0][0]
            refused.append((field.split(".")[0], f"tool_choice {forced} makes the whole answer a tool call, so "
                                                 f"{field} cannot shape it too; send one of the two (with "
                                                 f"tool_choice \"auto\" the answer is a call or text in the format)"))
        return refused

    def score_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ----------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # all n completions, each up to (and with) the token that ended it
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The completions API's (legacy) logprobs: parallel lists, one entry per token; with echo the prompt's
    tokens come first, and the very first has no logprob (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's bytes: a token may be part of a character


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None


def _without(data: dict, names: tuple[str, ...]) -> dict:
    """`data` less those of `names` whose value is None: a field OpenAI leaves out when it has nothing."""
    return {key: value for key, value in data.items() if not (key in names and value is None)}


class AssistantMessage(BaseModel):
    """The answer: text (content), or a tool call (tool_calls, and content null), as OpenAI writes them."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when there is none

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler):
        return _without(handler(self), ("tool_calls",))


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in the call's first delta only
    arguments: str | None = None  # the next piece of the arguments' JSON text

    @model_serializer(mode="wrap")
    def _only_what_is_new(self, handler):
        return _without(handler(self), ("name", "arguments"))


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first names it (id, type, function.name, arguments ""),
    the later ones add to its arguments. `index` is the call's place in the message's tool_calls."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _only_what_is_new(self, handler):
        return _without(handler(self), ("id", "type"))


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None  # left out of the JSON when the step added to no call

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler):
        return _without(handler(self), ("tool_calls",))


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
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
