"""Structured output and tool calls over HTTP: every answer valid, every field honoured or refused.

The oracles: jsonschema (every JSON answer parses and validates against the
schema it was asked for, sampled at temperature 1 under several seeds), Python's
`re.fullmatch` for guided_regex, the list for guided_choice, and a tool's own
`parameters` schema for each call's arguments. A streamed call must reassemble
into the call the same greedy request gets whole. The official `openai` client
and LangChain's ChatOpenAI drive the server as they would drive OpenAI, with
their own request shapes (pydantic models, `parse`, `with_structured_output`,
`bind_tools`). The model is SmolLM2 (the tiny random one writes no JSON within
a few tokens); refusals, which never reach the engine, use the tiny model.
What tool_choice "auto" does is the model's pick, so the reader that turns a
`<tool_call>` block into tool_calls is tested on its own, on texts written here.
"""
from __future__ import annotations

import functools
import json
import operator
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from minicb.llm import LLM
from minicb.serve import chat, tools
from minicb.serve import protocol as p
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread

from serve_support import tiny_server

NAME = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person named Ada who is 36, as JSON."}]
# Small bounds keep every answer within max_tokens, so an answer that did not end is a failure too.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
COLOUR = {"type": "string", "enum": ["red", "green", "blue"]}
ORDER = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 12},
    "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"item": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["item", "qty"]}},
    "paid": {"type": "boolean"}}, "required": ["title", "lines"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm2):
    model, tokenizer, _ = smollm2
    app = create_app(LLM.from_model(model, tokenizer, max_num_seqs=16), NAME)
    with serve_in_thread(app, shutdown_timeout=2.0) as url:
        yield url


@pytest.fixture(scope="module")
def tiny():
    with tiny_server() as (url, _), httpx.Client(base_url=url, timeout=30) as client:
        yield client


def post_all(url: str, requests: list[tuple[str, dict]]) -> list[dict]:
    """Each (path, body) POSTed at once (the engine batches them); their JSON answers, in order."""
    def post(request):
        response = httpx.post(url + request[0], json={"model": NAME, **request[1]}, timeout=120)
        assert response.status_code == 200, f"{request}: {response.status_code} {response.text}"
        return response.json()

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(post, requests))


def chat_body(schema_field: dict, max_tokens: int = 60, **more) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": ASK, "max_tokens": max_tokens, **schema_field, **more}


def json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                       "strict": True}}}


def check_call(call: dict, names=tuple(PARAMETERS)) -> dict:
    """A tool call's arguments, once its shape, name and arguments are right."""
    assert call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]+", call["id"]), call
    assert call["function"]["name"] in names, call
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, PARAMETERS[call["function"]["name"]])
    return arguments


# ---- every answer valid ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_formats_give_valid_answers_at_temperature_1(smol):
    seeds = (1, 2)
    cases = ([(json_schema(s), s) for s in (PERSON, COLOUR, ORDER)]
             + [({"guided_json": PERSON}, PERSON), ({"structured_outputs": {"json": ORDER}}, ORDER)])
    requests = [chat_body(field, 80, temperature=1.0, seed=seed) for field, _ in cases for seed in seeds]
    # Any JSON object has no bound on its length, and SmolLM2 at temperature 1 may ramble to max_tokens:
    # every json_object answer that ends must parse, and max_tokens is all that may end the others.
    # Seeds 1-24 ended 15 times within 120 tokens (5 within 60), so eight seeds all rambling, which
    # would leave nothing to parse, has a chance of about 4 in 10,000 on a CPU whose sums differ.
    objects = [chat_body({"response_format": {"type": "json_object"}}, 120, temperature=1.0, seed=seed)
               for seed in range(1, 9)]
    regex, choices = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}", ["yes", "no", "maybe"]
    requests += [chat_body({"guided_regex": regex}, temperature=1.0, seed=3),
                 chat_body({"guided_choice": choices}, temperature=1.0, seed=4),
                 chat_body({"structured_outputs": {"regex": regex}}, temperature=1.0, seed=5),
                 ("/v1/completions", {"prompt": "A person as JSON:", "max_tokens": 60, "temperature": 1.0,
                                      "seed": 6, "response_format": json_schema(PERSON)["response_format"]}),
                 ("/v1/completions", {"prompt": "Is the sky blue?", "max_tokens": 8, "guided_choice": choices})]
    answers = post_all(smol, requests + objects)
    answers, object_answers = answers[:len(requests)], answers[len(requests):]
    schemas = [schema for _, schema in cases for _ in seeds]
    for answer, schema in zip(answers, schemas):
        text = answer["choices"][0]["message"]["content"]
        assert answer["choices"][0]["finish_reason"] == "stop", (text, answer)
        jsonschema.validate(json.loads(text), schema)
    rest = [a["choices"][0] for a in answers[len(schemas):]]
    assert re.fullmatch(regex, rest[0]["message"]["content"]) and re.fullmatch(regex, rest[2]["message"]["content"])
    assert rest[1]["message"]["content"] in choices and rest[4]["text"] in choices, rest
    jsonschema.validate(json.loads(rest[3]["text"]), PERSON)
    ended = [a for a in object_answers if a["choices"][0]["finish_reason"] == "stop"]
    assert ended and all(a["usage"]["completion_tokens"] == 120 for a in object_answers if a not in ended)
    for answer in ended:
        assert isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict), answer


# ---- refused, by name -----------------------------------------------------------------------------------

REFUSED = {  # what -> (body fields, the param named, words the message must hold)
    "a schema keyword minicb cannot honour": (
        json_schema({"type": "object", "properties": {"age": {"type": "integer", "multipleOf": 3}}}),
        "response_format", "$.properties.age.multipleOf"),
    "the same in guided_json": ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json",
                                "$.uniqueItems"),
    "a regex construct": ({"guided_regex": "(?=a)b"}, "guided_regex", "a lookahead"),
    "two structured fields": ({"guided_regex": "a+", **json_schema(PERSON)}, "guided_regex",
                              "response_format and guided_regex"),
    "two keys of structured_outputs": ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
                                       "structured_outputs", "structured_outputs.regex and structured_outputs.choice"),
    "an EBNF grammar": ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs", "EBNF"),
    "a response_format type minicb has no grammar for": ({"response_format": {"type": "grammar"}},
                                                          "response_format", "'grammar'"),
    "json_schema without its schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                       "response_format", "the schema to follow"),
    "a tool_choice naming no tool": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, "tool_choice", "'get_time'"),
    "a tool that is not a function": ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools",
                                      "type 'custom'"),
    "a tool_choice of allowed_tools": ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice",
                                       "'allowed_tools'"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice", "no tools"),
    "an unknown tool_choice word": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'always'"),
    "a forced call and a format": ({"tools": TOOLS, "tool_choice": "required", **json_schema(PERSON)},
                                   "response_format", "tool_choice required"),
    "a tool's schema keyword": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"not": {"type": "null"}}}}}}], "tool_choice": "required"}, "tools",
                                "tools[0] (f).function.parameters: $.properties.n.not"),
    "two tools of one name": ({"tools": [ADD, ADD]}, "tools", "names an earlier tool"),
    "a name OpenAI does not allow": ({"tools": [{"type": "function", "function": {"name": "say hi"}}]}, "tools",
                                     "'say hi'"),
    "structured output with ignore_eos": ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "ignore_eos"),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_what_minicb_cannot_do_is_refused_by_name(tiny, what):
    fields, param, words = REFUSED[what]
    response = tiny.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2, **fields})
    assert response.status_code == 400, f"{what}: {response.status_code} {response.text}"
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], f"{what}: {error}"
    assert error["code"] in ("unsupported_value", "invalid_value", None), f"{what}: {error}"


def test_completions_refuse_tools_and_two_formats(tiny):
    body = {"prompt": "hi", "max_tokens": 2}
    error = tiny.post("/v1/completions", json={**body, "tools": TOOLS}).json()["error"]
    assert (error["param"], error["code"]) == ("tools", "unsupported_field"), error  # completions have no tools
    error = tiny.post("/v1/completions", json={**body, "guided_json": PERSON, "guided_choice": ["a"]}).json()["error"]
    assert error["param"] == "guided_choice" and "guided_json and guided_choice" in error["message"], error


# ---- tool calls -------------------------------------------------------------------------------------------


def calls_of(answer: dict) -> list[list[dict]]:
    """Each choice's tool_calls, once the choice is a whole call: content null, finish_reason tool_calls."""
    out = []
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        assert len(choice["message"]["tool_calls"]) == 1, choice  # one call per choice, whatever parallel_* says
        out.append(choice["message"]["tool_calls"])
    return out


def streamed_choices(url: str, body: dict) -> tuple[list[dict], list[dict]]:
    """The deltas of a streamed chat request (choice 0) and its last chunk's choices."""
    deltas, last = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json={"model": NAME, **body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                deltas += [c["delta"] for c in chunk["choices"]]
                last = chunk["choices"] or last
    return deltas, last


@pytest.mark.slow
def test_required_and_named_tool_calls_are_valid_and_stream_as_they_answer(smol):
    forced = {"messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 60}
    named = {"type": "function", "function": {"name": "add"}}
    greedy = {**forced, "tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(streamed_choices, smol, greedy)
        answers = post_all(smol, [("/v1/chat/completions", {**forced, "tool_choice": "required", "temperature": 1.0,
                                                            "seed": seed}) for seed in (1, 2)]
                           + [("/v1/chat/completions", {**forced, "tool_choice": named, "temperature": 1.0, "n": 2,
                                                        "seed": 3}),
                              ("/v1/chat/completions", greedy)])
        deltas, last = streamed.result()
    for answer in answers[:2]:
        check_call(calls_of(answer)[0][0])
    adds = [calls[0] for calls in calls_of(answers[2])]
    assert len({call["id"] for call in adds}) == 2, "each choice is its own call"
    for call in adds:
        check_call(call, names=("add",))
    [[whole]] = calls_of(answers[3])
    check_call(whole)
    # The stream: the role (content null: a forced call has none), the call's first delta, its arguments.
    assert deltas[0] == {"role": "assistant", "content": None}, deltas[0]
    pieces = [d["tool_calls"] for d in deltas[1:] if d.get("tool_calls")]
    first = pieces[0][0]
    assert (first["index"], first["type"], first["function"]["arguments"]) == (0, "function", ""), first
    assert all(set(piece[0]) == {"index", "function"} and set(piece[0]["function"]) == {"arguments"}
               for piece in pieces[1:]), pieces
    assert first["function"]["name"] == whole["function"]["name"]
    assert "".join(piece[0]["function"]["arguments"] for piece in pieces) == whole["function"]["arguments"]
    assert last[0]["finish_reason"] == "tool_calls" and not any(d.get("content") for d in deltas)


@pytest.mark.slow
def test_auto_and_none_as_documented(smol):
    prompt = httpx.post(smol + "/tokenize", json={"messages": WEATHER_ASK}).json()["count"]
    auto, none = post_all(smol, [("/v1/chat/completions", {"messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 40,
                                                           "temperature": 0}),
                                 ("/v1/chat/completions", {"messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 40,
                                                           "temperature": 0, "tool_choice": "none"})])
    # none: the tools stay out of the prompt, and the answer is text.
    assert none["usage"]["prompt_tokens"] == prompt, "tool_choice none leaves the tools out of the prompt"
    assert "tool_calls" not in none["choices"][0]["message"] and none["choices"][0]["finish_reason"] != "tool_calls"
    # auto: the tools are in the prompt; the model answers in text or with a whole, valid call.
    assert auto["usage"]["prompt_tokens"] > prompt + 100, "the tools are in the prompt"
    choice = auto["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        check_call(choice["message"]["tool_calls"][0])
    else:
        assert isinstance(choice["message"]["content"], str) and "tool_calls" not in choice["message"], choice


BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def read_in_pieces(reader: tools.CallReader, text: str, size: int, finish_reason: str) -> list[tools.Read]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    return [reader.read(piece, finish_reason if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_the_reader_turns_a_hermes_block_into_a_call_however_it_streams(size):
    reader = tools.CallReader()
    reads = read_in_pieces(reader, BLOCK, size, "stop")
    assert (reader.kind, reader.name, reader.complete) == ("call", "get_weather", True)
    assert "".join(r.arguments for r in reads) == reader.arguments == '{"city": "Paris", "unit": "celsius"}'
    assert sum(r.opened for r in reads) == 1 and not any(r.content for r in reads)
    assert reads[-1].finish_reason == "tool_calls"
    # Cut short: the arguments so far, finish_reason as the engine said.
    reader = tools.CallReader()
    reads = read_in_pieces(reader, BLOCK[:60], size, "length")
    assert reader.name == "get_weather" and reads[-1].finish_reason == "length"
    assert "".join(r.arguments for r in reads) == BLOCK[len('<tool_call>\n{"name": "get_weather", "arguments": '):60]


@pytest.mark.parametrize("text", ["Paris is sunny.", "<tools are not calls", "<tool", "", " " + BLOCK])
@pytest.mark.parametrize("size", [1, 1000])
def test_the_reader_gives_other_text_as_content(text, size):
    reader = tools.CallReader()
    reads = read_in_pieces(reader, text, size, "stop")
    assert "".join(r.content for r in reads) == text and reader.kind == "text"
    assert not any(r.opened or r.arguments for r in reads) and reads[-1].finish_reason == "stop"


def test_a_forced_call_is_bare_and_one_cut_before_its_name_is_content():
    reader = tools.CallReader(forced=True)
    reads = read_in_pieces(reader, BLOCK[len("<tool_call>\n"):-len("\n</tool_call>")], 2, "stop")
    assert reader.name == "get_weather" and reads[-1].finish_reason == "tool_calls"
    assert reader.arguments == '{"city": "Paris", "unit": "celsius"}'
    reader = tools.CallReader(forced=True)
    assert reader.read('{"name": "get_w', "length").content == '{"name": "get_w' and reader.kind == "text"


def test_the_grammars_take_calls_and_text_as_documented():
    request = p.ChatCompletionRequest.model_validate({"messages": WEATHER_ASK, "tools": TOOLS})
    auto = tools.tool_calling(request).grammar()
    required = tools.ToolCalling(request.callable_tools(), forced=True).grammar()
    block = "<tool_call>\n{}\n</tool_call>".format
    for call, valid in [('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', True),
                        ('{"name": "add", "arguments": {"a": 1, "b": 2}}', True),
                        ('{"name": "add", "arguments": {"a": 1}}', False),  # b is required
                        ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}', False),  # no c
                        ('{"name": "get_time", "arguments": {}}', False),  # no such tool
                        ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}', False)]:
        assert bool(re.fullmatch(required.spec, call)) == valid, call  # the bare call, forced
        assert bool(re.fullmatch(auto.spec, block(call))) == valid, call  # the call in its block, auto
        assert re.fullmatch(auto.spec, call), call  # to auto, a bare call is just text
    # Any text that does not start with the tag (so also one that stops short of it) is free.
    for text, free in [("Paris is sunny.", True), ("<tool", True), ("", True), ("<tools>", True),
                       ("<tool_call>\nhello", False), ("<tool_call>", False)]:
        assert bool(re.fullmatch(auto.spec, text)) == free, text


# ---- the tools reach the prompt ----------------------------------------------------------------------------

TOOL_LIST_TEMPLATE = ("{%- for tool in tools or [] %}[tool {{ tool.function.name }}]{% endfor -%}"
                      "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                      "{% endfor -%}<|im_start|>assistant\n")


@pytest.mark.slow
def test_the_tools_reach_the_prompt_through_the_template_or_the_system_message(smollm2):
    import copy

    from minicb.tokenizer import Tokenizer
    tokenizer = smollm2[1]
    request = p.ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."},
                                                                   *WEATHER_ASK], "tools": TOOLS})
    text = tokenizer.decode(chat.render(tokenizer, request.messages, tools=request.tools), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and "<tools>\n" in text, text
    for tool in tools.tool_dicts(request.tools):
        assert json.dumps(tool) in text, tool
    # A template that takes the tool list gets it, and no system text.
    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = TOOL_LIST_TEMPLATE
    listing = Tokenizer(hf)
    assert chat.knows_tool_list(listing) and not chat.knows_tool_list(tokenizer)
    text = listing.decode(chat.render(listing, request.messages, tools=request.tools), skip_special_tokens=False)
    assert text.startswith("[tool get_weather][tool add]<|im_start|>system\nBe brief.<|im_end|>"), text


# ---- the clients ----------------------------------------------------------------------------------------



class Person(BaseModel):
    """A person."""  # the clients send a model's docstring as its description
    name: str = Field(min_length=1, max_length=16)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=16)


@pytest.mark.slow
def test_the_openai_client_gets_formats_and_calls(smol):
    import openai  # a dev dependency: missing, the test fails rather than skips

    client = openai.OpenAI(base_url=smol + "/v1", api_key="unused", max_retries=0, timeout=120)
    # Greedy, so the answers are the same each run; test_formats_... samples at temperature 1.
    answer = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=60, temperature=0,
                                            **json_schema(PERSON))
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    answer = client.chat.completions.create(model=NAME, messages=WEATHER_ASK, max_tokens=60, temperature=0,
                                            tools=TOOLS, tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}})
    assert answer.choices[0].finish_reason == "tool_calls"
    check_call(answer.choices[0].message.tool_calls[0].model_dump(), names=("get_weather",))
    # parse(): the client writes a strict schema from the pydantic model and reads the answer back into it.
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    person = parse(model=NAME, messages=ASK, max_tokens=60, temperature=0,
                   response_format=Person).choices[0].message.parsed
    assert isinstance(person, Person), person
    called = parse(model=NAME, messages=WEATHER_ASK, max_tokens=60, temperature=0,
                   tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required")
    called = called.choices[0].message.tool_calls[0]
    assert isinstance(called.function.parsed_arguments, GetWeather), called


@pytest.mark.slow
def test_langchain_gets_structured_output_and_tool_calls(smol):
    from langchain_openai import ChatOpenAI  # a dev dependency, as openai is

    llm = ChatOpenAI(base_url=smol + "/v1", api_key="x", model=NAME, max_tokens=60, temperature=0, max_retries=0,
                     timeout=120)
    ask = "Describe a person named Ada who is 36."
    for method in ("json_schema", "function_calling"):  # response_format json_schema; a forced tool call
        person = llm.with_structured_output(Person, method=method).invoke(ask)
        assert isinstance(person, Person), (method, person)
    # json_mode holds the answer to any JSON object (no schema): a dict comes back.
    answer = llm.with_structured_output(None, method="json_mode").invoke('Give Ada\'s age, 36, as JSON: {"age": ...}')
    assert isinstance(answer, dict), answer
    weather = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    [call] = weather.invoke("What is the weather in Paris?").tool_calls
    assert call["name"] == "GetWeather" and isinstance(GetWeather(**call["args"]), GetWeather), call
    [call] = llm.bind_tools([GetWeather, Person], tool_choice="any").invoke("Weather in Oslo?").tool_calls
    assert call["name"] in ("GetWeather", "Person"), call
    streamed = functools.reduce(operator.add, weather.stream("What is the weather in Rome?"))
    [call] = streamed.tool_calls
    assert call["name"] == "GetWeather" and isinstance(GetWeather(**call["args"]), GetWeather), streamed
