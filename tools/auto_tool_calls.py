"""How often SmolLM2 calls a tool by itself when tool_choice is "auto".

The README's "Structured output and tool calls" says what a 135M model does with
"auto"; this is the measurement behind it. Ten questions, most of which invite
a call of one of two tools (the weather, a sum), go to `minicb serve`'s app in
this process, greedy and at temperature 1 with two seeds, all at once. Each
answer's finish_reason and call (or the start of its text) is printed, then the
count of answers that called a tool.

    .venv/bin/python tools/auto_tool_calls.py
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from minicb.llm import LLM
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread

NAME = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
QUESTIONS = ["What is the weather in Paris?", "Is it raining in London right now?", "What's the temperature in Tokyo?",
             "Use the weather tool for Berlin.", "What is 17 plus 25?", "Add 3 and 4 for me.",
             "Call add with a=2 and b=9.", "Tell me a joke.", "Who wrote Hamlet?", "Weather in Oslo and Rome?"]
RUNS = [(0.0, 0), (1.0, 1), (1.0, 2)]  # (temperature, seed)


def main() -> None:
    app = create_app(LLM(max_num_seqs=32), NAME)
    with serve_in_thread(app, shutdown_timeout=2.0) as url:
        def ask(job):
            question, temperature, seed = job
            answer = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "model": NAME, "messages": [{"role": "user", "content": question}], "tools": [WEATHER, ADD],
                "tool_choice": "auto", "max_tokens": 60, "temperature": temperature, "seed": seed}).json()
            return job, answer["choices"][0]

        jobs = [(q, t, seed) for t, seed in RUNS for q in QUESTIONS]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
    for (question, temperature, seed), choice in answers:
        calls = choice["message"].get("tool_calls")
        said = json.dumps(calls[0]["function"]) if calls else repr((choice["message"]["content"] or "")[:60])
        print(f"T={temperature} seed={seed} {choice['finish_reason']:10} {question[:36]:36} {said}")
    called = sum(choice["finish_reason"] == "tool_calls" for _, choice in answers)
    print(f"{called} of {len(answers)} answers called a tool (tool_choice auto)")


if __name__ == "__main__":
    main()
