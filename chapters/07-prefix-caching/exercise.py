"""Chapter 07 exercise: a block pool that caches prefixes, and copy-on-write.

Fill in the six methods and one function below, task by task. The text is
chapters/07-prefix-caching/README.md; the tests are
tests/chapters/test_ch07_prefix_cache.py (the pool alone) and tests/chapters/test_ch07_engine.py
(the engine with caching on, n > 1 included). Run them against this file with

    python -m minicb check 7
    MINICB_IMPL=student MINICB_IMPL_ONLY=prefix_cache python -m minicb bench --workload shared-prefix \
        --engines minicb-continuous,minicb-prefix-cache       # the benchmark, on your pool

Given, in `minicb.prefix_cache.CachingAllocatorBase`, the class below inherits
from (you call them; you do not write them; it holds none of your methods, and
`check 7` grades only what this file defines):
- the state: `_block_of_key` (key -> block) and `_key_of_block` (block -> key), the
  cache, held and evictable blocks alike; `_evictable`, an OrderedDict block -> key,
  least recently freed first; `stats`, a PrefixCacheStats (query_tokens,
  hit_tokens, evicted_blocks); and chapter 03's `_free` (a deque of the plain free
  blocks), `_ref_counts` (a list, one count per block), `_block_tables`
  (seq_id -> list of blocks) and `_num_tokens` (seq_id -> token slots held).
- `num_free_blocks`: plain free + evictable blocks (both can be handed out);
  `can_allocate(num_tokens)`, `can_append(seq_id)`, `blocks_needed(num_tokens)`.
- `self._take(count, why) -> list[int]`: hands out `count` blocks, plain free ones
  first, then the ones your `evict()` returns, each with its ref count already
  set to 1: the caller adds no reference of its own. Raises OutOfBlocksError
  (its message starts with `why` and gives the blocks needed and the blocks
  free) before changing anything.
- `self._lookup(seq_id) -> list[int]`: the sequence's block table itself, the live
  list the allocator keeps, not a copy: `table[-1] = new` changes the sequence.
  Raises UnknownSequenceError naming the id when seq_id is not allocated.
- `self._check_tokens(token_ids) -> list[int]`: the tokens as a list; TypeError
  naming the bad tokens by their repr ('x' for the string "x") when one is not an int.
- `num_cached_tokens(token_ids)` and `free_blocks_needed(token_ids)`: what the
  scheduler asks at admission, both worked out with your `cached_prefix()`: the
  cached tokens, and the free blocks allocate_prefix would use up (fresh blocks
  plus evictable hits).
- chapter 03's `allocate`, `fork`, `num_tokens`, `block_table` (a copy), `slot`,
  `slot_mapping`, `block_owners`, `has` and `truncate`, unchanged.
- the queries: `ref_count(block)` and `block_key(block)` (its key or None), both
  raising IndexError naming a block id that does not exist; `block_with_key(key)`
  (a block or None), `cached_free_blocks()` (the evictable blocks, the next to go
  first) and `shared_blocks()` (the blocks with ref count > 1).
"""
from __future__ import annotations

# given: the errors the tests expect, and the statistics record
from minicb.block_allocator import OutOfBlocksError, UnknownSequenceError  # noqa: F401
# given: the cache's state and helpers (_take, _check_tokens, ref_count, ...), none of your methods
from minicb.prefix_cache import CachingAllocatorBase
from minicb.prefix_cache import PrefixCacheStats  # noqa: F401


def block_keys(token_ids: list[int], block_size: int) -> list[int]:
    """Task 1: one key per FULL block of token_ids (a partial last block gets none):
    key[i] = hash((key[i-1], tuple(token_ids[i*block_size:(i+1)*block_size]))), with
    None as the parent of block 0. Unless block_size is a positive int, ValueError naming
    block_size and its value (e.g. 0)."""
    raise NotImplementedError(
        "Chapter 7, task 1: block_keys() — see chapters/07-prefix-caching/README.md#task-1")


class CachingBlockAllocator(CachingAllocatorBase):
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
        Check everything before changing anything: UnknownSequenceError naming an unknown seq_id
        (self._lookup raises it); ValueError if token_ids is longer than what seq_id holds, its
        message giving the count held before the count given ("holds 5 ... has 6"); ValueError
        with the words "different prefix" if a block already has a different key."""
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
        taking evictable hits out of self._evictable first), then fresh blocks for the rest
        (self._take(n, why): they come at ref count 1). Count the tokens in self.stats. Return the
        number of cached tokens. ValueError naming seq_id if it is known already; OutOfBlocksError
        giving the blocks needed and the blocks free when short -- both before changing anything."""
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
        """Task 4: grow seq_id by one token slot: a new block (self._take(1, why), at ref count 1)
        when the last is full, copy-on-write when the last block is partial and shared (the new
        block replaces it in the live table self._lookup returns, the old one loses a reference;
        return (src, dst): the engine copies the K/V before writing), else nothing. Return None
        when nothing was copied. UnknownSequenceError (self._lookup) for an unknown id."""
        raise NotImplementedError(
            "Chapter 7, task 4: CachingBlockAllocator.append() — see chapters/07-prefix-caching/README.md#task-4")
