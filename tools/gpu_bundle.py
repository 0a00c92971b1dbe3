"""What `make gpu-check` needs on an offline CUDA machine, prepared where there is network.

The GPU machine has its own python3 with CUDA torch and Triton, and no network:
nothing can be installed or downloaded there, and the SmolLM2 GGUF file (98 MB)
does not travel. So the check runs on a model with SmolLM2's exact shape and
random weights, made there from this bundle:

    python tools/gpu_bundle.py bundle  [--out build/gpu-bundle]   # `make gpu-bundle`: here, with the venv
    python tools/gpu_bundle.py model   --bundle B --out DIR [--tiny]  # there (gpu_check.sh calls it)
    python tools/gpu_bundle.py lengths [--out minicb/data/chat_output_lengths.json]  # the real model, on CPU

The bundle (at most 60 MiB; `bundle` prints its size and fails over it):
    site/         pure-Python packages of minicb's that a CUDA image may lack (gguf),
                  copied unpacked from this environment, so python3 finds them on PYTHONPATH
    smollm2/      SmolLM2-135M-Instruct's config.json and tokenizer files, no weights
    chat_output_lengths.json  how many tokens the real model answered to each of the
                  bench's chat prompts (greedy, fp32, CPU): random weights have no
                  natural end, so the GPU bench replays these lengths with EOS ignored
    manifest.json what is inside, and how it was made

Only pure-Python packages can travel this way: a compiled one (tokenizers,
safetensors) would have to match the other machine's Python and platform, so the
GPU machine must have those itself, beside torch and Triton. A CUDA image with
PyTorch usually does; gpu_check.sh's preflight names any import that is missing.
What minicb imports on the GPU path: torch, triton, numpy, safetensors,
transformers (with tokenizers and jinja2: the tokenizer, the chat template, the HF
engines), tqdm and matplotlib (the bench). Not gguf: the GGUF file stays here.
gguf travels all the same, as minicb's own dependency, small and pure Python.

`lengths` takes minutes (64 prompts, up to 256 tokens each, on the real model);
its output is committed as minicb/data/chat_output_lengths.json, so `bundle`
only copies it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's minicb, whatever is installed
LENGTHS = REPO / "minicb" / "data" / "chat_output_lengths.json"
PURE_PYTHON = ["gguf"]  # minicb's own dependencies that are pure Python and missing on the CUDA image
MAX_BYTES = 60 * 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_pure_python(name: str, site: pathlib.Path) -> list[str]:
    """Copy an installed pure-Python distribution's files (package and .dist-info) under site/.

    That is what unpacking its wheel gives, so `PYTHONPATH=site` imports it. Raises
    if the distribution is not pure Python (a compiled module would not run elsewhere).
    """
    dist = importlib.metadata.distribution(name)
    wheel = dist.read_text("WHEEL") or ""
    if "Root-Is-Purelib: true" not in wheel:
        raise SystemExit(f"{name} is not a pure-Python distribution (its WHEEL file says {wheel.strip()!r}); "
                         f"it cannot travel to another machine as files")
    copied = []
    for f in dist.files or []:
        parts = pathlib.PurePosixPath(str(f)).parts
        if parts[0] == ".." or "__pycache__" in parts:  # console scripts live outside site-packages
            continue
        if str(f).endswith((".so", ".pyd", ".dylib")):
            raise SystemExit(f"{name} holds a compiled file {f}; it cannot travel as files")
        target = site / str(f)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(dist.locate_file(f), target)
        copied.append(str(f))
    return copied


def folder_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def make_bundle(out: pathlib.Path) -> int:
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import GGUF_PACKAGE, resolve_checkpoint

    if not LENGTHS.is_file():
        raise SystemExit(f"{LENGTHS} is missing; make it with `python tools/gpu_bundle.py lengths` (minutes)")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    packages = {}
    for name in PURE_PYTHON:
        packages[name] = importlib.metadata.version(name)
        copy_pure_python(name, out / "site")
    # The real model's config (converted from the GGUF once, then cached) and its tokenizer.
    smollm2 = out / "smollm2"
    smollm2.mkdir()
    shutil.copyfile(resolve_checkpoint(None) / "config.json", smollm2 / "config.json")
    load_tokenizer(None).hf.save_pretrained(str(smollm2))
    for extra in set(p.name for p in smollm2.iterdir()) - set(TOKENIZER_FILES) - {"config.json"}:
        (smollm2 / extra).unlink()  # keep only what AutoTokenizer needs
    shutil.copyfile(LENGTHS, out / LENGTHS.name)
    size = folder_bytes(out)
    manifest = {
        "made": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python tools/gpu_bundle.py " + " ".join(sys.argv[1:]),
        "python": sys.version.split()[0],
        "site_packages": packages,
        "model": f"SmolLM2-135M-Instruct config and tokenizer, from the {GGUF_PACKAGE} package",
        "lengths": LENGTHS.name,
        "bytes": size,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = folder_bytes(out)
    print(f"gpu bundle: {out} holds {size / 2**20:.1f} MiB ({size:,} bytes; the limit is {MAX_BYTES // 2**20} MiB)")
    for p in sorted(out.iterdir()):
        bytes_ = folder_bytes(p) if p.is_dir() else p.stat().st_size
        print(f"  {p.name:28} {bytes_ / 2**20:7.2f} MiB")
    if size > MAX_BYTES:
        print(f"gpu bundle: {size / 2**20:.1f} MiB is over the {MAX_BYTES // 2**20} MiB limit", file=sys.stderr)
        return 1
    return 0


def tiny_shape(cfg):
    """SmolLM2's vocabulary and special tokens on a 2-layer body: the dry run's model on a CPU."""
    from dataclasses import replace
    return replace(cfg, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


def make_model(bundle: pathlib.Path, out: pathlib.Path, tiny: bool, seed: int) -> int:
    """An HF checkpoint directory: SmolLM2's config (or its tiny cut), random weights, SmolLM2's tokenizer.

    minicb (`--model DIR`) and HF transformers load the very same files, as in the bench on the real model.
    """
    from minicb.model import random_model
    from minicb.weights import config_from_hf, save_checkpoint

    cfg = config_from_hf(json.loads((bundle / "smollm2" / "config.json").read_text()))
    if tiny:
        cfg = tiny_shape(cfg)
    model = random_model(cfg, seed=seed)
    save_checkpoint(out, cfg, model.state_dict())
    for name in TOKENIZER_FILES:
        if (bundle / "smollm2" / name).is_file():
            shutil.copyfile(bundle / "smollm2" / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"{params / 1e6:.1f}M parameters, random weights (seed {seed})")
    return 0


def make_lengths(out: pathlib.Path, num_prompts: int, max_tokens: int, slots: int) -> int:
    """The real model's answer length to each of the bench's first chat prompts: greedy, fp32, CPU."""
    import time

    from minicb.bench.workloads import chat_requests
    from minicb.llm import LLM
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    model, tokenizer = load_model(None, device="cpu"), load_tokenizer(None)
    requests = chat_requests(tokenizer, num_prompts, max_tokens)
    llm = LLM.from_model(model, tokenizer, max_num_seqs=slots, keep_traces=0)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in requests], [r.params() for r in requests])
    seconds = time.perf_counter() - start
    record = {
        "about": "Output lengths of SmolLM2-135M-Instruct (the embedded GGUF, fp32, CPU, greedy) on the bench's "
                 "first chat prompts (minicb.bench.workloads.chat_requests). The GPU bench replays them on random "
                 "weights: `python -m minicb bench --lengths-json THIS`.",
        "command": f"python tools/gpu_bundle.py lengths --num-prompts {num_prompts} --max-tokens {max_tokens}",
        "date": datetime.date.today().isoformat(),
        "max_tokens": max_tokens,
        "prompt_lengths": [len(r.prompt_ids) for r in requests],
        "output_lengths": [len(o.token_ids) for o in outs],
        "finish_reasons": [o.finish_reason for o in outs],
    }
    out.write_text(json.dumps(record) + "\n")
    lengths = record["output_lengths"]
    print(f"wrote {out}: {len(lengths)} answers, {sum(lengths)} tokens in {seconds:.0f} s, "
          f"{sum(r == 'length' for r in record['finish_reasons'])} cut at {max_tokens}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bundle", help="make the bundle (make gpu-bundle)")
    b.add_argument("--out", type=pathlib.Path, default=REPO / "build" / "gpu-bundle")
    m = sub.add_parser("model", help="an HF checkpoint dir: SmolLM2's shape, random weights, its tokenizer")
    m.add_argument("--bundle", type=pathlib.Path, default=REPO / "build" / "gpu-bundle")
    m.add_argument("--out", type=pathlib.Path, required=True)
    m.add_argument("--tiny", action="store_true", help="2 layers, hidden 64: the dry run on a CPU")
    m.add_argument("--seed", type=int, default=0)
    n = sub.add_parser("lengths", help="the real model's answer lengths on the chat prompts (minutes, CPU)")
    n.add_argument("--out", type=pathlib.Path, default=LENGTHS)
    n.add_argument("--num-prompts", type=int, default=64)
    n.add_argument("--max-tokens", type=int, default=256)
    n.add_argument("--slots", type=int, default=32)
    args = ap.parse_args(argv)
    if args.command == "bundle":
        return make_bundle(args.out)
    if args.command == "model":
        return make_model(args.bundle, args.out, args.tiny, args.seed)
    return make_lengths(args.out, args.num_prompts, args.max_tokens, args.slots)


if __name__ == "__main__":
    sys.exit(main())
