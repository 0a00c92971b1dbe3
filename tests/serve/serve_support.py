"""What the server tests (tests/serve/test_server*.py) share: a tiny model with a tokenizer, and a server to run it.

Their streams are read with minicb/bench/sse.py, the parser bench-serve and tools/soak.py use.

The tiny random model (minicb.model.random_model) with a byte tokenizer (token
id = one UTF-8 byte; minicb/serve/tiny.py, which also serves it from the
command line) makes the text paths testable in milliseconds per step, without SmolLM2.
A test that acts while a request still runs paces the engine (`paced`), so that its
timing means the same on a fast CPU as on a slow one.
"""
from __future__ import annotations

import contextlib
import re
import time

from minicb.llm import LLM
from minicb.model import random_model
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread
from minicb.serve.tiny import TINY, ByteTokenizer  # noqa: F401 (the tests import both from here)

_MODEL = None


def tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = random_model()
    return _MODEL


def tiny_llm(**engine_config) -> LLM:
    """An LLM on the tiny model and the byte tokenizer; engine_config: EngineConfig's fields."""
    return LLM.from_model(tiny_model(), ByteTokenizer(), **{"max_num_seqs": 8, **engine_config})


class PacedRunner:
    """The engine's runner with every step taking at least `seconds`.

    A test that acts while a long request still runs (hangs up on it, shuts the
    server down under it) must not race the CPU: the tiny model's step takes
    under a millisecond on one machine and 15 on another, so 480 tokens can be
    over before the test acts. Paced, they last 480 x `seconds` on any of them.
    """

    def __init__(self, runner, seconds: float):
        self.runner, self.seconds = runner, seconds

    def __call__(self, inputs):
        start = time.perf_counter()
        logits = self.runner(inputs)
        time.sleep(max(0.0, self.seconds - (time.perf_counter() - start)))
        return logits


def paced(engine, seconds: float = 0.01):
    """`engine` with its runner paced (PacedRunner): call before any request arrives."""
    engine.runner = PacedRunner(engine.runner, seconds)
    return engine


@contextlib.contextmanager
def tiny_server(max_waiting: int = 256, shutdown_timeout: float = 2.0, **engine_config):
    """(url, app) of a server on 127.0.0.1 at a free port, stopped on exit as on SIGTERM: drained
    for up to `shutdown_timeout` seconds, then whatever still runs is aborted."""
    app = create_app(tiny_llm(**engine_config), TINY, max_waiting=max_waiting)
    with serve_in_thread(app, shutdown_timeout=shutdown_timeout) as url:
        yield url, app


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus' text format, e.g. metric(t, "minicb_kv_blocks_used")."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    match = re.search(pattern, text, re.M)
    if match is None:
        raise AssertionError(f"no sample {name}{{{labels}}} in /metrics:\n{text[:2000]}")
    return float(match[1])


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """predicate()'s first truthy value, asked every `interval` s; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"waited {timeout} s for {what}")
