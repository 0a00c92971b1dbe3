"""Prefix caching: keep the K/V of full blocks after a request ends, and reuse it.

What you will learn:
- why chat traffic repeats itself (one system prompt for everyone, every turn of
  a conversation resending the earlier turns, n samples of one prompt), and how
  an engine computes such a prefix once;
- how a *block key* -- a hash of the parent block's key and the block's own
  token ids -- names a whole prefix, so a dict lookup per block finds the
  longest cached prefix of a new prompt;
- why a freed block keeps its key and its K/V (it becomes *evictable*, not
  free), and why the least recently freed one is overwritten first;
- why even a full hit leaves the last prompt token to compute: its logits pick
  the first output token.

Run `python -m minicb.prefix_cache` for a small demo: two requests share a
system prompt, one is freed, a third hits the cache, a fourth forces an
eviction. The engine uses this allocator when `enable_prefix_caching=True`;
chapter 07 (chapters/07-prefix-caching/README.md) explains it all.

The keys of three requests (block_size 4) form a tree, one node per full block.
A key depends on every token before it, so the same four tokens after a
different prefix get a different key -- their K/V differ too:

    A = [You are a bot.][ Be brief.    ][ What is 2+2?][ ...   <- last block partial: no key
    B = [You are a bot.][ Be brief.    ][ Name a fruit][ ...
    C = [Hi there, bot.][ Be brief.    ]

    k0 = hash((None, "You are a bot."))          k3 = hash((None, "Hi there, bot."))
     |                                            |
    k1 = hash((k0, " Be brief."))                k4 = hash((k3, " Be brief."))   != k1
     |-- k2 = hash((k1, " What is 2+2?"))
     '-- k5 = hash((k1, " Name a fruit"))

B arrives while A runs: k0 and k1 are cached, so B shares A's first two blocks
(ref count 2) and computes only from its third block on.

When a request is freed, a block nobody else holds keeps its key and joins the
back of an LRU queue of evictable blocks. New blocks come from the plain free
list (blocks that hold nothing worth keeping) first, then from the front of the
LRU queue, whose key is dropped:

    plain free:  [6, 7]              <- taken first
    evictable:   [4, 2, 5]           <- least recently freed first; 4 is evicted next
    held:        0, 1 (ref 2), 3     <- never evicted, whatever their key

This file is pure Python, like chapter 03's: it decides which blocks hold which
tokens and never touches a tensor.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from minicb.block_allocator import BlockAllocator, OutOfBlocksError, _check_positive_int


def block_keys(token_ids: list[int], block_size: int) -> list[int]:
    """One key per FULL block of `token_ids`; a partial last block gets none.

    key[i] = hash((key[i-1], tuple(token_ids[i*block_size:(i+1)*block_size]))), key[-1] = None.

    Chaining in the parent's key makes a key name the whole prefix up to the end
    of its block, which is what the block's K/V depend on (attention at every
    position looks at all the tokens before it).
    """
    _check_positive_int("block_size", block_size)
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        # Python's hash() of a tuple is 64 bits, and the same for the same tokens
        # within one process, which is all the cache needs: it lives in the
        # engine's memory and dies with it. It is NOT the same in every run:
        # hash(None), the first block's parent, is derived from an address before
        # Python 3.12, and str/bytes hashes are salted. A cache kept on disk or
        # shared between processes would need a hash of bytes (hashlib). A
        # collision would hand out wrong K/V; vLLM offers SHA-256 where that matters.
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        keys.append(parent)
    return keys


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up by allocate_prefix, and how many of them were cache hits."""

    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0  # cached blocks whose key was dropped to make room

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class CachingAllocatorBase(BlockAllocator):
    """Chapter 03's allocator, plus a cache of full blocks keyed by their prefix.

    Every block is in exactly one of three states:
    - held:       ref count > 0, in at least one block table (may also have a key);
    - evictable:  ref count 0, has a key, in `_evictable` (oldest free first);
    - plain free: ref count 0, no key, in chapter 03's `_free` deque.

    On top of chapter 03's state:
    - `_block_of_key[key] -> block` and `_key_of_block[block] -> key`: the cache,
      one physical block per key and one key per block, held or evictable;
    - `_evictable`: OrderedDict block -> key, in the order the blocks were freed.

    `num_free_blocks` counts plain free + evictable blocks: both can be handed
    out, so the scheduler's arithmetic stays chapter 06's. Chapter 03's
    allocate, append (with copy-on-write) and fork work unchanged; allocate
    simply looks nothing up. A cached block is full, and chapter 03 never
    writes into a full block, so nobody writes into a cached block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._block_of_key: dict[int, int] = {}
        self._key_of_block: dict[int, int] = {}
        self._evictable: OrderedDict[int, int] = OrderedDict()
        self.stats = PrefixCacheStats()

    # ---- capacity: evictable blocks count as free --------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def can_append(self, seq_id: int) -> bool:
        # Chapter 03's rule, counted against plain free + evictable blocks.
        table = self._lookup(seq_id)
        needs_block = self._num_tokens[seq_id] % self.block_size == 0 or self._ref_counts[table[-1]] > 1
        return not needs_block or self.num_free_blocks >= 1

    def _take(self, count: int, why: str) -> list[int]:
        """Hand out `count` blocks: plain free ones first, then evict the least recently freed."""
        # Replaces chapter 03's _take, so allocate(), append() and copy-on-write
        # all go through the eviction policy without being rewritten. Still
        # atomic: the check comes before any change.
        if count > self.num_free_blocks:
            raise OutOfBlocksError(
                f"{why} needs {count} free block(s) but only {self.num_free_blocks} of {self.num_blocks} "
                f"are free ({len(self._free)} plain, {len(self._evictable)} cached and evictable; "
                f"block_size {self.block_size})")
        blocks = [self._free.popleft() if self._free else self.evict() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def _check_tokens(self, token_ids) -> list[int]:
        token_ids = list(token_ids)
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)]
        if bad:
            raise TypeError(f"token_ids must be ints; got {bad[:3]!r} among {len(token_ids)} token(s)")
        return token_ids

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` allocate_prefix would find cached. Changes nothing."""
        return len(self.cached_prefix(token_ids)) * self.block_size

    def free_blocks_needed(self, token_ids: list[int]) -> int:
        """How many of `num_free_blocks` allocate_prefix(token_ids) would use up.

        Fresh blocks for the uncached tokens, plus the evictable blocks it hits:
        reviving those takes them out of the free count too. Held blocks it hits
        cost nothing. This is the number to compare with num_free_blocks (and a
        watermark) at admission.
        """
        token_ids = self._check_tokens(token_ids)
        hits = self.cached_prefix(token_ids)
        revived = sum(1 for block in hits if self._ref_counts[block] == 0)
        return self.blocks_needed(len(token_ids)) - len(hits) + revived

    def can_allocate_prefix(self, token_ids: list[int]) -> bool:
        return self.free_blocks_needed(token_ids) <= self.num_free_blocks

    def _drop(self, block: int) -> None:
        """One holder fewer for `block`; with none left it is evictable if it has a key, else plain free.

        Chapter 03's free() calls this for each of a sequence's blocks, tail first:
        the LRU then evicts a request's last blocks before its first ones, which
        more requests are likely to share. truncate() (chapter 11) calls it too.
        """
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            key = self._key_of_block.get(block)
            if key is None:
                self._free.append(block)
            else:
                self._evictable[block] = key  # at the back: the most recently freed

    # ---- queries (cheap, for tests and pictures) -----------------------------------------

    def _check_block(self, block) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block!r} does not exist; blocks are 0..{self.num_blocks - 1}")

    def ref_count(self, block: int) -> int:
        """How many block tables hold `block`."""
        self._check_block(block)
        return self._ref_counts[block]

    def block_key(self, block: int) -> int | None:
        """The key `block` is cached under, or None."""
        self._check_block(block)
        return self._key_of_block.get(block)

    def block_with_key(self, key: int) -> int | None:
        """The physical block cached under `key` (held or evictable), or None."""
        return self._block_of_key.get(key)

    def cached_free_blocks(self) -> list[int]:
        """Evictable blocks (ref count 0, key kept), the next one to be evicted first."""
        return list(self._evictable)

    def shared_blocks(self) -> list[int]:
        """Blocks held by more than one sequence (ref count > 1), ascending."""
        return [block for block, count in enumerate(self._ref_counts) if count > 1]


class CachingBlockAllocator(CachingAllocatorBase):
    """Chapter 07's allocator: the given state and helpers above, with the cache's own moves (the
    exercise's tasks): keying full blocks, looking a prefix up and sharing it, eviction of the least
    recently freed, and chapter 03's free and append made to keep cached blocks."""

    def free(self, seq_id: int) -> None:
        """Drop `seq_id`: chapter 03's walk over its blocks, tail first, each through the base's _drop,
        which makes a keyed block nobody holds evictable (the back of the LRU) instead of plain free."""
        BlockAllocator.free(self, seq_id)  # named, not super(): a grader copies this method onto other classes

    def append(self, seq_id: int) -> tuple[int, int] | None:
        """Grow `seq_id` by one token slot: chapter 03's append (copy-on-write included), whose new
        blocks come from _take (the given base), which evicts the least recently freed cached block
        when no plain free block is left."""
        return BlockAllocator.append(self, seq_id)

    def evict(self) -> int:
        """Take the least recently freed evictable block out of the cache; return it.

        Its key is dropped first: whoever gets the block will overwrite its K/V,
        and a lookup must never find the old key pointing at new contents. The
        block comes back with ref count 0 and no key, owned by nobody; _take
        hands it out. Raises OutOfBlocksError when nothing is evictable.
        """
        if not self._evictable:
            raise OutOfBlocksError(f"no cached block to evict: all {self.num_blocks} blocks are held "
                                   f"or plain free ({len(self._free)} plain free)")
        block, key = self._evictable.popitem(last=False)  # the front: freed longest ago
        del self._block_of_key[key], self._key_of_block[block]
        self.stats.evicted_blocks += 1
        return block

    # ---- lookup at admission ------------------------------------------------------

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The physical blocks (held or evictable) of the longest cached run of leading full blocks.

        At most (len(token_ids) - 1) // block_size blocks: the last token is
        always left to compute. Changes nothing.
        """
        token_ids = self._check_tokens(token_ids)
        # Cap: at most (len - 1) // block_size blocks, so at least the last token
        # is computed -- the model needs its logits to sample the first output.
        # Sharing a full last block and recomputing only its last token would
        # mean writing into a cached (maybe shared) block, which is never allowed.
        max_blocks = max(0, len(token_ids) - 1) // self.block_size
        blocks = []
        for key in block_keys(token_ids[:max_blocks * self.block_size], self.block_size):
            block = self._block_of_key.get(key)
            if block is None:
                break  # a prefix tree: after the first miss nothing below can match
            blocks.append(block)
        return blocks

    def allocate_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Register `seq_id` holding `token_ids`, sharing its cached prefix; return num_cached_tokens.

        The engine then computes (and writes K/V for) positions
        [num_cached_tokens, len(token_ids)) only. Raises OutOfBlocksError and
        changes nothing when the pool is short.
        """
        if seq_id in self._block_tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first or pick a new id")
        token_ids = self._check_tokens(token_ids)
        hits = self.cached_prefix(token_ids)
        num_fresh = self.blocks_needed(len(token_ids)) - len(hits)
        revived = [block for block in hits if self._ref_counts[block] == 0]
        if num_fresh + len(revived) > self.num_free_blocks:
            raise OutOfBlocksError(
                f"allocating sequence {seq_id!r} with {len(token_ids)} token(s) ({len(hits)} cached block(s), "
                f"{len(revived)} of them evictable) needs {num_fresh + len(revived)} free block(s) but only "
                f"{self.num_free_blocks} of {self.num_blocks} are free (block_size {self.block_size})")
        # Revive the hits BEFORE taking fresh blocks: otherwise _take could evict
        # one of the very blocks this sequence is about to share.
        for block in revived:
            del self._evictable[block]
        for block in hits:
            self._ref_counts[block] += 1
        table = hits + self._take(num_fresh, f"allocating sequence {seq_id!r}")
        self._block_tables[seq_id] = table
        self._num_tokens[seq_id] = len(token_ids)
        num_cached = len(hits) * self.block_size
        self.stats.query_tokens += len(token_ids)
        self.stats.hit_tokens += num_cached
        return num_cached

    # ---- registering computed blocks ------------------------------------------------

    def cache_full_blocks(self, seq_id: int, token_ids: list[int]) -> int:
        """Give keys to `seq_id`'s full blocks among `token_ids`; return how many keys are new.

        `token_ids` are the sequence's tokens whose K/V are computed by the end of
        the step being scheduled (the scheduler calls it as it schedules them, so a
        request admitted later in the same step already hits them): all of them,
        or the first ones when the rest of a prompt is still to come in later
        chunks (chapter 08). Only full blocks among them get keys. Calling it
        again changes nothing.

        One key, one block: if another physical block already holds a full
        block's key (two requests computed the same prefix side by side), this
        block is not registered. It stays private and, when freed, goes back to
        the plain free list; the first block keeps serving the key.
        """
        table = self._lookup(seq_id)
        num_tokens = self._num_tokens[seq_id]
        token_ids = self._check_tokens(token_ids)
        if len(token_ids) > num_tokens:
            raise ValueError(f"sequence {seq_id!r} holds {num_tokens} token slot(s) but token_ids has "
                             f"{len(token_ids)}; pass only tokens whose K/V are in its blocks")
        keys = block_keys(token_ids, self.block_size)
        # Check before changing anything: a block already cached under a different
        # key means token_ids are not the tokens this sequence wrote.
        for index, key in enumerate(keys):
            held = self._key_of_block.get(table[index])
            if held is not None and held != key:
                raise ValueError(f"block {table[index]} (block {index} of sequence {seq_id!r}) is cached for a "
                                 f"different prefix than token_ids[{index * self.block_size}:"
                                 f"{(index + 1) * self.block_size}] = "
                                 f"{token_ids[index * self.block_size:(index + 1) * self.block_size]}; "
                                 f"token_ids must be the tokens the sequence holds")
        registered = 0
        for block, key in zip(table, keys):
            if block in self._key_of_block or key in self._block_of_key:
                continue  # already this block's key, or another block serves it
            self._block_of_key[key] = block
            self._key_of_block[block] = key
            registered += 1
        return registered

    # ---- freeing: cached blocks stay, evictable ------------------------------------------


# ---- demo --------------------------------------------------------------------------------


def _block_map(allocator: CachingBlockAllocator) -> str:
    """One character per block: the holder's id (lowest if shared), c = cached and evictable, . = free."""
    evictable = set(allocator.cached_free_blocks())
    owners = allocator.block_owners()
    return " ".join("c" if block in evictable else "." if owner is None else str(owner)
                    for block, owner in enumerate(owners))


def _print_demo() -> None:
    allocator = CachingBlockAllocator(num_blocks=8, block_size=4)
    system = [101, 102, 103, 104, 105, 106, 107, 108]  # 2 full blocks shared by every request
    requests = {0: system + [1, 2, 3, 4, 5, 6], 1: system + [7, 8, 9]}
    print("block_size 4, 8 blocks; every prompt starts with the same 8-token system prompt\n")

    def admit(seq_id: int, token_ids: list[int]) -> None:
        cached = allocator.allocate_prefix(seq_id, token_ids)
        # (the engine would now compute positions [cached, len) and write their K/V)
        allocator.cache_full_blocks(seq_id, token_ids)
        print(f"  admit {seq_id}: {len(token_ids):>2} tokens, {cached:>2} cached, computes {len(token_ids) - cached:>2}"
              f"; block table {allocator.block_table(seq_id)}")

    def show() -> None:
        print(f"  block map: {_block_map(allocator)}   (id = holder, c = cached and evictable, . = free)")
        print(f"  shared: {allocator.shared_blocks()}, evictable (next to go first): "
              f"{allocator.cached_free_blocks()}, num_free_blocks: {allocator.num_free_blocks}")

    print("requests 0 and 1 share the system prompt's two blocks:")
    admit(0, requests[0])
    admit(1, requests[1])
    show()
    print("\nrequest 0 finishes: its third block keeps its key and K/V; its partial last block is plain free")
    allocator.free(0)
    show()
    print("\nrequest 2, request 0's next turn, resends it: all three of its full blocks hit")
    admit(2, requests[0] + [42, 43, 44])
    show()
    print("\nrequest 2 finishes: its tail is freed first, so it is the first in line for eviction")
    allocator.free(2)
    show()
    print("\nrequest 3 (16 new tokens, 4 blocks) takes the 3 plain free blocks, then evicts the least\n"
          "recently freed cached block; the other keeps its key")
    admit(3, [200 + i for i in range(16)])
    show()
    stats = allocator.stats
    print(f"\nstats: {stats.hit_tokens} of {stats.query_tokens} prompt tokens were cache hits "
          f"({stats.hit_rate:.0%}), {stats.evicted_blocks} block(s) evicted")


if __name__ == "__main__":
    _print_demo()
