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
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # it puts nothing around a text (no BOS), as SmolLM2's

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [t for t in token_ids if not (skip_special_tokens and t in self.special)]
        return bytes(kept).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + "<assistant>" if add_generation_prompt else text)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's byte; one that is not a character by itself (part of one) as \\xNN."""
        return [bytes([t]).decode("utf-8", errors="backslashreplace") for t in token_ids]

    def info(self) -> dict:
        """GET /tokenizer_info's fields (minicb.tokenizer.Tokenizer.info's); its template is the code above."""
        return {"tokenizer_class": "ByteTokenizer", "vocab_size": self.vocab_size, "bos_token": "\x01",
                "bos_token_id": 1, "eos_token": "\x02", "eos_token_id": 2, "pad_token": None, "pad_token_id": None,
                "unk_token": None, "unk_token_id": None, "model_max_length": None, "chat_template": None}

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


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
