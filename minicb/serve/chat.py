"""A chat, as the model reads it: the messages written into one prompt by the chat template.

In this file you will learn what happens to a chat between the request and the
engine. A model reads one sequence of token ids; its chat template (a Jinja
program that ships with the tokenizer) writes the messages into it, in the
markup the model was trained on. HF's `apply_chat_template` runs the template
on a list of dicts shaped like OpenAI's messages: `role` and `content`, a
`name`, an assistant's `tool_calls` (each `{"id", "type": "function",
"function": {"name", "arguments"}}`, the arguments as a dict) and a tool
result's `tool_call_id`.

A template writes only what its authors wrote into it. SmolLM2-135M-Instruct's
writes `<|im_start|>{role}\\n{content}<|im_end|>` for each message and nothing
else: a tool result comes through as a `tool` turn, but an assistant's
`tool_calls` and any message's `name` vanish, and an assistant message whose
content is null makes it fail. A field the template leaves out would be
silently dropped, so before trusting a template with one we ask it: we render a
small probe chat and look for the probe's words in what came out
(`knows_tools`, `knows_names`). A template that writes them gets the messages
as they came. For one that does not, minicb writes those fields into the text
of the messages, in this format (Hermes', which many open models' templates
use, so a model trained on tool calls may know it):

- an assistant message's tool calls: after its content, one block per call,

      <tool_call>
      {"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  the arguments exactly as the client sent them when they are JSON (as
  OpenAI's are), else as a JSON string;
- tool results: a `user` turn, each result in its own block, the results of
  consecutive tool messages in one turn (every template knows a user turn, and
  those that insist on user and assistant taking turns accept it):

      <tool_response id="call_1">
      22 C and sunny
      </tool_response>

- a message's `name`: its content starts with `{name}: `, as in a transcript (an
  empty name says nothing, and nothing is written).

The tools a request offers (`tools`, unless tool_choice is "none") reach the
prompt too: a template that takes a tool list (HF's `tools=`; `knows_tool_list`
asks it) gets them there, and for one that does not, the system message gets
minicb/serve/tools.py's `tools_prompt`, the signatures inside `<tools></tools>`
and how to write a `<tool_call>` block, after its own text (a chat without a
system message gets one). SmolLM2's template takes none, so it gets the text.

So nothing a client sends is lost on the way to the model. Both
/v1/chat/completions and /tokenize (with messages) call `render`, so /tokenize
counts exactly the prompt a chat request would get:

    prompt_ids = render(server.tokenizer, req.messages)          # list[int]
    prompt_ids = render(tokenizer, messages, add_generation_prompt=False)
    prompt_ids = render(tokenizer, messages, tools=req.tools)    # protocol.Tools, into the prompt

The probes cost one more render of a tiny chat, and only for a chat that has
tool messages or names. The server is chapter 09's; tests in
tests/serve/test_server_chat_tools.py.
"""
from __future__ import annotations

import json

from minicb.serve.tools import tool_dicts, tools_prompt

# The probe chats' words: unlikely in any template, so finding one in the output means the template wrote it.
PROBE_FUNCTION = "minicb_probe_function"
PROBE_ARGUMENT = "minicb-probe-argument"
PROBE_RESULT = "minicb-probe-result"
PROBE_SPEAKER = "minicb-probe-speaker"


# ---- asking the template -------------------------------------------------------------------------


def writes(tokenizer, chat: list[dict], words: list[str], **template_args) -> bool:
    """Whether the template, run on `chat` (and `template_args`, e.g. tools=), writes every one of
    `words` into the prompt.

    We look at the prompt's text (its ids decoded with the special tokens kept), so
    this asks any tokenizer with `apply_chat_template` and `decode`, HF's or not.
    A template that fails on the probe (or a tokenizer that takes no such
    argument) does not know what the probe has.
    """
    try:
        text = tokenizer.decode(tokenizer.apply_chat_template(chat, **template_args), skip_special_tokens=False)
    except Exception:
        return False
    return all(word in text for word in words)


def knows_tools(tokenizer) -> bool:
    """Whether the chat template writes an assistant's tool call (name and arguments) and a tool's result."""
    call = {"id": "call_probe", "type": "function",
            "function": {"name": PROBE_FUNCTION, "arguments": {"place": PROBE_ARGUMENT}}}
    probe = [{"role": "user", "content": "What is the weather?"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_probe", "content": PROBE_RESULT}]
    return writes(tokenizer, probe, [PROBE_FUNCTION, PROBE_ARGUMENT, PROBE_RESULT])


def knows_tool_list(tokenizer) -> bool:
    """Whether the chat template writes the tools a request offers (HF's `tools=` argument)."""
    tool = {"type": "function", "function": {"name": PROBE_FUNCTION, "description": "Probe.",
                                             "parameters": {"type": "object", "properties": {}}}}
    return writes(tokenizer, [{"role": "user", "content": "Hello."}], [PROBE_FUNCTION], tools=[tool])


def knows_names(tokenizer) -> bool:
    """Whether the chat template writes a message's `name`."""
    return writes(tokenizer, [{"role": "user", "content": "Hello.", "name": PROBE_SPEAKER}], [PROBE_SPEAKER])


# ---- the messages as the template reads them ------------------------------------------------------


def arguments_value(arguments: str):
    """A tool call's arguments as HF's templates expect them: the JSON parsed (a dict, as OpenAI's
    arguments always are), or the string itself when it is not JSON (a template may still print it)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def call_as_text(call) -> str:
    """One tool call as a <tool_call> block (the module docstring's format)."""
    try:
        json.loads(call.function.arguments)
        arguments = call.function.arguments  # JSON already: the model reads it as the client sent it
    except ValueError:
        arguments = json.dumps(call.function.arguments, ensure_ascii=False)
    call_id, name = (json.dumps(text, ensure_ascii=False) for text in (call.id, call.function.name))
    return f'<tool_call>\n{{"id": {call_id}, "name": {name}, "arguments": {arguments}}}\n</tool_call>'


def as_turn(message, names_as_text: bool, tools_as_text: bool) -> dict:
    """One ChatMessage (minicb/serve/protocol.py) as the dict a template reads.

    names_as_text, tools_as_text: write that field into the content, because the
    template would not. A tool message written as text is still a "tool" turn
    here; `render` makes the user turn of it.
    """
    turn = {"role": message.role, "content": message.text()}  # text(): "" for a null content
    if message.name:
        if names_as_text:
            turn["content"] = f"{message.name}: {turn['content']}"
        else:
            turn["name"] = message.name
    if message.tool_calls:
        if tools_as_text:
            blocks = [call_as_text(call) for call in message.tool_calls]
            turn["content"] = "\n".join([turn["content"], *blocks] if turn["content"] else blocks)
        else:
            turn["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": arguments_value(call.function.arguments)}}
                                  for call in message.tool_calls]
    if message.role == "tool":
        if tools_as_text:
            turn["content"] = (f"<tool_response id={json.dumps(message.tool_call_id, ensure_ascii=False)}>\n"
                               f"{turn['content']}\n</tool_response>")
        else:
            turn["tool_call_id"] = message.tool_call_id
    return turn


def with_tools_in_system(chat: list[dict], tools: list) -> list[dict]:
    """`chat` (dicts) with tools_prompt(tools) at the end of its system message, or in a new one first."""
    text = tools_prompt(tools)
    if chat and chat[0]["role"] in ("system", "developer"):
        return [{**chat[0], "content": f"{chat[0]['content']}\n\n{text}" if chat[0]["content"] else text},
                *chat[1:]]
    return [{"role": "system", "content": text}, *chat]


def render(tokenizer, messages: list, add_generation_prompt: bool = True, tools: list | None = None) -> list[int]:
    """The prompt's token ids for a chat: `messages` (ChatMessages) through the chat template.

    add_generation_prompt: end with the assistant turn's header, as a chat request
    does (False: the chat as it stands, for /tokenize). tools: protocol.Tools the
    model may call (None or []: none). A template's own refusal (roles in an
    order it does not take, say) is raised as it came.
    """
    names_as_text = any(m.name for m in messages) and not knows_names(tokenizer)
    tools_as_text = any(m.tool_calls or m.role == "tool" for m in messages) and not knows_tools(tokenizer)
    chat: list[dict] = []
    after_result = False  # the last turn is tool results written as text: the next result joins it
    for message in messages:
        turn = as_turn(message, names_as_text, tools_as_text)
        is_result = tools_as_text and message.role == "tool"
        if is_result and after_result:
            chat[-1]["content"] += "\n" + turn["content"]
        else:
            chat.append({"role": "user", "content": turn["content"]} if is_result else turn)
        after_result = is_result
    if tools and knows_tool_list(tokenizer):
        return tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt,
                                             tools=tool_dicts(tools))
    if tools:
        chat = with_tools_in_system(chat, tools)
    return tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
