"""Throughput of this checkout's engine against an older commit's, in one process, in turns.

Two engines in two processes differ by 15-25% on a shared machine from the
processes alone (thread pools, memory placement), which hides a change of a
few percent. Here the old commit's `minicb` package is extracted from git
under another name, both engines run the same workload (greedy, or sampled with
`--temperature`, each request seeded) on the same loaded weights, and the runs
alternate (old, new, new, old, ...), so drift in the machine's load falls on both.

    python tools/ab_engine.py 946091c                       # 48 chat prompts, 64 tokens, 4 rounds
    python tools/ab_engine.py 946091c --num-prompts 32 --max-tokens 96 --rounds 6
    python tools/ab_engine.py 8353540 --temperature 1                # sampled requests
    python tools/ab_engine.py 2313caf --temperature 1 --top-p 0.9    # sampled from the nucleus

Prints each run's tokens/s and the new/old ratio of every round.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def extract(commit: str, into: pathlib.Path) -> None:
    """Write `commit`'s minicb/ as the package `minicb_old` under `into`, its imports renamed."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "minicb"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(into)], input=archive, check=True)
    (into / "minicb").rename(into / "minicb_old")
    for path in (into / "minicb_old").rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom minicb([. ])", r"from minicb_old\1", text)
        text = re.sub(r"\bimport minicb\.", "import minicb_old.", text)
        text = text.replace('import_module(f"minicb.', 'import_module(f"minicb_old.')  # impl.load
        path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commit", help="the older commit to compare against")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled, request i seeded with i")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: sample from this nucleus")
    args = ap.parse_args()
    if args.top_p != 1.0 and args.temperature == 0:
        ap.error(f"--top-p {args.top_p} needs --temperature above 0: greedy requests take no nucleus")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="minicb-ab-"))
    extract(args.commit, tmp)
    sys.path.insert(0, str(tmp))
    import minicb.engine as new
    import minicb.sampling as new_sampling
    import minicb_old.engine as old
    import minicb_old.sampling as old_sampling
    from minicb.bench.workloads import chat_requests
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    model = load_model(None)
    requests = chat_requests(load_tokenizer(None), args.num_prompts, args.max_tokens)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    blocks = args.slots * (-(-longest // 16) + 1)  # room for every slot: no preemption in either engine

    def run(engine_module, sampling_module) -> float:
        engine = engine_module.Engine(model, engine_module.EngineConfig(max_num_seqs=args.slots, num_blocks=blocks))
        for i, r in enumerate(requests):
            sampled = {"temperature": args.temperature, "top_p": args.top_p, "seed": i} if args.temperature > 0 else {}
            engine.add_request(r.prompt_ids, sampling_module.SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                                                            **sampled))
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished():
            tokens += len(engine.step().new_tokens)
        return tokens / (time.perf_counter() - start)

    engines = {"old": (old, old_sampling), "new": (new, new_sampling)}
    results = {"old": [], "new": []}
    with torch.inference_mode():
        run(new, new_sampling)  # warm-up
        for i in range(args.rounds):
            for name in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
                results[name].append(run(*engines[name]))
                print(f"round {i} {name} ({args.commit if name == 'old' else 'this checkout'}): "
                      f"{results[name][-1]:.1f} tok/s", flush=True)
    ratios = [n / o for n, o in zip(results["new"], results["old"])]
    print("new/old by round: " + " ".join(f"{r:.3f}" for r in ratios)
          + f"; geometric mean {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
