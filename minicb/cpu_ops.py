"""The small operations between the matmuls, compiled for the CPU: RMSNorm, rotary embeddings, SwiGLU.

In this file you will learn why a decode step on a CPU spends more time on its
cheapest arithmetic than the arithmetic costs, and how much compiling it helps.

Chapter 00 writes RMSNorm and rotary embeddings as PyTorch expressions: an
RMSNorm is a square, a mean, an add, a reciprocal square root and two
multiplies; rotating q and k is a concatenation, a negation, two multiplies and
an add, each twice. Every one of those is an operator call, and every call
costs a few microseconds of Python and dispatch, and one trip through memory
for its result, whatever the size of its tensor. At 32 decoding sequences the
tensors are tiny (32 x 576 floats), so the calls are the cost: removing the
norms from a SmolLM2 step saved 4.6 ms, removing rotary 3.1 ms, of a 92 ms
step whose matmuls take 58 (docs/results.md, "The step between its matmuls").

The kernels below do each in one pass, a loop over rows compiled by Numba, as
minicb/cpu_attention.py does for decode attention. They do not make the cost
vanish: a call into Numba, and handing it each tensor's memory, cost
microseconds too. At 32 rows an RMSNorm call takes 12.7 us instead of 21.2, q
and k's rotary 16.1 instead of 37.0 (`python -m minicb.cpu_ops`), and a whole
step 1.47 times its matmuls instead of 1.49 (tools/step_floor.py, both in turns).

    rms_norm_kernel   x [N, hidden] -> [N, hidden]: sum of squares, then scale, per row
    rotary_kernel     q [N, heads, hd], k [N, kv_heads, hd] -> both with each pair (x_i, x_{i + hd/2})
                      rotated by the row's angle
    swiglu_kernel     gate, up [N, intermediate] -> silu(gate) * up, with an exp of its own
                      (a polynomial and a float's exponent bits), because Numba's calls the C
                      library once per element

`CompiledRMSNorm` and `CompiledRotary` are chapter 00's `RMSNorm` and `Rotary`
with the forward swapped, and `CompiledMLP` is its `MLP` with `swiglu` swapped
(the three matmuls stay); anything the kernels do not take (a GPU, bfloat16,
a tensor that needs gradients, cos/sin broadcast over the batch) goes to the
plain forward they inherit. `use_cpu_ops(model, "compiled")` switches a model's
modules to them, "torch" back; the engine calls it with `EngineConfig.cpu_ops`.

    python -m minicb.cpu_ops       # check against chapter 00's modules, then time both

The results differ from PyTorch's in the last bits of float32 (another order of
summation, another exp); tests/engine/test_cpu_ops.py holds the two equal within
1e-5 and an engine's greedy tokens identical. SwiGLU, measured on an Intel Xeon
(in turns, 2 threads): a 32-slot decode step 1.0-1.6 ms faster, a 512-token
prefill 17-30 ms (of about 600).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch

from minicb.model import MLP, Model, RMSNorm, Rotary

SETTINGS = ("compiled", "torch")


def _fit_exp2(degree: int = 7) -> tuple:
    """Coefficients c0..c7 of a polynomial close to 2^f for f in [0, 1): least squares at
    Chebyshev points. Its relative error is about 3e-9, far below float32's 6e-8."""
    f = 0.5 - 0.5 * np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    return tuple(np.float32(c) for c in np.polynomial.polynomial.polyfit(f, np.exp2(f), degree))


EXP2_COEFFICIENTS = _fit_exp2()
LOG2_E = np.float32(1.4426950408889634)  # exp(x) = 2^(x * log2(e))


@functools.cache
def _kernels():
    """The Numba kernels, compiled on first use (then cached on disk); None without Numba."""
    try:
        from numba import njit, prange
    except ImportError:
        return None

    # parallel=True spreads the rows over the cores: a long prompt's thousands of
    # rows are worth two threads, and 32 rows lose only a microsecond or two to it.
    # Each kernel makes its own output, so that the wrapper's only PyTorch work is
    # wrapping it (torch.from_numpy shares the memory).
    @njit(parallel=True, fastmath=True, cache=True)
    def rms_norm_kernel(x, weight, eps):
        num_rows, hidden = x.shape  # x [N, hidden], weight [hidden]
        out = np.empty_like(x)
        for row in prange(num_rows):
            squares = np.float32(0.0)
            for i in range(hidden):
                squares += x[row, i] * x[row, i]
            scale = np.float32(1.0) / np.sqrt(squares / hidden + eps)  # 1 / rms(x)
            for i in range(hidden):
                out[row, i] = x[row, i] * scale * weight[i]
        return out

    @njit(parallel=True, fastmath=True, cache=True)
    def rotary_kernel(q, k, cos, sin):
        # q [N, n_heads, hd], k [N, n_kv_heads, hd], cos/sin [N, hd]: row r's angles
        num_rows, head_dim = q.shape[0], q.shape[2]
        half = head_dim // 2
        q_out, k_out = np.empty_like(q), np.empty_like(k)
        for row in prange(num_rows):
            for x, out in ((q, q_out), (k, k_out)):
                for head in range(x.shape[1]):
                    for i in range(half):  # the pair (i, i + half), as apply_rope's "half split" layout pairs them
                        first, second = x[row, head, i], x[row, head, i + half]
                        out[row, head, i] = first * cos[row, i] - second * sin[row, i]
                        out[row, head, i + half] = second * cos[row, i + half] + first * sin[row, i + half]
        return q_out, k_out

    # SwiGLU's silu(gate) * up needs exp, and Numba without Intel's SVML calls the C
    # library's expf once per element, one at a time: slower than PyTorch's SiLU. So
    # the kernel computes exp(-g) = 2^y itself, from two parts a CPU computes 16 lanes
    # at a time: y = whole + frac, 2^whole by writing whole + 127 into a float's
    # exponent bits (an int32 array seen as float32), and 2^frac by the polynomial.
    c0, c1, c2, c3, c4, c5, c6, c7 = EXP2_COEFFICIENTS

    @njit(parallel=True, fastmath=True, cache=True)
    def swiglu_kernel(gate, up):
        num_rows, width = gate.shape  # gate, up [N, intermediate]
        out = np.empty_like(gate)
        for row in prange(num_rows):
            exponent_bits = np.empty(width, dtype=np.int32)
            two_to_whole = exponent_bits.view(np.float32)  # the same memory, read as floats
            for i in range(width):
                # float32 reaches 2^126 and 2^-126; past them sigmoid is 0 or 1 anyway
                y = min(max(-gate[row, i] * LOG2_E, np.float32(-126.0)), np.float32(126.0))
                whole = np.floor(y)
                frac = y - whole
                out[row, i] = c0 + frac * (c1 + frac * (c2 + frac * (c3 + frac * (c4 + frac * (
                    c5 + frac * (c6 + frac * c7))))))  # 2^frac
                exponent_bits[i] = (np.int32(whole) + 127) << 23  # 2^whole
            for i in range(width):
                # silu(g) * u = g * sigmoid(g) * u = g * u / (1 + exp(-g))
                out[row, i] = gate[row, i] * up[row, i] / (np.float32(1.0) + out[row, i] * two_to_whole[i])
        return out

    return SimpleNamespace(rms_norm=rms_norm_kernel, rotary=rotary_kernel, swiglu=swiglu_kernel)


def applies_to(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: float32 on the CPU, no gradients wanted, Numba installed."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in tensors)
            and _kernels() is not None)


class CompiledRMSNorm(RMSNorm):
    """Chapter 00's RMSNorm in one compiled pass over each row. x [..., hidden] -> [..., hidden]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.detach()
        if not applies_to(x, weight):
            return super().forward(x)
        rows = x.numpy().reshape(-1, x.shape[-1])  # numpy's reshape: a view of the contiguous residual stream
        out = _kernels().rms_norm(rows, weight.numpy(), np.float32(self.eps))
        return torch.from_numpy(out.reshape(x.shape))


class CompiledRotary(Rotary):
    """Chapter 00's rotary embeddings, q and k in one compiled pass."""

    def forward(self, q, k, cos, sin):
        # q [B, T, n_heads, hd], k [B, T, n_kv_heads, hd], cos/sin [B, T, 1, hd]
        if not (applies_to(q, k, cos, sin) and cos.shape[:2] == q.shape[:2] == k.shape[:2]):
            return super().forward(q, k, cos, sin)  # e.g. one cos row broadcast over a batch
        head_dim = q.shape[-1]
        # [B * T, heads, hd]; contiguous (a copy only if they were not), as the kernel's loop over q and k needs
        q_rows = np.ascontiguousarray(q.numpy()).reshape(-1, q.shape[2], head_dim)
        k_rows = np.ascontiguousarray(k.numpy()).reshape(-1, k.shape[2], head_dim)
        q_out, k_out = _kernels().rotary(q_rows, k_rows, cos.numpy().reshape(-1, head_dim),
                                         sin.numpy().reshape(-1, head_dim))
        return torch.from_numpy(q_out.reshape(q.shape)), torch.from_numpy(k_out.reshape(k.shape))


class CompiledMLP(MLP):
    """Chapter 00's SwiGLU MLP with silu(gate) * up in one compiled pass; the three matmuls stay."""

    def swiglu(self, gate, up):
        # gate, up [..., intermediate] -> silu(gate) * up
        if not applies_to(gate, up) or gate.shape != up.shape:
            return super().swiglu(gate, up)
        width = gate.shape[-1]
        out = _kernels().swiglu(np.ascontiguousarray(gate.numpy()).reshape(-1, width),
                                np.ascontiguousarray(up.numpy()).reshape(-1, width))
        return torch.from_numpy(out.reshape(gate.shape))


# Each plain module class and its compiled twin. The twin adds no state, so switching is
# changing the class of the module in place: weights, names and state_dict stay as they are.
TWINS = ((RMSNorm, CompiledRMSNorm), (Rotary, CompiledRotary), (MLP, CompiledMLP))


def use_cpu_ops(model: Model, setting: str) -> str:
    """Switch the model's norms, rotary and SwiGLU to the compiled kernels ("compiled") or to chapter 00's
    PyTorch ("torch"), in place. Returns what runs now: "compiled" only where it can (a CPU,
    float32, Numba); otherwise "torch", whatever was asked.

    Like EngineConfig.linear_backend, this is a setting of the model, which engines share:
    the last engine built over a model decides for all of them.
    """
    if setting not in SETTINGS:
        raise ValueError(f"cpu_ops={setting!r} is not one of {list(SETTINGS)}")
    weight = model.lm_head.weight
    compiled = setting == "compiled" and weight.device.type == "cpu" and weight.dtype == torch.float32 \
        and _kernels() is not None
    for module in model.modules():
        for plain, twin in TWINS:
            if isinstance(module, plain):
                module.__class__ = twin if compiled else plain
    return "compiled" if compiled else "torch"


# ----------------------------------------------------------------------------
# Check and benchmark: python -m minicb.cpu_ops
#
# SmolLM2's shapes (hidden 576, 9 query and 3 KV heads of 64, MLP 1536) at 1 row (one
# request decoding), 32 (a full batch of decodes) and 512 (a prompt): each
# compiled module against chapter 00's on the same input, then both timed.

if __name__ == "__main__":
    import time

    from minicb.model import rope_cos_sin

    def median_us(fn, runs=200):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * sorted(times)[runs // 2]

    torch.manual_seed(0)
    plain_norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        plain_norm.weight.normal_(1.0, 0.1)
    compiled_norm = RMSNorm(576, 1e-5)
    compiled_norm.load_state_dict(plain_norm.state_dict())
    compiled_norm.__class__ = CompiledRMSNorm
    print(f"torch threads {torch.get_num_threads()}; median microseconds of {200} calls")
    plain_mlp, compiled_mlp = MLP.__new__(MLP), MLP.__new__(CompiledMLP)  # swiglu reads no weight
    print("| rows | RMSNorm: torch | compiled | max abs diff | q and k rotary: torch | compiled | max abs diff "
          "| SwiGLU: torch | compiled | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in (1, 32, 512):
            x = torch.randn(1, rows, 576)
            q, k = torch.randn(1, rows, 9, 64), torch.randn(1, rows, 3, 64)
            cos, sin = rope_cos_sin(torch.arange(100, 100 + rows)[None], 64, 100000.0, torch.float32)
            norm_diff = (compiled_norm(x) - plain_norm(x)).abs().max().item()
            rotary_diff = max((a - b).abs().max().item()
                              for a, b in zip(CompiledRotary()(q, k, cos, sin), Rotary()(q, k, cos, sin)))
            gate, up = 4 * torch.randn(1, rows, 1536), torch.randn(1, rows, 1536)
            swiglu_diff = (compiled_mlp.swiglu(gate, up) - plain_mlp.swiglu(gate, up)).abs().max().item()
            times = [median_us(lambda: m(x)) for m in (plain_norm, compiled_norm)]
            times += [median_us(lambda: m(q, k, cos, sin)) for m in (Rotary(), CompiledRotary())]
            times += [median_us(lambda: m.swiglu(gate, up)) for m in (plain_mlp, compiled_mlp)]
            print(f"| {rows} | {times[0]:.1f} | {times[1]:.1f} | {norm_diff:.1e} | {times[2]:.1f} | {times[3]:.1f} "
                  f"| {rotary_diff:.1e} | {times[4]:.1f} | {times[5]:.1f} | {swiglu_diff:.1e} |")
