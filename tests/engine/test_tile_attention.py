"""minicb/tile_attention.py: the query-tile kernel against chapter 04's PyTorch prefill.

Chapter 04's `paged_prefill_attention` is the oracle: same arguments, and
it computes each sequence with a dense, masked SDPA over the gathered blocks.
Without CUDA the kernel runs under the Triton interpreter, so shapes are small.
"""
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from minicb import paged_attention as chapter04  # the oracle
from minicb import tile_attention
from minicb.tile_attention import (make_ragged_inputs, paged_attention_tiles, paged_attention_tiles_unchecked,
                                   tile_plan)
from engine_support import paged_step
from test_host_syncs import count_host_reads

ROOT = pathlib.Path(__file__).resolve().parents[2]


def describe_row(token, cu_seqlens_q, context_lens):
    """'token 12 (sequence 2, new token 3 of 9, position 17)' for an error message."""
    starts = cu_seqlens_q.tolist()
    seq = max(i for i in range(len(starts) - 1) if starts[i] <= token)
    q_len = starts[seq + 1] - starts[seq]
    r = token - starts[seq]
    position = int(context_lens[seq]) - q_len + r
    return f"token {token} (sequence {seq}, new token {r} of {q_len}, position {position})"


def assert_matches_chapter04(out, args, tol, what, scale=None):
    q, _, _, _, context_lens, cu_seqlens_q = args
    expected = chapter04.paged_prefill_attention(*args, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype, \
        f"{what}: output is {tuple(out.shape)} {out.dtype}; expected q's {tuple(q.shape)} {q.dtype}"
    assert not torch.isnan(out).any(), f"{what}: output holds NaN"
    diff = (out.double().cpu() - expected.double().cpu()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    if worst > tol:
        token, head, dim = (int(x) for x in (diff == worst).nonzero()[0])
        bad_rows = sorted({int(t) for t in (diff > tol).nonzero()[:, 0]})
        raise AssertionError(
            f"{what}: max abs diff {worst:.3g} > {tol} at {describe_row(token, cu_seqlens_q.cpu(), context_lens)}, "
            f"head {head}, dim {dim}: got {out[token, head, dim].item():.5g}, chapter 04 "
            f"{expected[token, head, dim].item():.5g}; {len(bad_rows)} of {q.shape[0]} tokens differ: {bad_rows[:20]}")


# (q_lens, context_lens, n_q_heads, n_kv_heads, head_dim, block_size): q_lens[i] new tokens are the
# last of context_lens[i], so context_lens[i] - q_lens[i] tokens were cached before this step.
CASES = {
    # MHA, lengths that are multiples of neither the block size nor a tile
    "mha-odd-prompts": ([7, 13], [7, 13], 4, 4, 16, 4),
    # GQA (3 query heads per KV head), head_dim 24 (not a power of 2), chunks starting mid-block:
    # 19 cached tokens behind 11 new ones, 4 behind 5, with blocks of 8
    "gqa3-chunks-mid-block": ([11, 5], [30, 9], 6, 2, 24, 8),
    # a block of one token: every key in another physical block
    "gqa4-block-size-1": ([6, 3], [10, 3], 8, 2, 16, 1),
    # decode only: q_len 1 everywhere, contexts of 1, a block plus some, a few blocks
    "decode-only": ([1, 1, 1, 1], [1, 7, 16, 33], 6, 3, 32, 4),
    # a mixed step as the engine makes it: decodes, a chunk mid-block, a whole prompt, a 1-token prompt
    "mixed": ([1, 1, 9, 17, 1], [20, 5, 14, 17, 1], 9, 3, 16, 4),
    # 16 query heads per KV head: a tile is 64 rows of a handful of tokens
    "group-16": ([3, 2], [3, 9], 16, 1, 16, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_chapter04(case, device):
    q_lens, context_lens, n_q_heads, n_kv_heads, head_dim, block_size = CASES[case]
    args = make_ragged_inputs(q_lens, context_lens, n_q_heads, n_kv_heads, head_dim, block_size, device=device,
                              seed=len(case))
    assert_matches_chapter04(paged_attention_tiles(*args), args, 1e-5, case)


@pytest.mark.parametrize("block_q", [1, 2, 8, 32])  # 32: one tile holds a whole sequence, with rows to spare
def test_any_tile_size_gives_the_same_answer(block_q, device):
    q_lens, context_lens, n_q_heads, n_kv_heads, head_dim, block_size = CASES["mixed"]
    args = make_ragged_inputs(q_lens, context_lens, n_q_heads, n_kv_heads, head_dim, block_size, device=device,
                              seed=block_q)
    assert_matches_chapter04(paged_attention_tiles(*args, block_q=block_q), args, 1e-5, f"block_q {block_q}")


def test_custom_scale_and_strided_q(device):
    q, *rest = make_ragged_inputs([5, 1, 3], [5, 9, 12], 6, 2, 16, 4, device=device, seed=3)
    # q as a view into a wider tensor, as when it is sliced out of a fused QKV projection
    wide = torch.zeros(q.shape[0], q.shape[1], 3 * q.shape[2], device=device)
    wide[:, :, 16:32] = q
    args = [wide[:, :, 16:32], *rest]
    assert_matches_chapter04(paged_attention_tiles(*args, scale=0.3), args, 1e-5, "scale 0.3, strided q", scale=0.3)


def test_bfloat16(device):
    # fp32 inside the kernel and in chapter 04; the outputs differ by the last bf16 rounding at most
    args = make_ragged_inputs([1, 7, 20], [33, 12, 20], 9, 3, 64, 16, dtype=torch.bfloat16, device=device)
    assert_matches_chapter04(paged_attention_tiles(*args), args, 2e-2, "bfloat16")


def test_no_sequences(device):
    args = make_ragged_inputs([], [], 4, 2, 16, 4, device=device)
    out = paged_attention_tiles(*args)
    assert out.shape == (0, 4, 16)


def test_tile_plan_cuts_each_sequence_into_tiles():
    # q_lens 5, 1, 14 with block_q 4: tiles start at each sequence's new tokens 0, 4, 8, ...
    plan = tile_plan([0, 5, 6, 20], torch.empty(1, 4, 1, 16), block_q=4)
    assert plan.block_q == 4 and plan.tiles.dtype == torch.int32
    assert plan.tiles.tolist() == [[0, 0], [0, 4], [1, 0], [2, 0], [2, 4], [2, 8], [2, 12]]
    # the default: no tile larger than the longest sequence needs, so a decode-only step tiles by 1
    assert tile_plan([0, 1, 2, 3], torch.empty(1, 4, 1, 16)).block_q == 1
    assert tile_plan([0], torch.empty(1, 4, 1, 16)).tiles.shape == (0, 2)


# ----------------------------------------------------------------------------
# Bad input: each raises, naming the value and what is allowed.

def _replace(index, make):
    def change(args):
        args[index] = make(args[index])
    return change


def _set(index, position, value):
    def change(args):
        args[index] = args[index].clone()
        args[index][position] = value
    return change


# Valid inputs below: q_lens [4, 3], context_lens [4, 10], 4 query heads over 2 KV heads, head_dim 8,
# blocks of 4, so num_blocks = 1 + 3 + 2 = 6 and the table has 4 columns.
BAD = [  # (what is wrong, how to break the inputs, error, regex the message must match)
    ("q dtype", _replace(0, lambda q: q.double()), TypeError, r"q torch\.float64, k_cache torch\.float32"),
    ("cache dtype", _replace(2, lambda v: v.half()), TypeError, r"v_cache torch\.float16"),
    ("q rank", _replace(0, lambda q: q[0]), ValueError, r"q must be .* got shape \(4, 8\)"),
    ("head_dim", _replace(0, lambda q: q[:, :, :4]), ValueError, "q has head_dim 4 but the cache has 8"),
    ("gqa", _replace(0, lambda q: q[:, :3]), ValueError, r"n_q_heads \(3\) must be a multiple of n_kv_heads \(2\)"),
    ("table dtype", _replace(3, lambda t: t.float()), TypeError, "block_tables must have an integer dtype"),
    ("cu dtype", _replace(5, lambda c: c.float()), TypeError, r"cu_seqlens_q .* dtype torch\.float32"),
    ("cu entries", _replace(5, lambda c: c[:-1]), ValueError, "cu_seqlens_q must have num_seqs \\+ 1 entries; got 2"),
    ("cu start", _set(5, 0, 1), ValueError, r"cu_seqlens_q must start at 0.*got \[1, 4, 7\]"),
    ("cu end", _set(5, 2, 6), ValueError, r"end at total_q_tokens = 7; got \[0, 4, 6\]"),
    ("empty sequence", _set(5, 1, 0), ValueError, r"grow by at least 1 .* got \[0, 0, 7\]"),
    ("q_len > context", _set(4, 0, 3), ValueError, "sequence 0 has 4 query tokens but context length 3"),
    ("context past table", _set(4, 1, 17), ValueError, r"context_lens\[1\] = 17 is out of range.* = 16"),
    ("negative block", _set(3, (1, 2), -1), ValueError, r"block_tables\[1, 2\] = -1 is not a block id"),
    ("block past pool", _set(3, (0, 0), 6), ValueError, r"block_tables\[0, 0\] = 6 .* \[0, 6\)"),
    ("lens count", _replace(4, lambda c: c[:1]), ValueError, "context_lens has 1 entries"),
    ("not a tensor", _replace(4, lambda c: c.tolist()), TypeError, "context_lens must be a torch.Tensor, got list"),
    ("device mix", _replace(5, lambda c: c.to("meta")), ValueError, "cu_seqlens_q on meta"),
    ("pool strides", _replace(2, lambda v: v.transpose(0, 1).contiguous().transpose(0, 1)), ValueError,
     "k_cache and v_cache must have the same strides"),
]


@pytest.mark.parametrize("change,error,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_value(change, error, message, device):
    args = make_ragged_inputs([4, 3], [4, 10], 4, 2, 8, 4, device=device)
    change(args)
    with pytest.raises(error, match=message):
        paged_attention_tiles(*args)


def test_unreadable_device_and_bad_block_q(device):
    args = make_ragged_inputs([4, 3], [4, 10], 4, 2, 8, 4, device=device)
    with pytest.raises(ValueError, match="meta"):  # a device the kernels cannot read
        paged_attention_tiles(*(t.to("meta") for t in args))
    with pytest.raises(ValueError, match="block_q must be a positive power of 2 .* got 3"):
        paged_attention_tiles(*args, block_q=3)


# ----------------------------------------------------------------------------
# No host syncs: with the plan built beforehand (once per step, on the host lists),
# launching reads no tensor back. Counted as tests/engine/test_host_syncs.py counts them.

def test_unchecked_path_reads_nothing_on_the_host(device):
    args = make_ragged_inputs([1, 1, 9, 17, 1], [20, 5, 14, 17, 1], 9, 3, 16, 4, device=device)
    cu = args[5]
    plan = tile_plan(cu.tolist(), args[1])
    reads = count_host_reads(lambda: paged_attention_tiles_unchecked(*args, plan))
    assert reads == [], f"{len(reads)} host reads in paged_attention_tiles_unchecked:\n" + "\n".join(reads)
    # the counter is awake: the checked entry point reads the lengths and tables
    assert count_host_reads(lambda: paged_attention_tiles(*args)), "the checked path should read the host"


# ----------------------------------------------------------------------------
# Offsets past 2**31 elements. Each pool is an fp16 tensor of 2**31 + 64 elements
# (4 GiB) of which only the few blocks the sequences use are ever written: torch.empty
# reserves the address space, and the OS backs a page only when it is touched, so the
# run usually stays small (its peak resident memory is printed). The block ids are
# real: block num_blocks - 1 starts 2**31 + 56 elements into the pool, where an int32
# offset wraps to a negative one. It runs in a subprocess, because a kernel that wraps
# reads outside the pool and may crash the interpreter instead of failing an assert.

OVERFLOW_SCRIPT = textwrap.dedent("""
    import resource, sys
    from minicb.triton_mode import choose_triton_mode
    choose_triton_mode()
    import torch
    from minicb import paged_attention as chapter04, tile_attention
    device = sys.argv[1]
    block_size, n_kv_heads, head_dim = 2, 1, 4                   # 8 elements per block
    num_blocks = (1 << 28) + 8                                   # 2**31 + 64 fp16 elements per pool
    try:
        k_cache = torch.empty(num_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float16, device=device)
        v_cache = torch.empty_like(k_cache)
    except (RuntimeError, MemoryError) as e:
        print("SKIP cannot reserve 2 x 4 GiB of address space:", e); sys.exit(0)
    N = num_blocks
    # A chunk of 3 new tokens behind 4 cached (starting at block 2), a decode, a whole prompt of 4.
    q_lens, context_lens = [3, 1, 4], [7, 5, 4]
    table = torch.tensor([[N - 1, 3, N - 5, N - 3], [N - 2, N - 8, 0, -1], [N - 4, N - 6, -1, -1]],
                         dtype=torch.int32, device=device)
    blocks = table[table >= 0].long()
    gen = torch.Generator().manual_seed(0)
    for cache in (k_cache, v_cache):
        cache[blocks] = torch.randn(len(blocks), block_size, n_kv_heads, head_dim, generator=gen).half().to(device)
    q = torch.randn(sum(q_lens), 2, head_dim, generator=gen).half().to(device)
    args = (q, k_cache, v_cache, table, torch.tensor(context_lens, dtype=torch.int32, device=device),
            torch.tensor([0, 3, 4, 8], dtype=torch.int32, device=device))
    expected = chapter04.paged_prefill_attention(*args).float()
    for block_q in (1, 4):
        got = tile_attention.paged_attention_tiles(*args, block_q=block_q).float()
        diff = (got - expected).abs().max().item()
        assert diff <= 4e-3, f"block_q {block_q}: max abs diff {diff:.3g} vs chapter 04 with offsets past 2**31"
    # Resident memory is printed, not asserted: it depends on the OS (huge pages, memory
    # tiering daemons) as well as on the code. 307 MiB on a quiet machine here, 3.6 GiB once
    # inside a whole test run; either way the answer above was checked.
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"OK, peak resident memory {peak_mib:.0f} MiB")
""")


def test_block_offsets_past_int32(device):
    result = subprocess.run([sys.executable, "-c", OVERFLOW_SCRIPT, device], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0 and "OK" in result.stdout, (
        f"the tile kernel with block offsets past 2**31 elements failed (exit code {result.returncode}; a "
        f"negative code is a crash, e.g. -11 for a segfault: cast block ids to int64 before multiplying by a "
        f"stride).\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-2000:]}")


# ----------------------------------------------------------------------------
# In the model: the Triton backend's prefill. Compiled, it is the tile kernel by
# default; under the interpreter EngineConfig(tile_prefill=True) asks for it.

def mixed_step_logits(backend, seed=0):
    """Logits of every new token of one mixed step (2 decodes, a chunk after 9 cached tokens, a prompt)
    of a small random model, over a pool whose cached slots hold random K/V."""
    from minicb.model import random_model
    from minicb.paged_model import PagedAttention

    model = random_model(seed=seed)
    # (context length, new tokens): 2 decodes, a chunk after 9 cached tokens, a prompt
    ids, pos, meta, pool = paged_step(model, [(5, 1), (13, 1), (13, 4), (7, 7)], 2, kv_seed=seed)
    attention = PagedAttention(pool.k_caches, pool.v_caches, meta, backend)
    every_token = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return model(ids, pos, attention, logits_at=every_token)


def test_model_step_with_tile_prefill_matches_torch_backend(monkeypatch):
    from minicb import paged_attention, triton_attention
    from minicb.attention_backends import TorchAttention, TritonTileAttention
    if not triton_attention.INTERPRETED:
        pytest.skip("the kernels are compiled for CUDA; this test builds CPU tensors")
    calls = []
    launch = tile_attention.paged_attention_tiles_unchecked
    monkeypatch.setattr(tile_attention, "paged_attention_tiles_unchecked",
                        lambda *args, **kwargs: calls.append(1) or launch(*args, **kwargs))
    got = mixed_step_logits(TritonTileAttention(triton_attention, tile_attention))
    assert len(calls) == 2, f"the tile kernel ran {len(calls)} times; once per layer (2) expected"
    expected = mixed_step_logits(TorchAttention(paged_attention))  # chapter 04 as written
    diff = (got - expected).abs().max().item()
    assert diff < 1e-4, f"logits with the tile prefill differ from the torch backend's by {diff:.3g}"


def test_which_backend_the_parts_choose(monkeypatch):
    """EngineParts.attention picks a backend from EngineConfig alone: no module names, no environment."""
    from types import SimpleNamespace

    from minicb import cpu_attention, paged_attention, triton_attention
    from minicb.config import EngineConfig
    from minicb.parts import EngineParts

    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)

    def chosen(interpreted: bool, students=(), **config) -> str:
        monkeypatch.setattr(triton_attention, "INTERPRETED", interpreted)  # how this process defined its kernels
        modules = {"paged_attention": paged_attention, "triton_attention": SimpleNamespace()}
        parts = EngineParts(EngineConfig(**config), load=modules.__getitem__, students=frozenset(students))
        backend = parts.attention(model)
        inner = getattr(backend, "prefill_backend", None)
        return type(backend).__name__ + (f"+{type(inner).__name__}" if inner is not None else "")

    assert chosen(False, attention="triton") == "TritonTileAttention", "compiled: the tile prefill by default"
    assert chosen(True, attention="triton") == "TritonAttention+TorchAttention", (
        "interpreted: chapter 05's store and decode, chapter 04's prefill")
    assert chosen(True, attention="triton", tile_prefill=True) == "TritonTileAttention"
    assert chosen(False, attention="triton", tile_prefill=False) == "TritonAttention"
    # A student's chapter 05 file runs as written (its prefill is graded), whatever tile_prefill says.
    assert chosen(False, ["triton_attention"], attention="triton", tile_prefill=True) == "StudentAttention"
    assert chosen(True, ["triton_attention"], attention="triton") == "StudentAttention+TorchAttention"
    compiled = "CpuDecodeAttention" if cpu_attention.applies_to(model.device, model.dtype) else "TorchAttention"
    assert chosen(True, attention="torch") == compiled
    assert chosen(True, attention="torch", cpu_decode="gather") == "TorchAttention"
    assert chosen(True, ["paged_attention"], attention="torch") == "StudentAttention"
    with pytest.raises(ValueError, match="tile_prefill=True needs attention='triton'"):
        EngineConfig(attention="torch", tile_prefill=True)
    with pytest.raises(ValueError, match="cpu_decode='fast'"):
        EngineConfig(cpu_decode="fast")
