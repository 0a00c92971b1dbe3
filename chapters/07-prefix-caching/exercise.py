"""Chapter 07 exercise: a block pool that caches prefixes, and copy-on-write.

Fill in the six methods and one function below, task by task. The text is
chapters/07-prefix-caching/README.md; the tests are
tests/test_ch07_prefix_cache.py (the pool alone) and tests/test_ch07_engine.py
(the engine with caching on, n > 1 included). Run them against this file with

    python -m minicb check 7
    MINICB_IMPL=student MINICB_IMPL_ONLY=prefix_cache python -m minicb bench --workload shared-prefix \
        --engines minicb-continuous,minicb-prefix-cache       # the benchmark, on your pool

Given, in the class below (minicb/prefix_cache.py documents each): the state
(`_block_of_key`, `_key_of_block`, `_evictable`, `stats`, and chapter 03's
`_free`, `_ref_counts`, `_block_tables`, `_num_tokens`), the capacity checks
(`num_free_blocks` counts plain free + evictable blocks), `_take` (plain free
blocks first, then your `evict()`), `num_cached_tokens` and `free_blocks_needed`
(both call your `cached_prefix()`), and the queries (`ref_count`, `block_key`,
`block_with_key`, `cached_free_blocks`, `shared_blocks`).
"""
from __future__ import annotations

# given: the errors the tests expect, and the statistics record
from minicb.block_allocator import OutOfBlocksError, UnknownSequenceError  # noqa: F401
from minicb.prefix_cache import CachingBlockAllocator as _GivenCachingBlockAllocator
from minicb.prefix_cache import PrefixCacheStats  # noqa: F401


def block_keys(token_ids: list[int], block_size: int) -> list[int]:
    """Task 1: one key per FULL block of token_ids (a partial last block gets none):
    key[i] = hash((key[i-1], tuple(token_ids[i*block_size:(i+1)*block_size]))), with
    None as the parent of block 0. ValueError naming block_size unless it is a positive int."""
    raise NotImplementedError(
        "Chapter 7, task 1: block_keys() — see chapters/07-prefix-caching/README.md#task-1")


class CachingBlockAllocator(_GivenCachingBlockAllocator):
    """Chapter 03's allocator, plus a cache of full blocks keyed by their prefix.

    Every block is held (ref count > 0), evictable (ref count 0, keyed, in
    self._evictable, an OrderedDict block -> key, oldest free first) or plain free
    (ref count 0, no key, in self._free). self._block_of_key and self._key_of_block
    map keys to blocks and back: one block per key, one key per block.
    """

    def cache_full_blocks(self, seq_id: int, token_ids: list[int]) -> int:
        """Task 1: token_ids are seq_id's tokens whose K/V are computed (all, or the first ones);
        give the full blocks among them their keys and return how many keys are new. Skip a block
        that has its key already, and one whose key another block serves (it stays private).
        ValueError if token_ids is longer than what seq_id holds, or if a block already has a
        different key."""
        raise NotImplementedError(
            "Chapter 7, task 1: CachingBlockAllocator.cache_full_blocks() — "
            "see chapters/07-prefix-caching/README.md#task-1")

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Task 2: the physical blocks of the longest run of leading full blocks whose keys are
        cached (held or evictable), at most (len(token_ids) - 1) // block_size of them. Changes
        nothing. TypeError for a token that is not an int (self._check_tokens does it)."""
        raise NotImplementedError(
            "Chapter 7, task 2: CachingBlockAllocator.cached_prefix() — "
            "see chapters/07-prefix-caching/README.md#task-2")

    def allocate_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Task 2: register seq_id holding token_ids: share its cached prefix (ref count + 1,
        taking evictable hits out of self._evictable first), then fresh blocks (self._take) for
        the rest. Count the tokens in self.stats. Return the number of cached tokens.
        ValueError for a known seq_id, OutOfBlocksError when short -- changing nothing."""
        raise NotImplementedError(
            "Chapter 7, task 2: CachingBlockAllocator.allocate_prefix() — "
            "see chapters/07-prefix-caching/README.md#task-2")

    def evict(self) -> int:
        """Task 3: take the least recently freed evictable block out of the cache (drop its key
        both ways, count it in self.stats.evicted_blocks) and return it. OutOfBlocksError if
        none is evictable."""
        raise NotImplementedError(
            "Chapter 7, task 3: CachingBlockAllocator.evict() — see chapters/07-prefix-caching/README.md#task-3")

    def free(self, seq_id: int) -> None:
        """Task 3: drop seq_id; each of its blocks (last block first) loses one reference, and a
        block nobody holds any more joins the back of self._evictable if it has a key, else
        self._free. UnknownSequenceError (self._lookup) for an unknown id."""
        raise NotImplementedError(
            "Chapter 7, task 3: CachingBlockAllocator.free() — see chapters/07-prefix-caching/README.md#task-3")

    def append(self, seq_id: int) -> tuple[int, int] | None:
        """Task 4: grow seq_id by one token slot: a new block (self._take) when the last is full,
        copy-on-write when the last block is partial and shared (return (src, dst): the engine
        copies the K/V before writing), else nothing. Return None when nothing was copied."""
        raise NotImplementedError(
            "Chapter 7, task 4: CachingBlockAllocator.append() — see chapters/07-prefix-caching/README.md#task-4")
