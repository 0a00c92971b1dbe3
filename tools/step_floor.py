"""How close a decode step comes to its matmul floor: engine.step() against its linear layers alone.

    .venv/bin/python tools/step_floor.py                       # 1, 8, 32 slots; 1 and 2 threads
    .venv/bin/python tools/step_floor.py --slots 32 --threads 2 --profile

A decode step of SmolLM2 reads every weight once: 30 layers of seven projections
and the 576 x 49152 lm_head. The floor is what those matmuls cost alone, on N
rows, with the model's own weights (`floor`: each product the step runs, in
order, on a random [1, N, in] input). A packed model runs the seven as four:
q, k and v in one product, gate and up in another (minicb/packed_linear.py). The step is a whole decode-only
`engine.step()` with N requests decoding: schedule, prepare, forward (attention,
norms, rotary, the same matmuls), sample, postprocess. Their ratio says how much
of a step is anything but matmul.

Both are taken for the model as `load_model()` gives it (linear layers from
oneDNN-packed weights, minicb/packed_linear.py) and for the same weights in
plain `nn.Linear` (torch's default BLAS, MKL); the step also with each setting
of `--cpu-ops` (the compiled norms, rotary and SwiGLU of minicb/cpu_ops.py, or chapter
00's PyTorch). All in turns in one process, so that load from other programs
falls on each alike. Each figure is a median.

`--knockout` then takes the step apart: the same decode step with one piece
replaced by nothing (the decode attention, the K/V store, the norms, rotary,
SwiGLU; then all five), in turns with the whole step and the floor. It ends
with the decode attention's two bounds: a plain read of the step's K and V, and
the kernel's arithmetic with them in cache (`attention_bounds`). The tokens
of such a step are wrong; only its time counts. What a piece saves is what it
costs inside the step, where a piece timed alone costs less (docs/results.md,
"What a 2-thread step pays beyond its products").

    .venv/bin/python tools/step_floor.py --slots 32 --threads 2 --knockout
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.profiler import profile

from minicb.attention_backends import CpuDecodeAttention
from minicb.cpu_attention import set_num_threads
from minicb.cpu_ops import SETTINGS, CompiledMLP, CompiledRMSNorm, CompiledRotary, use_cpu_ops
from minicb.engine import Engine, EngineConfig
from minicb.packed_linear import packed_layers
from minicb.sampling import SamplingParams
from minicb.weights import load_model


def median_ms_in_turns(fns, rounds: int, setups=None) -> list[float]:
    """Run the functions in turns, `rounds` times each; the median milliseconds of each.
    setups[i], when given, runs untimed before each call of fns[i]."""
    times = [[] for _ in fns]
    setups = setups or [None] * len(fns)
    for _ in range(rounds):
        for fn, setup, ms in zip(fns, setups, times):
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(ms) for ms in times]


def linear_layers(model) -> list:
    """Every product a decode step runs, in order (lm_head last): a packed model's FusedLinears and
    PackedLinear modules, or a plain model's nn.Linear modules."""
    return packed_layers(model) or [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def floor_fn(model, rows: int):
    """The step's matmuls alone: each product on its own [1, rows, in] input."""
    layers = linear_layers(model)
    inputs = {n: torch.randn(1, rows, n) for n in {m.in_features for m in layers}}

    @torch.inference_mode()
    def floor():
        for m in layers:
            m(inputs[m.in_features])
    return floor


def decoding_engine(model, slots: int, context: int, steps: int, cpu_ops: str = "compiled") -> Engine:
    """An engine with `slots` requests past their prefill, each with room for `steps` more decodes."""
    gen = torch.Generator().manual_seed(0)
    engine = Engine(model, EngineConfig(max_num_seqs=slots, cpu_ops=cpu_ops))
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    vocab = model.config.vocab_size
    for i in range(slots):  # random ids past the first ones, which real vocabularies keep for special tokens
        prompt = torch.randint(min(100, vocab // 2), vocab, (context + (i % 7) * 5,), generator=gen)
        engine.add_request(prompt.tolist(), params)
    engine.step()  # every prefill
    for _ in range(2):
        engine.step()  # warm up the decode path
    return engine


# Each piece of a decode step and what stands in for it: (class, method, nothing). "Nothing"
# returns a tensor of the right shape without computing anything.
PIECES = {
    "decode attention": (CpuDecodeAttention, "decode", lambda self, q, k_cache, v_cache, plan: torch.zeros_like(q)),
    "K/V store": (CpuDecodeAttention, "store_kv", lambda self, k, v, k_cache, v_cache, slot_mapping: None),
    "norms": (CompiledRMSNorm, "forward", lambda self, x: x),
    "rotary": (CompiledRotary, "forward", lambda self, q, k, cos, sin: (q, k)),
    "SwiGLU": (CompiledMLP, "swiglu", lambda self, gate, up: gate),
}


@contextlib.contextmanager
def without(*names: str):
    """The named PIECES replaced by nothing inside the block, put back after it."""
    saved = [(cls, method, cls.__dict__[method]) for cls, method, _ in (PIECES[n] for n in names)]
    try:
        for name in names:
            cls, method, nothing = PIECES[name]
            setattr(cls, method, nothing)
        yield
    finally:
        for cls, method, original in saved:
            setattr(cls, method, original)


def attention_bounds(engine: Engine, rounds: int) -> dict:
    """What the decode attention of one step cannot go below, on this CPU and thread count.

    It must read every slot's K and V once (`kv_mb`), and `read_ms` is a plain pass over
    that many bytes (torch.sum over a buffer of the same size, too large for the caches).
    It must also do its arithmetic: `in_cache_ms` is the kernel run once per layer as in
    the step, but on the first layer's pool every time, so that after the first call its
    rows come from the caches. The attention in a step takes at least the larger of the two.
    """
    seen = []
    original = CpuDecodeAttention.decode

    def record(self, q, k_cache, v_cache, plan):
        if not seen:
            seen.append((self, q, k_cache, v_cache, plan))
        return original(self, q, k_cache, v_cache, plan)
    CpuDecodeAttention.decode = record
    try:
        engine.step()
    finally:
        CpuDecodeAttention.decode = original
    backend, q, k_cache, v_cache, plan = seen[0]
    layers = engine.model.config.num_layers
    _, context_lens = plan
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # one token's K (or V) row
    kv_bytes = 2 * layers * int(context_lens.sum()) * row_bytes
    buffer = torch.ones(kv_bytes // k_cache.element_size(), dtype=k_cache.dtype)

    def in_cache():
        for _ in range(layers):
            backend.decode(q, k_cache, v_cache, plan)
    read_ms, in_cache_ms = median_ms_in_turns([buffer.sum, in_cache], rounds)
    # Two multiply-adds per K/V element a query head reads: one for its score, one for its weighted value.
    flops = 4 * layers * int(context_lens.sum()) * q.shape[1] * q.shape[2]
    return {"kv_mb": kv_bytes / 1e6, "read_ms": read_ms, "in_cache_ms": in_cache_ms,
            "gflops_in_cache": flops / in_cache_ms / 1e6}


def floor_gflops(model, rows: int, floor_ms: float) -> float:
    """The rate of the floor's arithmetic: a multiply-add for each weight, on each row."""
    return 2 * rows * sum(m.in_features * m.out_features for m in linear_layers(model)) / floor_ms / 1e6


def knockout(model, slots: int, context: int, rounds: int) -> None:
    """Print the step whole, without each piece, without all of them, and the floor: in turns."""
    runs = [()] + [(name,) for name in PIECES] + [tuple(PIECES)]
    engine = decoding_engine(model, slots, context, len(runs) * rounds + 3)  # and one for attention_bounds
    if not isinstance(engine.attention, CpuDecodeAttention):
        raise SystemExit(f"--knockout takes apart the CPU decode of minicb/cpu_attention.py; this engine runs "
                         f"{type(engine.attention).__name__} (is Numba installed?)")

    bounds = attention_bounds(engine, rounds)  # first, at the context the step table's steps had

    def step_without(names):
        def step():
            with without(*names):
                engine.step()
        return step
    ms = median_ms_in_turns([step_without(names) for names in runs] + [floor_fn(model, slots)], rounds)
    whole, floor = ms[0], ms[-1]
    print(f"\n{slots} slots, {torch.get_num_threads()} thread(s): each piece replaced by nothing, median of "
          f"{rounds} steps each, in turns\n")
    print("| step without | step ms | saved ms | step / floor |")
    print("|---|---:|---:|---:|")
    labels = ["(nothing: the whole step)"] + list(PIECES) + ["all five"]
    for label, step in zip(labels, ms[:-1]):
        print(f"| {label} | {step:.1f} | {whole - step:+.1f} | {step / floor:.2f} |")
    print(f"| (the floor: its products alone) | {floor:.1f} | {whole - floor:+.1f} | 1.00 |", flush=True)
    print(f"\nThe decode attention's own bounds: reading the step's {bounds['kv_mb']:.0f} MB of K and V once "
          f"(a plain sum) takes {bounds['read_ms']:.1f} ms; its arithmetic, with the K and V of one layer in cache, "
          f"{bounds['in_cache_ms']:.1f} ms over {model.config.num_layers} layers ({bounds['gflops_in_cache']:.0f} "
          f"GFLOP/s, where the products run at {floor_gflops(model, slots, floor):.0f}). A step at 1.3 of its "
          f"floor leaves {0.3 * floor:.1f} ms for everything above the products.", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32], help="requests decoding together")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch (and Numba) threads")
    ap.add_argument("--context", type=int, default=150, help="shortest prompt; others are up to 30 tokens longer")
    ap.add_argument("--cpu-ops", nargs="+", default=list(SETTINGS), choices=SETTINGS,
                    help="the steps' norms, rotary and SwiGLU: compiled (minicb/cpu_ops.py), torch (chapter 00's), "
                         "or both")
    ap.add_argument("--rounds", type=int, default=10, help="timed runs of each step and floor, in turns")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top operators of a step")
    ap.add_argument("--rows", type=int, default=12, help="profiler rows to print")
    ap.add_argument("--knockout", action="store_true",
                    help="also time the step (oneDNN packed, compiled) with each piece replaced by nothing")
    args = ap.parse_args()

    models = {"oneDNN packed": load_model(), "nn.Linear (MKL)": load_model(packed=False)}
    print(f"decode step vs its matmul floor; median of {args.rounds} runs each, in turns\n")
    print("| threads | slots | weights | norms, rotary, SwiGLU | step ms | floor ms | step / floor | step tok/s |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    profiled = None
    for threads in args.threads:
        set_num_threads(threads)
        for slots in args.slots:
            # One engine per (weights, cpu_ops); the setting is the model's, so it is set again
            # (untimed) before each of its engine's steps. Each floor once per weights.
            runs = [(k, ops) for k in models for ops in args.cpu_ops]
            engines = {(k, ops): decoding_engine(models[k], slots, args.context, args.rounds + 2, ops)
                       for k, ops in runs}
            fns = [engines[run].step for run in runs] + [floor_fn(models[k], slots) for k in models]
            setups = [lambda m=models[k], ops=ops: use_cpu_ops(m, ops) for k, ops in runs] + [None] * len(models)
            ms = median_ms_in_turns(fns, args.rounds, setups)
            floors = dict(zip(models, ms[len(runs):]))
            for (k, ops), step in zip(runs, ms):
                print(f"| {threads} | {slots} | {k} | {ops} | {step:.1f} | {floors[k]:.1f} | {step / floors[k]:.2f} "
                      f"| {slots / step * 1e3:.0f} |", flush=True)
            profiled = (threads, slots, engines[("oneDNN packed", args.cpu_ops[0])], args.cpu_ops[0])
    if args.profile and profiled is not None:
        threads, slots, engine, ops = profiled
        use_cpu_ops(engine.model, ops)
        with profile() as prof:
            for _ in range(2):
                engine.step()
        print(f"\ntop operators of engine.step(), oneDNN packed, {ops} norms, rotary and SwiGLU, {slots} slots, "
              f"{threads} thread(s), 2 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.knockout:
        for threads in args.threads:
            set_num_threads(threads)
            for slots in args.slots:  # decoding_engine switches the model to the compiled ops
                knockout(models["oneDNN packed"], slots, args.context, args.rounds)


if __name__ == "__main__":
    main()
