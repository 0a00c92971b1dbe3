"""Throughput on a busy machine: the same bench alone and beside busy-loop processes.

    .venv/bin/python tools/busy_bench.py          # 2 busy loops; OMP_WAIT_POLICY=PASSIVE vs libgomp's default
    .venv/bin/python tools/busy_bench.py --busy 1 --settings "GOMP_SPINCOUNT=10000" -- --slots 8

A learner's laptop runs a browser and Jupyter beside the engine. This runs
`python -m minicb bench` (the arguments after `--`; by default 16 chat prompts,
64 tokens, 8 slots, minicb-continuous only) in fresh processes: for each setting,
once alone and once while `--busy` processes spin a Python loop
each, in the order alone, busy, alone, busy, ... so that drift falls on both.
It prints each run's tokens/s and what share of its idle throughput the busy
run kept.

Each setting is environment variables for the bench process, space-separated
NAME=VALUE pairs. OMP_WAIT_POLICY=PASSIVE lets an OpenMP thread that waits for
work sleep at once; an empty OMP_WAIT_POLICY, which libgomp ignores, keeps
libgomp's own rule (spin up to GOMP_SPINCOUNT times, then sleep); ACTIVE spins.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

DEFAULT_BENCH = ["--workload", "chat", "--num-prompts", "16", "--max-tokens", "64", "--slots", "8",
                 "--engines", "minicb-continuous"]


def bench_tok_s(bench_args: list[str], setting: str) -> float:
    """One bench process with the setting's variables; the first engine's output tokens/s."""
    env = dict(os.environ, **dict(pair.split("=", 1) for pair in setting.split()))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        subprocess.run([sys.executable, "-m", "minicb", "bench", *bench_args, "--out", out], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.load(open(out))
    workload = next(iter(result["workloads"].values()))
    return next(iter(workload["engines"].values()))["output_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the busy runs")
    ap.add_argument("--settings", nargs="+", default=["OMP_WAIT_POLICY=PASSIVE", "OMP_WAIT_POLICY="],
                    help="environments to compare, each space-separated NAME=VALUE pairs")
    ap.add_argument("--pairs", type=int, default=1, help="alone/busy pairs per setting")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then arguments for python -m minicb bench")
    args = ap.parse_args()
    bench_args = [a for a in args.bench if a != "--"] or DEFAULT_BENCH
    print(f"python -m minicb bench {' '.join(bench_args)}; {args.busy} busy loop(s) beside the busy runs")
    print("| setting | alone tok/s | busy tok/s | busy / alone |")
    print("|---|---:|---:|---:|")
    for setting in args.settings:
        for _ in range(args.pairs):
            alone = bench_tok_s(bench_args, setting)
            loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            try:
                busy = bench_tok_s(bench_args, setting)
            finally:
                for p in loops:
                    p.kill()
                    p.wait()
            print(f"| `{setting}` | {alone:.1f} | {busy:.1f} | {busy / alone:.0%} |", flush=True)


if __name__ == "__main__":
    main()
