"""The benchmark: minicb's three engines against HF transformers, on the same weights.

In this package you will learn how to measure a serving engine honestly:
every engine sees the same prompts, the same greedy parameters and the same
clock; the ratios come from one run, so noise hits them all alike; and before
anything is timed, static and continuous batching must give naive's greedy
tokens on 4 prompts, or the run stops.

    python -m minicb bench                        # the chat workload, 100 prompts
    python -m minicb bench --quick                # every engine, 8 prompts, 16 tokens
    python -m minicb bench --workload all --out build/bench/bench.json

One concern per file, in the order a run uses them:
    workloads.py   the requests (chat, random, poisson) and their arrival times
    runners.py     the five engines behind one call, timed by a forward hook
    metrics.py     throughput, latency, TTFT, TPOT, utilisation, busy slots, KV waste
    report.py      the markdown table, the JSON file and the PNG
    cli.py         the command line that runs them in that order

It is a benchmark, not a test: timings on a shared CPU are noisy (try --threads 1
when other jobs run). tests/tools/test_bench.py checks that what it reports is computed right.

The metrics need neither torch nor a model, so they are importable from here too
(`from minicb.bench import percentile`).
"""
from minicb.bench.metrics import (RequestTiming, busy_slot_steps, paged_kv_at_peak, percentile,
                                  static_batch_tokens, summarize_timings, tpot, waste_pct)

__all__ = ["RequestTiming", "busy_slot_steps", "paged_kv_at_peak", "percentile", "static_batch_tokens",
           "summarize_timings", "tpot", "waste_pct"]
