"""`python -m minicb serve`: load the model, build the app, run it on uvicorn.

    python -m minicb serve                                  # SmolLM2 on http://127.0.0.1:8000
    python -m minicb serve --port 8001 --max-num-seqs 16 --enable-prefix-caching
    python -m minicb serve --no-cuda-graphs                 # any EngineConfig field is a flag
    python -m minicb serve --help                           # every option

Open http://127.0.0.1:8000/ for the live dashboard. Any OpenAI client works:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                   messages=[{"role": "user", "content": "Hi!"}])

Shutting down (Ctrl-C or SIGTERM) happens in two halves. First the server
drains: it stops listening, refuses new requests, closes dashboard pages, and
lets running requests finish, for most of --shutdown-timeout seconds. Then
whatever is still waiting or running is aborted in the engine: its stream ends
with finish_reason "abort" and [DONE] (a plain request gets its answer so far),
the engine thread ends, and the process exits. A second Ctrl-C quits at once.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import signal
import socket
import sys
import threading
import time

from minicb.cli_args import add_engine_args, add_model_args, check_engine_args, engine_config

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded model's name in /v1/models


def build_parser() -> argparse.ArgumentParser:
    """The server's flags, then one for each of the engine's settings (minicb/cli_args.py)."""
    ap = argparse.ArgumentParser(prog="python -m minicb serve",
                                 description="Serve a model over HTTP: the OpenAI API, /metrics and a live "
                                             "dashboard at /.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    add_model_args(ap)
    ap.add_argument("--served-model-name", default=None,
                    help=f"the model's id in the API (default: {DEFAULT_MODEL_NAME}, or the model file's name)")
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="requests that may wait for their first token; more get 503 + Retry-After (default 256)")
    # Its default is app.py's MAX_BODY_BYTES, read in main: importing app.py here would load torch for --help.
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="the largest request body accepted, in bytes; a larger one gets 413 (default: "
                         "MAX_BODY_BYTES of minicb/serve/app.py, 4 MiB)")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds running requests get to finish on Ctrl-C / SIGTERM before they are aborted")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch and the compiled decode (default: every core); as for `python -m minicb bench`, 1 can be "
                         "much faster on a CPU shared with other jobs")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(ap)  # every EngineConfig field, e.g. --max-num-seqs, --no-cuda-graphs
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with the numbers that must be >= 1 checked before anything loads."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads={args.threads}; it must be >= 1")
    check_engine_args(ap, args)  # EngineConfig's own rules, before anything loads
    for name in ("port", "max_waiting"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        ap.error(f"--max-body-bytes={args.max_body_bytes}; it must be >= 1")
    return args


def model_name(model: str | None) -> str:
    return DEFAULT_MODEL_NAME if model is None else pathlib.Path(model).name.removesuffix(".gguf")


def make_server(app, host: str, port: int | None = None, shutdown_timeout: float = 10.0, log_level: str = "info"):
    """A uvicorn Server whose first Ctrl-C / SIGTERM also drains the engine loop (see the module's text)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                engine_loop = app.state.loop
                engine_loop.drain()  # refuse new requests, end the dashboard streams
                # Abort what still runs a little before uvicorn's own deadline, so that
                # those streams end with finish_reason "abort" and [DONE], not a cut connection.
                engine_loop.close_after(max(0.0, shutdown_timeout - min(1.0, shutdown_timeout / 4)))
            super().handle_exit(sig, frame)

    # Clients that connect and send nothing, or half a header, cost one socket and a parser
    # each and hold up nobody: asyncio serves the others meanwhile. So no limit_concurrency:
    # uvicorn counts open connections against it, silent ones too, and would answer real
    # requests 503 once enough idle ones are open. backlog: connections the kernel queues
    # before accepting (a burst of clients). h11 buffers at most 16 KiB of an unfinished
    # header per connection, then answers 400 and closes it.
    config = uvicorn.Config(app, host=host, port=port or 8000, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, access_log=log_level == "debug",
                            limit_concurrency=None, backlog=2048, h11_max_incomplete_event_size=16 * 1024)
    return DrainingServer(config)


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                    log_level: str = "warning", start_timeout: float = 60.0):
    """Run `app` on a background thread for the length of a `with` block; yields its base URL.

        with serve_in_thread(create_app(llm, "tiny")) as url:
            httpx.get(url + "/health")

    port 0 picks a free port (the socket is bound here, before uvicorn starts, so
    the URL is known and no other process can take the port in between). On exit
    the server shuts down as on SIGTERM (the same handler runs), and the thread is joined.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = make_server(app, host, port, shutdown_timeout, log_level)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minicb-uvicorn", daemon=True)
    thread.start()
    began = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - began > start_timeout:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server did not start on {host}:{port} within {start_timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.handle_exit(signal.SIGTERM, None)  # what a SIGTERM does: drain, wait, abort the rest
        thread.join(shutdown_timeout + 10)
        sock.close()


def on_a_thread_of_its_own(fn):
    """fn() on a new thread, which ends when it returns; its result, or its exception raised here.

    Loading a model runs torch operators, and torch's OpenMP runtime keeps a pool of
    worker threads for every thread that has run one, for as long as that thread
    lives. The main thread runs the event loop for the whole life of the server and
    the engine thread runs the steps, so the model loads on a third thread that ends
    and takes its pool with it: only the engine thread's pool is left, and libgomp keeps
    spinning between operators (EngineLoop.start in minicb/serve/loop.py says why that matters).
    """
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the caller
            result["error"] = e

    thread = threading.Thread(target=run, name="minicb-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # Only now, with the arguments read: `--help` answers without loading torch.
    from minicb.triton_mode import choose_triton_mode
    choose_triton_mode()  # before anything imports triton: interpret its kernels when there is no GPU
    from minicb.bench.machine import device_name
    from minicb.llm import build
    from minicb.serve.app import MAX_BODY_BYTES, create_app

    if args.threads:
        from minicb.cpu_attention import set_num_threads
        set_num_threads(args.threads)  # torch's count reaches later threads; the kernel re-applies Numba's
    try:
        # The same builder as LLM's: the model, its tokenizer, and an engine with every engine flag.
        built = on_a_thread_of_its_own(lambda: build(args.model, device=args.device, dtype=args.dtype,
                                                     **engine_config(args)))
    except (ValueError, RuntimeError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or model_name(args.model)
    max_body_bytes = MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    app = create_app(built, name, max_waiting=args.max_waiting, max_body_bytes=max_body_bytes)
    where = device_name(built.model.device)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (dashboard: http://{args.host}:{args.port}/) "
          f"on {where}; linear layers: {built.engine.linear_choice.describe()}; norms, rotary and SwiGLU: "
          f"{built.engine.cpu_ops}", flush=True)
    make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
