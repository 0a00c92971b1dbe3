"""What a small call costs between a decode step's products, against back to back.

    .venv/bin/python tools/cold_calls.py                  # 2 threads, 32 rows
    .venv/bin/python tools/cold_calls.py --threads 1 --rows 1

A decode step alternates SmolLM2's products (oneDNN, minicb/packed_linear.py)
with small calls: residual adds, norms, rotary, SwiGLU, the K/V store and the
decode kernel. Timed in a loop of their own, those calls are a few microseconds;
inside the step they cost several times that. This times three of them three
ways: back to back; right after one small product (a 576 x 64 weight, 147 KB,
which stays in the core's caches); and right after one layer's four products at
SmolLM2's shapes (15.7 MB of weights, as the step runs them). Each figure is the
median of --calls timed calls, in microseconds.

The weights are random: only their shapes matter here, and the model file is not
needed. docs/results.md ("What a 2-thread step pays beyond its products") has
the table for an AMD EPYC (Zen 3).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from minicb import cpu_ops
from minicb.cpu_attention import set_num_threads
from minicb.model import RMSNorm
from minicb.packed_linear import PackedLinear, available

HIDDEN, QKV, INTERMEDIATE = 576, 960, 1536  # SmolLM2-135M: q, k and v as one product of 576 + 192 + 192


def layer_products(rows: int):
    """One decoder layer's four products at SmolLM2's shapes, packed for oneDNN: a function that runs them."""
    shapes = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
    products = [PackedLinear(torch.nn.Linear(n_in, n_out, bias=False)) for n_in, n_out in shapes]
    inputs = {n_in: torch.randn(1, rows, n_in) for n_in, _ in shapes}

    def run():
        for m in products:
            m(inputs[m.in_features])
    return run


def median_us(call, before, calls: int) -> float:
    """The median microseconds of `call`, each time right after an untimed `before()`."""
    times = []
    for _ in range(calls):
        before()
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def measure(rows: int, calls: int) -> dict[str, list[float]]:
    """{call: [back to back, after a small product, after a layer's products]} in microseconds."""
    torch.manual_seed(0)
    norm = RMSNorm(HIDDEN, 1e-5)
    norm.__class__ = cpu_ops.CompiledRMSNorm  # as cpu_ops.use_cpu_ops switches a model's norms
    x = torch.randn(1, rows, HIDDEN)
    rows_np, weight_np, eps = x.numpy().reshape(rows, HIDDEN), norm.weight.detach().numpy(), np.float32(1e-5)
    kernels = cpu_ops._kernels()
    small = PackedLinear(torch.nn.Linear(HIDDEN, 64, bias=False))
    layer = layer_products(rows)
    probes = {"the compiled RMSNorm module": lambda: norm(x),
              "its Numba kernel alone": lambda: kernels.rms_norm(rows_np, weight_np, eps),
              f"a torch add of two [{rows}, {HIDDEN}] tensors": lambda: x + x}
    befores = [lambda: None, lambda: small(x), layer]
    with torch.inference_mode():
        for probe in probes.values():  # compile, and warm every path once
            for before in befores:
                before()
                probe()
        return {name: [median_us(probe, before, calls) for before in befores] for name, probe in probes.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch (and Numba) threads")
    ap.add_argument("--rows", type=int, default=32, help="rows of each call: the slots decoding")
    ap.add_argument("--calls", type=int, default=300, help="timed calls behind each median")
    args = ap.parse_args()
    if cpu_ops._kernels() is None:
        raise SystemExit("cold_calls.py times minicb's compiled RMSNorm, which needs Numba: pip install numba")
    if not available():
        raise SystemExit(f"cold_calls.py runs oneDNN's packed products, which this torch ({torch.__version__}) lacks")
    set_num_threads(args.threads)
    results = measure(args.rows, args.calls)
    print(f"{args.rows} rows, {args.threads} thread(s), median microseconds of {args.calls} calls\n")
    print("| call | back to back | right after a 576 x 64 product | right after a layer's four products |")
    print("|---|---:|---:|---:|")
    for name, (alone, small, layer) in results.items():
        print(f"| {name} | {alone:.1f} | {small:.1f} | {layer:.1f} |")


if __name__ == "__main__":
    main()
