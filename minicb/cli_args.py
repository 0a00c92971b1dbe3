"""Command-line flags shared by every command that loads a model.

`python -m minicb generate`, `demo`, `bench` and `serve` all take the same
--model, --device and --dtype, and `serve` takes the engine's settings too
(`add_engine_args`). They live here, apart from minicb/__main__.py, so that a
command's own module (minicb/bench/cli.py) can add them without importing the
top-level command line that imports it. Only argparse is imported: `--help`
stays instant.
"""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add --model, --device and --dtype to `p`.

    Their values go to minicb.weights.load_model as they are; it names the
    allowed choices when one is wrong, so nothing is validated twice.
    """
    p.add_argument("--model", default=None, help="a .gguf file or HF checkpoint directory (default: embedded SmolLM2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add the continuous-batching engine's settings (EngineConfig's fields) to `p`.

    Used by `python -m minicb serve`; the defaults are EngineConfig's, and the
    engine checks the values when it is built.
    """
    p.add_argument("--max-num-seqs", type=int, default=32, help="slots: sequences decoding together (default 32)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: from the memory budget, 1 GiB on a CPU)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="new tokens per step at most; caps how much prefill joins a step (default 4096)")
    p.add_argument("--attention", default="torch", choices=["torch", "triton"])
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="share computed prompt blocks between requests that start alike")
    add_speculative_args(p)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Add chapter 11's --speculative-ngram and --num-speculative-tokens (EngineConfig's fields)."""
    p.add_argument("--speculative-ngram", type=int, default=None, metavar="N",
                   help="speculative decoding by prompt lookup: find a request's last N tokens earlier in its "
                        "context and propose the tokens that followed (default: off; bench's minicb-spec uses 2)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="speculative decoding: draft tokens proposed and verified per step at most (default 4)")
