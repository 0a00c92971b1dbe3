"""Tool calls over HTTP: the tools into the prompt, a call as a grammar, and the call back out of the text.

In this file you will learn how a server gives OpenAI's `tools` to a model that
only writes text. Three steps, each a plain function of the request:

1. **The model must see the tools.** A chat template that takes a tool list
   (HF's `tools=`) writes them its own way; for one that does not (SmolLM2's),
   minicb/serve/chat.py puts `tools_prompt` into the system message: the
   functions' signatures as JSON inside `<tools></tools>` and how to call one,
   in the Hermes format many open models are trained on (and the one chat.py
   already writes a history's calls in):

       <tool_call>
       {"name": "get_weather", "arguments": {"city": "Paris"}}
       </tool_call>

2. **The call is a grammar** (chapter 12: every token sampled under a mask).
   With tool_choice "required" or a named function, the whole answer *is* a
   call: `call_regex` is `{"name": ..., "arguments": ...}` with the name one of
   the tools' (or the named one) and the arguments valid JSON under that tool's
   `parameters` schema, in json.dumps' layout (minicb/structured/json_schema.py);
   the block's tags would cost ten tokens of max_tokens and say nothing, so a
   forced call goes without them. With "auto" the model picks: the grammar is a
   call in its `<tool_call>` block *or* any text that does not start with
   `<tool_call>` (`free_text_regex`), or, with a response_format beside the
   tools, a call or text in that format. So a call the model starts is always
   a whole, valid one, and text stays free. With "none" there is no grammar and
   the tools stay out of the prompt, so the model is not invited to call what
   it may not.

       tool_choice   the grammar                             the prompt
       none          none (or the response_format's)         no tools
       auto          <tool_call> block | free text (format)  the tools
       required      call of any tool                        the tools
       {"function"}  call of that tool                       the tools

3. **The call comes back out of the text.** `CallReader` reads a choice's text
   as it streams: while it could still be the start of `<tool_call>` nothing is
   sent; once it is a call, the name is held until it is whole, then the
   arguments go out piece by piece (OpenAI's delta shape: a first tool_calls
   delta with the id, the name and arguments "", then the arguments' pieces),
   each piece held back by the length of what closes the call (`}`, or
   `}\\n</tool_call>` in a block) so that nothing past the arguments is ever
   sent. A whole answer is the same reader fed once. A call ends with
   finish_reason "tool_calls".

A call's text fits `{"name": "<name>", "arguments": <JSON>}` exactly: the
grammar writes it, and a function's name is letters, digits, _ and - (OpenAI's
rule, checked in protocol.py), so a name never holds a quote to escape.

minicb makes one call per choice: `parallel_tool_calls` (true or false) is
honoured by that, since true allows several calls and never demands them. With
n > 1, each choice is its own call. What a 135M model does with "auto": it
rarely writes a call by itself, so ask for "required" or a named function when
a call must come. Chapter text: chapters/12-structured-output/README.md; tests in
tests/serve/test_server_structured.py.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from minicb.sampling import StructuredOutput
from minicb.scheduler import RequestRejected
from minicb.structured.backend import to_regex
from minicb.structured.json_schema import UnsupportedSchema, json_literal, literal, schema_to_regex

CALL_TAG = "<tool_call>"
OPENING = CALL_TAG + "\n"  # a call's block (tool_choice auto) starts so...
CLOSING = "}\n</tool_call>"  # ...and ends so: the call object's brace, then the tag
HEADER = re.compile(r'\{"name": "([a-zA-Z0-9_-]+)", "arguments": ')  # a call's start, up to its arguments


# ---- 1. the tools, as the model reads them --------------------------------------------------------


def tool_dicts(tools: list) -> list[dict]:
    """protocol.Tools as the dicts a chat template (or the Hermes text) shows: type, name, description,
    parameters. `strict` is for the server, not the model, and stays out."""
    shown = []
    for tool in tools:
        function = {"name": tool.function.name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = parameters_schema(tool)
        shown.append({"type": "function", "function": function})
    return shown


def tools_prompt(tools: list) -> str:
    """The system message's text that lists the tools and says how to call one (Hermes', as in Qwen2.5's
    template, for one call)."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tool_dicts(tools))
    return ("# Tools\n\nYou may call a function to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, return a json object with the function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def parameters_schema(tool) -> dict:
    """A tool's arguments' schema, always an object's: none given is a function of no arguments (`{}`),
    and one without a type is an object's (OpenAI's parameters describe the arguments object)."""
    parameters = tool.function.parameters
    if parameters is None:
        return {"type": "object", "properties": {}}
    return parameters if "type" in parameters else {"type": "object", **parameters}


# ---- 2. the call as a grammar ---------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _arguments_regex(schema_text: str) -> str:
    # Keyed by the schema's JSON text: a client sends the same tools with every turn of a chat.
    return schema_to_regex(json.loads(schema_text))


def call_regex(tools: list) -> str:
    """The regex of a call of one of `tools`: {"name": ..., "arguments": ...}, the arguments valid under
    that tool's parameters. (A forced call's whole text; auto puts it in a <tool_call> block.)

    Raises RequestRejected (param "tools") naming the tool and the schema keyword minicb
    cannot hold a model to, e.g. "tools[0] (get_weather): $.properties.days.multipleOf: ...".
    """
    calls = []
    for i, tool in enumerate(tools):
        schema = parameters_schema(tool)
        where = f"tools[{i}] ({tool.function.name}).function.parameters"
        if schema.get("type") != "object":
            raise RequestRejected(f"{where}: type={schema['type']!r}; a function's parameters describe its "
                                  f"arguments, an object (type \"object\")", "tools", "unsupported_value")
        try:
            arguments = _arguments_regex(json.dumps(schema))
        except UnsupportedSchema as e:  # the keyword and its path, as for a response_format's schema
            raise RequestRejected(f"{where}: {e}", "tools", "unsupported_value") from None
        calls.append(literal('{"name": ') + json_literal(tool.function.name) + literal(', "arguments": ')
                     + arguments + literal("}"))
    return "(?:" + "|".join(calls) + ")"


def free_text_regex(prefix: str = CALL_TAG) -> str:
    """Any text that does not start with `prefix`: a proper start of it, or a start of it and then a
    character that leaves it. (A regex has no "not"; for one fixed prefix it is this finite list.)

    >>> free_text_regex("ab")
    '(?:a|[^a][\\\\s\\\\S]*|a[^b][\\\\s\\\\S]*)?'
    """
    starts = [literal(prefix[:i]) for i in range(1, len(prefix))]  # the empty text: the "?" at the end
    leaves = [literal(prefix[:i]) + "[^" + literal(prefix[i]) + r"][\s\S]*" for i in range(len(prefix))]
    return "(?:" + "|".join(starts + leaves) + ")?"


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request's tools mean for its answer: the tools it may call, and whether it must.

    forced: tool_choice "required" or a named function (tools is then that one tool).
    """

    tools: list
    forced: bool

    def grammar(self, answer: tuple[str, StructuredOutput] | None = None) -> StructuredOutput:
        """The answer's grammar: the call, or (auto) the call or free text, or the call or `answer`
        ((field, StructuredOutput): a response_format or guided_* beside the tools, auto only)."""
        call = call_regex(self.tools)
        if self.forced:
            return StructuredOutput("regex", call)
        block = literal(OPENING) + call + literal(CLOSING[1:])  # CLOSING's "}" ends the call itself
        other = free_text_regex() if answer is None else format_regex(*answer)
        return StructuredOutput("regex", f"(?:{block}|{other})")

    def reader(self) -> CallReader:
        """A new reader of one choice's text: a forced call is the bare call, auto's is in its block."""
        return CallReader(forced=self.forced)


def format_regex(field_name: str, structured: StructuredOutput) -> str:
    """minicb's regex of a structured output, for a grammar that puts it beside a call; a construct it
    does not honour is a 400 under the field that asked for it (as the engine's own check words it)."""
    from minicb.structured.regex import parse
    try:
        regex = to_regex(structured.kind, structured.spec)
        parse(regex)
    except ValueError as e:
        raise RequestRejected(str(e), field_name.split(".")[0], "unsupported_value") from None
    return regex


def tool_calling(req) -> ToolCalling | None:
    """A ChatCompletionRequest's ToolCalling; None when no tool may be called (no tools, or "none")."""
    mode = req.tool_mode()
    if mode == "none":
        return None
    return ToolCalling(req.callable_tools(), forced=mode == "required")


# ---- 3. the call, read back out of the text -------------------------------------------------------


@dataclass
class Read:
    """What one piece of a choice's text adds to its answer."""

    content: str = ""  # text for the message's content
    opened: bool = False  # the call's name became whole with this piece: send its first delta
    arguments: str = ""  # the next piece of the call's arguments
    finish_reason: str | None = None  # the engine's, "tool_calls" for a whole call


@dataclass
class CallReader:
    """One choice's text, read as it comes (`read`), as a tool call or as content.

    forced: the text is a bare call (tool_choice required or named); else (auto) a
    call is a text that starts with `<tool_call>`, which the grammar lets no free
    text do. Invariants: everything sent as content or arguments is final (nothing
    is ever taken back); `arguments` is what was sent of the call's arguments so
    far, and at the end all of them. A text cut before the call's name is whole
    (max_tokens) is given as content.
    """

    forced: bool = False
    text: str = ""
    kind: str | None = None  # None (undecided), "text" or "call"
    name: str | None = None
    call_id: str | None = None
    arguments: str = ""
    complete: bool = False  # the call was written to its end
    _sent: int = 0  # characters of text sent as content
    _arguments_at: int = 0  # where the arguments start in text, once the name is whole

    @property
    def opening(self) -> str:
        return "" if self.forced else OPENING

    @property
    def closing(self) -> str:
        return "}" if self.forced else CLOSING

    def read(self, text: str, finish_reason: str | None = None) -> Read:
        """The next piece of the text; finish_reason set on the last (the engine's: "stop", "length", ...)."""
        self.text += text
        ended = finish_reason is not None
        if self.kind is None:
            tag = "" if self.forced else CALL_TAG
            if self.text.startswith(tag):
                self.kind = "call"
            elif not tag.startswith(self.text) or ended:  # it can no longer be a call
                self.kind = "text"
        out = Read(finish_reason=finish_reason)
        if self.kind == "call":
            self._read_call(out, ended)
            if ended and self.name is None:  # cut before the name was whole: what there is, as text
                self.kind = "text"
        if self.kind == "text":
            out.content, self._sent = self.text[self._sent:], len(self.text)
        if ended and self.kind == "call":
            self.complete = finish_reason == "stop" and self.text.endswith(self.closing)
            out.finish_reason = "tool_calls" if self.complete else finish_reason
        return out

    def _read_call(self, out: Read, ended: bool) -> None:
        if self.name is None:
            header = HEADER.match(self.text, len(self.opening))
            if header is None:
                return  # the name is not whole yet
            self.name, self._arguments_at = header[1], header.end()
            self.call_id, out.opened = f"call_{uuid.uuid4().hex[:24]}", True
        written, closing = self.text[self._arguments_at:], self.closing
        if ended:
            final = written[:-len(closing)] if written.endswith(closing) else _cut_closing(written, closing)
        else:  # the last len(closing) characters may be the closing: hold them back
            final = written[:max(len(written) - len(closing), 0)]
        if len(final) > len(self.arguments):
            out.arguments, self.arguments = final[len(self.arguments):], final


def _cut_closing(written: str, closing: str) -> str:
    """A call cut short (max_tokens): its arguments less a start of the closing after them, if what
    remains is whole JSON; else all of it, as far as it got."""
    for k in range(min(len(closing), len(written)) - 1, 0, -1):
        if closing.startswith(written[-k:]):
            try:
                json.loads(written[:-k])
                return written[:-k]
            except ValueError:
                pass
    return written
