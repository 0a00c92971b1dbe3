"""Linear layers at the CPU's matmul floor: oneDNN with each weight packed once, at load.

Every weight of the model is read once per decode step, so on a CPU a step costs
about what its matmuls cost, and a matmul of a few rows is bound by how well the
BLAS library handles a short, wide product. torch's CPU build sends `F.linear`
to Intel MKL, which on this project's AMD machine takes a slow path for a few
rows: all the linear layers of a SmolLM2 step cost 69 ms at 1 row and 157 ms at
32 rows on 2 threads (`tools/step_floor.py`, docs/results.md, "The matmul floor").
oneDNN, which torch also ships, computes the same products from a weight it has
first reordered into its own blocked layout, and the same layers then cost 44
and 77 ms: the weight is packed once here instead of at every call.

`pack_linears(model)` swaps every `nn.Linear` of a CPU float32 model for a
`PackedLinear` that keeps the same `weight` Parameter (state dicts, tied
embeddings and HF comparisons see nothing new) plus the packed copy. Anything
else (CUDA, bfloat16, a torch without oneDNN) keeps `F.linear`. The results
differ from MKL's in the last bits of float32 (another summation order), as
two BLAS libraries do; greedy tokens stay HF-equal in the tests and the bench.

`load_model(..., packed=False)` keeps plain `nn.Linear`s, so the two can be
timed side by side in one process (`tools/step_floor.py`). A PackedLinear keeps
the plain weight too, so it can send a call of few rows to MKL instead
(`mkl_below`): on an Intel CPU MKL is the faster there, and the engine measures
where (minicb/linear_backend.py).

Projections of one input are packed as one matrix. A layer multiplies the same
normed x by q, k and v (576 -> 576, 192, 192 in SmolLM2), and the MLP's input by
gate and up (576 -> 1536 twice): five products where two will do, one 576 x 960
and one 576 x 3072. Each call has its own start-up and its own wait for the
slowest thread. So `FusedLinears` packs the stacked weights once and answers
`project_qkv` and `project_gate_up` (minicb/model.py) with one oneDNN call,
whose output it hands back as views, one per projection. On an AMD EPYC (Zen 3), in turns, against
every layer packed alone: on 2 threads a 1-slot decode step 39.2 against 43.3 ms
(38.8 against 45.0 in another run), a 32-slot step 0.7-3.5% faster (four runs);
on one thread no gain at one slot and 1.5-3.4% at 32 (docs/results.md). Two
threads gain most: a narrow product leaves them more of their time waiting for
each other. The projections it fuses stay the model's `nn.Linear`s, which it
runs one by one when a call is not for oneDNN (few rows on MKL, a GPU, a weight
written since packing).

    fused = FusedLinears([attn.q_proj, attn.k_proj, attn.v_proj])
    q, k, v = fused(x)       # x [..., 576] -> [..., 576], [..., 192], [..., 192]
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minicb.model import MLP, Attention


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward from a oneDNN-packed copy of the weight. x [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters, not copies
        # A plain attribute, not a buffer: `.to()` and `state_dict()` never see the
        # opaque oneDNN tensor. forward falls back to F.linear when it no longer fits.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self._packed_from = self._weight_state()
        # Calls with fewer rows than this go to MKL (F.linear on the same weight), the rest to
        # oneDNN: minicb/linear_backend.py measures where MKL stops being the faster. 0: oneDNN always.
        self.mkl_below = 0

    def _weight_state(self) -> tuple[int, int]:
        # Where the weight lives and how often it was written in place (load_state_dict, copy_).
        return self.weight.data_ptr(), self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or self._weight_state() != self._packed_from:
            return F.linear(x, self.weight, self.bias)  # moved, cast or written since packing
        if self.mkl_below and x.numel() < self.mkl_below * self.in_features:  # few rows: MKL's fast path
            return F.linear(x, self.weight, self.bias)
        return self.onednn(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the plain weight: F.linear, MKL on a CPU."""
        return F.linear(x, self.weight, self.bias)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The product from the packed weight, whatever the row count. x [..., in] fp32 on the CPU."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN"


class FusedLinears:
    """Linear layers of one input as one product from a oneDNN-packed stack of their weights.

    x [..., in] -> a tuple of [..., out_i], one per layer, views of one [..., sum(out_i)] result.
    Not a module: the weights are the layers' own Parameters, so the model's state_dict and
    modules() see nothing new. Like PackedLinear it checks on every call that the packed
    copy still fits, and runs the layers one by one (`plain`) when it does not.
    """

    def __init__(self, linears: list[nn.Linear]):
        if len({m.in_features for m in linears}) != 1:
            raise ValueError(f"FusedLinears needs layers of one input width; got {[m.in_features for m in linears]}")
        self.linears = linears
        self.in_features = linears[0].in_features
        self.sizes = [m.out_features for m in linears]
        self.out_features = sum(self.sizes)
        biases = [m.bias for m in linears]
        self.bias = None
        if any(b is not None for b in biases):  # a missing bias is zeros in the stack
            self.bias = torch.cat([b.detach() if b is not None else torch.zeros(m.out_features)
                                   for b, m in zip(biases, linears)])
        stacked = torch.cat([m.weight.detach() for m in linears])  # [sum(out_i), in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(stacked)
        self._packed_from = self._weight_state()
        self.mkl_below = 0  # as PackedLinear's: calls with fewer rows run separately, on MKL

    def _weight_state(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for m in self.linears for p in (m.weight, m.bias) if p is not None)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.device.type != "cpu" or x.dtype != torch.float32 or self._weight_state() != self._packed_from:
            return self.plain(x)  # moved, cast or written since packing
        if self.mkl_below and x.numel() < self.mkl_below * self.in_features:
            return self.plain(x)
        return self.onednn(x)

    def plain(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's own forward, one by one (F.linear, MKL on a CPU): the model's products unfused."""
        return tuple(m(x) for m in self.linears)

    def onednn(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One product from the packed stack, whatever the row count. x [..., in] fp32 on the CPU."""
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # [..., sum(out_i)]
        return out.split(self.sizes, dim=-1)

    def __repr__(self) -> str:
        return f"FusedLinears(in_features={self.in_features}, out_features={'+'.join(map(str, self.sizes))}, oneDNN)"


# What pack_linears fuses: a module's method that multiplies one input by several of its
# layers (minicb/model.py), and those layers' names.
FUSED = {Attention: ("project_qkv", ("q_proj", "k_proj", "v_proj")),
         MLP: ("project_gate_up", ("gate_proj", "up_proj"))}


def pack_linears(model: nn.Module) -> nn.Module:
    """Pack a CPU float32 model's linear layers for oneDNN, in place. Returns the model.

    Each attention's q, k, v and each MLP's gate and up become one FusedLinears, set on
    the module as its `project_qkv` / `project_gate_up` (an attribute of the instance,
    which Python finds before the class's method); every other nn.Linear becomes a
    PackedLinear.
    """
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not available():
        return model
    fused_layers = set()
    for module in list(model.modules()):
        for kind, (method, names) in FUSED.items():
            linears = [getattr(module, name) for name in names] if isinstance(module, kind) else []
            if linears and all(type(m) is nn.Linear for m in linears):
                setattr(module, method, FusedLinears(linears))
                fused_layers.update(map(id, linears))
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and id(child) not in fused_layers:
                setattr(parent, name, PackedLinear(child))
    return model


def packed_layers(model: nn.Module) -> list[PackedLinear | FusedLinears]:
    """Every product a packed model's forward runs, in order: FusedLinears and PackedLinear."""
    found = []
    for module in model.modules():
        for kind, (method, _) in FUSED.items():
            if isinstance(module, kind) and isinstance(module.__dict__.get(method), FusedLinears):
                found.append(module.__dict__[method])
        if isinstance(module, PackedLinear):
            found.append(module)
    return found
