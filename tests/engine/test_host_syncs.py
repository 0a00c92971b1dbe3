"""The model's forward over the paged pool reads no tensor's value on the host.

On a GPU every such read (`.item()`, `.tolist()`, `int(t)`, a tensor in an
`if`, `.nonzero()`, a boolean mask as an index) makes the host wait until the
GPU has finished everything queued before it, and a forward that waits cannot
be captured as a CUDA graph. So the argument checks run once per step, on the
host lists `AttentionMetadata.build` gets, and inside the forward the kernels
run unchecked. This test runs on the CPU, where nothing waits, so it counts
the calls that *would* wait on a GPU with a TorchFunctionMode, which sees every
torch function and Tensor method called while it is active.

On a CPU the torch backend's decodes go to a compiled CPU kernel
(minicb/cpu_attention.py), which reads the pool through numpy views; the torch
test runs chapter 04's gather instead (TorchAttention), since a GPU never runs it.

Under the Triton interpreter the kernel programs themselves run on the host
with numpy, reading memory through raw pointers the mode never sees; that is
what interpreting means, and compiled kernels read nothing. What the count
covers there is the Python around each launch, which is the same either way.
"""
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from minicb import paged_attention, triton_attention
from minicb.model import random_model
from minicb.paged_model import PagedAttention

from engine_support import paged_step

Tensor = torch.Tensor
# Calls that copy a value to the host (and so wait for the GPU) whatever their arguments.
ALWAYS_READ = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__int__, Tensor.__float__,
               Tensor.__complex__, Tensor.__index__, Tensor.cpu, Tensor.numpy, Tensor.__array__,
               Tensor.nonzero, torch.nonzero, torch.argwhere, Tensor.masked_select, torch.masked_select,
               Tensor.unique, torch.unique, torch.unique_consecutive}


def _reads_host(func, args, kwargs) -> bool:
    if func in ALWAYS_READ:
        return True
    if func in (Tensor.__getitem__, Tensor.__setitem__):
        # t[mask] with a bool mask needs the mask's nonzero() to size the result.
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in index)
    if func in (torch.repeat_interleave, Tensor.repeat_interleave):
        # Tensor repeats: the output size is their sum, read on the host unless given.
        # repeat_interleave(t) alone repeats arange(len(t)) by t.
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        return isinstance(repeats, Tensor) and kwargs.get("output_size") is None
    if func is torch.where:
        return len(args) + len(kwargs) == 1  # torch.where(cond) is nonzero()
    if func is Tensor.to:
        # .to("cpu") copies back to the host.
        return any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())
                   if isinstance(a, (str, torch.device)))
    return False


class HostReadCounter(TorchFunctionMode):
    """Records every call that would read a tensor on the host, with where it came from."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_host(func, args, kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
            self.reads.append(f"{getattr(func, '__qualname__', func)} at {where}")
        return func(*args, **kwargs)


def count_host_reads(fn) -> list[str]:
    with HostReadCounter() as counter:
        fn()
    return counter.reads


def test_the_counter_sees_host_reads():
    # The test below asserts zero; this shows the counter would have seen them.
    t = torch.tensor([3, 0, 2])
    reads = count_host_reads(lambda: (t.max().item(), t.tolist(), int(t[0]), bool(t[1]), t[t > 0],
                                      t.nonzero(), torch.repeat_interleave(t), t[:2].clone()))
    assert len(reads) == 7, "\n".join(reads)
    assert "item" in reads[0] and "test_host_syncs.py" in reads[0], reads[0]
    assert count_host_reads(lambda: torch.repeat_interleave(t, t, output_size=5)) == []


# (context length, new tokens) per sequence, decodes first, as the scheduler orders them.
STEPS = {
    "decode": ([(5, 1), (17, 1), (9, 1)], 3),
    "prefill": ([(6, 6), (11, 11)], 0),
    "mixed": ([(5, 1), (20, 1), (7, 7), (13, 4), (3, 1)], 2),  # a chunked prefill and a 1-token prompt too
}


def forward_reads(step: str, attention: str) -> list[str]:
    """Host reads during one model forward, with the inputs built the way prepare() builds them (model_runner.py).
    attention: "torch" (chapter 04's gather), "triton" (chapter 05's, chapter 04's prefill as under the
    interpreter) or "triton-tile" (the query-tile prefill)."""
    from minicb import tile_attention
    from minicb.attention_backends import TorchAttention, TritonAttention, TritonTileAttention

    model = random_model(seed=0)
    kernels = {"torch": TorchAttention(paged_attention),
               "triton": TritonAttention(triton_attention, TorchAttention(paged_attention)),
               "triton-tile": TritonTileAttention(triton_attention, tile_attention)}[attention]
    seqs, num_decodes = STEPS[step]
    ids, pos, meta, pool = paged_step(model, seqs, num_decodes)
    attention_object = PagedAttention(pool.k_caches, pool.v_caches, meta, kernels)
    logits_at = meta.last_token_index()
    return count_host_reads(lambda: model(ids, pos, attention_object, logits_at=logits_at))


@pytest.mark.parametrize("step", sorted(STEPS))
def test_torch_forward_reads_nothing_on_the_host(step, monkeypatch):
    # On a CPU the torch backend decodes with the compiled kernel of
    # minicb/cpu_attention.py, which hands Numba the tensors' memory (.numpy(): no
    # copy, and on a CPU nothing waits). A GPU never takes that path, so this test
    # checks the one a GPU does take: chapter 04's gather.
    reads = forward_reads(step, "torch")
    assert reads == [], f"{len(reads)} host reads in a {step} forward:\n" + "\n".join(reads)


def test_triton_decode_forward_reads_nothing_on_the_host():
    if not triton_attention.INTERPRETED:
        pytest.skip("the kernels are compiled for CUDA; this test builds CPU tensors")
    reads = forward_reads("decode", "triton")
    assert reads == [], f"{len(reads)} host reads in a Triton decode forward:\n" + "\n".join(reads)


@pytest.mark.parametrize("step", ["prefill", "mixed"])
def test_triton_tile_prefill_forward_reads_nothing_on_the_host(step, monkeypatch):
    # Compiled, the Triton backend prefills with minicb/tile_attention.py; under the
    # interpreter only when asked, since chapter 04's prefill is quicker there.
    if not triton_attention.INTERPRETED:
        pytest.skip("the kernels are compiled for CUDA; this test builds CPU tensors")
    reads = forward_reads(step, "triton-tile")
    assert reads == [], f"{len(reads)} host reads in a Triton {step} forward, tile prefill:\n" + "\n".join(reads)
