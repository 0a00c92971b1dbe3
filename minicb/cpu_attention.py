"""Paged decode attention compiled for the CPU: the blocks are read where they lie.

In this file you will learn why chapter 04's PyTorch decode costs more than a
padded cache on a CPU, and how a compiled loop removes that cost:

- Version 1 of chapter 04 (the gather) first copies every sequence's K/V
  blocks out of the pool into a dense tensor, then hands the copy to SDPA. So
  K and V are read, written, and read again: three passes over memory where a
  contiguous cache needs one. On SmolLM2 at 32 sequences that copy was about
  10% of a whole decode step (tools/profile_step.py).
- Version 2 (the online softmax) reads each block once, but from a Python loop
  over blocks, each iteration a handful of small tensor ops.
- This file is version 2 written as the loop it really is, compiled to machine
  code by Numba (`@njit`), and run in parallel over sequences. Each sequence
  walks its block table a block at a time: every head's scores against the
  block's keys, then one new running max per head (and one rescale of what was
  summed), the block's weights all at once, and their weighted values (each
  value row read once for all the query heads that share it). It never
  copies a block. While it scores a block it asks the CPU for the block's
  value rows, and while it weighs values, for the next block's key rows (a
  prefetch): the next block may lie anywhere in the pool, and this way memory
  is read during both kinds of work, not in bursts.

Its first version folded in one key at a time, chapter 04's online softmax at
its finest grain: a comparison, a rescale and a C library exp for every key and
head. A block at a time, the exps run as SIMD instructions (the polynomial of
minicb/cpu_ops.py's SwiGLU) and the rescales are 16 times fewer. On an AMD EPYC
with AVX2 (Zen 3), in turns: a 32-slot decode step 112.7 against 117.9 ms on 2
threads, 184.9 against 199.9 on one; alone, over 30 layers, 15.7 against 31.8 ms
from memory and 17.4 against 31.0 in cache (docs/results.md).

It is compiled once for each shape of heads: with the head size and the number of
query heads per KV head as constants, the compiler unrolls each 64-long dot product
into whole SIMD registers. A 32-slot step on the Zen 3 took 5-6% less than with the
shapes read at run time on 2 threads, 4% less on one (docs/results.md).

It is what the engine's "torch" backend runs for decodes on a CPU, in fp32, when
Numba is installed (it is a dependency of minicb): the backend CpuDecodeAttention
(minicb/attention_backends.py). `EngineConfig(cpu_decode="gather")`, or the flag
`--cpu-decode gather`, switches back to chapter 04's gather, to compare the two. On a GPU the engine
never comes here: there chapter 05's Triton kernels do the same walk. The backend
writes K/V with a compiled loop too (`store_kv_unchecked`): one call a layer.

"Unchecked" means the step's metadata was checked once, on the host; it never
means memory goes unguarded. Numba checks no index, so both kernels test each
slot and block id against the pool and the wrappers raise a ValueError naming
the first one outside it, before anything is written.

    python -m minicb.cpu_attention     # check against chapter 04, then time both and a padded cache

Shapes (chapter 04's calling convention):
    q             [num_seqs, n_q_heads, head_dim]                 one new token per sequence
    k/v_cache     [num_blocks, block_size, n_kv_heads, head_dim]  one layer of the pool
    block_tables  [num_seqs, max_blocks] int32                    logical block -> physical block id
    context_lens  [num_seqs] int32                                tokens stored, the new one included
    out           like q
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from minicb.cpu_ops import EXP2_COEFFICIENTS, LOG2_E
from minicb.paged_attention import check_paged_args

FLOAT_MAX = np.float32(np.finfo(np.float32).max)  # the running max's start, in place of -inf


# Whether the kernel asks for K/V rows before it reads them (a prefetch; False: never).
# It asks for a block's value rows while it scores the block's keys, and for the next
# block's key rows while it weighs this block's values: each phase asks for what the other
# reads next, one row a token, so memory is busy all the time. The kernel used to ask for
# a token's K and V rows 8 tokens ahead, all while scoring, so that memory was busy in
# bursts and idle while values were weighed. On an AMD EPYC (Zen 3), over 30 scattered
# pools of 32 sequences (tokens from memory), in turns: 32.3 -> 25.2 ms on 2 threads, 47.1
# -> 36.2 on one; the attention inside a 32-slot step 18-22% less. In cache, where no row
# needs asking for, it costs 5% (0.47 -> 0.50 ms). The key-at-a-time kernel before
# that took 4-5 ms less a 32-sequence step on an Intel Xeon with 8 tokens ahead than
# with none; 2 and 4 tokens were slower than none, 16 and 32 no better than 8
# (docs/results.md).
# `python -m minicb.cpu_attention` times the kernel with and without.
# (Numba's disk cache follows this file, not minicb/cpu_prefetch.py: after changing
# that one, delete minicb/__pycache__/*.nbi.)
PREFETCH = True


@functools.cache
def _has_numba() -> bool:
    """Whether Numba imports (it is a dependency of minicb, but a broken install should cost only speed)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _compiled_kernel(head_dim: int, group: int):
    """The Numba kernel for one shape of heads, compiled on first use (a few seconds, then cached on
    disk); None without Numba.

    head_dim and group (query heads per KV head) are constants of the compiled code, not
    numbers it reads from its arrays at run time. Knowing that a dot product is 64 long,
    the compiler unrolls it into whole SIMD registers with no loop for a remainder, and
    h // 3 becomes a multiply. Each shape is a compile of its own, once: SmolLM2 has one,
    (64, 3). Measured in docs/results.md ("The decode kernel compiled for the model's heads").
    """
    if not _has_numba():
        return None
    from numba import njit, prange
    # A module global, not a local the kernel would close over: Numba keys its disk cache on
    # what a kernel closes over, and an intrinsic is a new object in every process, so the
    # kernel would be compiled again (3 s) in each.
    global prefetch
    from minicb.cpu_prefetch import prefetch
    c0, c1, c2, c3, c4, c5, c6, c7 = EXP2_COEFFICIENTS

    # fastmath lets the compiler reorder the sums in the dot products, so they run
    # as SIMD instructions; the result differs from SDPA's only in the last bits.
    @njit(parallel=True, fastmath=True, cache=True)
    def decode_kernel(q, k_cache, v_cache, block_tables, context_lens, scale, out, prefetch_rows):
        # head_dim and group: the closure's constants, which the caller took from these arrays
        num_seqs, n_q_heads = q.shape[0], q.shape[1]
        num_blocks, block_size, n_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        row_floats = n_kv_heads * head_dim  # one token's row of a block: every KV head, side by side
        # Numba checks no index: a block id outside the pool would read whatever memory
        # lies there. So each job counts the blocks it refuses to read, and the caller
        # raises if any was (a parallel loop cannot raise itself).
        refused = 0
        # One job per sequence, spread over the CPU cores. A job takes every head
        # of its sequence, because one token's row of a block holds all KV heads
        # side by side: [n_kv_heads, head_dim], contiguous. Reading it whole is one
        # run of memory; a job per (sequence, KV head), chapter 05's Triton grid,
        # would read every row in n_kv_heads strided pieces. On this project's 2-core
        # machine that took 27-35 ms where a job per sequence took 20-28 (three runs,
        # side by side), for 30 layers of 32 sequences of 150-189 tokens: 250 MB of K
        # and V, too much for the CPU's caches, so how memory is read is what counts.
        for seq in prange(num_seqs):
            # Scores in base 2 (exp(x) = 2^(x log2 e)), for the exponent-bits exp below.
            queries = q[seq] * (scale * LOG2_E)  # [H, D]
            running_max = np.full(n_q_heads, -FLOAT_MAX, dtype=np.float32)  # [H]; finite: fastmath assumes no inf
            running_sum = np.zeros(n_q_heads, dtype=np.float32)  # [H]
            acc = np.zeros((n_q_heads, head_dim), dtype=np.float32)  # [H, D] sum of 2^(score - max) * v
            scores = np.empty((n_q_heads, block_size), dtype=np.float32)  # [H, block]: one block's, then its weights
            exponent_bits = np.empty(block_size, dtype=np.int32)
            two_to_whole = exponent_bits.view(np.float32)  # the same memory, read as floats
            n = context_lens[seq]
            if n > block_tables.shape[1] * block_size:  # more tokens than its table lists
                refused += 1
                continue
            used = (n + block_size - 1) // block_size  # blocks holding its context
            for b in range(used):
                block = block_tables[seq, b]
                if block < 0 or block >= num_blocks:
                    refused += 1
                    break
                count = min(block_size, n - b * block_size)  # tokens of this block in the context
                # The next block's id, to ask early for its key rows (-1: none; an id outside the pool is
                # not asked for, and the next round refuses it). The CPU's own prefetcher follows a run
                # of memory, but cannot know where the next block lies.
                following = block_tables[seq, b + 1] if prefetch_rows and b + 1 < used else -1
                if following >= num_blocks:
                    following = -1
                # 1. Every head's score against every key of the block.
                for t in range(count):
                    if prefetch_rows:  # this token's value rows, which step 4 reads
                        row = (block * block_size + t) * row_floats
                        for line in range(0, row_floats, 16):  # 16 floats: a 64-byte cache line
                            prefetch(v_cache, row + line)
                    for h in range(n_q_heads):
                        key = k_cache[block, t, h // group]  # [D], read in place
                        score = np.float32(0.0)
                        for d in range(head_dim):
                            score += queries[h, d] * key[d]
                        scores[h, t] = score
                for h in range(n_q_heads):
                    # 2. The online softmax of chapter 04, a block at a time: a new maximum
                    # rescales what was summed so far, once per block, not once per key.
                    new_max = running_max[h]
                    for t in range(count):
                        new_max = max(new_max, scores[h, t])
                    if new_max > running_max[h]:
                        # (At the first block the sums are still 0, whatever the rescale.)
                        rescale = np.exp2(max(running_max[h] - new_max, np.float32(-126.0)))
                        running_sum[h] *= rescale
                        for d in range(head_dim):
                            acc[h, d] *= rescale
                        running_max[h] = new_max
                    # 3. The block's weights 2^(score - max), all at once: 2^whole in a float's
                    # exponent bits, 2^frac from a polynomial, as minicb/cpu_ops.py's SwiGLU,
                    # so the loop runs as SIMD instructions where np.exp would call the C
                    # library once per key.
                    for t in range(count):
                        y = max(scores[h, t] - new_max, np.float32(-126.0))  # <= 0; below 2^-126 is 0 anyway
                        whole = np.floor(y)
                        frac = y - whole
                        scores[h, t] = c0 + frac * (c1 + frac * (c2 + frac * (c3 + frac * (c4 + frac * (
                            c5 + frac * (c6 + frac * c7))))))
                        exponent_bits[t] = (np.int32(whole) + 127) << 23
                    total = np.float32(0.0)
                    for t in range(count):
                        scores[h, t] *= two_to_whole[t]
                        total += scores[h, t]
                    running_sum[h] += total
                # 4. The weighted values, a value row at a time: each of its numbers is loaded
                # once and added into the rows of its `group` query heads, which all weigh the
                # same KV head's values (GQA). Head by head, the row was read once for each of
                # them; on the Zen 3 the kernel takes 7-15% less this way (docs/results.md).
                for t in range(count):
                    if following >= 0 and (b + 1) * block_size + t < n:  # the next block's key rows
                        row = (following * block_size + t) * row_floats
                        for line in range(0, row_floats, 16):
                            prefetch(k_cache, row + line)
                    for g in range(n_kv_heads):
                        value = v_cache[block, t, g]  # [D]
                        first = g * group  # the group's query heads: first .. first + group - 1
                        for d in range(head_dim):
                            v = value[d]
                            for j in range(group):
                                acc[first + j, d] += scores[first + j, t] * v
            for h in range(n_q_heads):
                for d in range(head_dim):
                    out[seq, h, d] = acc[h, d] / running_sum[h]
        return refused

    return decode_kernel


@functools.cache
def _compiled_store():
    """store_kv's loop, compiled: one call where PyTorch makes six (a division, a remainder,
    two index casts, two scattered writes), in every layer of every step."""
    from numba import njit

    @njit(fastmath=True, cache=True)
    def store_kv_kernel(k, v, k_cache, v_cache, slot_mapping):
        num_tokens, n_kv_heads, head_dim = k.shape
        block_size = k_cache.shape[1]
        # Numba checks no index, and a write outside the pool would corrupt memory:
        # return the first token whose slot lies outside it, before writing anything.
        for token in range(num_tokens):
            if slot_mapping[token] < 0 or slot_mapping[token] >= k_cache.shape[0] * block_size:
                return token
        for token in range(num_tokens):
            block, offset = slot_mapping[token] // block_size, slot_mapping[token] % block_size
            for head in range(n_kv_heads):
                for d in range(head_dim):
                    k_cache[block, offset, head, d] = k[token, head, d]
                    v_cache[block, offset, head, d] = v[token, head, d]
        return -1

    return store_kv_kernel


def set_num_threads(n: int) -> None:
    """Run torch's CPU ops and this kernel on n threads (the --threads flag of bench and serve).

    Numba keeps a thread pool of its own, so torch.set_num_threads alone leaves this
    kernel on every core. On a CPU shared with other jobs one thread each is often
    faster: a parallel loop waits for its slowest thread. The count is also the most
    an engine's threads may use when they follow the machine's load (chosen_threads,
    minicb/cpu_threads.py).
    """
    global _chosen_threads
    apply_num_threads(n)
    _chosen_threads = n


def chosen_threads() -> int | None:
    """The count the last set_num_threads chose (None: never called)."""
    return _chosen_threads


def apply_num_threads(n: int) -> None:
    """set_num_threads's work, without making n the chosen count: what minicb/cpu_threads.py
    calls to follow the machine's load."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads={n!r}; give a whole number >= 1")
    # Numba first: starting its thread pool can start an OpenMP runtime, and with it
    # reset the pool torch shares, so a torch setting made before would be lost.
    try:
        import numba
    except ImportError:
        numba = None
    global _numba_threads
    if numba is not None:
        _numba_threads = min(n, numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(_numba_threads)
    torch.set_num_threads(n)


# Numba's thread count belongs to the thread that set it: a thread started later (the
# server's engine thread) would run the kernel on every core. So the count chosen here
# is kept, and the kernel's caller sets it on its own thread first (None: never chosen).
_numba_threads: int | None = None
_chosen_threads: int | None = None  # set_num_threads's n, the ceiling of minicb/cpu_threads.py


def applies_to(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this kernel can decode a pool on `device` in `dtype`: fp32 on the CPU, with Numba installed."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and _has_numba()


def paged_decode_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens, scale=None,
                                     prefetch_rows: bool = PREFETCH):
    """The kernel on arguments already checked. Returns [num_seqs, n_q_heads, head_dim].

    .numpy() shares memory with a CPU tensor: nothing is copied, and on a CPU
    nothing waits for anything.
    """
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if _numba_threads is not None:
        import numba
        if numba.get_num_threads() != _numba_threads:  # this thread has not taken the setting yet
            numba.set_num_threads(_numba_threads)
    kernel = _compiled_kernel(q.shape[2], q.shape[1] // k_cache.shape[2])  # head_dim, query heads per KV head
    refused = kernel(q.numpy(), k_cache.numpy(), v_cache.numpy(), block_tables.numpy(), context_lens.numpy(),
                     np.float32(scale), out.numpy(), prefetch_rows)
    if refused:
        raise ValueError(_outside_the_pool(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1]))
    return out


def _outside_the_pool(block_tables, context_lens, num_blocks: int, block_size: int) -> str:
    """What the decode kernel refused to read, named for a person (only ever on the error path)."""
    for seq, (table, n) in enumerate(zip(block_tables.tolist(), context_lens.tolist())):
        used = -(-n // block_size)
        if used > len(table):
            return (f"sequence {seq} has context length {n}, which needs {used} blocks of {block_size}, "
                    f"but its block table lists {len(table)}")
        for j, block in enumerate(table[:used]):
            if not 0 <= block < num_blocks:
                return (f"block_tables[{seq}][{j}] = {block} is not a block of the pool: each must be in "
                        f"[0, {num_blocks})")
    return "a block table names a block outside the pool"


def store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Chapter 04's store_kv_unchecked, compiled: k, v [N, n_kv_heads, hd] into the caches
    [num_blocks, block_size, n_kv_heads, hd] at slot_mapping [N] (every slot in the pool, none padding)."""
    bad = _compiled_store()(k.numpy(), v.numpy(), k_cache.numpy(), v_cache.numpy(), slot_mapping.numpy())
    if bad >= 0:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        raise ValueError(f"slot_mapping[{bad}] = {int(slot_mapping[bad])} lies outside the KV pool: slots must be "
                         f"in [0, num_blocks * block_size) = [0, {num_slots}); nothing was written")


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Decode attention over the paged pool, compiled for the CPU. Returns [num_seqs, n_q_heads, head_dim]."""
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    if not (q.device.type == "cpu" and q.dtype == torch.float32):
        raise ValueError(f"the compiled CPU kernel takes float32 tensors on the CPU, got {q.dtype} on {q.device}; "
                         f"use minicb.paged_attention (any device and dtype) or minicb.triton_attention (CUDA)")
    if not _has_numba():
        raise RuntimeError("the compiled CPU kernel needs Numba: pip install numba")
    return paged_decode_attention_unchecked(q, k_cache, v_cache, block_tables.to(torch.int32),
                                            context_lens.to(torch.int32), scale)


# ----------------------------------------------------------------------------
# Check and benchmark: python -m minicb.cpu_attention
#
# One SmolLM2 layer's decode at 32 sequences: the compiled kernel against
# chapter 04's gather + SDPA (the bytes copied are 2 * S * T * n_kv_heads *
# head_dim * 4), and against SDPA on a contiguous, padded cache of the same
# lengths, which is what chapter 02's static batching pays. Then the kernel over
# 30 layers' pools in turn, as a decode step calls it, where K and V no longer
# fit in the CPU's caches and come from memory.

if __name__ == "__main__":
    import time

    from minicb.model import attend
    from minicb.paged_attention import paged_decode_attention_gather

    def median_ms(fn, runs=30):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[runs // 2]

    gen = torch.Generator().manual_seed(0)
    num_seqs, n_q_heads, n_kv_heads, head_dim, block_size = 32, 9, 3, 64, 16
    lens = torch.randint(150, 190, (num_seqs,), dtype=torch.int32, generator=gen)
    blocks_per_seq = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 8
    order = torch.randperm(num_blocks, generator=gen)  # scattered blocks, as in a busy pool
    tables = torch.full((num_seqs, max(blocks_per_seq)), -1, dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_per_seq):
        tables[i, :count] = order[taken:taken + count]
        taken += count
    k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_seqs, n_q_heads, head_dim, generator=gen)

    start = time.perf_counter()
    ours = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    print(f"first call (compile or load from the disk cache): {time.perf_counter() - start:.2f} s")
    theirs = paged_decode_attention_gather(q, k_cache, v_cache, tables, lens)
    print(f"max abs difference from chapter 04's gather: {(ours - theirs).abs().max().item():.2e}")

    longest = int(lens.max())
    keys = torch.randn(num_seqs, longest, n_kv_heads, head_dim, generator=gen)
    values = torch.randn(num_seqs, longest, n_kv_heads, head_dim, generator=gen)
    mask = (torch.arange(longest)[None, :] < lens[:, None])[:, None, None, :]
    # Checked, as a caller outside the engine calls it and as the gather is; unchecked, as the
    # engine's backend calls it once the step's metadata was checked on the host.
    compiled = median_ms(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens))
    in_engine = median_ms(lambda: paged_decode_attention_unchecked(q, k_cache, v_cache, tables, lens))
    gather = median_ms(lambda: paged_decode_attention_gather(q, k_cache, v_cache, tables, lens))
    padded = median_ms(lambda: attend(q[:, None], keys, values, mask))
    print(f"one layer, {num_seqs} sequences of {int(lens.min())}-{longest} tokens, torch threads "
          f"{torch.get_num_threads()} (median of 30):")
    print(f"  compiled {compiled:.2f} ms ({in_engine:.2f} without the argument checks, as in the engine), "
          f"gather + SDPA {gather:.2f} ms ({gather / compiled:.1f}x), "
          f"padded SDPA {padded:.2f} ms ({padded / in_engine:.1f}x the engine's call)")

    num_layers = 30
    pools = [(torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(num_layers)]
    megabytes = 2 * num_layers * int(lens.sum()) * n_kv_heads * head_dim * 4 / 1e6
    print(f"{num_layers} layers, each its own pool ({megabytes:.0f} MB of K and V read), in turns, median of 5x15:")
    steps = {ask: [] for ask in (True, False)}
    for _ in range(5):
        for ask, ms in steps.items():
            ms.append(median_ms(lambda: [paged_decode_attention_unchecked(q, k, v, tables, lens, prefetch_rows=ask)
                                         for k, v in pools], runs=15))
    with_it, without = (sorted(ms)[2] for ms in steps.values())
    print(f"  compiled {with_it:.1f} ms asking for rows early, {without:.1f} ms without "
          f"({without / with_it:.2f}x)")
