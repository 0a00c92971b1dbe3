"""Chats with tools, names and content parts: what reaches the prompt (minicb/serve/chat.py) and what is refused.

A tool call, a tool's result and a message's name must reach the prompt's token
ids: through the chat template when it writes them, else as the text format of
chat.py's docstring. The oracles: the template itself, run by HF on the dicts it
expects (for a template that knows tools), and the exact prompt SmolLM2's
template makes (for one that does not). Over HTTP, on the tiny model: a chat
request's prompt is /tokenize's, and its greedy answer is /v1/completions' on
those ids. A content part that is not text gets a 400 that says so.
"""
from __future__ import annotations

import copy

import httpx
import pytest

from minicb.serve import chat
from minicb.serve import protocol as p
from minicb.tokenizer import Tokenizer, load_tokenizer

from serve_support import ByteTokenizer, tiny_server

WEATHER = [
    {"role": "user", "content": "What is the weather in Paris and in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "4 C, rain"}]},
]

# SmolLM2's template writes no tool calls: the prompt it gets, in chat.py's text format.
SMOL_WEATHER_PROMPT = """<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
<|im_start|>user
What is the weather in Paris and in Oslo?<|im_end|>
<|im_start|>assistant
<tool_call>
{"id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"id": "call_2", "name": "get_weather", "arguments": {"city": "Oslo"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response id="call_1">
22 C and sunny
</tool_response>
<tool_response id="call_2">
4 C, rain
</tool_response><|im_end|>
<|im_start|>assistant
"""

# A ChatML template that knows tools and names (written for this test), for the template's own path.
TOOL_TEMPLATE = (  # HF's Jinja trims the newline after a tag, hence {{ nl }}
    "{%- set nl = '\\n' -%}"
    "{%- for message in messages -%}"
    "<|im_start|>{{ message.role }}{% if message.name %} ({{ message.name }}){% endif %}{{ nl }}"
    "{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}{{ nl }}"
    "<call {{ call.id }}>{{ call.function.name }}{{ call.function.arguments | tojson }}</call>"
    "{%- endfor %}"
    "{%- if message.tool_call_id %} [for {{ message.tool_call_id }}]{% endif %}<|im_end|>{{ nl }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif -%}")


def messages(raw: list[dict]) -> list[p.ChatMessage]:
    return [p.ChatMessage.model_validate(m) for m in raw]


@pytest.fixture(scope="module")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def tool_tokenizer(smol_tokenizer) -> Tokenizer:
    """SmolLM2's tokenizer with TOOL_TEMPLATE as its chat template."""
    hf = copy.deepcopy(smol_tokenizer.hf)
    hf.chat_template = TOOL_TEMPLATE
    return Tokenizer(hf)


@pytest.fixture(scope="module")
def tiny():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        yield client


# ---- what reaches the prompt -------------------------------------------------------------------------


def test_smollm2s_template_gets_tool_calls_and_results_as_text(smol_tokenizer):
    assert not chat.knows_tools(smol_tokenizer) and not chat.knows_names(smol_tokenizer)
    ids = chat.render(smol_tokenizer, messages(WEATHER))
    text = smol_tokenizer.decode(ids, skip_special_tokens=False)
    for word in ('"name": "get_weather"', '{"city": "Paris"}', '{"city": "Oslo"}', "22 C and sunny", "4 C, rain"):
        assert word in text, f"{word!r} did not reach the prompt:\n{text}"
    assert text == SMOL_WEATHER_PROMPT
    assert ids == smol_tokenizer.encode(SMOL_WEATHER_PROMPT), "the prompt is the template's ids of that text"


def test_a_template_that_knows_tools_gets_the_fields_as_hf_expects_them(tool_tokenizer):
    assert chat.knows_tools(tool_tokenizer) and chat.knows_names(tool_tokenizer)
    raw = [{"role": "system", "content": "Use tools.", "name": "setup"}, *WEATHER]
    # HF's form: arguments as a dict, a null content as "", content parts joined.
    expected = [{"role": "system", "content": "Use tools.", "name": "setup"}, WEATHER[0],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "4 C, rain"}]
    assert chat.render(tool_tokenizer, messages(raw)) == tool_tokenizer.apply_chat_template(expected)
    text = tool_tokenizer.decode(chat.render(tool_tokenizer, messages(raw)), skip_special_tokens=False)
    assert '<call call_2>get_weather{"city": "Oslo"}</call>' in text and "4 C, rain [for call_2]" in text, text
    assert "<|im_start|>system (setup)\n" in text and "<tool_call>" not in text, text


def test_names_and_odd_arguments_are_written_into_the_text(smol_tokenizer, tool_tokenizer):
    raw = [{"role": "user", "content": "Hi, I am Ann.", "name": "ann"},
           {"role": "assistant", "content": "Calling.", "tool_calls": [
               {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "not json"}}]},
           {"role": "tool", "tool_call_id": "c", "content": "found", "name": "lookup"}]
    text = smol_tokenizer.decode(chat.render(smol_tokenizer, messages(raw)), skip_special_tokens=False)
    assert "<|im_start|>user\nann: Hi, I am Ann.<|im_end|>" in text, text
    assert ('Calling.\n<tool_call>\n{"id": "c", "name": "lookup", "arguments": "not json"}\n</tool_call>'
            in text), text
    assert '<tool_response id="c">\nlookup: found\n</tool_response>' in text, text
    # A template that writes names gets them as a field, and the text stays the client's.
    text = tool_tokenizer.decode(chat.render(tool_tokenizer, messages(raw)), skip_special_tokens=False)
    assert "<|im_start|>user (ann)\nHi, I am Ann." in text and '<call c>lookup"not json"</call>' in text, text


def test_add_generation_prompt_false_ends_with_the_last_message(smol_tokenizer):
    ids = chat.render(smol_tokenizer, messages(WEATHER), add_generation_prompt=False)
    assert smol_tokenizer.decode(ids, skip_special_tokens=False) + "<|im_start|>assistant\n" == SMOL_WEATHER_PROMPT


# ---- over HTTP ---------------------------------------------------------------------------------------------


def test_a_chat_with_tools_is_served_with_the_prompt_tokenize_gives(tiny):
    body = {"messages": WEATHER, "max_completion_tokens": 12, "temperature": 0, "ignore_eos": True}
    answer = tiny.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    prompt = tiny.post("/tokenize", json={"messages": WEATHER}).json()["tokens"]
    text = ByteTokenizer().decode(prompt)
    assert '"name": "get_weather", "arguments": {"city": "Oslo"}' in text and "4 C, rain" in text, text
    assert answer.json()["usage"]["prompt_tokens"] == len(prompt)
    # The chat's answer is the completion of exactly those ids.
    same = tiny.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True}).json()
    assert answer.json()["choices"][0]["message"]["content"] == same["choices"][0]["text"]


NOT_TEXT = {
    "image_url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    "video_url": {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
}


@pytest.mark.parametrize("kind", sorted(NOT_TEXT))
def test_a_content_part_that_is_not_text_is_refused_by_its_type(tiny, kind):
    content = [{"type": "text", "text": "What is in this?"}, NOT_TEXT[kind]]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                 "max_tokens": 2}),
                       ("/tokenize", {"messages": [{"role": "user", "content": content}]})):
        response = tiny.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        expected = f"minicb serves a text-only model; content part type {kind!r} is not supported"
        assert expected in error["message"], error
        assert (error["param"], error["code"]) == ("messages", "unsupported_content_part"), error


BAD_MESSAGES = {
    "a tool message without tool_call_id": [{"role": "tool", "content": "22 C"}],
    "a tool message without content": [{"role": "tool", "tool_call_id": "c"}],
    "tool_calls on a user message": [{"role": "user", "content": "hi", "tool_calls": []}],
    "tool_call_id on an assistant message": [{"role": "assistant", "content": "hi", "tool_call_id": "c"}],
    "a call that is not a function": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]}],
    "arguments as an object, not a JSON string": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}],
    "a call without its function's name": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}],
}


def test_malformed_tool_messages_are_refused_and_name_messages(tiny):
    for name, chat_messages in BAD_MESSAGES.items():
        response = tiny.post("/v1/chat/completions", json={"messages": chat_messages, "max_tokens": 2})
        assert response.status_code == 400, f"{name}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["param"] == "messages" and error["message"], f"{name}: {error}"
    assert tiny.get("/health").json()["status"] == "ok"
