"""Which matmul library runs each linear layer on a CPU: chosen by measuring, once, at load.

In this file you will learn why a serving engine on a CPU should time its own
matmuls rather than trust a default. torch offers two libraries for a float32
linear layer: Intel's MKL (`F.linear`, torch's default) and oneDNN, from a
weight packed once into its own blocked layout (minicb/packed_linear.py). Which
is faster depends on the CPU and on the number of rows: on this project's AMD
machine oneDNN was 1.1-1.9x MKL at every row count; on an Intel Xeon, MKL took
its fast path and was 1.4-2.7x oneDNN at one row (a single request decoding),
while oneDNN won at 32. A default right on one vendor is wrong on the other.

So `use_linear_backend` times both on the model's own weights, every layer of
each shape in one pass (cold, as a step reads them), at the row counts the
engine will run (1, a few, max_num_seqs), and keeps per shape a row threshold:
rows below it go to MKL, rows from it on to oneDNN. A `PackedLinear` keeps the
plain weight beside the packed one, so switching per call costs nothing.
`linear_backend` (EngineConfig) forces one library instead: "mkl" or "onednn";
"auto" measures.

Measuring SmolLM2 takes 0.4-1.3 s at 32 rows and 3.6 s at 256 (a 2-core AMD
EPYC), in every engine a process builds. So the engine keeps what it measured in a file
(`~/.cache/minicb/linear_choice.json`, or under `$MINICB_CACHE`), under a key
of everything the timings depend on: the CPU model, torch's version, the thread
count, the row counts and the model's shapes. The next engine with the same key
reads the timings back and decides from them as if it had just measured. A
machine of another CPU, a new torch or another `--threads` measures again; to
measure again on the same one, delete the file.

    choice = use_linear_backend(model, "auto", rows=[1, 4, 32])
    choice.describe()      # "576x576: mkl below 32 rows, onednn from 32; ..."

`pick_thresholds` is the decision alone, from timings, so a test can hand it
timings of its own and see it pick each library when it is the faster.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from minicb.bench.machine import cpu_model
from minicb.packed_linear import FusedLinears, PackedLinear, packed_layers

BACKENDS = ("auto", "mkl", "onednn")
ALWAYS_MKL = 2**62  # a threshold no row count reaches


@dataclass
class LinearChoice:
    """What was chosen: per (in, out) shape, the first row count that goes to oneDNN."""

    backend: str  # the setting: auto, mkl or onednn
    thresholds: dict[tuple[int, int], int] = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # (shape, rows, library) -> seconds, when measured
    seconds: float = 0.0  # what measuring cost
    note: str = ""  # why nothing was chosen, when nothing could be
    kept_in: str = ""  # the cache file the timings were read from, when they were not measured now

    def describe(self) -> str:
        if self.note:
            return f"{self.backend}: {self.note}"
        parts = []
        for (i, o), threshold in sorted(self.thresholds.items()):
            if threshold == 0:
                parts.append(f"{i}x{o} onednn")
            elif threshold >= ALWAYS_MKL:
                parts.append(f"{i}x{o} mkl")
            else:
                parts.append(f"{i}x{o} mkl below {threshold} rows, onednn from {threshold}")
        measured = ""
        if self.timings:
            kept = f", read from {self.kept_in}" if self.kept_in else ""
            measured = f" (measured in {self.seconds:.2f} s{kept})"
        return f"{self.backend}{measured}: " + "; ".join(parts)


def pick_thresholds(timings: dict, rows: list[int]) -> dict[tuple[int, int], int]:
    """Per shape, the row count from which oneDNN is used: the smallest r such that oneDNN was the
    faster at r and at every larger row count timed; ALWAYS_MKL if it never was at the largest.

    timings: (shape, rows, "mkl" | "onednn") -> seconds, for every shape and every r in `rows`.
    """
    shapes = sorted({shape for shape, _, _ in timings})
    rows = sorted(rows)
    thresholds = {}
    for shape in shapes:
        threshold = ALWAYS_MKL
        for r in reversed(rows):
            if timings[(shape, r, "onednn")] < timings[(shape, r, "mkl")]:
                threshold = r
            else:
                break
        thresholds[shape] = 0 if threshold == rows[0] else threshold
    return thresholds


def measure(layers: list[PackedLinear | FusedLinears], rows: list[int], repeats: int = 2) -> dict:
    """(shape, rows, library) -> seconds per product, for each shape, library and row count.

    Each figure is the best of `repeats` passes over every layer of that shape, divided by
    their number, the two libraries in turns. A step finds each weight cold, in memory
    (SmolLM2's are 424 MB), and so does a pass over 30 layers; timing one layer again and
    again would time its weight warm in the CPU's cache, where the faster library can be
    the other one: on an AMD EPYC (Zen 3) at one row, warm MKL beat the fused gate and up
    that, cold, ran 1.9x faster than it. A FusedLinears' shape is its stack's, (in, sum
    of outs), and its "mkl" is its layers one by one.
    """
    by_shape = {}
    for layer in layers:
        by_shape.setdefault((layer.in_features, layer.out_features), []).append(layer)
    timings = {}
    with torch.inference_mode():
        for shape, group in by_shape.items():
            for r in rows:
                x = torch.randn(r, shape[0])  # packed layers are float32
                passes = {"mkl": lambda: [m.plain(x) for m in group], "onednn": lambda: [m.onednn(x) for m in group]}
                group[0].plain(x), group[0].onednn(x)  # oneDNN makes its primitive for a new shape on first use
                best = dict.fromkeys(passes, float("inf"))
                for _ in range(repeats):
                    for library, one_pass in passes.items():
                        began = time.perf_counter()
                        one_pass()
                        best[library] = min(best[library], time.perf_counter() - began)
                for library, seconds in best.items():
                    timings[(shape, r, library)] = seconds / len(group)
    return timings


def timings_key(layers: list[PackedLinear | FusedLinears], rows: list[int]) -> str:
    """What measured timings depend on, as one string: CPU, torch, threads, row counts, shapes."""
    shapes = Counter(f"{m.in_features}x{m.out_features}" for m in layers)
    return (f"{cpu_model()}; torch {torch.__version__}; {torch.get_num_threads()} threads; rows "
            f"{','.join(map(str, sorted(rows)))}; " + ", ".join(f"{s} x{n}" for s, n in sorted(shapes.items())))


def read_timings(cache: pathlib.Path, key: str) -> tuple[dict, float] | None:
    """(timings, seconds they took) kept in `cache` under `key`, or None: no file, no such key, unreadable."""
    try:
        entry = json.loads(cache.read_text())[key]
        timings = {((i, o), r, library): t for i, o, r, library, t in entry["timings"]}
        return timings, float(entry["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unreadable file is measured again and written anew


def keep_timings(cache: pathlib.Path, key: str, timings: dict, seconds: float) -> None:
    """Add `timings` under `key` to `cache`, replacing the file whole, so a reader never sees half of it."""
    try:
        kept = json.loads(cache.read_text())
        kept = kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        kept = {}
    kept[key] = {"timings": [[i, o, r, library, t] for ((i, o), r, library), t in sorted(timings.items())],
                 "seconds": seconds, "measured": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps(kept, indent=1))
        os.replace(partial, cache)
    except OSError:
        pass  # a read-only home: this engine keeps its choice, the next one measures again


def measure_or_read(layers: list[PackedLinear | FusedLinears], rows: list[int],
                    cache: pathlib.Path | None) -> tuple[dict, float, str]:
    """(timings, the seconds measuring them took, the file they were read from or "")."""
    key = timings_key(layers, rows)
    kept = read_timings(cache, key) if cache is not None else None
    if kept is not None:
        return *kept, str(cache)
    began = time.perf_counter()
    timings = measure(layers, rows)
    seconds = time.perf_counter() - began
    if cache is not None:
        keep_timings(cache, key, timings, seconds)
    return timings, seconds, ""


def use_linear_backend(model, backend: str, rows: list[int], timings: dict | None = None,
                       cache: pathlib.Path | None = None) -> LinearChoice:
    """Set which library each of `model`'s linear layers uses, by row count; return the choice.

    backend "mkl" or "onednn" forces it; "auto" measures, or reads what an earlier measurement
    kept in the JSON file `cache` under the same key (None: always measure), or takes `timings`
    (for tests). A model whose linear layers are plain nn.Linear (load_model(packed=False), a
    model built by hand, or not a float32 model on a CPU) has only MKL's: "auto" and "mkl" leave
    it so, "onednn" is refused.
    """
    if backend not in BACKENDS:
        raise ValueError(f"linear_backend={backend!r} is not one of {list(BACKENDS)}")
    layers = packed_layers(model)
    if not layers:
        if backend == "onednn":
            raise ValueError("linear_backend='onednn' needs oneDNN-packed linear layers, and this model has none "
                             "(a model on a GPU or not in float32, load_model(packed=False), or one built by hand: "
                             "minicb.packed_linear.pack_linears packs a CPU float32 model); use 'auto' or 'mkl'")
        return LinearChoice(backend, note="no packed layers, so every matmul is MKL's (or the GPU's)")
    shapes = sorted({(m.in_features, m.out_features) for m in layers})
    seconds, kept_in = 0.0, ""
    if backend == "auto":
        if timings is None:
            timings, seconds, kept_in = measure_or_read(layers, rows, cache)
        thresholds = pick_thresholds(timings, rows)
    else:
        timings, thresholds = {}, {s: (ALWAYS_MKL if backend == "mkl" else 0) for s in shapes}
    for m in layers:
        m.mkl_below = thresholds[(m.in_features, m.out_features)]
    return LinearChoice(backend, thresholds, timings, seconds, kept_in=kept_in)


# ----------------------------------------------------------------------------
# The choice against each library alone: python -m minicb.linear_backend [--rounds 3]
#
# A SmolLM2 decode step at 1 and at 32 slots (chat prompts, 60 tokens each),
# with linear_backend auto, mkl and onednn in turns, `rounds` times; each the
# median of 10 decode steps.

if __name__ == "__main__":
    import argparse
    import statistics

    from minicb.data import load_chat_prompts
    from minicb.llm import LLM
    from minicb.sampling import SamplingParams

    parser = argparse.ArgumentParser(description="a decode step with each linear_backend, in turns")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(device="cpu", max_num_seqs=32)
    engine = llm.engine
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in load_chat_prompts(32)]

    def decode_step_ms(num_requests: int) -> float:
        for ids in prompts[:num_requests]:
            engine.add_request(ids, SamplingParams(max_tokens=60, ignore_eos=True))
        while any(not s.output_token_ids for s in engine.sequences.values()):
            engine.step()
        steps = [engine.step().time_s for _ in range(10)]
        for rid in {s.request_id for s in engine.sequences.values()}:
            engine.abort(rid)
        return statistics.median(steps) * 1e3

    measured = engine.linear_choice  # the engine's own "auto", kept so every round uses the same choice
    results = {(b, n): [] for b in BACKENDS for n in (1, 32)}
    decode_step_ms(4)  # warm-up
    for _ in range(args.rounds):
        for backend in BACKENDS:
            use_linear_backend(llm.model, backend, [1, 4, 32], timings=measured.timings if backend == "auto" else None)
            for n in (1, 32):
                results[(backend, n)].append(decode_step_ms(n))
    print(f"CPU: {cpu_model()}; {measured.describe()}")
    print("| linear_backend | 1 slot | 32 slots |\n|---|---:|---:|")
    for backend in BACKENDS:
        print(f"| {backend} | " + " | ".join(f"{statistics.median(results[(backend, n)]):.1f} ms" for n in (1, 32))
              + " |")
