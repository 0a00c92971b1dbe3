"""Chapter 07: the prefix-caching block pool alone (minicb/prefix_cache.py).

Unit tests pin down keys, registration, lookup, the LRU of freed blocks and
copy-on-write, and the three hard cases, each in a test named after it: a
full-prefix hit, a preempted request coming back, and a cached block that is
shared (it must never be evicted). Then hypothesis runs random operation
sequences against a model of what the engine would have written into every
KV slot, so a cache hit is checked to hand back the right K/V, not just some
block. Keys are compared with each other, never with fixed numbers: any
deterministic hash that chains the parent's key works.

Each test grades one task, with the reference standing in for the others (the
one_task fixture in conftest.py); the random sequences run all of your code
together (the row "all"). Run against your own code with `python -m minicb check 7`.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from minicb import impl
from minicb.block_allocator import OutOfBlocksError, UnknownSequenceError

GRADED_MODULE = "prefix_cache"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")

SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks of 4: a shared system prompt


def pc():
    """The graded module (your exercise under `check 7`), read when the test runs."""
    return impl.load("prefix_cache")


def snapshot(allocator):
    """Everything the public API says; compared around a call that must fail."""
    tables = {seq_id: (allocator.num_tokens(seq_id), allocator.block_table(seq_id))
              for seq_id in range(8) if allocator.has(seq_id)}
    blocks = [(allocator.ref_count(b), allocator.block_key(b)) for b in range(allocator.num_blocks)]
    stats = allocator.stats
    return (allocator.num_free_blocks, tables, allocator.cached_free_blocks(), blocks,
            (stats.query_tokens, stats.hit_tokens, stats.evicted_blocks))


def admit(allocator, seq_id: int, token_ids: list[int]) -> int:
    """What the engine will do: look up, compute the rest, then register the full blocks."""
    cached = allocator.allocate_prefix(seq_id, token_ids)
    allocator.cache_full_blocks(seq_id, token_ids)
    return cached


# ---- keys --------------------------------------------------------------------------------


@pytest.mark.task(1)
def test_block_keys_chain_the_whole_prefix():
    keys = pc().block_keys(SYSTEM + [1, 2, 3, 4, 5], 4)
    assert len(keys) == 3, f"13 tokens in blocks of 4 are 3 full blocks and a partial one: got {len(keys)} keys"
    other = pc().block_keys([9, 9, 9, 9, 105, 106, 107, 108], 4)
    assert other[1] != keys[1], ("block [105..108] after a different first block must get a different key "
                                 f"(its K/V differ); got {other[1]} both times")
    again = pc().block_keys(SYSTEM + [1, 2, 3, 4], 4)
    assert again == keys, f"the same tokens must give the same keys: {again} vs {keys}"
    assert pc().block_keys([1, 2, 3], 4) == [], "a partial block has no key"
    assert pc().block_keys([], 4) == [], "no tokens, no keys"
    with pytest.raises(ValueError, match="0"):
        pc().block_keys([1, 2], 0)


@pytest.mark.task(1)
def test_only_full_blocks_are_cached():
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    allocator.allocate_prefix(0, [1, 2, 3, 4, 5, 6])
    registered = allocator.cache_full_blocks(0, [1, 2, 3, 4, 5, 6])
    full, partial = allocator.block_table(0)
    got = (registered, allocator.block_key(full) is not None, allocator.block_key(partial))
    assert got == (1, True, None), f"6 tokens in blocks of 4: (registered, full block keyed, partial key) = {got}, " \
                                   f"want (1, True, None)"
    allocator.append(0)
    allocator.append(0)  # positions 6 and 7 fill the second block
    assert allocator.cache_full_blocks(0, [1, 2, 3, 4, 5, 6, 7, 8]) == 1, "the second block is full now: 1 new key"
    assert allocator.cache_full_blocks(0, [1, 2, 3, 4, 5, 6, 7, 8]) == 0, "calling again must register nothing"


@pytest.mark.task(1)
def test_only_computed_tokens_are_cached():
    # A prompt computed in chunks (chapter 08): the blocks are allocated for all 12
    # tokens, but only the computed ones may get keys.
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    tokens = list(range(20, 32))
    allocator.allocate_prefix(0, tokens)
    got = [allocator.cache_full_blocks(0, tokens[:end]) for end in (3, 6, 12)]
    assert got == [0, 1, 2], f"new keys after computing 3, 6 and 12 tokens: {got}, want [0, 1, 2]"
    keyed = [allocator.block_key(b) is not None for b in allocator.block_table(0)]
    assert keyed == [True, True, True], f"all three blocks are computed and full: keyed {keyed}"


# ---- lookup at admission ------------------------------------------------------------------


@pytest.mark.task(2)
def test_a_shared_system_prompt_is_computed_once():
    allocator = pc().CachingBlockAllocator(num_blocks=8, block_size=4)
    assert admit(allocator, 0, SYSTEM + [1, 2, 3]) == 0, "the first request finds an empty cache"
    cached = admit(allocator, 1, SYSTEM + [7, 7])
    assert cached == 8, f"request 1 shares the 8-token system prompt: num_cached_tokens {cached}, want 8"
    got, want = allocator.block_table(1)[:2], allocator.block_table(0)[:2]
    assert got == want, f"request 1's first blocks {got} must be request 0's {want}"
    assert allocator.shared_blocks() == sorted(want), f"shared_blocks() is {allocator.shared_blocks()}, want {want}"
    assert allocator.num_free_blocks == 4, f"0 holds 3 blocks, 1 one more: {allocator.num_free_blocks} free, want 4"
    stats = allocator.stats
    got = (stats.query_tokens, stats.hit_tokens)
    assert got == (21, 8), f"stats (query_tokens, hit_tokens) = {got}, want (21, 8)"


@pytest.mark.task(2)
def test_full_prefix_hit_still_computes_the_last_token():
    allocator = pc().CachingBlockAllocator(num_blocks=8, block_size=4)
    admit(allocator, 0, SYSTEM)  # exactly two full blocks, both cached
    assert allocator.num_cached_tokens(SYSTEM) == 4, (
        f"SYSTEM is fully cached, but its last token's logits are needed: num_cached_tokens must leave the "
        f"last block (4 tokens) to compute; got {allocator.num_cached_tokens(SYSTEM)}")
    cached = allocator.allocate_prefix(1, SYSTEM)
    assert cached == 4, f"a full hit of 8 tokens must cache at most 7 (whole blocks: 4); got {cached}"
    last = allocator.block_table(1)[-1]
    got = (last == allocator.block_table(0)[-1], allocator.block_key(last), allocator.ref_count(last))
    assert got == (False, None, 1), (f"the block the last token is written to must be fresh and private: "
                                     f"(same as request 0's, key, ref count) = {got}, want (False, None, 1)")
    # One token past a block boundary: every full block hits, one token is computed.
    assert allocator.num_cached_tokens(SYSTEM + [5]) == 8, "SYSTEM + 1 token: both full blocks hit"


@pytest.mark.task(2)
def test_empty_prompt_hits_nothing():
    allocator = pc().CachingBlockAllocator(num_blocks=2, block_size=4)
    assert allocator.allocate_prefix(0, []) == 0 and allocator.block_table(0) == [], "0 tokens need no block"


@pytest.mark.task(2)
def test_a_lookup_stops_at_the_first_missing_block():
    # Requests 0 and 1 are admitted in one step, so both compute the first block; 0 registers
    # it and 1 registers only its second. Evict 0's copy and key 1 is cached without key 0:
    # a lookup that stepped over the miss would share block 1's K/V at position 0.
    first, second = SYSTEM[:4], SYSTEM[4:]
    allocator = pc().CachingBlockAllocator(num_blocks=7, block_size=4)  # evict() hands its block to the caller
    allocator.allocate_prefix(0, first + [1])
    allocator.allocate_prefix(1, first + second + [2])
    allocator.cache_full_blocks(0, first + [1])
    allocator.cache_full_blocks(1, first + second + [2])
    allocator.free(0)
    allocator.evict()
    keys = pc().block_keys(first + second, 4)
    state = (allocator.block_with_key(keys[0]), allocator.block_with_key(keys[1]))
    assert state[0] is None and state[1] is not None, f"setup: blocks with keys 0 and 1 are {state}"
    hits = allocator.cached_prefix(first + second + [3])
    assert hits == [], (f"cached_prefix gave {hits}: block 0's key is not cached, so nothing is, "
                        f"even though block {state[1]} holds key 1")
    assert allocator.allocate_prefix(2, first + second + [3]) == 0, "allocate_prefix must find nothing cached too"


@pytest.mark.task(2)
def test_hits_are_revived_before_fresh_blocks_are_taken():
    # Every block is evictable, request 0's two at the front of the LRU. Request 1
    # hits them and needs 1 fresh block: that one must be evicted, not a hit.
    allocator = pc().CachingBlockAllocator(num_blocks=3, block_size=4)
    admit(allocator, 0, SYSTEM)
    admit(allocator, 9, [9] * 4)
    allocator.free(0)
    allocator.free(9)
    other = allocator.cached_free_blocks()[-1]
    assert allocator.free_blocks_needed(SYSTEM + [1]) == 3, "2 revived evictable blocks + 1 fresh block"
    cached = allocator.allocate_prefix(1, SYSTEM + [1])
    table = allocator.block_table(1)
    assert (cached, len(set(table)), table[-1]) == (8, 3, other), (
        f"request 1 must share both cached blocks and evict block {other} for its third: "
        f"num_cached_tokens {cached} (want 8), block table {table}")
    allocator.allocate(2, 0)
    assert not allocator.can_allocate_prefix([9] * 4 + [1]), "the pool is full: nothing is free"


@pytest.mark.task(2)
def test_allocate_prefix_out_of_blocks_changes_nothing():
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    admit(allocator, 0, SYSTEM + [1])  # 3 blocks, 2 of them cached
    allocator.free(0)  # 2 evictable + 2 plain free
    admit(allocator, 1, [7, 7, 7, 7, 7])  # takes the 2 plain ones: 2 evictable blocks are left
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError) as error:
        allocator.allocate_prefix(2, [9] * 12)  # 3 fresh blocks, 2 free
    assert "3" in str(error.value) and "2" in str(error.value), f"say what was needed and free: {error.value}"
    assert snapshot(allocator) == before, "allocate_prefix failed but changed the state"
    with pytest.raises(OutOfBlocksError):
        allocator.allocate_prefix(2, SYSTEM + [3])  # 2 evictable hits to revive + 1 fresh block
    assert snapshot(allocator) == before, "allocate_prefix with hits failed but changed the state (revived them?)"
    with pytest.raises(ValueError, match="1"):
        allocator.allocate_prefix(1, SYSTEM)
    assert snapshot(allocator) == before, "allocate_prefix of an existing id failed but changed the state"
    allocator.free(1)
    assert allocator.allocate_prefix(2, SYSTEM + [3]) == 8, "the cached blocks are still there to hit"


# ---- the LRU of freed blocks --------------------------------------------------------------


@pytest.mark.task(3)
def test_lru_evicts_the_least_recently_freed_block_first():
    allocator = pc().CachingBlockAllocator(num_blocks=3, block_size=4)
    for seq_id, token in enumerate([1, 2, 3]):
        admit(allocator, seq_id, [token] * 4)  # one full, cached block each
    for seq_id in (1, 0, 2):
        allocator.free(seq_id)
    order = allocator.cached_free_blocks()
    assert len(order) == 3 and allocator.num_free_blocks == 3, f"3 freed cached blocks, all evictable: {order}"
    admit(allocator, 5, [9] * 4)
    got = [allocator.num_cached_tokens([token] * 4 + [0]) for token in (2, 1, 3)]
    assert got == [0, 4, 4], (f"requests were freed in the order 1, 0, 2: the block of request 1 (tokens [2]*4) "
                              f"must be evicted first; hits for [2]*4, [1]*4, [3]*4 are {got}, want [0, 4, 4]")
    assert allocator.cached_free_blocks() == order[1:], \
        f"evictable blocks {allocator.cached_free_blocks()}, want {order[1:]} (the first one evicted)"
    assert allocator.stats.evicted_blocks == 1, f"stats.evicted_blocks is {allocator.stats.evicted_blocks}, want 1"


@pytest.mark.task(3)
def test_free_gives_a_sequences_blocks_back_last_block_first():
    # Tail first: the LRU then evicts a request's last blocks before its first ones, which later
    # requests starting the same way are the most likely to share.
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    admit(allocator, 0, list(range(10, 22)))  # three full, cached blocks
    table = allocator.block_table(0)
    allocator.free(0)
    got = allocator.cached_free_blocks()
    assert got == table[::-1], (f"free must drop the blocks last first, so the last block is the first to be "
                                f"evicted: evictable order {got}, want {table[::-1]} (the table was {table})")


@pytest.mark.task(3)
def test_plain_free_blocks_go_before_cached_ones():
    allocator = pc().CachingBlockAllocator(num_blocks=3, block_size=4)
    admit(allocator, 0, [1, 1, 1, 1, 2])  # block 0 cached, block 1 partial
    allocator.free(0)
    allocator.allocate(1, 8)  # two blocks: the never-used one and the partial one, not the cached one
    assert allocator.num_cached_tokens([1, 1, 1, 1, 2]) == 4, "a plain free block was left, yet a cached one went"


@pytest.mark.task(3)
def test_a_shared_cached_block_is_never_evicted():
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    admit(allocator, 0, SYSTEM + [1])
    admit(allocator, 1, SYSTEM + [2])  # shares 0's two cached blocks; 4 of 4 held
    allocator.free(0)  # the shared blocks keep ref count 1; only 0's tail is freed
    shared = allocator.block_table(1)[:2]
    assert allocator.cached_free_blocks() == [], f"held blocks are never evictable: {allocator.cached_free_blocks()}"
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(2, 8)  # 2 blocks, only 1 free: the held cached blocks must not be taken
    assert snapshot(allocator) == before, "a failed allocation changed the state"
    allocator.allocate(2, 4)
    got = [allocator.block_key(b) is not None and allocator.ref_count(b) for b in shared]
    assert got == [1, 1], f"request 1's shared system-prompt blocks {shared} must keep key and ref count 1: {got}"
    assert allocator.num_cached_tokens(SYSTEM + [3]) == 8, "the system prompt must still hit"


# ---- preemption, fork and copy-on-write ----------------------------------------------------


@pytest.mark.task(3)
def test_a_preempted_request_comes_back_and_hits_the_cache():
    allocator = pc().CachingBlockAllocator(num_blocks=6, block_size=4)
    tokens = SYSTEM + [1, 2]
    admit(allocator, 0, tokens)
    for token in [3, 4, 5]:  # three decode steps; the third block fills up at 12 tokens
        allocator.append(0)
        tokens.append(token)
        allocator.cache_full_blocks(0, tokens)
    tokens.append(6)  # sampled, not yet computed, when the scheduler preempts it
    allocator.free(0)
    assert len(allocator.cached_free_blocks()) == 3, \
        f"its 3 full blocks stay cached after preemption: evictable {allocator.cached_free_blocks()}"
    cached = admit(allocator, 0, tokens)
    assert cached == 12, f"re-admitted with prompt + outputs (13 tokens), 12 are cached; num_cached_tokens {cached}"
    assert allocator.cached_free_blocks() == [], "the hits are held again, not evictable"


@pytest.mark.task(4)
def test_fork_and_copy_on_write_with_caching():
    allocator = pc().CachingBlockAllocator(num_blocks=6, block_size=4)
    admit(allocator, 0, SYSTEM + [1, 2])
    allocator.fork(0, 1)  # n = 2 samples of one prompt
    tail = allocator.block_table(0)[-1]
    src, dst = allocator.append(1)
    assert src == tail and allocator.block_key(dst) is None, \
        f"seq 1 writes into the shared partial block {tail}: copy ({src}, {dst}) must go to a fresh block"
    got = allocator.block_table(1)[:2] == allocator.block_table(0)[:2]
    assert got, "the full cached blocks stay shared after copy-on-write of the last one"
    # A full, shared, cached last block is never written: append adds a block instead.
    allocator.append(1)  # seq 1 now holds 12 tokens: its last block is full
    allocator.cache_full_blocks(1, SYSTEM + [1, 2, 3, 4])
    full = allocator.block_table(1)[-1]
    allocator.fork(1, 3)
    copies = (allocator.append(3), allocator.append(1))
    assert copies == (None, None), f"appending after a full shared block copies nothing; copies {copies}"
    got = (allocator.block_table(3)[:3] == allocator.block_table(1)[:3], allocator.ref_count(full),
           allocator.block_key(full) is not None)
    assert got == (True, 2, True), (f"seqs 1 and 3 keep sharing cached block {full}: (same first 3 blocks, "
                                    f"ref count, keyed) = {got}, want (True, 2, True)")
    for seq_id in (0, 1, 3):
        allocator.free(seq_id)
    assert allocator.num_free_blocks == 6, f"everything freed: {allocator.num_free_blocks} of 6 free"



@pytest.mark.task(4)
def test_copy_on_write_takes_an_evicted_block_when_nothing_is_plain_free():
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    admit(allocator, 9, [9] * 4)
    allocator.free(9)  # block 0: cached and evictable
    admit(allocator, 0, SYSTEM + [1])  # 3 blocks: the 3 plain free ones
    allocator.fork(0, 1)
    evictable = allocator.cached_free_blocks()
    tail = allocator.block_table(0)[-1]
    copy = allocator.append(1)
    assert copy == (tail, evictable[0]), (f"seq 1 writes into the shared partial block {tail}; no block is plain "
                                          f"free, so the copy must evict {evictable[0]}: append returned {copy}")
    got = (allocator.block_key(copy[1]), allocator.ref_count(tail), allocator.ref_count(copy[1]))
    assert got == (None, 1, 1), f"(key of the copy, ref count of the original, of the copy) = {got}, want (None, 1, 1)"
    assert allocator.num_cached_tokens([9] * 4 + [1]) == 0, "the evicted block's key must be gone"
    assert allocator.append(1) is None, "seq 1's last block is its own now: the next token is written in place"
    assert allocator.append(0) is None, "seq 0 holds its block alone again after seq 1's copy: no second copy"


@pytest.mark.task(4)
def test_append_errors_change_nothing():
    allocator = pc().CachingBlockAllocator(num_blocks=3, block_size=4)
    admit(allocator, 0, SYSTEM + [1])  # all 3 blocks held
    allocator.fork(0, 1)
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError):
        allocator.append(1)  # copy-on-write needs a block and none is free
    assert snapshot(allocator) == before, "append failed but changed the state"
    with pytest.raises(UnknownSequenceError, match="5"):
        allocator.append(5)
    allocator.free(0)
    assert allocator.append(1) is None, "seq 0 is gone: seq 1 holds the partial block alone and writes in place"


@pytest.mark.task(3)
def test_evict_takes_the_front_of_the_lru_and_forgets_its_key():
    allocator = pc().CachingBlockAllocator(num_blocks=3, block_size=4)
    for seq_id, token in enumerate([1, 2]):
        admit(allocator, seq_id, [token] * 4)
    allocator.free(1)
    allocator.free(0)
    first, second = allocator.cached_free_blocks()
    key = allocator.block_key(first)
    assert allocator.evict() == first, f"evict() must take {first}, freed before {second}"
    got = (allocator.block_key(first), allocator.block_with_key(key), allocator.cached_free_blocks(),
           allocator.stats.evicted_blocks)
    assert got == (None, None, [second], 1), (f"after evicting {first}: (its key, block with its old key, evictable, "
                                              f"evicted count) = {got}, want (None, None, [{second}], 1)")
    allocator.evict()
    with pytest.raises(OutOfBlocksError):
        allocator.evict()  # nothing left to evict

# ---- registering, errors -------------------------------------------------------------------


@pytest.mark.task(1)
def test_two_blocks_with_one_key_are_registered_once():
    allocator = pc().CachingBlockAllocator(num_blocks=6, block_size=4)
    allocator.allocate_prefix(0, SYSTEM + [1])
    allocator.allocate_prefix(1, SYSTEM + [2])  # admitted in the same step: nothing cached yet
    got = (allocator.cache_full_blocks(0, SYSTEM + [1]), allocator.cache_full_blocks(1, SYSTEM + [2]))
    assert got == (2, 0), f"the second copy of the same prefix must not be registered: new keys {got}, want (2, 0)"
    allocator.free(1)
    assert allocator.cached_free_blocks() == [], "request 1's unregistered blocks are plain free, not evictable"
    assert allocator.allocate_prefix(2, SYSTEM + [3]) == 8, "the first copy serves the key"


@pytest.mark.task(1)
def test_errors_name_what_was_wrong():
    allocator = pc().CachingBlockAllocator(num_blocks=4, block_size=4)
    allocator.allocate_prefix(0, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="5.*6"):
        allocator.cache_full_blocks(0, [1, 2, 3, 4, 5, 6])  # more than the 5 tokens it holds
    with pytest.raises(UnknownSequenceError, match="7"):
        allocator.cache_full_blocks(7, [1])
    allocator.cache_full_blocks(0, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="different prefix"):
        allocator.cache_full_blocks(0, [9, 9, 9, 9, 5])
    with pytest.raises(TypeError, match="'x'"):
        allocator.allocate_prefix(1, [1, "x"])
    with pytest.raises(IndexError, match="9"):
        allocator.block_key(9)


@pytest.mark.task(3)
def test_evictable_blocks_count_as_free():
    allocator = pc().CachingBlockAllocator(num_blocks=2, block_size=4)
    admit(allocator, 0, [1, 1, 1, 1])
    allocator.allocate(1, 4)
    allocator.free(0)
    got = (allocator.num_free_blocks, allocator.can_allocate(4), allocator.can_append(1))
    assert got == (1, True, True), f"one evictable block: (num_free_blocks, can_allocate(4), can_append(1)) = " \
                                   f"{got}, want (1, True, True)"
    allocator.append(1)  # takes the evictable block, dropping its key
    assert allocator.num_cached_tokens([1, 1, 1, 1, 2]) == 0, "an evicted block must not hit any more"


# ---- random operation sequences, with a model of every KV slot ---------------------------------
#
# The model plays the engine: after each allocation or append it "computes" the
# uncached positions, writing into each slot what that slot's K/V depend on --
# the tuple of tokens up to and including that position -- then registers the
# full blocks. Every write is checked (never into a block that has a key, never
# into a block someone else holds), and after every operation every sequence's
# slots must hold exactly its tokens' prefixes, every key must name what its
# block holds, and every block is exactly one of held / evictable / plain free.
# Prompts come from a few shared prefixes over a tiny alphabet, so hits, partial
# hits, duplicate keys and evictions all happen often on a pool of 6 blocks.
# 4,000 sequences of 10-40 operations (15-20 s); derandomize=True, so the
# same ones every run. A failure prints the operations that led to it.

NUM_BLOCKS, BLOCK_SIZE = 6, 4
IDS = list(range(3))
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8]]


class PrefixCacheModel:
    def __init__(self):
        self.allocator = pc().CachingBlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}  # live seq id -> its tokens, all of them computed
        self.contents = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]  # per slot: tokens[:pos + 1]
        self.key_prefix: dict[int, tuple] = {}  # every key seen -> the prefix it names
        self.history: list[list[int]] = []  # tokens of freed sequences, to re-admit (preemption)

    # -- what the engine sees and does: pool state, K/V writes, registration

    def pool(self):
        """(plain free blocks, evictable blocks in LRU order, block -> key) now."""
        a = self.allocator
        evictable = a.cached_free_blocks()
        plain = {b for b in range(NUM_BLOCKS) if a.ref_count(b) == 0} - set(evictable)
        return plain, evictable, {b: a.block_key(b) for b in range(NUM_BLOCKS)}

    def expect_failure(self, error, call, *args):
        before = snapshot(self.allocator)
        with pytest.raises(error):
            call(*args)
        assert snapshot(self.allocator) == before, f"{call.__name__}{args} failed but changed the state"

    def check_taken(self, before, fresh: list[int], revived: list[int]) -> None:
        """Fresh blocks come from plain free ones first, then the least recently freed; only they lose keys."""
        plain, evictable, keys = before
        lru = [b for b in evictable if b not in revived]
        want_evicted = lru[:max(0, len(fresh) - len(plain))]
        got_evicted = [b for b in fresh if b not in plain]
        assert sorted(got_evicted) == sorted(want_evicted), (
            f"fresh blocks {fresh}: {got_evicted} were not plain free; plain free were {sorted(plain)}, "
            f"evictable (LRU first) {evictable}, so the evicted blocks should be {want_evicted}")
        for block in range(NUM_BLOCKS):
            want = None if block in want_evicted else keys[block]
            got = self.allocator.block_key(block)
            assert got == want, f"block {block}: key {got} after taking {fresh}, want {want}"

    def write(self, seq_id: int, start: int, end: int) -> None:
        """The forward pass: K/V for positions [start, end) go where slot_mapping says."""
        a, tokens = self.allocator, self.tokens[seq_id]
        for position, slot in zip(range(start, end), a.slot_mapping(seq_id, start, end)):
            block, offset = divmod(slot, BLOCK_SIZE)
            assert a.block_key(block) is None, (f"seq {seq_id} writes position {position} into block {block}, "
                                                f"which is cached under a key: its K/V would no longer match")
            assert a.ref_count(block) == 1, (f"seq {seq_id} writes position {position} into block {block}, "
                                             f"which {a.ref_count(block)} sequences hold")
            self.contents[block][offset] = tuple(tokens[:position + 1])

    def register(self, seq_id: int) -> None:
        a, tokens = self.allocator, self.tokens[seq_id]
        a.cache_full_blocks(seq_id, tokens)
        table = a.block_table(seq_id)
        for index, key in enumerate(pc().block_keys(tokens, BLOCK_SIZE)):
            self.key_prefix[key] = tuple(tokens[:(index + 1) * BLOCK_SIZE])
            holder = a.block_with_key(key)
            assert holder is not None, f"seq {seq_id}'s full block {index} ({table[index]}) was not cached"
            assert holder == table[index] or a.block_key(table[index]) is None, (
                f"key of seq {seq_id}'s block {index} is served by block {holder}, yet block {table[index]} "
                f"has key {a.block_key(table[index])}")

    # -- operations

    def allocate(self, seq_id: int, token_ids: list[int]) -> None:
        a = self.allocator
        if seq_id in self.tokens:
            return self.expect_failure(ValueError, a.allocate_prefix, seq_id, token_ids)
        before = self.pool()
        # The longest cached run of full blocks, leaving the last token to compute.
        block_of_key = {key: block for block, key in before[2].items() if key is not None}
        capped = token_ids[:max(0, len(token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE]
        hits = []
        for key in pc().block_keys(capped, BLOCK_SIZE):
            if key not in block_of_key:
                break
            hits.append(block_of_key[key])
        revived = [b for b in hits if b in before[1]]
        need = -(-len(token_ids) // BLOCK_SIZE) - len(hits) + len(revived)
        got = (a.num_cached_tokens(token_ids), a.free_blocks_needed(token_ids))
        assert got == (len(hits) * BLOCK_SIZE, need), (
            f"{token_ids}: (num_cached_tokens, free_blocks_needed) = {got}, want {(len(hits) * BLOCK_SIZE, need)}")
        if need > a.num_free_blocks:
            return self.expect_failure(OutOfBlocksError, a.allocate_prefix, seq_id, token_ids)
        cached = a.allocate_prefix(seq_id, token_ids)
        table = a.block_table(seq_id)
        assert table[:len(hits)] == hits, f"allocate_prefix({seq_id}, {token_ids}): table {table} must start {hits}"
        self.check_taken(before, table[len(hits):], revived)
        self.tokens[seq_id] = list(token_ids)
        self.write(seq_id, cached, len(token_ids))
        self.register(seq_id)

    def readmit(self, seq_id: int, index: int) -> None:
        if self.history:
            self.allocate(seq_id, self.history[index % len(self.history)])

    def append(self, seq_id: int, token: int) -> None:
        a = self.allocator
        if seq_id not in self.tokens:
            return self.expect_failure(UnknownSequenceError, a.append, seq_id)
        num_tokens, table = len(self.tokens[seq_id]), a.block_table(seq_id)
        needs_block = num_tokens % BLOCK_SIZE == 0 or a.ref_count(table[-1]) > 1
        want = not needs_block or a.num_free_blocks > 0  # evictable blocks count
        assert a.can_append(seq_id) == want, (
            f"can_append({seq_id}) is {not want}, want {want}: {'needs' if needs_block else 'needs no'} new block, "
            f"{a.num_free_blocks} free ({len(a.cached_free_blocks())} of them evictable)")
        if not want:
            return self.expect_failure(OutOfBlocksError, a.append, seq_id)
        before = self.pool()
        copy = a.append(seq_id)
        after = a.block_table(seq_id)
        if copy is not None:
            src, dst = copy
            assert src == table[-1] and after[-1] == dst, f"copy {copy}: table {table} -> {after}"
            self.contents[dst] = list(self.contents[src])  # the engine's pool.copy_block(src, dst)
        fresh = [after[-1]] if after != table else []
        self.check_taken(before, fresh, [])
        self.tokens[seq_id].append(token)
        self.write(seq_id, num_tokens, num_tokens + 1)
        self.register(seq_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        a = self.allocator
        if parent_id not in self.tokens or child_id in self.tokens:
            return self.expect_failure((UnknownSequenceError, ValueError), a.fork, parent_id, child_id)
        a.fork(parent_id, child_id)
        self.tokens[child_id] = list(self.tokens[parent_id])

    def free(self, seq_id: int) -> None:
        a = self.allocator
        if seq_id not in self.tokens:
            return self.expect_failure(UnknownSequenceError, a.free, seq_id)
        _, evictable, keys = self.pool()
        table = a.block_table(seq_id)
        a.free(seq_id)
        self.history.append(self.tokens.pop(seq_id))
        newly = [b for b in reversed(table) if a.ref_count(b) == 0 and keys[b] is not None]
        want = evictable + newly
        assert a.cached_free_blocks() == want, (
            f"free({seq_id}) of table {table}: evictable {a.cached_free_blocks()}, want {want} "
            f"(the ones it had, then its cached blocks nobody holds, tail first)")
        assert [a.block_key(b) for b in range(NUM_BLOCKS)] == [keys[b] for b in range(NUM_BLOCKS)], \
            "free() must keep every key"

    # -- after every operation

    def check(self) -> None:
        a = self.allocator
        tables = {seq_id: a.block_table(seq_id) for seq_id in self.tokens}
        for block in range(NUM_BLOCKS):
            holders = sum(table.count(block) for table in tables.values())
            assert a.ref_count(block) == holders, f"block {block}: ref count {a.ref_count(block)}, " \
                                                  f"held by {holders} block table(s) {tables}"
        held = {b for b in range(NUM_BLOCKS) if a.ref_count(b) > 0}
        evictable = a.cached_free_blocks()
        assert len(set(evictable)) == len(evictable) and not held & set(evictable), (
            f"evictable blocks {evictable} must be distinct and held by no one; held: {sorted(held)}")
        assert a.num_free_blocks == NUM_BLOCKS - len(held), (
            f"{a.num_free_blocks} free blocks, but {len(held)} of {NUM_BLOCKS} are held: every block must be "
            f"held, evictable or plain free, exactly one of them")
        for block in evictable:
            key = a.block_key(block)
            assert key is not None and a.block_with_key(key) == block, \
                f"evictable block {block} has key {key}, which maps to block {a.block_with_key(key)}"
        for key, prefix in self.key_prefix.items():
            block = a.block_with_key(key)
            if block is None:
                continue
            assert a.block_key(block) == key, f"key {key} maps to block {block}, whose key is {a.block_key(block)}"
            want = [prefix[:len(prefix) - BLOCK_SIZE + offset + 1] for offset in range(BLOCK_SIZE)]
            assert self.contents[block] == want, (
                f"block {block} is cached for the prefix {list(prefix)} but holds the K/V of {self.contents[block]}")
        for seq_id, tokens in self.tokens.items():
            assert a.num_tokens(seq_id) == len(tokens), f"seq {seq_id}: num_tokens {a.num_tokens(seq_id)}, " \
                                                       f"want {len(tokens)}"
            for position in range(len(tokens)):
                block, offset = divmod(a.slot(seq_id, position), BLOCK_SIZE)
                got, want = self.contents[block][offset], tuple(tokens[:position + 1])
                assert got == want, (f"seq {seq_id} ({tokens}) reads position {position} from block {block}, "
                                     f"which holds the K/V of {got}, not {want}")
        assert a.shared_blocks() == [b for b in range(NUM_BLOCKS) if a.ref_count(b) > 1], "shared_blocks() is wrong"


ids = st.sampled_from(IDS)
suffix = st.lists(st.integers(0, 2), max_size=6)
operation = st.one_of(
    st.tuples(st.just("allocate"), ids, st.sampled_from(range(len(PREFIXES))), suffix),
    st.tuples(st.just("append"), ids, st.integers(0, 2)),
    st.tuples(st.just("append"), ids, st.integers(0, 2)),
    st.tuples(st.just("fork"), ids, ids),
    st.tuples(st.just("free"), ids),
    st.tuples(st.just("free"), ids),
    st.tuples(st.just("readmit"), ids, st.integers(0, 20)),
)


def run_operations(operations) -> None:
    model, log = PrefixCacheModel(), []
    try:
        for name, *args in operations:
            if name == "allocate":
                args = [args[0], PREFIXES[args[1]] + args[2]]
            log.append(f"{name}({', '.join(map(repr, args))})")
            getattr(model, name)(*args)
            model.check()
        for seq_id in list(model.tokens):
            log.append(f"free({seq_id})  # at the end")
            model.free(seq_id)
            model.check()
        assert model.allocator.num_free_blocks == NUM_BLOCKS, "every sequence freed, yet some block is held"
    except BaseException:
        note(f"CachingBlockAllocator(num_blocks={NUM_BLOCKS}, block_size={BLOCK_SIZE}), failed at the last of:\n  "
             + "\n  ".join(log))
        raise


@pytest.mark.task("all")
@settings(max_examples=4000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture],  # one_task does nothing for "all"
          report_multiple_bugs=False)  # one failure, with its operations, is what a student needs
@given(st.lists(operation, min_size=10, max_size=40))
def test_hypothesis_random_operation_sequences_keep_every_slot_right(operations):
    run_operations(operations)
