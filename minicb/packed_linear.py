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
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The product from the packed weight, whatever the row count. x [..., in] fp32 on the CPU."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN"


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a CPU float32 model by a PackedLinear, in place. Returns the model."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not available():
        return model
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
    return model
