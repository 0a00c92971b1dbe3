"""Chapter 03 exercises: the KV block allocator.

Fill in each stub, then run `python -m minicb check 3`. The chapter text
(chapters/03-block-allocation/README.md) explains every task.

Everything here is plain Python: lists, dicts and a deque. No tensors.
"""
from __future__ import annotations

# given: the two errors the tests expect (OutOfBlocksError is a RuntimeError,
# UnknownSequenceError a KeyError; raise them with your own message), and the
# length mix for task 5: long_tailed_lengths(num_seqs=64, max_len=2048, seed=0)
# returns num_seqs int lengths in [1, max_len], long-tailed (median about 256)
from minicb.block_allocator import OutOfBlocksError, UnknownSequenceError, long_tailed_lengths  # noqa: F401
# given: the prefix-caching calls the engine makes of every allocator, answered
# "nothing cached" in terms of your blocks_needed() and allocate() (chapter 07
# caches for real): num_cached_tokens(token_ids) -> 0, free_blocks_needed(token_ids)
# -> blocks_needed(len(token_ids)), allocate_prefix(seq_id, token_ids) -> calls
# allocate(seq_id, len(token_ids)) and returns 0, cache_full_blocks(...) -> 0,
# cached_free_blocks() -> []. You write none of them.
from minicb.block_allocator import NoPrefixCache


class BlockAllocator(NoPrefixCache):
    """Hands out fixed-size KV blocks to sequences and takes them back.

    Keep four pieces of state: a block table (list of physical block ids) and a
    token count per sequence id, a ref count per physical block, and a free
    list (a collections.deque works well) holding exactly the blocks whose
    ref count is 0.
    """

    def __init__(self, num_blocks: int, block_size: int):
        """Store num_blocks and block_size (both must be positive ints: raise
        ValueError naming the bad value) and start with every block free."""
        raise NotImplementedError(
            "Chapter 3, task 1: BlockAllocator.__init__() — see chapters/03-block-allocation/README.md#task-1")

    @property
    def num_free_blocks(self) -> int:
        raise NotImplementedError(
            "Chapter 3, task 1: num_free_blocks — see chapters/03-block-allocation/README.md#task-1")

    def blocks_needed(self, num_tokens: int) -> int:
        """ceil(num_tokens / block_size); ValueError naming the count (e.g. -1) if it is negative."""
        raise NotImplementedError(
            "Chapter 3, task 1: blocks_needed() — see chapters/03-block-allocation/README.md#task-1")

    def can_allocate(self, num_tokens: int) -> bool:
        raise NotImplementedError(
            "Chapter 3, task 1: can_allocate() — see chapters/03-block-allocation/README.md#task-1")

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give a new sequence enough blocks for num_tokens tokens; return (a copy of) its block table.

        ValueError if seq_id already exists; OutOfBlocksError if there are too
        few free blocks -- and in both cases change nothing at all.
        """
        raise NotImplementedError(
            "Chapter 3, task 1: allocate() — see chapters/03-block-allocation/README.md#task-1")

    def can_append(self, seq_id: int) -> bool:
        """Would append(seq_id) succeed right now?"""
        raise NotImplementedError(
            "Chapter 3, task 2: can_append() — see chapters/03-block-allocation/README.md#task-2")

    def append(self, seq_id: int) -> tuple[int, int] | None:
        """Grow the sequence by one token slot.

        Task 2: take a new block only when the last one is full (or there is none).
        Task 3: if the last block has room but is shared, copy-on-write: give this
        sequence a fresh block in its place and return (old_block, new_block).
        Otherwise return None.
        """
        raise NotImplementedError(
            "Chapter 3, task 2: append() — see chapters/03-block-allocation/README.md#task-2")

    def fork(self, parent_id: int, child_id: int) -> None:
        """A new sequence child_id with the parent's tokens, sharing all its blocks."""
        raise NotImplementedError(
            "Chapter 3, task 3: fork() — see chapters/03-block-allocation/README.md#task-3")

    def free(self, seq_id: int) -> None:
        """Drop the sequence; blocks nobody else holds go back on the free list.

        UnknownSequenceError for an id that is not allocated (e.g. a double free).
        """
        raise NotImplementedError(
            "Chapter 3, task 1: free() — see chapters/03-block-allocation/README.md#task-1")

    def num_tokens(self, seq_id: int) -> int:
        raise NotImplementedError(
            "Chapter 3, task 1: num_tokens() — see chapters/03-block-allocation/README.md#task-1")

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        raise NotImplementedError(
            "Chapter 3, task 1: block_table() — see chapters/03-block-allocation/README.md#task-1")

    def slot(self, seq_id: int, position: int) -> int:
        """block_table[position // block_size] * block_size + position % block_size.

        IndexError unless 0 <= position < num_tokens(seq_id).
        """
        raise NotImplementedError(
            "Chapter 3, task 4: slot() — see chapters/03-block-allocation/README.md#task-4")

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions start, start + 1, ..., end - 1 (IndexError unless 0 <= start <= end <= num_tokens)."""
        raise NotImplementedError(
            "Chapter 3, task 4: slot_mapping() — see chapters/03-block-allocation/README.md#task-4")

    def block_owners(self) -> list[int | None]:
        """For each physical block: the lowest sequence id holding it, or None if it is free."""
        raise NotImplementedError(
            "Chapter 3, task 4: block_owners() — see chapters/03-block-allocation/README.md#task-4")

    def has(self, seq_id: int) -> bool:
        raise NotImplementedError(
            "Chapter 3, task 1: has() — see chapters/03-block-allocation/README.md#task-1")


def memory_waste(lengths: list[int], max_len: int, block_size: int) -> dict:
    """{"contiguous": {...}, "paged": {...}}, each with "reserved", "used" (KV slots) and "waste_pct" (0-100).

    contiguous reserves max_len slots per sequence; paged reserves whole blocks.
    ValueError for a length outside [0, max_len] or a non-positive size.
    """
    raise NotImplementedError(
        "Chapter 3, task 5: memory_waste() — see chapters/03-block-allocation/README.md#task-5")
