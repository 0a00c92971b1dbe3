"""`python -m minicb demo` (and `make demo`): static vs continuous batching on a real model.

The same bundled chat prompts run twice on SmolLM2, with the same number of
slots: once with chapter 02's static batcher, once with chapter 06's engine.
The terminal shows both slot timelines (rows are slots, columns are steps; a
letter is a request, upper case while it prefills), a few answers, and a
summary table; a PNG of both timelines is saved.

With MINICB_IMPL=student the engine runs on your exercise code: MINICB_IMPL_ONLY=block_allocator,scheduler
names which modules (the demo prints them); without it, every chapter's, unfinished ones too.
"""
from __future__ import annotations

import os
import pathlib
import statistics
import time


def finish_times(traces) -> dict[int, float]:
    """Seconds from the start of the run until each request's last token, from the traces alone."""
    # Every request is queued at time 0, so the moment its last token appears is
    # its latency. Steps run back to back: summing step times gives the clock.
    elapsed, done = 0.0, {}
    for t in traces:
        elapsed += t.time_s
        for rid, _ in t.finished:
            done[rid] = elapsed
    return done


def latency_verdict(static_s: float, continuous_s: float) -> str:
    """What the mean latencies say, in words that match the numbers: lower, higher or the same."""
    if continuous_s < static_s:
        return f"mean latency {static_s / continuous_s:.2f}x lower with continuous batching"
    if continuous_s > static_s:
        return (f"mean latency {continuous_s / static_s:.2f}x HIGHER with continuous batching "
                f"(chapters/06-continuous-batching/README.md, \"When refilling cannot win\", says when and why)")
    return "the same mean latency"


def summary_row(name: str, traces, num_output_tokens: int) -> dict:
    from minicb.viz import summarize

    # Everything comes from the StepTraces both engines emit, so the two rows are
    # computed the same way and the comparison is fair by construction.
    s = summarize(traces)
    latencies = list(finish_times(traces).values())
    return {"engine": name, "steps": s["steps"], "seconds": s["time_s"],
            "tok/s": num_output_tokens / s["time_s"], "mean latency (s)": statistics.mean(latencies),
            "utilisation": s["utilisation"], "idle slot-steps": s["idle_slot_steps"],
            "evictions": s["evictions"], "refills": s["refills"]}


def main(args) -> int:
    import torch

    from minicb.cli_args import engine_config
    from minicb.data import load_chat_prompts
    from minicb.llm import LLM
    from minicb.sampling import SamplingParams
    from minicb.static_batching import run_static
    from minicb.tokenizer import load_tokenizer
    from minicb.viz import plot_side_by_side, timeline_text
    from minicb.weights import load_model

    t0 = time.perf_counter()
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    print(f"loaded {model.config.architecture} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) "
          f"on {model.device} in {time.perf_counter() - t0:.1f} s; torch threads: {torch.get_num_threads()}")
    questions = load_chat_prompts(args.num_prompts)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    # Greedy, so both engines must produce the same tokens: any difference in the
    # summary comes from scheduling, never from different answers.
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy
    print(f"{len(prompts)} chat prompts, {args.max_num_seqs} slots, greedy, max_tokens {args.max_tokens}")
    png = pathlib.Path(args.png).resolve()
    replacing = " (it replaces the one there: --png PATH writes elsewhere)" if png.exists() else ""
    print(f"the slot timelines will be drawn to {png}{replacing}\n")

    # Static: prompts go in fixed batches of `slots`; each batch runs until its
    # longest answer ends, and finished rows sit idle (the grey in the timeline).
    print("static batching (chapter 02) ...", flush=True)
    static = run_static(model, prompts, params, batch_size=args.max_num_seqs)
    print("continuous batching (chapter 06) ...", flush=True)
    # Continuous: the same number of slots, but a finished request leaves at once
    # and the next waiting one takes its slot in the following step.
    # The engine takes every engine flag (--max-num-seqs / --slots, --attention, ...).
    llm = LLM.from_model(model, tokenizer, **engine_config(args))
    # Say exactly whose code runs: the engine's parts know which file each came from.
    yours, ours = llm.engine.parts.students(), llm.engine.parts.references()
    if yours:
        print(f"  the engine runs your {', '.join(yours)}" + (f" and the reference {', '.join(ours)}" if ours else ""))
    try:
        outputs = llm.generate(prompts, params)
    except NotImplementedError as e:
        print(f"\nyour exercise code is not finished yet: {e}")
        return 1
    continuous = llm.traces

    # Colour only on a terminal; piped output (logs, CI) stays plain text.
    for name, traces in (("static batching", static.traces), ("continuous batching", continuous)):
        print(f"\n== {name}: slot timeline ==")
        print(timeline_text(traces, color=os.isatty(1)))

    # The correctness side of the comparison: how many answers are token-for-token equal.
    same = sum(g.token_ids == o.token_ids for g, o in zip(static.generations, outputs))
    print(f"\n== a few answers (static and continuous agree on {same} of {len(prompts)}) ==")
    for q, o in list(zip(questions, outputs))[:3]:
        print(f"Q: {q}\nA: {o.text.strip()[:300]}\n")

    # Throughput counts only the tokens a user receives, not padding or idle rows.
    n_static = sum(len(g.token_ids) for g in static.generations)
    n_cont = sum(len(o.token_ids) for o in outputs)
    rows = [summary_row("static", static.traces, n_static), summary_row("continuous", continuous, n_cont)]
    print("== summary (same prompts, same slots, one run) ==")
    print(f"{'engine':<11} {'steps':>6} {'seconds':>8} {'tok/s':>7} {'mean latency':>13} {'utilisation':>12} "
          f"{'idle slot-steps':>16} {'refills':>8}")
    for r in rows:
        print(f"{r['engine']:<11} {r['steps']:>6} {r['seconds']:>8.1f} {r['tok/s']:>7.1f} "
              f"{r['mean latency (s)']:>12.1f}s {r['utilisation']:>12.1%} {r['idle slot-steps']:>16} {r['refills']:>8}")
    print(f"continuous / static: {rows[1]['tok/s'] / rows[0]['tok/s']:.2f}x tok/s; " + latency_verdict(
        rows[0]["mean latency (s)"], rows[1]["mean latency (s)"]))

    # The same two timelines as a picture (docs/results.md shows one).
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_side_by_side(static.traces, continuous, path=str(png))
    print(f"wrote the slot timelines to {png}  (total {time.perf_counter() - t0:.0f} s)")
    return 0
