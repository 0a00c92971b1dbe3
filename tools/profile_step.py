"""Where one decode step's time goes: continuous (paged) vs static (padded) batching.

    .venv/bin/python tools/profile_step.py                # 32 sequences, ~150-180 tokens of context
    .venv/bin/python tools/profile_step.py --seqs 8 --context 400

Both engines get the same batch of random prompts on the real model. After the
prefill and a few warm-up steps, they take `--steps` decode steps on the clock
in turns (continuous, static, continuous, ...), so that load from other
programs on a shared machine falls on both alike, then a few more each under
torch.profiler. Both take a whole step of the same kind: the engine's
`step()` (schedule, prepare, forward, sample, postprocess) against a padded
step that, like chapter 02's `run_batch`, runs the forward, `sample()` and each
row's stop check. Then the two forwards alone, also in turns. The script prints
the median of each and the profiler's top operators. The ratios of the medians
are the figures to read.
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
from minicb.model_runner import prepare
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample
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

    # Static: chapter 02's padded cache, driven by hand. A step does what a decode
    # step of run_batch does: the forward, sample() with each row's generator and
    # params, and each row's stop check (its step traces and counters left out).
    ids, padding_mask, positions = left_pad(prompts, pad_id=0, device=model.device)
    cache = PaddedKVCache(model, padding_mask, ids.shape[1] + 2 * budget)
    model(ids, positions, cache, logits_at=torch.full((args.seqs, 1), ids.shape[1] - 1))
    cache.advance(ids.shape[1])
    generators = [make_generator(params, model.device) for _ in prompts]
    cfg = model.config
    state = {"pos": positions[:, -1:] + 1, "tok": torch.randint(100, 1000, (args.seqs, 1)), "n": 0}

    def padded_forward():
        return model(state["tok"], state["pos"], cache)  # [S, 1, V]

    def static_step():
        logits = padded_forward()
        tokens = sample(logits[:, -1], [params] * args.seqs, generators)
        state["n"] += 1
        for row, token in enumerate(tokens):
            finish_reason(token, state["n"], params, cfg.eos_token_ids, len(prompts[row]) + state["n"],
                          cfg.max_position_embeddings)
        state["tok"] = torch.tensor(tokens)[:, None]
        cache.advance(1)
        state["pos"] = state["pos"] + 1

    for _ in range(3):
        static_step()

    # The static cache grows by one column per static_step; the forward-only
    # comparison below reuses the last column, like the paged one reuses its step.
    def padded_forward_in_place():
        cache.seq_len -= 1
        padded_forward()
        cache.advance(1)

    continuous, static = median_seconds_in_turns([engine.step, static_step], args.steps)
    continuous_ops, static_ops = top_ops(engine.step, 5, args.rows), top_ops(static_step, 5, args.rows)

    # The paged forward alone: the next step's batch through the engine's runner, again
    # and again (its few input tensors and the attention metadata are built each time,
    # as every step builds them). It rewrites the same K/V slots each time, which changes
    # nothing; the engine is not stepped after this, so its half-taken step never matters.
    batch = prepare(engine.scheduler.schedule(), engine.allocator)

    def paged_forward():
        engine.runner.forward(batch)  # [S, V]

    paged, padded = median_seconds_in_turns([paged_forward, padded_forward_in_place], args.steps)
    print(f"{args.seqs} sequences, context {args.context}-{args.context + 30}, torch threads "
          f"{torch.get_num_threads()}; median of {args.steps} runs of each, in turns:")
    print(f"  whole step   continuous {continuous * 1e3:.0f} ms (engine.step: schedule, prepare, forward, sample, "
          f"postprocess)\n               static {static * 1e3:.0f} ms (forward, sample, stop checks), "
          f"ratio {continuous / static:.2f}")
    print(f"  forward only paged {paged * 1e3:.0f} ms, padded {padded * 1e3:.0f} ms, ratio {paged / padded:.2f}")
    print("\ncontinuous (engine.step)")
    print(continuous_ops)
    print("static (padded forward, sample, stop checks)")
    print(static_ops)


if __name__ == "__main__":
    main()
