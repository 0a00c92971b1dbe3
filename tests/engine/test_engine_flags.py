"""The engine's settings have one source: EngineConfig's fields become every command's flags.

Each field of minicb/config.py's EngineConfig must be a flag of `serve`,
`bench`, `generate` and `demo`, with the field's default (or the command's own,
documented below), and reach the engine unchanged through
`cli_args.engine_config`. `LLM` takes the same names and refuses others, and
`serve --help` answers without loading torch.
"""
import dataclasses
import subprocess
import sys

import pytest

from minicb import cli_args
from minicb.cli_args import engine_config
from minicb.config import EngineConfig

FIELDS = dataclasses.fields(EngineConfig)
DEFAULTS = {f.name: f.default for f in FIELDS}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_serve(argv):
    from minicb.serve.server import parse_args
    return parse_args(argv)


def parse_bench(argv):
    from minicb.bench.cli import parse_args
    return parse_args(argv)


def parse_generate(argv):
    from minicb.__main__ import build_parser
    return build_parser().parse_args(["generate", "What is 2+2?", *argv])


def parse_demo(argv):
    from minicb.__main__ import build_parser
    return build_parser().parse_args(["demo", *argv])


# command -> (parse, the defaults it documents in place of EngineConfig's)
COMMANDS = {
    # keep_traces has one default everywhere (0): pictures ask a step for its trace (LLM, an open dashboard).
    "serve": (parse_serve, {}),
    # minicb-chunked's budget, minicb-spec's n-gram.
    "bench": (parse_bench, {"max_num_batched_tokens": 256, "speculative_ngram": 2}),
    "generate": (parse_generate, {}),
    # 8 slots keep `make demo` short.
    "demo": (parse_demo, {"max_num_seqs": 8}),
}


def other_value(field: dataclasses.Field, default):
    """A value unlike `default` for this field, and the words that ask for it on the command line."""
    name = flag(field.name)
    if field.type == "bool":
        return (not default), [name if not default else "--no-" + name[2:]]
    if field.type == "bool | None":
        return False, ["--no-" + name[2:]]  # the way to turn CUDA graphs off
    if field.type == "int | None":
        return (7, [name, "7"]) if default is None else (None, [name, "none"])
    if field.type == "int":
        return default + 3, [name, str(default + 3)]
    if field.type == "float":
        return default / 2, [name, str(default / 2)]
    if "choices" in field.metadata:
        value = next(c for c in field.metadata["choices"] if c != default)
        return value, [name, value]
    raise AssertionError(f"the test has no value for EngineConfig.{field.name}: {field.type!r}")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_a_flag_with_its_default(command):
    parse, overrides = COMMANDS[command]
    got = engine_config(parse([]))
    expected = {**DEFAULTS, **overrides}
    wrong = {name: (got[name], expected[name]) for name in expected if got[name] != expected[name]}
    assert not wrong, f"{command}: defaults differ (got, expected): {wrong}"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_reaches_the_engine_settings(command):
    parse, overrides = COMMANDS[command]
    defaults = {**DEFAULTS, **overrides}
    for field in FIELDS:
        value, words = other_value(field, defaults[field.name])
        got = engine_config(parse(words))
        changed = {name: got[name] for name in got if got[name] != defaults[name]}
        assert changed == {field.name: value}, (
            f"{command} {' '.join(words)}: changed {changed}, want only {field.name}={value!r}")


def test_a_typical_command_line_round_trips():
    words = ["--enable-chunked-prefill", "--max-num-batched-tokens", "64", "--no-cuda-graphs", "--num-blocks", "none",
             "--attention", "triton", "--keep-traces", "none", "--watermark", "0.05"]
    for command, (parse, overrides) in COMMANDS.items():
        got = engine_config(parse(words))
        want = {**DEFAULTS, **overrides, "enable_chunked_prefill": True, "max_num_batched_tokens": 64,
                "cuda_graphs": False, "num_blocks": None, "attention": "triton", "keep_traces": None, "watermark": 0.05}
        assert got == want, f"{command}: {[(k, got[k], want[k]) for k in want if got[k] != want[k]]}"
        assert EngineConfig(**got) == EngineConfig(**want)  # a complete, valid set of settings
    assert engine_config(parse_serve(["--cuda-graphs"]))["cuda_graphs"] is True


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_slots_is_another_name_for_max_num_seqs(command):
    parse, _ = COMMANDS[command]
    assert engine_config(parse(["--slots", "3"]))["max_num_seqs"] == 3
    assert engine_config(parse(["--max-num-seqs", "5"]))["max_num_seqs"] == 5


def test_bad_values_are_refused_with_the_flag_named(capsys):
    with pytest.raises(SystemExit):
        parse_serve(["--num-blocks", "lots"])
    assert "--num-blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_serve(["--attention", "flash"])
    assert "--attention" in capsys.readouterr().err


def test_a_new_field_becomes_a_flag_with_no_other_edit(monkeypatch):
    # What adding a setting to EngineConfig does: the same add_engine_args, a dataclass with one field more.
    grown = dataclasses.make_dataclass("EngineConfig", [
        ("new_knob", "int", dataclasses.field(default=5, metadata={"help": "a setting added later"}))],
        bases=(EngineConfig,))
    monkeypatch.setattr(cli_args, "EngineConfig", grown)
    from minicb.serve.server import build_parser
    parser = build_parser()
    assert "--new-knob" in parser.format_help() and "a setting added later (default: 5)" in parser.format_help()
    assert engine_config(parser.parse_args(["--new-knob", "9"]))["new_knob"] == 9


def test_the_bench_variants_each_turn_on_their_own_feature():
    from minicb.bench.cli import minicb_engine_configs

    configs = minicb_engine_configs(parse_bench(["--slots", "3", "--attention", "triton"]), num_blocks=99)
    plain = configs["minicb-continuous"]
    # The plain engine: the flags, the pool it was given, and no chunking budget or n-gram of the variants'.
    assert plain == {**DEFAULTS, "max_num_seqs": 3, "attention": "triton", "num_blocks": 99}, plain
    differences = {name: {k: v for k, v in config.items() if plain[k] != v} for name, config in configs.items()}
    assert differences == {
        "minicb-continuous": {},
        "minicb-eager": {"cuda_graphs": False},
        "minicb-prefix-cache": {"enable_prefix_caching": True},
        "minicb-chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 256},
        "minicb-spec": {"speculative_ngram": 2},
    }, differences
    # A flag for every engine reaches every engine; chunking for all brings its budget to all.
    eager = minicb_engine_configs(parse_bench(["--no-cuda-graphs"]), 99)
    assert {name: c["cuda_graphs"] for name, c in eager.items()} == dict.fromkeys(eager, False)
    chunking = minicb_engine_configs(parse_bench(["--enable-chunked-prefill", "--max-num-batched-tokens", "64"]), 99)
    assert {name: c["max_num_batched_tokens"] for name, c in chunking.items()} == dict.fromkeys(chunking, 64)


def test_llm_refuses_an_unknown_setting_naming_it_and_the_allowed_ones():
    from minicb.llm import LLM
    from minicb.model import random_model

    with pytest.raises(TypeError) as e:
        LLM.from_model(random_model(), max_num_seq=4)
    assert "'max_num_seq'" in str(e.value) and all(f.name in str(e.value) for f in FIELDS), str(e.value)
    # Checked before anything loads: a missing model file would otherwise be the error.
    with pytest.raises(TypeError, match="'enable_caching'"):
        LLM("no/such/model.gguf", enable_caching=True)
    llm = LLM.from_model(random_model(), max_num_seqs=3, enable_prefix_caching=True)
    assert (llm.engine.config.max_num_seqs, llm.engine.config.enable_prefix_caching) == (3, True)
    assert llm.engine.config.keep_traces == 0, "keep_traces has one default, EngineConfig's (LLM asks each step)"


@pytest.mark.parametrize("command", ["serve", "bench", "demo"])
def test_every_command_refuses_settings_by_engineconfigs_rules_before_loading(command, capsys):
    """One place for the rules: each command asks EngineConfig.validate, and names the flag."""
    parse = {"serve": lambda argv: __import__("minicb.serve.server", fromlist=["parse_args"]).parse_args(argv),
             "bench": lambda argv: __import__("minicb.bench.cli", fromlist=["parse_args"]).parse_args(argv),
             "demo": lambda argv: __import__("minicb.__main__", fromlist=["main"]).main(["demo", *argv])}[command]
    for argv, said in ((["--max-num-seqs", "0"], "max_num_seqs=0"), (["--watermark", "1.5"], "watermark=1.5"),
                       (["--speculative-ngram", "2", "--num-speculative-tokens", "8",
                         "--max-num-batched-tokens", "4"], "num_speculative_tokens=8")):
        with pytest.raises(SystemExit) as e:
            parse(argv)
        assert e.value.code == 2, f"{command} {argv}: exit code {e.value.code}"
        err = capsys.readouterr().err
        assert said in err, f"{command} {argv} must say {said!r}: {err[-300:]}"


def test_serve_help_lists_every_flag_without_loading_torch():
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "minicb", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    missing = [flag(f.name) for f in FIELDS if flag(f.name) not in run.stdout]
    assert not missing and "--no-cuda-graphs" in run.stdout, f"serve --help lacks {missing}:\n{run.stdout}"
    # -X importtime writes one line per module imported: "import time: self | cumulative | name".
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy", "transformers", "triton"))
    assert not heavy, f"`python -m minicb serve --help` imported {heavy[:10]}"
