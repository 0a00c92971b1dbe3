"""Throughput on a busy machine: the same bench alone and beside busy-loop processes.

    .venv/bin/python tools/busy_bench.py          # 2 busy loops; minicb's default, fixed threads, PASSIVE
    .venv/bin/python tools/busy_bench.py --busy 1 --settings "GOMP_SPINCOUNT=10000" -- --slots 8
    .venv/bin/python tools/busy_bench.py --rounds 3 --settings "OMP_WAIT_POLICY=PASSIVE" "GOMP_SPINCOUNT=3000"

A learner's laptop runs a browser and Jupyter beside the engine. This runs
`python -m minicb bench` (the arguments after `--`; by default 16 chat prompts,
64 tokens, 8 slots, minicb-continuous only) in fresh processes: for each setting,
once alone and once while `--busy` processes spin a Python loop
each; with `--rounds N`, N rounds of every setting in turn (alone, busy, next
setting, ...), so that drift falls on all of them. It prints each run's tokens/s
and the cores the engine used (its CPU seconds over the run's seconds, all
threads, spinning included: beside the busy loops, the share the scheduler gave
it), then each setting's median: what share of its idle throughput the busy run
kept, and its idle throughput against the best setting's.

Each setting is environment variables for the bench process, space-separated
NAME=VALUE pairs, and flags of the bench for that setting alone
(`"OMP_WAIT_POLICY= --cpu-threads fixed"`: the engine keeps its threads
whatever the load, where minicb's default, `--cpu-threads share`, runs on the
cores the busy loops leave). OMP_WAIT_POLICY=PASSIVE lets an OpenMP thread that waits for
work sleep at once; an empty OMP_WAIT_POLICY, which libgomp ignores, keeps
libgomp's own rule (spin up to GOMP_SPINCOUNT times, then sleep); ACTIVE spins.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DEFAULT_BENCH = ["--workload", "chat", "--num-prompts", "16", "--max-tokens", "64", "--slots", "8",
                 "--engines", "minicb-continuous"]


def bench_run(bench_args: list[str], setting: str) -> tuple[float, float]:
    """One bench process with the setting's variables and flags; the first engine's output tokens/s and cores used."""
    words = setting.split()
    # A flag, and the value after it, go to the bench (e.g. --cpu-threads fixed); NAME=VALUE to the environment.
    is_flag = [w.startswith("--") or (i > 0 and words[i - 1].startswith("--") and "=" not in w)
               for i, w in enumerate(words)]
    flags = [w for w, flag in zip(words, is_flag) if flag]
    env = dict(os.environ, **dict(w.split("=", 1) for w, flag in zip(words, is_flag) if not flag))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        subprocess.run([sys.executable, "-m", "minicb", "bench", *bench_args, *flags, "--out", out], env=env,
                       check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = json.load(open(out))
    workload = next(iter(result["workloads"].values()))
    row = next(iter(workload["engines"].values()))
    return row["output_tok_s"], row["cores"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the busy runs")
    ap.add_argument("--settings", nargs="+",
                    default=["OMP_WAIT_POLICY=", "OMP_WAIT_POLICY= --cpu-threads fixed",
                             "OMP_WAIT_POLICY=PASSIVE --cpu-threads fixed"],
                    help="environments to compare, each space-separated NAME=VALUE pairs")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds; each runs every setting alone then busy, in turn, and a row is the median round")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then arguments for python -m minicb bench")
    args = ap.parse_args()
    bench_args = [a for a in args.bench if a != "--"] or DEFAULT_BENCH
    from minicb.bench.machine import cpu_model
    print(f"python -m minicb bench {' '.join(bench_args)}; {args.busy} busy loop(s) beside the busy runs; "
          f"CPU: {cpu_model()}, {os.cpu_count()} cores; {args.rounds} round(s), settings in turns")
    runs = {setting: [] for setting in args.settings}  # setting -> [((tok/s, cores) alone, busy)] per round
    for _ in range(args.rounds):
        for setting in args.settings:
            alone = bench_run(bench_args, setting)
            loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            try:
                busy = bench_run(bench_args, setting)
            finally:
                for p in loops:
                    p.kill()
                    p.wait()
            runs[setting].append((alone, busy))
            print(f"  {setting or '(none)'}: alone {alone[0]:.1f} tok/s on {alone[1]:.2f} cores, "
                  f"busy {busy[0]:.1f} tok/s on {busy[1]:.2f} cores", flush=True)
    best_alone = max(statistics.median(a[0] for a, _ in r) for r in runs.values())
    print("| setting | alone tok/s | busy tok/s | busy / alone | alone / best alone | cores alone | cores busy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for setting, r in runs.items():
        alone, busy = statistics.median(a[0] for a, _ in r), statistics.median(b[0] for _, b in r)
        cores_alone, cores_busy = statistics.median(a[1] for a, _ in r), statistics.median(b[1] for _, b in r)
        print(f"| `{setting}` | {alone:.1f} | {busy:.1f} | {busy / alone:.0%} | {alone / best_alone:.0%} | "
              f"{cores_alone:.2f} | {cores_busy:.2f} |")


if __name__ == "__main__":
    main()
