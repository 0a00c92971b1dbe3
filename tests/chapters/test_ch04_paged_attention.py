"""Chapter 04: paged attention against dense attention on the same keys and values.

The implementation under test comes from impl.load("paged_attention"): the
reference by default, the student's chapters/04-paged-attention/exercise.py
with MINICB_IMPL=student. The oracle below never touches the pool layout: it
keeps each sequence's keys and values as plain [context_len, n_kv_heads, head_dim]
tensors, attends in float64 with an explicit softmax, and the paged pool is
built from those same tensors with its blocks handed out in a random order.
"""
import pytest
import torch

from minicb import impl

pa = impl.load("paged_attention")

DECODE_VERSIONS = [  # (function name, task that writes it)
    pytest.param("paged_decode_attention_gather", marks=pytest.mark.task(2), id="gather"),
    pytest.param("paged_decode_attention_online", marks=pytest.mark.task(3), id="online"),
    pytest.param("paged_decode_attention", marks=pytest.mark.task(2), id="default"),
]


# ----------------------------------------------------------------------------
# Inputs and the oracle

def make_sequences(context_lens, n_kv_heads, head_dim, gen, dtype=torch.float32):
    """Each sequence's keys and values, contiguous: lists of [n, n_kv_heads, head_dim]."""
    keys = [torch.randn(n, n_kv_heads, head_dim, generator=gen).to(dtype) for n in context_lens]
    values = [torch.randn(n, n_kv_heads, head_dim, generator=gen).to(dtype) for n in context_lens]
    return keys, values


def build_pool(keys, values, block_size, gen, spare_blocks=3):
    """Copy each sequence into blocks of a pool, handing out physical blocks in a random order.

    Every slot nobody owns (spare blocks, the tail of each last block) holds
    random numbers, so attention that fails to mask them gives a wrong answer.
    The table has two padding columns of -1, so reading past a sequence's last
    block is out of bounds. Returns k_cache, v_cache, block_tables [S, max_blocks] int32.
    """
    n_kv_heads, head_dim = keys[0].shape[1:]
    blocks_per_seq = [-(-k.shape[0] // block_size) for k in keys]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(keys[0].dtype)
    v_cache = torch.randn(shape, generator=gen).to(keys[0].dtype)
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(keys), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    for i, (k, v) in enumerate(zip(keys, values)):
        for t in range(k.shape[0]):
            logical = t // block_size
            if t % block_size == 0:
                block_tables[i, logical] = physical.pop()
            block = block_tables[i, logical]
            k_cache[block, t % block_size] = k[t]
            v_cache[block, t % block_size] = v[t]
    return k_cache, v_cache, block_tables


def dense_attention(q, keys, values, scale=None):
    """q [q_len, n_q_heads, D] are the last q_len positions of keys/values [n, n_kv_heads, D]; causal.

    float64, explicit softmax, KV heads repeated: the plainest attention there is.
    """
    q_len, n_q_heads, head_dim = q.shape
    n = keys.shape[0]
    group = n_q_heads // keys.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, q_len, n]
    q_positions = torch.arange(n - q_len, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > q_positions, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [q_len, Hq, D]


def assert_close(got, expected, atol, what, row_names="row"):
    """Fail with the largest difference, where it is, and both values there."""
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    diff = (got.double() - expected.double()).abs()
    assert not torch.isnan(got).any(), f"{what}: output has NaN at {torch.isnan(got).nonzero()[0].tolist()}"
    worst = diff.max().item()
    if worst > atol:
        where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{what}: max |diff| = {worst:.3e} > {atol:.0e} at [{row_names}, head, dim] = "
                             f"{list(where)}: got {got[where].item():.6f}, expected {expected[where].item():.6f}; "
                             f"{int((diff > atol).sum())} of {diff.numel()} elements differ")


def context_lens_for(block_size):
    """1, exact multiples of the block size, multiples + 1, and a longer one."""
    return [1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 1, 45]


# ----------------------------------------------------------------------------
# Decode: both versions against dense

DECODE_SHAPES = [  # (block_size, n_q_heads, n_kv_heads, head_dim): GQA ratios 1, 3 and 4
    (1, 4, 4, 64),
    (8, 9, 3, 64),
    (16, 8, 2, 128),
    (32, 12, 3, 128),
    (16, 16, 4, 64),
]


@pytest.mark.parametrize("version", DECODE_VERSIONS)
@pytest.mark.parametrize("block_size,n_q_heads,n_kv_heads,head_dim", DECODE_SHAPES)
def test_decode_matches_dense(version, block_size, n_q_heads, n_kv_heads, head_dim, device):
    gen = torch.Generator().manual_seed(block_size * 1000 + n_q_heads * 10 + head_dim)
    lens = context_lens_for(block_size)
    keys, values = make_sequences(lens, n_kv_heads, head_dim, gen)
    k_cache, v_cache, block_tables = build_pool(keys, values, block_size, gen)
    q = torch.randn(len(lens), n_q_heads, head_dim, generator=gen)

    out = getattr(pa, version)(q.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device),
                               torch.tensor(lens, dtype=torch.int32, device=device))
    expected = torch.cat([dense_attention(q[i:i + 1], keys[i], values[i]) for i in range(len(lens))])
    assert out.dtype == q.dtype, f"{version} returned {out.dtype} for {q.dtype} inputs"
    assert_close(out.cpu(), expected, 1e-5, f"{version}, context_lens={lens}", row_names="seq")


@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_custom_scale_int64_metadata_strided_q(version, device):
    # The model hands over q as a slice of a larger tensor, so it need not be contiguous.
    gen = torch.Generator().manual_seed(7)
    lens = [5, 33, 16]
    keys, values = make_sequences(lens, 2, 64, gen)
    k_cache, v_cache, block_tables = build_pool(keys, values, 16, gen)
    q = torch.randn(6, 3, 64, generator=gen).transpose(0, 1)  # [3, 6, 64], not contiguous
    out = getattr(pa, version)(q.to(device), k_cache.to(device), v_cache.to(device),
                               block_tables.long().to(device), torch.tensor(lens, device=device), scale=0.3)
    expected = torch.cat([dense_attention(q[i:i + 1], keys[i], values[i], scale=0.3) for i in range(3)])
    assert_close(out.cpu(), expected, 1e-5, f"{version} with scale=0.3, int64 tables, strided q", row_names="seq")


@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_bfloat16_returns_bfloat16(version, device):
    # The pool stores bf16; the softmax must still run in fp32, and the result comes back as bf16.
    gen = torch.Generator().manual_seed(8)
    lens = [1, 17, 40]
    keys, values = make_sequences(lens, 3, 64, gen, dtype=torch.bfloat16)
    k_cache, v_cache, block_tables = build_pool(keys, values, 8, gen)
    q = torch.randn(3, 9, 64, generator=gen).to(torch.bfloat16)
    out = getattr(pa, version)(q.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device),
                               torch.tensor(lens, dtype=torch.int32, device=device))
    assert out.dtype == torch.bfloat16, f"{version} returned {out.dtype} for bfloat16 inputs"
    expected = torch.cat([dense_attention(q[i:i + 1], keys[i], values[i]) for i in range(3)])
    assert_close(out.cpu(), expected, 2e-2, f"{version} in bfloat16", row_names="seq")


@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_rejects_a_bad_block_id(version, paged_args):
    q, k_cache, v_cache, block_tables, context_lens = paged_args
    block_tables[1, 0] = 6
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 6"):
        getattr(pa, version)(q, k_cache, v_cache, block_tables, context_lens)


# ----------------------------------------------------------------------------
# Block ids whose element offset passes 2**31.
#
# A kernel that computes block_id * block_size * n_kv_heads * head_dim in int32
# wraps around there. Testing that needs a pool past 2**31 elements: 4 GiB in
# float16. torch.empty only reserves address space; the kernel touches a few
# blocks, so only those pages become real memory. (An expand()ed pool would be
# free too, but every block would alias one, so store_kv could not write
# distinct blocks and a read of the wrong block would go unnoticed.)

BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM = 16, 2, 16  # 512 elements per block
BIG_NUM_BLOCKS = 2**31 // (BIG_BLOCK_SIZE * BIG_HEADS * BIG_HEAD_DIM) + 4


@pytest.fixture(scope="module")
def huge_pool():
    shape = (BIG_NUM_BLOCKS, BIG_BLOCK_SIZE, BIG_HEADS, BIG_HEAD_DIM)
    try:
        k_cache = torch.empty(shape, dtype=torch.float16)
        v_cache = torch.empty(shape, dtype=torch.float16)
    except RuntimeError as error:  # a machine that refuses to reserve 2 x 4 GiB of address space
        pytest.skip(f"cannot reserve a {shape} float16 pool: {error}")
    yield k_cache, v_cache


@pytest.mark.parametrize("version", DECODE_VERSIONS[:2])
def test_decode_with_block_offsets_past_2_to_the_31(version, huge_pool):
    k_cache, v_cache = huge_pool
    gen = torch.Generator().manual_seed(31)
    lens = [20, 3]
    # Sequence 0 uses a low block then the last one; sequence 1 one just past the 2**31 element mark.
    tables = [[0, BIG_NUM_BLOCKS - 1], [BIG_NUM_BLOCKS - 3]]
    keys, values = make_sequences(lens, BIG_HEADS, BIG_HEAD_DIM, gen, dtype=torch.float16)
    for table, k, v in zip(tables, keys, values):
        for t in range(k.shape[0]):
            k_cache[table[t // BIG_BLOCK_SIZE], t % BIG_BLOCK_SIZE] = k[t]
            v_cache[table[t // BIG_BLOCK_SIZE], t % BIG_BLOCK_SIZE] = v[t]
    block_tables = torch.tensor([tables[0], tables[1] + [-1]], dtype=torch.int32)
    assert (BIG_NUM_BLOCKS - 3) * BIG_BLOCK_SIZE * BIG_HEADS * BIG_HEAD_DIM > 2**31, \
        "test setup: the pool must pass 2**31 elements, or int32 offsets would not overflow"
    q = torch.randn(2, 4, BIG_HEAD_DIM, generator=gen).to(torch.float16)

    out = getattr(pa, version)(q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32))
    expected = torch.cat([dense_attention(q[i:i + 1], keys[i], values[i]) for i in range(2)])
    assert_close(out, expected, 2e-3, f"{version} reading blocks past 2**31 elements", row_names="seq")


@pytest.mark.task(1)
def test_store_kv_into_block_offsets_past_2_to_the_31(huge_pool):
    k_cache, v_cache = huge_pool
    gen = torch.Generator().manual_seed(32)
    block = BIG_NUM_BLOCKS - 2
    slots = torch.tensor([block * BIG_BLOCK_SIZE + 5, -1, block * BIG_BLOCK_SIZE + 15], dtype=torch.int32)
    k = torch.randn(3, BIG_HEADS, BIG_HEAD_DIM, generator=gen).to(torch.float16)
    v = torch.randn(3, BIG_HEADS, BIG_HEAD_DIM, generator=gen).to(torch.float16)
    pa.store_kv(k, v, k_cache, v_cache, slots)
    for row, offset in ((0, 5), (2, 15)):
        assert torch.equal(k_cache[block, offset], k[row]) and torch.equal(v_cache[block, offset], v[row]), (
            f"token {row} (slot {int(slots[row])}) did not land in block {block}, offset {offset}")


# ----------------------------------------------------------------------------
# Prefill over a ragged batch

PREFILL_SHAPES = [  # (block_size, n_q_heads, n_kv_heads, head_dim)
    (16, 9, 3, 64),
    (8, 8, 2, 128),
    (1, 4, 4, 64),
]


@pytest.mark.task(4)
@pytest.mark.parametrize("block_size,n_q_heads,n_kv_heads,head_dim", PREFILL_SHAPES)
def test_prefill_ragged_batch_matches_dense(block_size, n_q_heads, n_kv_heads, head_dim, device):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    # (context_len, q_len): fresh prompts, prompts continuing after cached tokens, and decodes.
    pairs = [(block_size, block_size), (37, 37), (40, 9), (2 * block_size + 1, 1), (1, 1), (33, 32)]
    lens = [n for n, _ in pairs]
    keys, values = make_sequences(lens, n_kv_heads, head_dim, gen)
    k_cache, v_cache, block_tables = build_pool(keys, values, block_size, gen)
    qs = [torch.randn(q_len, n_q_heads, head_dim, generator=gen) for _, q_len in pairs]
    cu_seqlens_q = torch.tensor([0] + torch.tensor([q_len for _, q_len in pairs]).cumsum(0).tolist(),
                                dtype=torch.int32)

    out = pa.paged_prefill_attention(torch.cat(qs).to(device), k_cache.to(device), v_cache.to(device),
                                     block_tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                                     cu_seqlens_q.to(device))
    expected = torch.cat([dense_attention(q, k, v) for q, k, v in zip(qs, keys, values)])
    assert_close(out.cpu(), expected, 1e-5, f"paged_prefill_attention, (context_len, q_len) = {pairs}",
                 row_names="token")


@pytest.mark.task(4)
def test_prefill_after_store_kv_matches_dense(device):
    # The way the model runs it: store this step's K/V through the slot mapping, then attend.
    gen = torch.Generator().manual_seed(44)
    block_size, n_q_heads, n_kv_heads, head_dim = 4, 6, 2, 64
    prompt_lens = [7, 12, 3, 9]
    keys, values = make_sequences(prompt_lens, n_kv_heads, head_dim, gen)
    num_blocks = 20
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((4, 3), -1, dtype=torch.int32)
    slots = []
    for i, n in enumerate(prompt_lens):
        for t in range(n):
            if t % block_size == 0:
                block_tables[i, t // block_size] = physical.pop()
            slots.append(int(block_tables[i, t // block_size]) * block_size + t % block_size)
    k_cache = torch.zeros(num_blocks, block_size, n_kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    pa.store_kv(torch.cat(keys).to(device), torch.cat(values).to(device), k_cache, v_cache,
                torch.tensor(slots, device=device))
    qs = [torch.randn(n, n_q_heads, head_dim, generator=gen) for n in prompt_lens]
    cu_seqlens_q = torch.tensor([0, 7, 19, 22, 31], dtype=torch.int32, device=device)
    packed = torch.cat(qs).transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided like the model's q
    out = pa.paged_prefill_attention(packed.to(device), k_cache, v_cache, block_tables.to(device),
                                     torch.tensor(prompt_lens, dtype=torch.int32, device=device), cu_seqlens_q)
    expected = torch.cat([dense_attention(q, k, v) for q, k, v in zip(qs, keys, values)])
    assert_close(out.cpu(), expected, 1e-5, "store_kv then paged_prefill_attention", row_names="token")


@pytest.mark.task(4)
def test_prefill_custom_scale(device):
    # A scale it is given, on every kind of row: a fresh prompt, one after cached tokens, decodes.
    gen = torch.Generator().manual_seed(5)
    block_size, n_q_heads, n_kv_heads, head_dim = 4, 6, 2, 16
    pairs = [(6, 6), (11, 3), (9, 1), (2, 1)]  # (context_len, q_len)
    lens = [n for n, _ in pairs]
    keys, values = make_sequences(lens, n_kv_heads, head_dim, gen)
    k_cache, v_cache, block_tables = build_pool(keys, values, block_size, gen)
    qs = [torch.randn(q_len, n_q_heads, head_dim, generator=gen) for _, q_len in pairs]
    cu_seqlens_q = torch.tensor([0, 6, 9, 10, 11], dtype=torch.int32)
    out = pa.paged_prefill_attention(torch.cat(qs).to(device), k_cache.to(device), v_cache.to(device),
                                     block_tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
                                     cu_seqlens_q.to(device), scale=0.3)
    expected = torch.cat([dense_attention(q, k, v, scale=0.3) for q, k, v in zip(qs, keys, values)])
    assert_close(out.cpu(), expected, 1e-5, f"paged_prefill_attention with scale=0.3, (context_len, q_len) = {pairs}",
                 row_names="token")


@pytest.mark.task(4)
@pytest.mark.parametrize("cu,lens,message", [
    ([0, 3, 5], [3, 2, 1], "cu_seqlens_q"),  # 3 entries for 3 sequences
    ([0, 3, 6], [3, 2], "cu_seqlens_q"),  # ends past the 5 query tokens
    ([0, 3, 3], [3, 2], "cu_seqlens_q"),  # sequence 1 has no queries
    ([0, 2, 5], [2, 2], "sequence 1"),  # 3 queries but only 2 tokens of context
], ids=["entries", "end", "empty", "q_len>context"])
def test_prefill_rejects_bad_offsets(cu, lens, message):
    q = torch.randn(5, 4, 8)
    k_cache = torch.randn(4, 4, 2, 8)
    block_tables = torch.tensor([[0], [1], [2]][:len(lens)], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        pa.paged_prefill_attention(q, k_cache, k_cache, block_tables, torch.tensor(lens, dtype=torch.int32),
                                   torch.tensor(cu, dtype=torch.int32))


# ----------------------------------------------------------------------------
# store_kv

@pytest.mark.task(1)
def test_store_kv_round_trip_skips_padding(device):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, n_kv_heads, head_dim = 5, 4, 2, 8
    k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    slots = [13, -1, 0, 19, 6, -1, 7]  # 19 is the very last slot; -1 must not wrap around onto it
    k = torch.randn(len(slots), n_kv_heads, head_dim, generator=gen)
    v = torch.randn(len(slots), n_kv_heads, head_dim, generator=gen)

    # The oracle: the same writes, one token at a time.
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = k[row]
            expected_v[slot // block_size, slot % block_size] = v[row]
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    pa.store_kv(k.to(device), v.to(device), k_cache, v_cache, torch.tensor(slots, dtype=torch.int32, device=device))
    for name, got, expected in (("k_cache", k_cache, expected_k), ("v_cache", v_cache, expected_v)):
        wrong = (got.cpu() != expected).any(dim=-1).any(dim=-1).nonzero().tolist()
        assert not wrong, (f"{name} differs at [block, offset] = {wrong} after store_kv with slots {slots} "
                           f"(block_size {block_size}); slots -1 must be skipped")


@pytest.mark.task(1)
def test_store_kv_all_padding_writes_nothing():
    k_cache = torch.randn(2, 4, 1, 8)
    before = k_cache.clone()
    pa.store_kv(torch.randn(2, 1, 8), torch.randn(2, 1, 8), k_cache, k_cache, torch.tensor([-1, -1]))
    assert torch.equal(k_cache, before), "store_kv wrote into the pool although every slot was -1"


@pytest.mark.task(1)
@pytest.mark.parametrize("change,error,message", [
    ("k_shape", ValueError, "3, 2, 9"),  # the shape's numbers: (3, 2, 9) and torch.Size([3, 2, 9]) both pass
    ("head_dim", ValueError, "16"),
    ("dtype", TypeError, "float64"),
    ("slot_len", ValueError, "slot_mapping"),
    ("slot_float", TypeError, "float32"),
    ("slot_too_big", ValueError, "40"),
    ("slot_one_past", ValueError, "20"),  # the pool's 20 slots are 0..19: slot 20 is the first one past it
], ids=["k_shape", "head_dim", "dtype", "slot_len", "slot_float", "slot_too_big", "slot_one_past"])
def test_store_kv_rejects_bad_input(change, error, message):
    k_cache = torch.zeros(5, 4, 2, 8)
    k = v = torch.randn(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    if change == "k_shape":
        v = torch.randn(3, 2, 9)
    elif change == "head_dim":
        k = v = torch.randn(3, 2, 16)
    elif change == "dtype":
        k = v = k.double()
    elif change == "slot_len":
        slots = torch.tensor([0, 1])
    elif change == "slot_float":
        slots = slots.float()
    elif change == "slot_too_big":
        slots = torch.tensor([0, 40, 2])
    elif change == "slot_one_past":
        slots = torch.tensor([0, 20, 2])
    with pytest.raises(error, match=message):
        pa.store_kv(k, v, k_cache, k_cache.clone(), slots)
