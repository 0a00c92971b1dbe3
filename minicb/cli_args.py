"""Command-line flags shared by every command that loads a model.

`python -m minicb generate`, `demo` and `bench` all take the same --model,
--device and --dtype. They live here, apart from minicb/__main__.py, so that a
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
