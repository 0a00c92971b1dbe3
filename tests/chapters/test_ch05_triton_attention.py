"""Chapter 05: the Triton kernels against a dense SDPA oracle and against chapter 04.

The implementation under test comes from impl.load("triton_attention"): the
reference by default, the student's chapters/05-triton-attention/exercise.py
with MINICB_IMPL=student. Without CUDA the kernels run under the Triton
interpreter, which is slow, so shapes are small.
"""
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from minicb import impl
from minicb import paged_attention as chapter04  # the oracle, never the code under test

ta = impl.load("triton_attention")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------
# Inputs and oracles

def random_paged_inputs(context_lens, n_q_heads, n_kv_heads, head_dim, block_size, dtype=torch.float32,
                        device="cpu", seed=0):
    """A pool whose blocks are handed out in a random order, one table row per sequence.

    Table entries past a sequence's last block are -1 and the table has two
    spare columns, so a kernel that reads past the context fails loudly."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 2  # two blocks nobody owns
    physical = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(context_lens), max(blocks_needed) + 2), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_needed):
        table[i, :n] = physical[start:start + n]
        start += n
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(context_lens), n_q_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, table, lens)]


def dense_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """One sequence at a time: copy its tokens out of the pool in order, then float64 SDPA."""
    out = torch.empty(q.shape, dtype=torch.float64)
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // n_kv_heads
    for i, n in enumerate(context_lens.tolist()):
        token_rows = [(int(block_tables[i, t // block_size]), t % block_size) for t in range(n)]
        keys = torch.stack([k_cache[b, o] for b, o in token_rows]).double().cpu()  # [n, n_kv_heads, head_dim]
        values = torch.stack([v_cache[b, o] for b, o in token_rows]).double().cpu()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [n_q_heads, n, head_dim]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[i].double().cpu()[:, None, :]  # [n_q_heads, 1, head_dim]
        out[i] = F.scaled_dot_product_attention(query, keys, values, scale=scale)[:, 0]
    return out


def assert_close(actual, expected, tol, what):
    diff = (actual.double().cpu() - expected.double().cpu()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    where = tuple(int(x) for x in (diff == worst).nonzero()[0]) if diff.numel() else ()
    assert worst <= tol, f"{what}: max abs diff {worst:.3g} at index {where} (tolerance {tol})"
    assert not torch.isnan(actual).any(), f"{what}: output holds NaN"


def check_attention(fn, args, tol=1e-5, scale=None):
    """fn's output against the dense oracle and chapter 04's decode."""
    out = fn(*args, scale=scale)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype, \
        f"output is {tuple(out.shape)} {out.dtype}; expected q's {tuple(args[0].shape)} {args[0].dtype}"
    assert_close(out, dense_attention(*args, scale=scale), tol, "vs dense SDPA")
    assert_close(out, chapter04.paged_decode_attention(*args, scale=scale), tol, "vs chapter 04")


def contexts(block_size):
    """Lengths at a multiple of the block size, one past it, and a single token."""
    return [2 * block_size, 2 * block_size + 1, 1, block_size + 3]


# (block_size, n_kv_heads, group = n_q_heads / n_kv_heads, head_dim)
SHAPES = [(1, 2, 1, 64), (8, 3, 3, 64), (16, 2, 4, 128), (32, 1, 3, 128), (16, 4, 1, 128), (8, 1, 4, 64),
          (16, 2, 3, 80)]  # head_dim 80: not a power of 2, so the kernel must mask its padding

# Tests that run on both decode kernels grade task 2 or task 3 accordingly.
ATTENTION_FUNCTIONS = [pytest.param("paged_decode_attention", marks=pytest.mark.task(2)),
                       pytest.param("paged_decode_attention_split_k", marks=pytest.mark.task(3))]


# ----------------------------------------------------------------------------
# Task 1: store_kv

@pytest.mark.task(1)
@pytest.mark.parametrize("block_size,n_kv_heads,head_dim,slot_dtype",
                         [(1, 2, 64, torch.int64), (16, 3, 80, torch.int32), (8, 1, 128, torch.int64)])
def test_store_kv_round_trip_skips_negative_slots(block_size, n_kv_heads, head_dim, slot_dtype, device):
    gen = torch.Generator().manual_seed(1)
    num_blocks = 5
    # Each pool sits inside a buffer with one block of sentinels on either
    # side: a skipped slot written at offset -1 lands there and fails the
    # check below, instead of corrupting the heap and crashing the run.
    block_elems = block_size * n_kv_heads * head_dim
    buffers = [torch.full((block_elems * (num_blocks + 2),), 7.0, device=device) for _ in range(2)]
    k_cache, v_cache = (b[block_elems:-block_elems].view(num_blocks, block_size, n_kv_heads, head_dim)
                        for b in buffers)
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    num_tokens = min(7, num_blocks * block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1] = slots[4] = -1  # padding tokens: must not be written anywhere
    k = torch.randn(num_tokens, n_kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(num_tokens, n_kv_heads, head_dim, generator=gen).to(device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    chapter04.store_kv(k, v, expected_k, expected_v, slots.to(device))

    ta.store_kv(k, v, k_cache, v_cache, slots.to(slot_dtype).to(device))
    assert_close(k_cache, expected_k, 0.0, "k_cache after store_kv vs chapter 04")
    assert_close(v_cache, expected_v, 0.0, "v_cache after store_kv vs chapter 04")
    for b in buffers:
        outside = torch.cat([b[:block_elems], b[-block_elems:]])
        assert (outside == 7.0).all(), "store_kv wrote outside the pool (a slot < 0 must be skipped)"
    for t, slot in enumerate(slots.tolist()):  # and read back directly
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], k[t]), f"token {t}, slot {slot}"


@pytest.mark.task(1)
@pytest.mark.parametrize("case", ["dtype", "shape", "slot_past_pool", "device_mix"])
def test_store_kv_rejects_bad_inputs(case, device):
    k_cache = torch.zeros(4, 8, 2, 16, device=device)
    v_cache = torch.zeros(4, 8, 2, 16, device=device)
    k = torch.ones(3, 2, 16, device=device)
    v = torch.ones(3, 2, 16, device=device)
    slots = torch.tensor([0, 9, 31], device=device)
    if case == "dtype":
        k, v = k.half(), v.half()
        error, words = TypeError, "float16"
    elif case == "shape":
        k, v = k[:, :1], v[:, :1]
        error, words = ValueError, "(3, 1, 16)"
    elif case == "slot_past_pool":
        slots = torch.tensor([0, 9, 32], device=device)
        error, words = ValueError, "32"
    else:
        slots = slots.to("meta")
        error, words = ValueError, "meta"
    with pytest.raises(error, match=re.escape(words)):
        ta.store_kv(k, v, k_cache, v_cache, slots)
    assert not k_cache.any(), "a rejected store_kv must not write to the cache"


# ----------------------------------------------------------------------------
# Task 2: the decode kernel

@pytest.mark.task(2)
@pytest.mark.parametrize("block_size,n_kv_heads,group,head_dim", SHAPES)
def test_decode_matches_dense_and_chapter04(block_size, n_kv_heads, group, head_dim, device):
    args = random_paged_inputs(contexts(block_size), n_kv_heads * group, n_kv_heads, head_dim, block_size,
                               device=device, seed=block_size + group)
    check_attention(ta.paged_decode_attention, args)


@pytest.mark.task(2)
def test_decode_custom_scale_and_strided_q(device):
    q, *rest = random_paged_inputs([9, 16, 1], 6, 2, 64, 8, device=device)
    # q as a view into a wider tensor, as when it is sliced out of a fused QKV projection
    wide = torch.zeros(q.shape[0], q.shape[1], 3 * q.shape[2], device=device)
    wide[:, :, 64:128] = q
    check_attention(ta.paged_decode_attention, [wide[:, :, 64:128], *rest], scale=0.3)


@pytest.mark.parametrize("name", ATTENTION_FUNCTIONS)
@pytest.mark.parametrize("case", ["dtype", "device_mix", "shape", "context_past_table", "negative_block",
                                  "block_past_pool", "unreadable_device"])
def test_attention_rejects_bad_inputs(case, name, device):
    q, k_cache, v_cache, table, lens = random_paged_inputs([5, 9], 4, 2, 64, 4, device=device)
    if case == "dtype":
        q, error, words = q.half(), TypeError, "float16"
    elif case == "device_mix":
        table, error, words = table.to("meta"), ValueError, "meta"
    elif case == "shape":
        q, error, words = q[:, :, :32], ValueError, "head_dim"
    elif case == "context_past_table":
        lens[1] = table.shape[1] * 4 + 1
        error, words = ValueError, str(table.shape[1] * 4 + 1)
    elif case == "negative_block":
        table[0, 1] = -3
        error, words = ValueError, "-3"
    elif case == "block_past_pool":
        table[1, 0] = k_cache.shape[0]
        error, words = ValueError, str(k_cache.shape[0])
    else:  # every tensor on a device the kernels cannot read
        q, k_cache, v_cache, table, lens = (t.to("meta") for t in (q, k_cache, v_cache, table, lens))
        error, words = ValueError, "meta"
    with pytest.raises(error, match=words):
        getattr(ta, name)(q, k_cache, v_cache, table, lens)


# Sized so that block_id * block_size * n_kv_heads * head_dim passes 2**31 for
# the blocks used: int32 offsets wrap there. The pool is 4 GiB of address
# space but only the few pages written are ever touched. It runs in a
# subprocess because an implementation that wraps reads far outside the pool
# and crashes the interpreter instead of failing an assert.
OVERFLOW_SCRIPT = textwrap.dedent("""
    import sys, torch
    from minicb import impl, paged_attention as chapter04
    ta = impl.load("triton_attention")
    name, device = sys.argv[1], sys.argv[2]
    block_size, n_kv_heads, head_dim = 2, 1, 4                   # 8 elements per block
    num_blocks = (1 << 28) + 8                                   # (2**31 + 64) fp16 elements, 4 GiB
    try:
        k_cache = torch.empty(num_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as e:
        print("SKIP cannot reserve 4 GiB of address space:", e); sys.exit(0)
    v_cache = k_cache  # one pool for both keeps it to 4 GiB; the test only needs the addresses
    table = torch.tensor([[num_blocks - 1, 3, num_blocks - 5], [num_blocks - 2, num_blocks - 8, 0]],
                         dtype=torch.int32, device=device)
    lens = torch.tensor([6, 5], dtype=torch.int32, device=device)
    blocks = table.flatten().long()
    gen = torch.Generator().manual_seed(0)
    k_cache[blocks] = torch.randn(len(blocks), block_size, n_kv_heads, head_dim, generator=gen).half().to(device)
    if name == "store_kv":
        slots = torch.cat([blocks * block_size, blocks * block_size + 1]).int()  # int32, as an engine sends them
        values = torch.randn(len(slots), n_kv_heads, head_dim, generator=gen).half().to(device)
        ta.store_kv(values, values, k_cache, v_cache, slots)
        for t, slot in enumerate(slots.tolist()):
            got = k_cache[slot // block_size, slot % block_size]
            assert torch.equal(got, values[t]), f"slot {slot} holds {got.tolist()}, wrote {values[t].tolist()}"
    else:
        q = torch.randn(2, 2, head_dim, generator=gen).half().to(device)
        expected = chapter04.paged_decode_attention(q, k_cache, v_cache, table, lens).float()
        diff = (getattr(ta, name)(q, k_cache, v_cache, table, lens).float() - expected).abs().max().item()
        assert diff <= 4e-3, f"max abs diff {diff:.3g} vs chapter 04 with blocks past 2**31 elements"
    print("OK")
""")


@pytest.mark.parametrize("name", [pytest.param("store_kv", marks=pytest.mark.task(1))] + ATTENTION_FUNCTIONS)
def test_block_offsets_past_int32(name, device):
    # A small call in this process first, so an unfinished function fails here with its own message.
    q, k_cache, v_cache, table, lens = random_paged_inputs([3], 2, 1, 4, 2, device=device)
    if name == "store_kv":
        ta.store_kv(k_cache[0], v_cache[0], k_cache, v_cache, torch.tensor([0, 1], device=device))
    else:
        getattr(ta, name)(q, k_cache, v_cache, table, lens)

    result = subprocess.run([sys.executable, "-c", OVERFLOW_SCRIPT, name, device], capture_output=True, text=True,
                            timeout=300, cwd=pathlib.Path(__file__).resolve().parents[2])
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0 and "OK" in result.stdout, (
        f"{name} with block offsets past 2**31 elements failed (exit code {result.returncode}; a negative "
        f"code is a crash, e.g. -11 for a segfault: cast block ids and slots to int64 before multiplying "
        f"by a stride).\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-2000:]}")


# ----------------------------------------------------------------------------
# Task 3: split-K

@pytest.mark.task(3)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])  # 8 > the blocks of any sequence: empty splits
@pytest.mark.parametrize("block_size,n_kv_heads,group,head_dim", [SHAPES[1], SHAPES[2], SHAPES[6]])
def test_split_k_matches_dense_and_chapter04(block_size, n_kv_heads, group, head_dim, num_splits, device):
    args = random_paged_inputs(contexts(block_size), n_kv_heads * group, n_kv_heads, head_dim, block_size,
                               device=device, seed=num_splits or 0)

    def split_k(*a, scale=None):
        return ta.paged_decode_attention_split_k(*a, scale=scale, num_splits=num_splits)
    check_attention(split_k, args)


@pytest.mark.task(3)
def test_split_k_custom_scale_and_strided_q(device):
    q, *rest = random_paged_inputs([9, 16, 1], 6, 2, 64, 8, device=device)
    wide = torch.zeros(q.shape[0], q.shape[1], 3 * q.shape[2], device=device)  # q as a strided view
    wide[:, :, 64:128] = q

    def split_k(*a, scale=None):
        return ta.paged_decode_attention_split_k(*a, scale=scale, num_splits=2)
    check_attention(split_k, [wide[:, :, 64:128], *rest], scale=0.3)


@pytest.mark.task(3)
@pytest.mark.parametrize("num_splits", [0, -2, 1.5])
def test_split_k_rejects_bad_num_splits(num_splits, device):
    args = random_paged_inputs([3, 4], 2, 1, 64, 4, device=device)
    with pytest.raises(ValueError, match=str(num_splits)):
        ta.paged_decode_attention_split_k(*args, num_splits=num_splits)


# ----------------------------------------------------------------------------
# 16-bit data: fp32 math inside, one rounding on the way out.

@pytest.mark.parametrize("name", ATTENTION_FUNCTIONS)
def test_bfloat16(name, device):
    args = random_paged_inputs([33, 1, 16, 40], 9, 3, 64, 16, dtype=torch.bfloat16, device=device)
    check_attention(getattr(ta, name), args, tol=2e-2)


# ----------------------------------------------------------------------------
# Task 4: prefill as a batch of decodes

@pytest.mark.task(4)
def test_prefill_matches_chapter04(device):
    # Sequence 0: a fresh prompt of 5; 1: 3 new tokens after 9 cached; 2: a decode; 3: a prompt of 17.
    q_lens, context_lens = [5, 3, 1, 17], [5, 12, 7, 17]
    _, k_cache, v_cache, table, lens = random_paged_inputs(context_lens, 6, 2, 64, 4, device=device)
    q = torch.randn(sum(q_lens), 6, 64, generator=torch.Generator().manual_seed(3)).to(device)
    cu_seqlens_q = torch.tensor([0, 5, 8, 9, 26], dtype=torch.int32, device=device)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q)
    expected = chapter04.paged_prefill_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q)
    assert_close(out, expected, 1e-5, "prefill vs chapter 04")


@pytest.mark.task(4)
def test_prefill_custom_scale(device):
    q_lens, context_lens = [4, 3, 1], [4, 9, 6]  # a fresh prompt, 3 new tokens after 6 cached, a decode
    _, k_cache, v_cache, table, lens = random_paged_inputs(context_lens, 6, 2, 64, 4, device=device)
    q = torch.randn(sum(q_lens), 6, 64, generator=torch.Generator().manual_seed(4)).to(device)
    cu_seqlens_q = torch.tensor([0, 4, 7, 8], dtype=torch.int32, device=device)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q, scale=0.3)
    expected = chapter04.paged_prefill_attention(q, k_cache, v_cache, table, lens, cu_seqlens_q, scale=0.3)
    assert_close(out, expected, 1e-5, "prefill with scale=0.3 vs chapter 04")


@pytest.mark.task(4)
def test_prefill_rejects_more_queries_than_context(device):
    _, k_cache, v_cache, table, lens = random_paged_inputs([4, 2], 2, 1, 64, 4, device=device)
    q = torch.randn(7, 2, 64, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_q|q_len|context"):
        ta.paged_prefill_attention(q, k_cache, v_cache, table, lens,
                                   torch.tensor([0, 4, 7], dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------
# Compiled on a GPU: SmolLM2's attention shape in bf16 (the tensor-core path).

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ATTENTION_FUNCTIONS)
def test_compiled_kernels_on_gpu_smollm2_shape(name):
    args = random_paged_inputs([1, 17, 256, 1000, 4096, 511], 9, 3, 64, 16, dtype=torch.bfloat16, device="cuda")
    assert_close(getattr(ta, name)(*args), chapter04.paged_decode_attention(*args), 2e-2, f"{name} on cuda")
    with pytest.raises(ValueError, match="cpu"):  # compiled kernels cannot read host memory
        getattr(ta, name)(*(t.cpu() for t in args))
