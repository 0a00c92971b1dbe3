"""KV-cache block allocation: a free list, ref counts and block tables.

What you will learn:
- why a serving engine cuts the KV cache into fixed-size blocks instead of
  reserving `max_len` slots per sequence, and how much memory that saves;
- how a block table maps a sequence's logical token positions to physical
  KV slots (`slot = block_table[pos // block_size] * block_size + pos % block_size`);
- how two sequences share a prefix (`fork`) and split only when one of them
  writes into a shared block (copy-on-write);
- why running out of blocks must leave the allocator exactly as it was.

Run `python -m minicb.block_allocator` to print the memory-waste comparison
and a small block map. Chapter 03 (chapters/03-block-allocation/README.md)
explains it all.

This file is pure Python on purpose: it decides *where* each token's keys and
values live, never touches a tensor, and so can be tested exhaustively in
milliseconds. Chapter 04 writes and reads the KV cache through the slot
mappings and block tables it hands out; chapter 06's scheduler asks it
whether a sequence still fits.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than the request needs. Nothing was changed."""


class UnknownSequenceError(KeyError):
    """A sequence id the allocator does not hold (never allocated, or already freed)."""

    def __str__(self) -> str:
        # KeyError's str() wraps the message in quotes; a person wants the plain sentence.
        return str(self.args[0]) if self.args else ""


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class NoPrefixCache:
    """The prefix-caching calls of chapter 07, answered by an allocator that caches nothing.

    The scheduler and the engine talk to every allocator the same way: at
    admission they ask how much of a prompt is cached (`num_cached_tokens`) and
    how many free blocks it would cost (`free_blocks_needed`), then allocate it
    with `allocate_prefix`; when tokens are scheduled they offer the full blocks
    for keys (`cache_full_blocks`). Here the answers are "none", "all of them
    fresh", a plain `allocate`, and "nothing registered", so chapter 03's
    allocator is the case of a cache that never hits, and no caller needs an
    `if caching:` branch. Chapter 07's `CachingBlockAllocator` answers for real.
    """

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` whose K/V are cached: none."""
        return 0

    def free_blocks_needed(self, token_ids: list[int]) -> int:
        """Free blocks allocate_prefix(token_ids) would use: one per block of tokens."""
        return self.blocks_needed(len(token_ids))

    def allocate_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Allocate `seq_id` holding `token_ids`; return the cached tokens among them: 0."""
        self.allocate(seq_id, len(token_ids))
        return 0

    def cache_full_blocks(self, seq_id: int, token_ids: list[int]) -> int:
        """Give keys to the full blocks of `token_ids`; return how many are new: none."""
        return 0

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that keep their K/V for a later hit: none."""
        return []


class BlockAllocator(NoPrefixCache):
    """Hands out fixed-size KV blocks to sequences and takes them back.

    The KV cache itself (chapter 04) is a tensor of shape
    [num_blocks, block_size, n_kv_heads, head_dim] per layer; this class only
    decides which of its `num_blocks` rows each sequence may use.

    State, and the one rule that ties it together:
    - `_block_tables[seq_id]`: the sequence's physical blocks, in logical order;
    - `_num_tokens[seq_id]`: how many token slots the sequence holds;
    - `_ref_counts[block]`: how many block tables contain `block`;
    - `_free`: every block whose ref count is 0, and no other.
    """

    def __init__(self, num_blocks: int, block_size: int):
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The free list is a FIFO queue: allocation takes from the left, free()
        # returns blocks on the right. Both ends are O(1), and a freshly built
        # pool hands out 0, 1, 2, ... so the first block tables are easy to read.
        # FIFO also means a freed block is reused as late as possible, which
        # keeps its contents around the longest -- exactly what prefix caching
        # (minicb/prefix_cache.py) wants when it revives a finished request's blocks.
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    # ---- capacity -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        _check_count("num_tokens", num_tokens)
        return -(-num_tokens // self.block_size)  # integer ceil, no float rounding

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= len(self._free)

    # ---- the lifetime of a sequence -------------------------------------------

    def _lookup(self, seq_id: int) -> list[int]:
        table = self._block_tables.get(seq_id)
        if table is None:
            raise UnknownSequenceError(
                f"sequence {seq_id!r} is not allocated (never allocated, or already freed); "
                f"allocated ids: {sorted(self._block_tables)}")
        return table

    def _take(self, count: int, why: str) -> list[int]:
        """Pop `count` free blocks, or raise before touching anything."""
        # Every public method that needs blocks calls this *before* it changes
        # any other state. The scheduler relies on that: when a sequence does not
        # fit, it catches the error (or asks can_* first), preempts someone, and
        # tries again -- which only works if the failed attempt left no trace.
        if count > len(self._free):
            raise OutOfBlocksError(
                f"{why} needs {count} free block(s) but only {len(self._free)} of "
                f"{self.num_blocks} are free (block_size {self.block_size})")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Register a new sequence holding `num_tokens` tokens; return its block table."""
        if seq_id in self._block_tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first or pick a new id")
        needed = self.blocks_needed(num_tokens)
        table = self._take(needed, f"allocating sequence {seq_id!r} with {num_tokens} token(s)")
        self._block_tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        return list(table)

    def can_append(self, seq_id: int) -> bool:
        table = self._lookup(seq_id)
        # The same two cases in which append() takes a block: a full (or no) last
        # block, or a shared one that must be copied before it is written.
        needs_block = self._num_tokens[seq_id] % self.block_size == 0 or self._ref_counts[table[-1]] > 1
        return not needs_block or len(self._free) >= 1

    def append(self, seq_id: int) -> tuple[int, int] | None:
        """Grow `seq_id` by one token slot.

        Returns (src_block, dst_block) when copy-on-write happened: the caller
        must copy the KV of physical block src into dst (all layers) before
        writing the new token. Returns None otherwise.
        """
        table = self._lookup(seq_id)
        num_tokens = self._num_tokens[seq_id]
        if num_tokens % self.block_size == 0:
            # Full (or no) last block. A shared full block is fine: nobody writes
            # into it again, so the sequences keep sharing it.
            table.extend(self._take(1, f"appending a token to sequence {seq_id!r}"))
            copy = None
        elif self._ref_counts[table[-1]] > 1:
            # The new token goes into the last block, which another sequence also
            # holds: writing there would change *its* KV too. Copy first.
            src = table[-1]
            (dst,) = self._take(1, f"copy-on-write of shared block {src} for sequence {seq_id!r}")
            self._ref_counts[src] -= 1  # still > 0: the other holders keep it
            table[-1] = dst
            copy = (src, dst)
        else:
            copy = None  # room in a private last block: write in place
        self._num_tokens[seq_id] = num_tokens + 1
        return copy

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make `child_id` a sequence with the same tokens, sharing all of the parent's blocks.

        This is how parallel sampling (n > 1) and prefix sharing avoid storing
        the same prompt twice. It costs no free blocks; the first write into a
        shared partial block pays for one (see append).
        """
        table = self._lookup(parent_id)
        if child_id in self._block_tables:
            raise ValueError(f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} already exists")
        for block in table:
            self._ref_counts[block] += 1
        self._block_tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]

    def free(self, seq_id: int) -> None:
        """Drop `seq_id`; blocks no other sequence holds go back to the free list."""
        table = self._lookup(seq_id)
        # Return the tail first. With the FIFO free list that makes the prompt's
        # first blocks -- the part other requests are most likely to share --
        # the last of this sequence's blocks to be overwritten.
        for block in reversed(table):
            self._drop(block)
        del self._block_tables[seq_id]
        del self._num_tokens[seq_id]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink `seq_id` to its first `num_tokens` token slots; blocks past them go back.

        Speculative decoding (chapter 11) calls this to drop the slots of draft
        tokens the model rejected. The blocks that still hold a kept token stay.
        """
        table = self._lookup(seq_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) \
                or not 0 <= num_tokens <= self._num_tokens[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id!r} to {num_tokens!r} tokens; "
                             f"it holds {self._num_tokens[seq_id]}, so allowed: 0..{self._num_tokens[seq_id]}")
        while len(table) > self.blocks_needed(num_tokens):
            self._drop(table.pop())
        self._num_tokens[seq_id] = num_tokens

    def _drop(self, block: int) -> None:
        """One holder fewer for `block`; with none left it is free again."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)

    # ---- queries ----------------------------------------------------------------

    def has(self, seq_id: int) -> bool:
        return seq_id in self._block_tables

    def num_tokens(self, seq_id: int) -> int:
        self._lookup(seq_id)
        return self._num_tokens[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._lookup(seq_id))  # a copy: callers must not edit our state

    def slot(self, seq_id: int, position: int) -> int:
        """Where token `position` of `seq_id` lives in the flat KV cache.

        Flattening the cache to [num_blocks * block_size, n_kv_heads, head_dim]
        makes every token slot a single integer; chapter 04 writes new keys and
        values with `k_cache.view(-1, ...)[slot] = k`.
        """
        table = self._lookup(seq_id)
        num_tokens = self._num_tokens[seq_id]
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < num_tokens:
            raise IndexError(f"position {position!r} is outside sequence {seq_id!r}, "
                             f"which holds positions 0..{num_tokens - 1} ({num_tokens} token(s))")
        block, offset = divmod(position, self.block_size)
        return table[block] * self.block_size + offset

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions [start, end): a prefill writes [0, n), a decode step [n-1, n)."""
        table = self._lookup(seq_id)
        num_tokens = self._num_tokens[seq_id]
        if not 0 <= start <= end <= num_tokens:
            raise IndexError(f"range [{start!r}, {end!r}) is not inside sequence {seq_id!r}; "
                             f"allowed: 0 <= start <= end <= {num_tokens}")
        # slot() for each position, without re-checking each one: the engine
        # calls this for every sequence on every step.
        size = self.block_size
        return [table[position // size] * size + position % size for position in range(start, end)]

    def block_owners(self) -> list[int | None]:
        """Per physical block, a sequence that holds it (the lowest id if shared), None if free."""
        owners: list[int | None] = [None] * self.num_blocks
        for seq_id in sorted(self._block_tables):  # ascending, so the first writer is the lowest id
            for block in self._block_tables[seq_id]:
                if owners[block] is None:
                    owners[block] = seq_id
        return owners


# ---- how much memory does paging save? -----------------------------------------


def memory_waste(lengths: list[int], max_len: int, block_size: int) -> dict:
    """KV slots reserved vs used for `lengths`, in two schemes.

    - contiguous: every sequence reserves `max_len` slots up front (chapter 01's
      cache), because nobody knows in advance how long it will grow;
    - paged: every sequence holds ceil(length / block_size) blocks, so only
      the unused tail of its last block is wasted.

    Returns {"contiguous": {...}, "paged": {...}}, each with
    "reserved" and "used" (KV slots, i.e. tokens) and "waste_pct" (0-100).
    """
    _check_positive_int("max_len", max_len)
    _check_positive_int("block_size", block_size)
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= max_len:
            raise ValueError(f"lengths[{index}] = {length!r}; allowed: an int in [0, max_len={max_len}]")
    used = sum(lengths)

    def scheme(reserved: int) -> dict:
        waste = 100.0 * (reserved - used) / reserved if reserved else 0.0
        return {"reserved": reserved, "used": used, "waste_pct": waste}

    return {
        "contiguous": scheme(len(lengths) * max_len),
        "paged": scheme(sum(math.ceil(length / block_size) for length in lengths) * block_size),
    }


def long_tailed_lengths(num_seqs: int = 64, max_len: int = 2048, seed: int = 0) -> list[int]:
    """Sequence lengths (prompt + output) with a long tail, as real chat traffic has.

    Lognormal with median 256 and sigma 1: most requests are a few hundred
    tokens, a few run to max_len. The cap is what a contiguous cache must reserve.
    """
    rng = random.Random(seed)
    return [min(max_len, max(1, round(rng.lognormvariate(math.log(256), 1.0)))) for _ in range(num_seqs)]


def _print_waste(lengths: list[int], max_len: int, block_size: int) -> None:
    print(f"{len(lengths)} sequences, long-tailed lengths: min {min(lengths)}, "
          f"median {statistics.median(lengths):g}, mean {statistics.mean(lengths):.0f}, max {max(lengths)}")
    print(f"contiguous reserves max_len={max_len} slots per sequence; paged uses block_size={block_size}\n")
    waste = memory_waste(lengths, max_len, block_size)
    # What that means in bytes for SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64 dims, fp32.
    kv_bytes_per_token = 2 * 30 * 3 * 64 * 4
    print(f"{'scheme':<12}{'reserved':>10}{'used':>10}{'waste':>9}{'SmolLM2 fp32 KV':>18}")
    for name, row in waste.items():
        print(f"{name:<12}{row['reserved']:>10}{row['used']:>10}{row['waste_pct']:>8.1f}%"
              f"{row['reserved'] * kv_bytes_per_token / 2**30:>14.2f} GiB")
    # Smaller blocks waste less but make longer block tables (more metadata per
    # sequence, more indirection per attention read). 16 is vLLM's default.
    print("\npaged waste by block size:",
          ", ".join(f"{size}: {memory_waste(lengths, max_len, size)['paged']['waste_pct']:.1f}%"
                    for size in (1, 8, 16, 32, 128, 512)))


def _print_demo() -> None:
    # Two requests, one finishes, a third fills the hole, and a fork shares a prefix.
    allocator = BlockAllocator(num_blocks=10, block_size=4)
    allocator.allocate(0, 10)   # blocks 0-2
    allocator.allocate(1, 5)    # blocks 3-4
    allocator.free(0)           # 2, 1, 0 join the back of the free list
    allocator.allocate(2, 26)   # 7 blocks: the 5 never used, then 2 and 1
    allocator.fork(1, 3)        # 3 shares both of 1's blocks
    copy = allocator.append(3)  # 3 writes into the shared half-full block: it gets block 0
    print("\nblock_size 4, 10 blocks; allocate 0 (10 tok), 1 (5 tok); free 0; "
          "allocate 2 (26 tok); fork 1 -> 3; append to 3")
    for seq_id in (1, 2, 3):
        print(f"  seq {seq_id}: {allocator.num_tokens(seq_id):>2} tokens, block table {allocator.block_table(seq_id)}")
    print(f"  copy-on-write on append: {copy} (copy block {copy[0]}'s KV into block {copy[1]})")
    print("  block map:", " ".join("." if owner is None else str(owner) for owner in allocator.block_owners()))
    print(f"  free blocks: {allocator.num_free_blocks}; slots of seq 3: {allocator.slot_mapping(3, 0, 6)}")


if __name__ == "__main__":
    _print_waste(long_tailed_lengths(64, 2048, seed=0), max_len=2048, block_size=16)
    _print_demo()
