"""The command line: python -m minicb {generate, demo, bench, check, grade, serve, bench-serve}.

    python -m minicb generate "What is the capital of France?"   # stream an answer
    python -m minicb demo                                         # static vs continuous batching, side by side
    python -m minicb bench                                        # minicb vs HF transformers
    python -m minicb check 3                                      # grade chapter 3's exercise
    python -m minicb check all                                    # every chapter's exercise, a row each
    python -m minicb grade 3 submissions/*.py --csv grades.csv    # a teacher: many submissions, one CSV
    python -m minicb serve --port 8000                            # the OpenAI API, /metrics, a dashboard at /
    python -m minicb bench-serve --url http://127.0.0.1:8000      # load-test any OpenAI-compatible server
"""
from __future__ import annotations

import argparse
import sys

from minicb.cli_args import add_engine_args, add_model_args, check_engine_args, engine_config  # bench and serve add them too


def cmd_generate(args) -> int:
    from minicb import LLM, SamplingParams

    # Reject bad input before the model loads: an empty prompt would otherwise cost
    # seconds of loading and then fail anyway.
    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give some text to answer")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, min_tokens=args.min_tokens,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **engine_config(args))
    if llm.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer files, so text prompts cannot be encoded")
    # An instruct model expects its chat template around the question; --raw skips
    # it to show what the bare model does with plain text.
    messages = [{"role": "user", "content": args.prompt}]
    prompt = llm.tokenizer.apply_chat_template(messages) if not args.raw else llm.tokenizer.encode(args.prompt)
    # stream() runs the continuous-batching engine with one request and yields an
    # event per generated token; the last event also carries the finished output.
    tokens, shown = [], ""
    for event in llm.stream([prompt], params):
        # Decode everything so far and print what is new: a token can be half of a
        # multi-byte character, so decoding tokens one by one would garble text.
        tokens.append(event.token_id)
        text = llm.tokenizer.decode(tokens)
        print(text[len(shown):], end="", flush=True)
        shown = text
        if event.output is not None:
            m = event.output.metrics
            print(f"\n[{len(tokens)} tokens, finish_reason={event.output.finish_reason}, "
                  f"{len(tokens) / max(m.latency, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


# The demo's engine: 8 slots (see below). Its timelines draw LLM.traces, every step of a call.
DEMO_ENGINE_DEFAULTS = {"max_num_seqs": 8}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; generate and demo parse here, the others get the rest of the line."""
    ap = argparse.ArgumentParser(prog="python -m minicb", description="minicb: learn LLM serving by building it.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    # One subcommand per job. The module docstring doubles as the help's epilog,
    # so `--help` shows the same examples this file opens with.
    sub = ap.add_subparsers(dest="command", metavar="{generate,demo,bench,check,grade,serve,bench-serve}")

    g = sub.add_parser("generate", help="stream an answer to one prompt (chat template applied)")
    g.add_argument("prompt")
    add_model_args(g)
    # Sampling flags map one to one onto SamplingParams, which validates them
    # (e.g. --max-tokens 0 or --top-p 2 is an error that names the allowed range).
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g)  # every EngineConfig field: --attention triton, --no-cuda-graphs, ...

    # The demo's defaults keep `make demo` to about two minutes on a 2-core CPU (121 s measured).
    # Its slots (--max-num-seqs, or --slots) are the static batch size and the engine's alike.
    d = sub.add_parser("demo", help="static vs continuous batching on the bundled prompts, with slot timelines")
    add_model_args(d)
    d.add_argument("--num-prompts", type=int, default=24)
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--png", default="build/demo_timeline.png")
    add_engine_args(d, defaults=DEMO_ENGINE_DEFAULTS, aliases={"max_num_seqs": ["--slots"]})

    # These parse their own arguments (python -m minicb bench --help), so the
    # rest of the command line is handed to them untouched.
    sub.add_parser("bench", help="throughput and latency: minicb engines vs HF transformers", add_help=False)
    sub.add_parser("check", help="run a chapter's tests against your exercise file", add_help=False)
    sub.add_parser("grade", help="grade many submissions of one chapter: a table and a CSV", add_help=False)
    sub.add_parser("serve", help="serve the model over HTTP (OpenAI API, /metrics, dashboard)", add_help=False)
    sub.add_parser("bench-serve", help="load-test an OpenAI-compatible server: TTFT, TPOT, ITL, throughput",
                   add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if args.command in ("generate", "demo", "bench"):
        # Triton must know before its first import whether to interpret (no GPU) or compile.
        # (serve chooses after reading its flags, so that `serve --help` needs no torch.)
        from minicb.triton_mode import choose_triton_mode
        choose_triton_mode()

    if args.command == "bench":
        from minicb.bench.cli import main as bench_main
        return bench_main(rest)
    if args.command == "check":
        from minicb.check import main as check_main
        return check_main(rest)
    if args.command == "grade":
        from minicb.grade import main as grade_main
        return grade_main(rest)
    if args.command == "serve":
        from minicb.serve.server import main as serve_main
        return serve_main(rest)
    if args.command == "bench-serve":
        from minicb.bench.serve import main as bench_serve_main
        return bench_serve_main(rest)
    # Heavy imports (torch, transformers) happen inside each command, so
    # `python -m minicb --help` answers at once.
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        ap.print_help()
        return 0
    check_engine_args(ap, args)  # generate and demo: EngineConfig's rules, before the model loads
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "demo":
            from minicb.demo import main as demo_main
            return demo_main(args)
    except (ValueError, RuntimeError, FileNotFoundError, TypeError) as e:
        # Bad input from the command line: say what was wrong, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
