"""Where one decode step's time goes: continuous (paged) vs static (padded) batching.

    .venv/bin/python tools/profile_step.py                # 32 sequences, ~150-180 tokens of context
    .venv/bin/python tools/profile_step.py --seqs 8 --context 400

Both engines get the same batch of random prompts on the real model. After the
prefill and a few warm-up steps, they take `--steps` decode steps on the clock
in turns (continuous, static, continuous, ...), so that load from other
programs on a shared machine falls on both alike, then a few more each under
torch.profiler. The script prints the median step time of each and the
profiler's top operators. The ratio of the two medians is the figure to read.
The bench (`python -m minicb bench`) measures whole workloads; this looks
inside a step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import profile

from minicb.engine import Engine, EngineConfig
from minicb.sampling import SamplingParams
from minicb.static_batching import PaddedKVCache, left_pad
from minicb.weights import load_model


def median_seconds_in_turns(steps, num_steps: int) -> list[float]:
    """Run the step functions in turns, num_steps each; the median seconds of each."""
    times = [[] for _ in steps]
    for _ in range(num_steps):
        for step, seconds in zip(steps, times):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
    return [statistics.median(seconds) for seconds in times]


def top_ops(step, num_steps: int, rows: int) -> str:
    with profile() as prof:
        for _ in range(num_steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32, help="sequences decoding together (slots)")
    ap.add_argument("--context", type=int, default=150, help="shortest prompt; others are up to 30 tokens longer")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per engine")
    ap.add_argument("--rows", type=int, default=8, help="profiler rows to print")
    args = ap.parse_args()

    model = load_model()
    torch.manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.context + (i % 7) * 5,)).tolist() for i in range(args.seqs)]
    budget = 3 + 2 * args.steps + 10  # decode steps each engine will take, with room to spare
    params = SamplingParams(max_tokens=budget, ignore_eos=True)

    # Continuous: the chapter 06 engine, every slot decoding.
    engine = Engine(model, EngineConfig(max_num_seqs=args.seqs))
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # all prefills
    for _ in range(3):
        engine.step()

    # Static: chapter 02's padded cache, driven by hand so only the forward is timed.
    ids, padding_mask, positions = left_pad(prompts, pad_id=0, device=model.device)
    cache = PaddedKVCache(model, padding_mask, ids.shape[1] + budget)
    model(ids, positions, cache, logits_at=torch.full((args.seqs, 1), ids.shape[1] - 1))
    cache.advance(ids.shape[1])
    state = {"pos": positions[:, -1:] + 1, "tok": torch.randint(100, 1000, (args.seqs, 1))}

    def static_step():
        logits = model(state["tok"], state["pos"], cache)  # [S, 1, V]
        state["tok"] = logits[:, -1].argmax(-1, keepdim=True)
        cache.advance(1)
        state["pos"] = state["pos"] + 1

    for _ in range(3):
        static_step()

    continuous, static = median_seconds_in_turns([engine.step, static_step], args.steps)
    print(f"{args.seqs} sequences, context {args.context}-{args.context + 30}, torch threads "
          f"{torch.get_num_threads()}")
    print(f"median of {args.steps} steps in turns: continuous step {continuous * 1e3:.0f} ms, "
          f"static step {static * 1e3:.0f} ms, ratio {continuous / static:.2f}")
    print("\ncontinuous (engine.step: schedule, paged forward, sample, postprocess)")
    print(top_ops(engine.step, 5, args.rows))
    print("static (padded forward and argmax)")
    print(top_ops(static_step, 5, args.rows))


if __name__ == "__main__":
    main()
