"""What prefix caching costs when nothing is shared: its bookkeeping, timed inside the steps.

    .venv/bin/python tools/prefix_cache_overhead.py               # 32 random prompts, 48 new tokens
    .venv/bin/python tools/prefix_cache_overhead.py --num-prompts 16 --max-tokens 32

Random prompts share no prefix, so the cache can only cost. The engine runs
them on SmolLM2 with `enable_prefix_caching=True`, with every caching call of
the pool (`allocate_prefix`, `num_cached_tokens`, `free_blocks_needed`,
`cache_full_blocks`, `free`) wrapped in a timer. The script prints that time
as a share of the time spent in `engine.step()`. Both clocks run in the same
steps of the same process, so load from other programs on a shared machine
falls on both alike; a throughput ratio of two separate runs would drown the
effect in that noise.
"""
from __future__ import annotations

import argparse
import functools
import time

from minicb.bench.workloads import random_requests
from minicb.engine import Engine, EngineConfig
from minicb.weights import load_model

CACHING_CALLS = ("allocate_prefix", "num_cached_tokens", "free_blocks_needed", "cache_full_blocks", "free")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--slots", type=int, default=16)
    args = ap.parse_args()

    model = load_model(None, "cpu", "float32")
    engine = Engine(model, EngineConfig(max_num_seqs=args.slots, enable_prefix_caching=True))
    spent = {name: 0.0 for name in CACHING_CALLS}
    for name in CACHING_CALLS:
        method = getattr(engine.allocator, name)

        @functools.wraps(method)
        def timed(*call_args, _method=method, _name=name):
            start = time.perf_counter()
            try:
                return _method(*call_args)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(engine.allocator, name, timed)

    requests = random_requests(model.config.vocab_size, args.num_prompts, args.max_tokens,
                               args.max_prompt_len, seed=0)
    for request in requests:
        engine.add_request(request.prompt_ids, request.params())
    step_seconds, steps = 0.0, 0
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        step_seconds += time.perf_counter() - start
        steps += 1
    stats = engine.allocator.stats
    total = sum(spent.values())
    print(f"{args.num_prompts} random prompts (8-{args.max_prompt_len} tokens), up to {args.max_tokens} new tokens, "
          f"{args.slots} slots, prefix caching on: {steps} steps, {step_seconds:.1f} s in engine.step()")
    print(f"cache hits: {stats.hit_tokens} of {stats.query_tokens} prompt tokens")
    for name, seconds in spent.items():
        print(f"  {name:<20} {seconds * 1e3:8.1f} ms")
    print(f"caching bookkeeping: {total * 1e3:.1f} ms = {100 * total / step_seconds:.2f}% of the step time")


if __name__ == "__main__":
    main()
