"""The tiny random model behind the server, with a byte tokenizer: a server that starts in seconds.

    python -m minicb.serve.tiny --port 8001 --enable-prefix-caching   # serve's flags, less --model

The tiny random model (minicb.model.random_model) has 256 token ids, so a byte
tokenizer fits it exactly: token id = one UTF-8 byte. Its greedy answers are
random bytes, often not valid UTF-8, which is just what the server's incremental
decoding must survive (half characters, replacement characters). So the whole
HTTP path, text and chat included, runs at milliseconds per step without
SmolLM2: the server tests (tests/serve/serve_support.py) use ByteTokenizer in their
own process, and a soak test (tools/soak.py) runs `main` in a child process,
whose memory, file descriptors and threads it can watch from outside.
"""
from __future__ import annotations

import sys

TINY = "tiny-random"  # the served model's name


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


def main(argv: list[str] | None = None) -> int:
    """`python -m minicb serve` with the tiny model in place of a loaded one; the same flags and shutdown."""
    from minicb.serve.server import make_server, parse_args

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.model is not None:
        print(f"error: --model={args.model!r}; this server always runs the tiny random model "
              "(use `python -m minicb serve --model ...` for a checkpoint)", file=sys.stderr)
        return 2
    # As serve's main does, in its order: triton's mode before anything imports it, threads before the engine.
    from minicb.triton_mode import choose_triton_mode
    choose_triton_mode()
    from minicb.cli_args import engine_config
    from minicb.llm import LLM
    from minicb.model import random_model
    from minicb.serve.app import create_app

    if args.threads:
        from minicb.cpu_attention import set_num_threads
        set_num_threads(args.threads)
    llm = LLM.from_model(random_model(), ByteTokenizer(), **engine_config(args))
    name = args.served_model_name or TINY
    app = create_app(llm, name, max_waiting=args.max_waiting)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
