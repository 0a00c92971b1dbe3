"""Bundled data: the chat prompts that the benchmark, demos and notebooks share.

`chat_prompts.json` is a plain JSON list of user messages. They are short
questions, explanations, lists, small coding asks, rewrites, word problems,
definitions and stories, so that a small chat model answers them with very
different lengths: some with one line, some until the token limit. That
spread is what makes static batching waste slots and continuous batching win.

`chat_output_lengths.json` records how many tokens the real SmolLM2 answered to
the first 64 of them (greedy, fp32, on a CPU; made by `python tools/gpu_bundle.py
lengths`). The GPU check's bench replays those lengths on random weights, whose
answers have no natural end (`python -m minicb bench --lengths-json ...`).
"""

import json
from importlib import resources


def load_chat_prompts(n: int | None = None) -> list[str]:
    """The first `n` bundled user messages (all of them when `n` is None)."""
    text = resources.files(__package__).joinpath("chat_prompts.json").read_text(encoding="utf-8")
    prompts = json.loads(text)
    if n is None:
        return prompts
    # bool is an int in Python; a True here is a mistake, not "1 prompt".
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(prompts):
        raise ValueError(f"n must be an int from 1 to {len(prompts)} (the number of bundled "
                         f"prompts), or None for all of them; got {n!r}")
    return prompts[:n]
