"""Command-line flags shared by every command that loads a model.

`python -m minicb generate`, `demo`, `bench` and `serve` all take the same
--model, --device and --dtype (`add_model_args`), and a flag for each of the
engine's settings (`add_engine_args`), made from EngineConfig's fields
(minicb/config.py): a setting added there is a flag of every command, with its
help, and `engine_config(args)` hands them all to the engine.

    add_engine_args(parser, defaults={"max_num_seqs": 8}, aliases={"max_num_seqs": ["--slots"]})
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **engine_config(args))

They live here, apart from minicb/__main__.py, so that a command's own module
(minicb/bench/cli.py) can add them without importing the top-level command
line that imports it. Only argparse and the dataclass are imported: `--help`
stays instant, with no torch to load.
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from minicb.config import EngineConfig  # torch-free: only dataclasses


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add --model, --device and --dtype to `p`.

    Their values go to minicb.weights.load_model as they are; it names the
    allowed choices when one is wrong, so nothing is validated twice.
    """
    p.add_argument("--model", default=None, help="a .gguf file or HF checkpoint directory (default: embedded SmolLM2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")


def int_or_none(text: str) -> int | None:
    """A flag's value for an `int | None` field: a whole number, or "none"."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor 'none'") from None


# How a field's annotation becomes a flag. The annotations are strings (EngineConfig's
# module uses `from __future__ import annotations`), so they are matched as written.
# A bool gets --x and --no-x; `bool | None` too, with None (the engine decides) when neither is given.
FLAG_KINDS = {
    "int": {"type": int, "metavar": "N"},
    "int | None": {"type": int_or_none, "metavar": "N|none"},
    "float": {"type": float, "metavar": "X"},
    "str": {"type": str},
    "bool": {"action": argparse.BooleanOptionalAction},
    "bool | None": {"action": argparse.BooleanOptionalAction},
}


def show(value) -> str:
    """A default as the help prints it: in the words a user types."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_engine_args(p: argparse.ArgumentParser, defaults: dict | None = None,
                    aliases: dict[str, list[str]] | None = None) -> None:
    """Add a flag to `p` for each of EngineConfig's fields: --max-num-seqs for max_num_seqs, and so on.

    The flags are made from the dataclass (minicb/config.py): the type from the
    field's annotation, the help from its metadata, the default from the field,
    or from `defaults` where a command needs its own (serve keeps one trace for
    its dashboard). `aliases` adds older names, e.g. {"max_num_seqs": ["--slots"]}.
    A field added to EngineConfig becomes a flag of every command that calls this.
    The values go to the engine as they are: it checks them when it is built.
    """
    defaults, aliases = defaults or {}, aliases or {}
    names = [f.name for f in fields(EngineConfig)]
    unknown = sorted((set(defaults) | set(aliases)) - set(names))
    if unknown:
        raise ValueError(f"no EngineConfig field named {', '.join(unknown)}; the fields are {', '.join(names)}")
    group = p.add_argument_group("engine settings", "EngineConfig's fields (minicb/config.py)")
    for f in fields(EngineConfig):
        if f.type not in FLAG_KINDS:
            raise TypeError(f"EngineConfig.{f.name} is annotated {f.type!r}, which has no flag type; "
                            f"use one of {', '.join(map(repr, FLAG_KINDS))}")
        default = defaults.get(f.name, f.default)
        kind = {**FLAG_KINDS[f.type], **({"choices": f.metadata["choices"]} if "choices" in f.metadata else {})}
        action = group.add_argument("--" + f.name.replace("_", "-"), *aliases.get(f.name, []), dest=f.name,
                                    default=default, **kind)
        # Set after the fact: Python 3.10's BooleanOptionalAction appends a default of its own to `help`.
        # argparse %-formats help texts, so a literal % is doubled.
        action.help = f"{f.metadata['help']} (default: {show(default)})".replace("%", "%%")


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with the parser's usage error if the engine flags break one of EngineConfig's rules.

    The rules are EngineConfig.validate's (minicb/config.py), so a command checks
    its flags before loading a model without restating any of them."""
    try:
        EngineConfig(**engine_config(args))
    except ValueError as e:
        parser.error(f"{e} (the flag is --{str(e).split('=', 1)[0].replace('_', '-')})")


def engine_config(args: argparse.Namespace) -> dict:
    """{field: value} for every EngineConfig field, from flags add_engine_args added: `LLM(**engine_config(args))`."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
