"""What the server tests (tests/test_server*.py) share: a tiny model with a tokenizer, and a server to run it.

The tiny random model (minicb.model.random_model) has 256 token ids, so a byte
tokenizer fits it exactly: token id = one UTF-8 byte. Its greedy answers are
random bytes, often not valid UTF-8, which is just what the server's incremental
decoding must survive (half characters, replacement characters). It makes the
text paths testable in milliseconds per step, without SmolLM2.
"""
from __future__ import annotations

import contextlib
import re

from minicb.llm import LLM
from minicb.model import random_model
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread

TINY = "tiny-random"  # the served model name


class ByteTokenizer:
    """Token id = byte. Ids 1 (BOS) and 2 (EOS, tiny_config's) are special and decode to nothing."""

    eos_token_id = 2
    special = {1, 2}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [t for t in token_ids if not (skip_special_tokens and t in self.special)]
        return bytes(kept).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


_MODEL = None


def tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = random_model()
    return _MODEL


def tiny_llm(**engine_config) -> LLM:
    """An LLM on the tiny model and the byte tokenizer; engine_config: EngineConfig's fields."""
    return LLM.from_model(tiny_model(), ByteTokenizer(), **{"max_num_seqs": 8, **engine_config})


@contextlib.contextmanager
def tiny_server(max_waiting: int = 256, shutdown_timeout: float = 2.0, **engine_config):
    """(url, app) of a server on 127.0.0.1 at a free port, stopped on exit as on SIGTERM: drained
    for up to `shutdown_timeout` seconds, then whatever still runs is aborted."""
    app = create_app(tiny_llm(keep_traces=1, **engine_config), TINY, max_waiting=max_waiting)
    with serve_in_thread(app, shutdown_timeout=shutdown_timeout) as url:
        yield url, app


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus' text format, e.g. metric(t, "minicb_kv_blocks_used")."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    match = re.search(pattern, text, re.M)
    if match is None:
        raise AssertionError(f"no sample {name}{{{labels}}} in /metrics:\n{text[:2000]}")
    return float(match[1])


def sse_events(lines) -> list[dict | str]:
    """The data of each server-sent event ("[DONE]" stays a string) from an iterable of lines."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
