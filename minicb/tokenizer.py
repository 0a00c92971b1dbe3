"""Chapter 00: text <-> token ids, and the chat template.

In this file you will learn where a model's tokenizer and chat template come
from when all you have is a GGUF file: llama.cpp stores the BPE vocabulary,
merges and the Jinja chat template as metadata, and HF transformers can rebuild
a fast tokenizer from them (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
Rebuilding takes ~10 s, so we save the result next to the converted weights and
later loads take well under a second. An HF checkpoint directory carries its own
tokenizer files and loads directly.

We never hand-write BPE: the point of minicb is serving, not tokenization.
"""
from __future__ import annotations

import os
import pathlib

from minicb import weights


class Tokenizer:
    """A thin wrapper that gives the engine the four things it needs."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Messages -> prompt token ids, ending with the assistant turn's header."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError(f"a chat must be a non-empty list of {{'role': ..., 'content': ...}} dicts; got {messages!r}")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def load_tokenizer(model: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer for `model` (None = the embedded SmolLM2), as in `weights.load_model`."""
    from transformers import AutoTokenizer

    path = weights.default_gguf_path() if model is None else pathlib.Path(model).expanduser()
    if path.is_dir():
        return Tokenizer(AutoTokenizer.from_pretrained(str(path)))
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    base = weights.gguf_cache_path(path)
    cached = base.with_name(base.name + "-tokenizer")
    if not (cached / "tokenizer.json").is_file():
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tmp = cached.with_name(cached.name + ".tmp")
        hf.save_pretrained(str(tmp))
        tmp.rename(cached)
    return Tokenizer(AutoTokenizer.from_pretrained(str(cached)))
