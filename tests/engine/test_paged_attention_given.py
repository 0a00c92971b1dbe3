"""The given parts of chapter 04: `check_paged_args` and `KVPool`.

The exercise file imports both from minicb.paged_attention unchanged, so these
tests run on the reference only. `python -m minicb check 4` runs
tests/chapters/test_ch04_*.py, which grade what the student writes; a test of given
code there would pass on the untouched stubs and grade nothing.
"""
import pytest
import torch

from minicb.paged_attention import KVPool, check_paged_args


# ----------------------------------------------------------------------------
# check_paged_args: every way the arguments can disagree, each named in the message

def test_check_paged_args_accepts_valid_input(paged_args):
    check_paged_args(*paged_args)  # the 99 and -7 lie past what the sequences use


def _bad(index, value):
    def change(args):
        args[index] = value(args[index]) if callable(value) else value
    return change


def _set(index, position, value):
    def change(args):
        args[index][position] = value
    return change


BAD_ARGS = [  # (what is wrong, how to break paged_args, error type, text the message must contain)
    ("q dtype", _bad(0, lambda q: q.double()), TypeError, "q torch.float64"),
    ("v dtype", _bad(2, lambda v: v.half()), TypeError, "v_cache torch.float16"),
    ("device mix", _bad(0, lambda q: q.to("meta")), ValueError, "q on meta"),
    ("q rank", _bad(0, lambda q: q[0]), ValueError, r"got shape \(4, 8\)"),
    ("k rank", _bad(1, lambda k: k[0]), ValueError, r"k_cache must be .* got shape \(4, 2, 8\)"),
    ("k/v shape", _bad(2, lambda v: v[:5]), ValueError, r"\(6, 4, 2, 8\) and \(5, 4, 2, 8\)"),
    ("table rank", _bad(3, lambda t: t[0]), ValueError, r"block_tables must be .* got shape \(3,\)"),
    ("lens rank", _bad(4, lambda c: c[None]), ValueError, r"context_lens must be .* got shape \(1, 2\)"),
    ("gqa", _bad(0, lambda q: q[:, :3]), ValueError, r"n_q_heads \(3\) must be a multiple of n_kv_heads \(2\)"),
    ("head_dim", _bad(0, lambda q: torch.randn(2, 4, 16)), ValueError, "q has head_dim 16 but the cache has 8"),
    ("table float", _bad(3, lambda t: t.float()), TypeError, "block_tables must have an integer dtype"),
    ("lens float", _bad(4, lambda c: c.float()), TypeError, "context_lens must have an integer dtype"),
    ("lens bool", _bad(4, lambda c: c > 0), TypeError, "context_lens .* torch.bool"),
    ("too few lens", _bad(4, lambda c: c[:1]), ValueError, "context_lens has 1 entries"),
    ("too many rows", _bad(3, lambda t: torch.cat([t, t])), ValueError, "block_tables has 4 rows"),
    ("zero length", _set(4, 1, 0), ValueError, r"context_lens\[1\] = 0"),
    ("negative length", _set(4, 0, -3), ValueError, r"context_lens\[0\] = -3"),
    ("too long", _set(4, 1, 13), ValueError, r"context_lens\[1\] = 13 .* = 12"),
    ("negative block", _set(3, (0, 1), -1), ValueError, r"block_tables\[0, 1\] = -1"),
    ("block too big", _set(3, (1, 0), 6), ValueError, r"block_tables\[1, 0\] = 6 .* \[0, 6\)"),
    ("padding now used", _set(4, 1, 5), ValueError, r"block_tables\[1, 1\] = 99"),
    ("not a tensor", _bad(4, lambda c: [5, 4]), TypeError, "context_lens must be a torch.Tensor, got list"),
]


@pytest.mark.parametrize("change,error,message", [case[1:] for case in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_check_paged_args_names_the_bad_value(paged_args, change, error, message):
    args = list(paged_args)
    change(args)
    with pytest.raises(error, match=message):
        check_paged_args(*args)


# ----------------------------------------------------------------------------
# KVPool

def test_kv_pool_sizes_and_copy_block(device):
    pool = KVPool(num_layers=3, num_blocks=7, block_size=4, n_kv_heads=2, head_dim=8,
                     dtype=torch.float16, device=device)
    assert len(pool.k_caches) == len(pool.v_caches) == 3
    for cache in pool.k_caches + pool.v_caches:
        assert cache.shape == (7, 4, 2, 8) and cache.dtype == torch.float16
        assert torch.count_nonzero(cache) == 0, "a fresh pool must hold finite values (zeros)"
    assert pool.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2  # K and V, 3 layers, 4 slots, 2 heads, 8 dims, 2 bytes
    assert pool.total_bytes == 7 * pool.bytes_per_block
    assert KVPool.num_blocks_for_memory(10 * pool.bytes_per_block + 5, 3, 4, 2, 8, torch.float16) == 10
    assert KVPool.memory_budget("cpu", cpu_gib=0.5) == 2**29

    for layer in range(3):
        pool.k_caches[layer].normal_()
        pool.v_caches[layer].normal_()
    before = [c.clone() for c in pool.k_caches + pool.v_caches]
    pool.copy_block(2, 5)
    for cache, old in zip(pool.k_caches + pool.v_caches, before):
        assert torch.equal(cache[5], old[2]), "copy_block(2, 5) did not copy block 2 onto block 5"
        keep = [b for b in range(7) if b != 5]
        assert torch.equal(cache[keep], old[keep]), "copy_block(2, 5) changed a block other than 5"


def test_kv_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        KVPool(2, 0, 16, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs 4096 bytes"):
        KVPool.num_blocks_for_memory(100, 2, 16, 2, 8, torch.float32)
    pool = KVPool(1, 4, 2, 1, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"dst block id 4 is out of range \[0, 4\)"):
        pool.copy_block(0, 4)
