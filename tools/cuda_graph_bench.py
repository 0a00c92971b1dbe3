"""Time decode steps with and without CUDA graphs (chapter 10's runner, minicb/cuda_graphs.py).

    python tools/cuda_graph_bench.py --seqs 32 --json build/graphs.json

Two engines hold the same sequences past their prefill, one with the eager
runner and one with DecodeGraphs; whole engine steps are timed in turns, then
the forward alone (eager against replay). On CUDA: SmolLM2's shape with random
weights, attention="triton". On a CPU there are no graphs: the runner's eager
path on tiny shapes, so this runs everywhere.
"""
from __future__ import annotations

import math
import statistics
import time

from minicb.triton_mode import choose_triton_mode

choose_triton_mode()  # before anything imports triton

import torch  # noqa: E402


def _decode_engines(model, attention: str, num_seqs: int, context: int, steps: int):
    """Two engines, graphs on and off, each holding num_seqs sequences past their prefill at `context` tokens."""
    from minicb.engine import Engine, EngineConfig
    from minicb.sampling import SamplingParams

    block_size = 16
    blocks = num_seqs * math.ceil((context + steps + 16) / block_size)
    engines = []
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=num_seqs, attention=attention, num_blocks=blocks,
                                            block_size=block_size, cuda_graphs=graphs))
        for i in range(num_seqs):
            prompt = [(7 * i + 13 * t) % (model.config.vocab_size - 10) + 10 for t in range(context)]
            engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        engine.step()  # every prompt, eagerly
        engines.append(engine)
    return engines


def _median_ms_in_turns(functions, repeats: int, cuda: bool) -> list[float]:
    """Each function `repeats` times, in turns, so load from other programs falls on all alike."""
    times = [[] for _ in functions]
    for _ in range(repeats):
        for fn, seconds in zip(functions, times):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    return [1000 * statistics.median(s) for s in times]


def main(argv=None) -> None:
    import argparse
    import json

    from minicb.model import ModelConfig, random_model, tiny_config

    parser = argparse.ArgumentParser(description="time decode steps with and without CUDA graphs")
    parser.add_argument("--seqs", type=int, default=32, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=256, help="tokens of context each sequence starts with")
    parser.add_argument("--steps", type=int, default=50, help="timed steps of each kind")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", help="write the figures to this file")
    opts = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        # SmolLM2-135M's shape with random weights: the time of a step does not depend on the weights.
        model = random_model(ModelConfig(), seed=0).to("cuda", getattr(torch, opts.dtype))
        attention, seqs, context, steps = "triton", opts.seqs, opts.context, opts.steps
    else:
        # No graphs on a CPU: the runner's eager path on tiny shapes, so this entry point runs everywhere.
        model = random_model(tiny_config(), seed=0)
        attention, seqs, context, steps = "torch", min(opts.seqs, 5), min(opts.context, 24), min(opts.steps, 3)
    eager, graphed = _decode_engines(model, attention, seqs, context, steps + 3)
    runner = graphed.runner
    for engine in (eager, graphed):  # warm-up: the first decode steps, off the clock
        engine.step()
    # Whole engine steps (schedule, prepare or copy into buffers, forward, sample, postprocess).
    step_ms = _median_ms_in_turns([eager.step, graphed.step], steps, cuda)
    # The forward alone, on the runner's buffers as the last step left them: eager vs replay.
    bucket = runner.bucket_for(seqs)
    meta = runner.metadata(bucket, [[runner.scratch_block]] * bucket, [1] * bucket, runner.scratch_slot)
    meta.host_block_tables = runner.block_tables[:bucket].cpu().tolist()
    meta.host_context_lens = runner.context_lens[:bucket].cpu().tolist()
    forwards = [lambda: runner.run_bucket(bucket, meta)]
    if bucket in runner.graphs:
        forwards.append(runner.graphs[bucket].replay)
    forward_ms = _median_ms_in_turns(forwards, steps, cuda)
    device = torch.cuda.get_device_name() if cuda else "cpu (no CUDA graphs: the runner runs eagerly)"
    report = {"device": device, "dtype": str(model.dtype).removeprefix("torch."), "attention": attention,
              "seqs": seqs, "bucket": bucket, "context": context, "steps": steps, "graphs": bool(runner.graphs),
              "step_ms": {"eager": step_ms[0], "graphs": step_ms[1]},
              "forward_ms": {"eager": forward_ms[0], "graphs": forward_ms[1] if len(forward_ms) > 1 else None}}
    print(f"{device}: {seqs} sequences (bucket {bucket}) at {context}+ tokens of context, {report['dtype']}, "
          f"attention={attention}, medians of {steps}")
    print(f"  engine step   eager {step_ms[0]:8.3f} ms   runner {step_ms[1]:8.3f} ms   "
          f"eager / runner {step_ms[0] / step_ms[1]:5.2f}x")
    if len(forward_ms) > 1:
        print(f"  forward only  eager {forward_ms[0]:8.3f} ms   replay {forward_ms[1]:8.3f} ms   "
              f"eager / replay {forward_ms[0] / forward_ms[1]:5.2f}x")
    else:
        print(f"  forward only  eager {forward_ms[0]:8.3f} ms   (no graph captured on this device)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
