"""Where a benchmark run's time goes in minicb-continuous: its steps by kind, from the engine's own traces.

    .venv/bin/python tools/step_kinds.py                   # the README's chat run: 48 prompts, 128 tokens, 32 slots
    .venv/bin/python tools/step_kinds.py --rounds 2 -- --workload chat --num-prompts 16 --slots 8

It builds the workload and the engine exactly as `python -m minicb bench` does
(the arguments after `--` are the bench's), runs it once to warm up and then
`--rounds` times on the clock, and sorts every step of the timed runs by what
its forward computed (minicb.viz.token_split):

    prefill        prompt tokens only (in the chat run, the first step: the first batch of prompts)
    mixed          prompt tokens beside decoding rows: a request takes a freed slot
    decode a-b     decoding rows only, a to b of them (four ranges of the slots)

For each kind: the steps, their seconds, their share of the run and the median
step. The bench says how fast a run is; this says which steps a faster one must
shorten. A decode step's own pieces are tools/step_floor.py's.
"""
from __future__ import annotations

import argparse
import statistics
import time

from minicb.viz import token_split


def step_kind(split: dict[str, int], slots: int, bins: int = 4) -> str:
    """A step's kind from its token split: "prefill", "mixed", or "decode a-b" (rows in one of `bins` ranges)."""
    if split["prefill"]:
        return "mixed" if split["decode"] else "prefill"
    width = -(-slots // bins)  # ceil: 32 slots in 4 bins -> 1-8, 9-16, 17-24, 25-32
    low = (split["decode"] - 1) // width * width + 1
    high = min(low + width - 1, slots)
    return f"decode {low}-{high}" if high > low else f"decode {low}"


def tally(traces, slots: int) -> dict[str, dict]:
    """kind -> {"steps", "seconds", "prompt_tokens", "decode_tokens", "times"} over the traces, in kind order."""
    table: dict[str, dict] = {}
    for trace, split in zip(traces, token_split(traces)):
        row = table.setdefault(step_kind(split, slots),
                               {"steps": 0, "seconds": 0.0, "prompt_tokens": 0, "decode_tokens": 0, "times": []})
        row["steps"] += 1
        row["seconds"] += trace.time_s
        row["prompt_tokens"] += split["prefill"]
        row["decode_tokens"] += split["decode"]
        row["times"].append(trace.time_s)

    def order(kind: str) -> tuple[int, int]:  # prefill, mixed, then decodes by their fewest rows
        return (2, int(kind.split()[1].split("-")[0])) if kind.startswith("decode") else (kind == "mixed", 0)
    return {kind: table[kind] for kind in sorted(table, key=order)}


def markdown(table: dict[str, dict], wall_s: float) -> str:
    lines = ["| steps | count | seconds | share of the run | median step ms | prompt tokens | decode tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, row in table.items():
        lines.append(f"| {kind} | {row['steps']} | {row['seconds']:.2f} | {row['seconds'] / wall_s:.0%} | "
                     f"{statistics.median(row['times']) * 1e3:.1f} | {row['prompt_tokens']} | {row['decode_tokens']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="timed runs after the warm-up, each its own table")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then arguments for python -m minicb bench")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}; it must be >= 1")
    from minicb.bench.cli import minicb_engine_configs, parse_args
    from minicb.bench.machine import cpu_model
    from minicb.bench.runners import kv_blocks_for
    from minicb.bench.workloads import build_requests
    from minicb.cpu_attention import set_num_threads
    from minicb.llm import LLM
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    bench = parse_args([a for a in args.bench if a != "--"]
                       or ["--workload", "chat", "--num-prompts", "48", "--max-tokens", "128", "--slots", "32"])
    if bench.workload == "all":
        ap.error("give the bench one --workload")
    if bench.threads:
        set_num_threads(bench.threads)
    model = load_model(bench.model, device=bench.device, dtype=bench.dtype, packed=not bench.unpacked)
    tokenizer = load_tokenizer(bench.model)
    requests, arrivals, description = build_requests(bench.workload, bench, tokenizer, model.config.vocab_size)
    config = minicb_engine_configs(bench, kv_blocks_for(requests, bench.max_num_seqs, bench.block_size))
    print(f"{description}; minicb-continuous, {bench.max_num_seqs} slots; CPU: {cpu_model()}")
    for run in range(1 + args.rounds):
        # A new engine each run: nothing cached from the run before.
        llm = LLM.from_model(model, tokenizer, **config["minicb-continuous"])
        began = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in requests], [r.params() for r in requests],
                            use_tqdm=False, arrival_times=arrivals)
        wall_s = time.perf_counter() - began
        if run == 0:
            continue  # the warm-up
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"\nround {run}: {wall_s:.2f} s, {tokens} tokens, {tokens / wall_s:.1f} tok/s, "
              f"{len(llm.traces)} steps ({sum(t.time_s for t in llm.traces):.2f} s inside steps)")
        print(markdown(tally(llm.traces, bench.max_num_seqs), wall_s))


if __name__ == "__main__":
    main()
