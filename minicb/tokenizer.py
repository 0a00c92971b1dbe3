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
    """A thin wrapper that gives the engine the four things it needs, and the server's tokenizer
    endpoints (minicb/serve/tokenize_routes.py) the few more they report."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: what the tokenizer puts around any text by itself (a BOS, for many
        models; nothing, for SmolLM2). minicb's prompts never get them: a chat template writes its own."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Messages -> prompt token ids, ending with the assistant turn's header (unless add_generation_prompt
        is False). tools: OpenAI-shaped function tools for the template to write, if it writes them
        (SmolLM2's does not; minicb/serve/chat.py asks before it relies on one)."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError(f"a chat must be a non-empty list of {{'role': ..., 'content': ...}} dicts; got {messages!r}")
        extra = {"tools": tools} if tools else {}
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          **extra)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)  # the base vocabulary and the added (special) tokens

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it ("Ġworld": byte-level BPE writes a space as Ġ)."""
        return self.hf.convert_ids_to_tokens(token_ids)

    def info(self) -> dict:
        """What the server's GET /tokenizer_info reports: the class, the vocabulary's size, the special
        tokens, the tokenizer's own length limit (None when it sets none) and the chat template."""
        hf = self.hf
        special = {f"{kind}_token{suffix}": getattr(hf, f"{kind}_token{suffix}")
                   for kind in ("bos", "eos", "pad", "unk") for suffix in ("", "_id")}
        # HF says "no limit" with a sentinel, int(1e30) (transformers' VERY_LARGE_INTEGER).
        limit = hf.model_max_length if hf.model_max_length < int(1e30) else None
        template = hf.chat_template if isinstance(hf.chat_template, (str, dict)) else None
        return {"tokenizer_class": type(hf).__name__, "vocab_size": self.vocab_size, **special,
                "model_max_length": limit, "chat_template": template}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE token may be part of a character, which
        no text of its own can show (OpenAI's logprobs give these as `bytes`)."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is not None and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")  # not byte-level: its text


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's, SmolLM2's) spells each byte as one printable character: the printable
    Latin-1 bytes as themselves, the other 68 (controls, space, ...) as chr(256 + i) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


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
