"""Paged attention in Triton: the KV pool of chapter 04, read by real GPU kernels.

In this file you will learn:
- how to write a Triton kernel that stores new keys and values into a paged KV
  pool through a slot mapping (`store_kv`);
- how a decode kernel with one program per (sequence, KV head) walks a block
  table, loading K/V tiles from scattered physical blocks and folding them into
  an online softmax, for all the query heads that share that KV head at once
  (`paged_decode_attention`);
- why one program per (sequence, KV head) leaves a big GPU idle at small batch,
  and how flash-decoding splits each sequence across several programs and
  merges their partial softmaxes in a second kernel
  (`paged_decode_attention_split_k`);
- how to develop all of this on a laptop with the Triton interpreter.

Run `python -m minicb.triton_attention` to check every kernel against chapter
04's PyTorch version and, on a CUDA GPU, to measure achieved memory bandwidth
(`--batch 64 --ctx 4096 --dtype bfloat16 --json out.json`).
Chapter 05 (chapters/05-triton-attention/README.md) explains it all.

Shapes (the calling convention of chapter 04):
    q             [num_seqs, n_q_heads, head_dim]                 one new token per sequence
    k/v_cache     [num_blocks, block_size, n_kv_heads, head_dim]  one layer of the pool
    block_tables  [num_seqs, max_blocks] int                      logical block -> physical block id
    context_lens  [num_seqs] int                                  tokens stored, the new one included
    out           like q
"""
from __future__ import annotations

import math
import os

import torch

# Without a GPU the kernels run under the Triton interpreter, which executes
# each program with numpy on the CPU. That is decided once per process, before
# triton is imported, by minicb.triton_mode.choose_triton_mode(), which the
# CLI, the tests and the notebooks call; importing this module changes nothing.
# Run as a script, it is the entry point, so it makes the choice itself.
if __name__ == "__main__":
    from minicb.triton_mode import choose_triton_mode
    choose_triton_mode()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# ----------------------------------------------------------------------------
# The torch reference is chapter 04: same arguments, same answers. Its argument
# checks run on the host before any kernel launches, because a bad block id
# inside a kernel does not raise; it reads someone else's memory.
from minicb.paged_attention import check_paged_args  # noqa: E402
from minicb.paged_attention import paged_decode_attention as torch_paged_decode_attention  # noqa: E402
from minicb.paged_attention import store_kv as torch_store_kv  # noqa: E402


# ----------------------------------------------------------------------------
# Kernel 1: store K/V. One program per new token copies its [n_kv_heads,
# head_dim] keys and values into the slot the allocator gave it.

@triton.jit
def _store_kv_kernel(
    k_ptr,               # [num_tokens, n_kv_heads, head_dim] new keys
    v_ptr,               # [num_tokens, n_kv_heads, head_dim] new values, same strides as k
    k_cache_ptr,         # [num_blocks, block_size, n_kv_heads, head_dim] key pool
    v_cache_ptr,         # value pool, same shape and strides as the key pool
    slot_mapping_ptr,    # [num_tokens] int: block_id * block_size + offset, or < 0 to skip the token
    n_kv_heads,          # real head count (the tile below is padded to a power of 2)
    head_dim,            # real head size
    stride_k_token, stride_k_head, stride_k_dim,  # element strides of k (and v)
    stride_cache_block, stride_cache_token, stride_cache_head, stride_cache_dim,  # of the pools
    BLOCK_SIZE: tl.constexpr,    # tokens per KV block
    HEADS_PAD: tl.constexpr,     # n_kv_heads rounded up to a power of 2 (tl.arange needs one)
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of 2
):
    token = tl.program_id(0)
    # int64 before any multiply: in a big pool block_id * stride_cache_block
    # passes 2**31 elements and int32 would wrap to a negative offset.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding, or a token whose K/V is already in the pool
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < n_kv_heads) & (dims[None, :] < head_dim)  # [HEADS_PAD, HEAD_DIM_PAD]
    src = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :] * stride_k_dim
    dst = ((slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token
           + heads[:, None] * stride_cache_head + dims[None, :] * stride_cache_dim)
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


# ----------------------------------------------------------------------------
# Kernel 2: paged decode. Two helpers first, shared with the split-K kernel.

@triton.jit
def _matmul(a, b, USE_DOT: tl.constexpr):
    """a [M, K] @ b [K, N] -> [M, N], accumulated in fp32.

    On a GPU with 16-bit K/V, tl.dot runs on tensor cores (it needs M, N, K >= 16,
    which is why the wrapper pads the query group to 16 rows). Elsewhere a
    broadcast multiply and sum: exact in fp32, and right under the interpreter,
    whose bf16 tl.dot returns garbage."""
    if USE_DOT:
        return tl.dot(a.to(b.dtype), b)
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _attend_tokens(
    q,                   # [GROUP_PAD, HEAD_DIM_PAD] the query heads of one KV head; padding is 0
    k_cache_ptr, v_cache_ptr,  # the pools, already offset to this program's KV head
    block_table_ptr,     # this sequence's row of block_tables
    stride_table_block,  # element stride along that row
    start, end,          # attend to logical token positions [start, end); start is a multiple of TILE
    scale,               # softmax scale, usually 1/sqrt(head_dim)
    head_dim,
    stride_cache_block, stride_cache_token, stride_cache_dim,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,  # tokens per loop step; may span several blocks or part of one
    USE_DOT: tl.constexpr,
):
    """Online softmax over tokens [start, end); returns the running (max, sum, acc)."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < head_dim
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)   # running max score per query head
    l = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32) # running sum of exp(score - m) * v
    for tile_start in range(start, end, TILE):
        # Walk the block table one token at a time: token t lives in logical
        # block t // BLOCK_SIZE, at offset t % BLOCK_SIZE of the physical block
        # the table names. Neighbouring tokens repeat the same table entry,
        # which costs nothing (it is one cached line), and this lets TILE be
        # chosen for the hardware whatever the block size is.
        tokens = tile_start + tl.arange(0, TILE)                                   # [TILE]
        valid = tokens < end
        block_ids = tl.load(block_table_ptr + (tokens // BLOCK_SIZE) * stride_table_block,
                            mask=valid, other=0).to(tl.int64)                       # [TILE]
        rows = block_ids * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_token  # [TILE] int64
        kv_mask = valid[None, :] & dim_ok[:, None]
        k_t = tl.load(k_cache_ptr + rows[None, :] + dims[:, None] * stride_cache_dim,
                      mask=kv_mask, other=0.0)                                      # [HEAD_DIM_PAD, TILE]
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :] * stride_cache_dim,
                    mask=valid[:, None] & dim_ok[None, :], other=0.0)               # [TILE, HEAD_DIM_PAD]

        scores = _matmul(q, k_t, USE_DOT) * scale                                  # [GROUP_PAD, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        # Every tile holds at least one valid token (the loop stops at end), so
        # m_new is finite and exp(m - m_new) never sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        correction = tl.exp(m - m_new)           # rescales what was summed under the old max
        p = tl.exp(scores - m_new[:, None])      # [GROUP_PAD, TILE]
        l = l * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + _matmul(p, v, USE_DOT)
        m = m_new
    return m, l, acc


@triton.jit
def _decode_kernel(
    out_ptr,             # [num_seqs, n_q_heads, head_dim] output
    q_ptr,               # [num_seqs, n_q_heads, head_dim] one query token per sequence
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, n_kv_heads, head_dim] pools
    block_tables_ptr,    # [num_seqs, max_blocks] int
    context_lens_ptr,    # [num_seqs] int, >= 1
    scale, group, head_dim,  # group = n_q_heads // n_kv_heads
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_out_seq, stride_out_head, stride_out_dim,
    stride_table_seq, stride_table_block,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_cache_dim,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr, USE_DOT: tl.constexpr,
):
    # grid = (num_seqs, n_kv_heads). One program reads its KV head's keys and
    # values once for all `group` query heads that share them (GQA).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, GROUP_PAD)  # query head kv_head * group + row
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_mask = (rows[:, None] < group) & (dims[None, :] < head_dim)
    heads = kv_head * group + rows
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
                mask=q_mask, other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    m, l, acc = _attend_tokens(
        q, k_cache_ptr + kv_head * stride_cache_head, v_cache_ptr + kv_head * stride_cache_head,
        block_tables_ptr + seq * stride_table_seq, stride_table_block, 0, context_len, scale, head_dim,
        stride_cache_block, stride_cache_token, stride_cache_dim,
        BLOCK_SIZE, GROUP_PAD, HEAD_DIM_PAD, TILE, USE_DOT)
    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :] * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------
# Kernel 3: split-K (flash-decoding). Each sequence's tokens are cut into
# num_splits ranges; program (seq, kv_head, split) runs the same online softmax
# over its range and writes the unnormalised (max, sum, acc). A reduce kernel
# then merges the splits exactly as the loop above merges tiles.

@triton.jit
def _split_kernel(
    m_ptr, l_ptr,        # [num_seqs, n_kv_heads, num_splits, GROUP_PAD] fp32 partial max / sum
    acc_ptr,             # [num_seqs, n_kv_heads, num_splits, GROUP_PAD, HEAD_DIM_PAD] fp32 partial acc
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,  # as in _decode_kernel
    scale, group, head_dim,
    tokens_per_split,    # a multiple of TILE; split s covers [s * tokens_per_split, (s+1) * tokens_per_split)
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_table_seq, stride_table_block,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_cache_dim,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr, USE_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_splits = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)  # may be <= start: an empty split

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * group + rows
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
                mask=(rows[:, None] < group) & (dims[None, :] < head_dim), other=0.0)

    m, l, acc = _attend_tokens(
        q, k_cache_ptr + kv_head * stride_cache_head, v_cache_ptr + kv_head * stride_cache_head,
        block_tables_ptr + seq * stride_table_seq, stride_table_block, start, end, scale, head_dim,
        stride_cache_block, stride_cache_token, stride_cache_dim,
        BLOCK_SIZE, GROUP_PAD, HEAD_DIM_PAD, TILE, USE_DOT)
    # An empty split leaves m = -inf, l = 0, acc = 0: it will weigh exp(-inf) = 0.
    # Only the `group` real rows are written; the reduce reads only those.
    part = (seq * num_kv_heads + kv_head) * num_splits + split
    row_ok = rows < group
    tl.store(m_ptr + part * GROUP_PAD + rows, m, mask=row_ok)
    tl.store(l_ptr + part * GROUP_PAD + rows, l, mask=row_ok)
    tl.store(acc_ptr + (part * GROUP_PAD + rows[:, None]) * HEAD_DIM_PAD + dims[None, :], acc,
             mask=row_ok[:, None])


@triton.jit
def _reduce_kernel(
    out_ptr,             # [num_seqs, n_q_heads, head_dim] output
    m_ptr, l_ptr, acc_ptr,  # partials written by _split_kernel
    group, head_dim, num_splits,
    stride_out_seq, stride_out_head, stride_out_dim,
    GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # grid = (num_seqs, n_kv_heads). Split 0 always starts at token 0 and every
    # context has >= 1 token, so after the first step m_total is finite.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < group
    m_total = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_total = tl.zeros([GROUP_PAD], tl.float32)
    acc_total = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    first = (seq * tl.num_programs(1) + kv_head) * num_splits
    for split in range(0, num_splits):
        part = first + split
        # Padding rows read as m = 0, l = 1, acc = 0, which keeps them finite.
        m = tl.load(m_ptr + part * GROUP_PAD + rows, mask=row_ok, other=0.0)
        l = tl.load(l_ptr + part * GROUP_PAD + rows, mask=row_ok, other=1.0)
        acc = tl.load(acc_ptr + (part * GROUP_PAD + rows[:, None]) * HEAD_DIM_PAD + dims[None, :],
                      mask=row_ok[:, None], other=0.0)
        # The same rescaling as inside a split: bring both sides to the larger max.
        m_new = tl.maximum(m_total, m)
        old_weight = tl.exp(m_total - m_new)
        new_weight = tl.exp(m - m_new)
        l_total = l_total * old_weight + l * new_weight
        acc_total = acc_total * old_weight[:, None] + acc * new_weight[:, None]
        m_total = m_new
    out = acc_total / l_total[:, None]
    heads = kv_head * group + rows
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :] * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims[None, :] < head_dim))


# ----------------------------------------------------------------------------
# Wrappers: check on the host, allocate, pick the launch shape, launch.

INTERPRETED = isinstance(_decode_kernel, InterpretedFunction)  # True under TRITON_INTERPRET=1
_INTERPRET_SETTING = os.environ.get("TRITON_INTERPRET")  # as it was when the kernels above were defined


def _check_device(**tensors: torch.Tensor) -> None:
    """All tensors on the one device this build of the kernels can read."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    device = next(iter(devices.values()))
    if INTERPRETED and device.type != "cpu":
        raise ValueError(f"the kernels run under the Triton interpreter (TRITON_INTERPRET=1), which reads CPU "
                         f"tensors, but got tensors on {device}; move them with .cpu(), or start Python "
                         f"without TRITON_INTERPRET=1 on a CUDA machine to compile the kernels")
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(f"the kernels are compiled for a CUDA GPU (TRITON_INTERPRET was {_INTERPRET_SETTING!r} "
                         f"when minicb.triton_attention defined them) but got tensors on {device}; move the "
                         f"tensors to cuda, or run on the CPU under the interpreter: call "
                         f"minicb.triton_mode.choose_triton_mode() before anything imports triton, or start "
                         f"Python with TRITON_INTERPRET=1")


def _check_pools(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels address both pools with one set of strides.
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must have the same strides, got {k_cache.stride()} and "
                         f"{v_cache.stride()}")


def _launch_config(q: torch.Tensor, n_kv_heads: int, block_size: int) -> dict:
    """Constexpr sizes and warps for the attention kernels."""
    group = q.shape[1] // n_kv_heads
    head_dim_pad = triton.next_power_of_2(q.shape[2])
    # Tensor cores only on a GPU, only for 16-bit data, and only when every
    # side of both products is at least 16.
    use_dot = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and head_dim_pad >= 16
    if use_dot:
        group_pad = max(16, triton.next_power_of_2(group))
        tile = 64   # 64 tokens x 64 dims x 2 bytes = 8 KiB of K and of V in flight per step
    else:
        group_pad = triton.next_power_of_2(group)
        # The multiply-and-sum form holds a [group, head_dim, tile] product in
        # registers; cap it near 8K fp32 values (64 per thread at 4 warps).
        tile = max(16, min(64, 8192 // (group_pad * head_dim_pad)))
    return dict(BLOCK_SIZE=block_size, GROUP_PAD=group_pad, HEAD_DIM_PAD=head_dim_pad, TILE=tile,
                USE_DOT=use_dot, num_warps=4)


def check_store_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Raise TypeError/ValueError naming the bad value if store_kv's arguments don't fit together."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, n_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (n_kv_heads, head_dim):
        raise ValueError(f"k and v must both be [num_tokens, {n_kv_heads}, {head_dim}] to fit the cache, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens] = [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"k, v and the caches must share one dtype, got k {k.dtype}, v {v.dtype}, "
                        f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    _check_pools(k_cache, v_cache)
    num_slots = num_blocks * block_size
    if k.shape[0] and int(slot_mapping.max()) >= num_slots:
        bad = int(slot_mapping.argmax())
        raise ValueError(f"slot_mapping[{bad}] = {int(slot_mapping[bad])} is past the pool: slots must be "
                         f"< num_blocks * block_size = {num_blocks} * {block_size} = {num_slots} (or < 0 to skip)")


def check_attention_args(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Chapter 04's checks, plus the two things only kernels care about: device and strides."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("context_lens", context_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    _check_pools(k_cache, v_cache)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [num_tokens, n_kv_heads, head_dim] into the pools at slot_mapping [num_tokens].

    A slot is block_id * block_size + offset; slots < 0 are skipped. In place."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping)


def store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping) -> None:
    """store_kv for arguments already checked (the engine checks once per step). Reads nothing on the host."""
    if k.shape[0] == 0:
        return
    if k.stride() != v.stride():  # one set of strides for both inputs; they are small, so copy
        k, v = k.contiguous(), v.contiguous()
    _, block_size, n_kv_heads, head_dim = k_cache.shape
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, n_kv_heads, head_dim, *k.stride(), *k_cache.stride(),
        BLOCK_SIZE=block_size, HEADS_PAD=triton.next_power_of_2(n_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None) -> torch.Tensor:
    """Decode attention over the paged pool, one program per (sequence, KV head). Returns out like q."""
    check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


# The engine's decode, unchecked, with the calling convention of chapter 04's:
# the arguments were checked once for the whole step, and the plan is built
# once and shared by every layer. The kernel walks the block table itself, so
# its plan is just the table and the lengths.
def decode_plan(block_tables, context_lens, max_context_len: int, block_size: int):
    """What the decode kernel reads: (block_tables, context_lens) as they are."""
    return block_tables, context_lens


def paged_decode_attention_unchecked(q, k_cache, v_cache, plan, scale=None) -> torch.Tensor:
    """Decode from a prepared plan. Reads nothing on the host. Returns out like q."""
    return _launch_decode(q, k_cache, v_cache, *plan, scale)


def _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale=None) -> torch.Tensor:
    # Unchecked: the benchmark and the engine call this, since the checks above sync with the GPU.
    num_seqs, n_q_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else float(scale)
    _decode_kernel[(num_seqs, n_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, scale, n_q_heads // n_kv_heads, head_dim,
        *q.stride(), *out.stride(), *block_tables.stride(), *k_cache.stride(),
        **_launch_config(q, n_kv_heads, k_cache.shape[1]))
    return out


def default_num_splits(num_seqs: int, n_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many pieces to cut each sequence into so the GPU has enough programs."""
    if device.type != "cuda":
        # The interpreter runs programs one after another: nothing to win,
        # but split in two so the path runs.
        return 2
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    # About 8 programs per SM keeps enough loads in flight to cover memory
    # latency and leaves a small tail when programs finish unevenly. Stop
    # before a split gets fewer than 4 tiles of 64 tokens: each split costs a
    # partial write and a read in the reduce.
    wanted = math.ceil(8 * num_sms / max(1, num_seqs * n_kv_heads))
    return max(1, min(wanted, math.ceil(max_context / 256)))


def paged_decode_attention_split_k(q, k_cache, v_cache, block_tables, context_lens, scale=None,
                                   num_splits=None) -> torch.Tensor:
    """Flash-decoding: grid (sequence, KV head, split), then a reduce over splits. Returns out like q."""
    check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None (choose for me), got {num_splits!r}")
    return _launch_split_k(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits)


def _launch_split_k(q, k_cache, v_cache, block_tables, context_lens, scale=None, num_splits=None):
    num_seqs, n_q_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else float(scale)
    config = _launch_config(q, n_kv_heads, block_size)
    # Size the splits from the block table's width rather than the longest
    # context, which would need a sync with the GPU. Sequences shorter than
    # the table leave their last splits empty; the reduce gives those weight 0.
    capacity = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, n_kv_heads, capacity, q.device)
    tile = config["TILE"]
    tokens_per_split = math.ceil(math.ceil(capacity / num_splits) / tile) * tile

    part_shape = (num_seqs, n_kv_heads, num_splits, config["GROUP_PAD"])
    m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    l = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    acc = torch.empty(part_shape + (config["HEAD_DIM_PAD"],), dtype=torch.float32, device=q.device)
    group = n_q_heads // n_kv_heads
    _split_kernel[(num_seqs, n_kv_heads, num_splits)](
        m, l, acc, q, k_cache, v_cache, block_tables, context_lens, scale, group, head_dim, tokens_per_split,
        *q.stride(), *block_tables.stride(), *k_cache.stride(), **config)
    _reduce_kernel[(num_seqs, n_kv_heads)](
        out, m, l, acc, group, head_dim, num_splits, *out.stride(),
        GROUP_PAD=config["GROUP_PAD"], HEAD_DIM_PAD=config["HEAD_DIM_PAD"], num_warps=4)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                            scale=None) -> torch.Tensor:
    """Causal attention for a ragged batch of new tokens whose K/V are already stored.

    q [total_new_tokens, n_q_heads, head_dim]; cu_seqlens_q [num_seqs + 1]: sequence i owns
    q rows cu_seqlens_q[i]:cu_seqlens_q[i+1], which are the last tokens of its context.

    A new token at position p attends to positions 0..p: exactly a decode step
    with context p + 1. So each query row becomes its own "sequence" with its
    own copy of the block-table row, and the decode kernel does the rest. It
    re-reads K/V once per query token, which a real prefill kernel avoids."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [total_new_tokens, n_q_heads, head_dim] tensor, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if (not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1
            or cu_seqlens_q.shape[0] != len(block_tables) + 1):
        raise ValueError(f"cu_seqlens_q must be a 1-dim tensor of num_seqs + 1 = {len(block_tables) + 1} "
                         f"offsets, got {cu_seqlens_q!r:.80}")
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    if starts[0] != 0 or starts[-1] != q.shape[0] or not all(1 <= n <= c for n, c in zip(q_lens, lens)):
        raise ValueError(f"cu_seqlens_q = {starts} must rise from 0 to q.shape[0] = {q.shape[0]} by at least 1 "
                         f"per sequence, and no more than its context_lens = {lens}: a sequence's new tokens "
                         f"are the last q_len tokens of its context")
    check_attention_args(q[cu_seqlens_q[1:].long() - 1], k_cache, v_cache, block_tables, context_lens)
    return paged_prefill_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                                             starts, lens, scale)


def paged_prefill_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                                      query_starts, lens, scale=None) -> torch.Tensor:
    """paged_prefill_attention for arguments already checked. It works from the tensors alone and
    reads nothing on the host; query_starts and lens (cu_seqlens_q and context_lens as Python
    lists, which chapter 04's prefill loops over) are not needed here."""
    # Row r of sequence s sits end_s - 1 - r tokens before the end of its context.
    # output_size gives repeat_interleave the total, which it would otherwise read on the host.
    num_seqs = block_tables.shape[0]
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [num_seqs]
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens,
                                         output_size=q.shape[0])  # [total_new_tokens]
    ends = cu_seqlens_q[1:].long()[seq_of_row]
    rows = torch.arange(q.shape[0], device=q.device)
    row_context = (context_lens.long()[seq_of_row] - (ends - 1 - rows)).to(context_lens.dtype)
    return _launch_decode(q, k_cache, v_cache, block_tables[seq_of_row], row_context, scale)


# ----------------------------------------------------------------------------
# Check against chapter 04, then (on CUDA) time.

def make_paged_inputs(batch, ctx, n_q_heads, n_kv_heads, head_dim, block_size, dtype, device="cpu"):
    """Random q and a pool whose blocks are handed out in shuffled order, as after a long run.

    Returns q, k_cache, v_cache, block_tables (int32), context_lens (int32)."""
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * blocks_per_seq
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(batch, n_q_heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return [q, k_cache, v_cache, table, context_lens]


def check_against_reference(args, tol) -> dict:
    """Max abs difference of each kernel vs chapter 04; raises if any exceeds tol."""
    q, k_cache, v_cache, block_tables, context_lens = args
    expected = torch_paged_decode_attention(*args).float()
    diffs = {
        "decode": (paged_decode_attention(*args).float() - expected).abs().max().item(),
        "split_k": (paged_decode_attention_split_k(*args).float() - expected).abs().max().item(),
    }
    # store_kv: one new token per sequence into random slots, the first one a padding token.
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], device=q.device)[:q.shape[0]]
    slots[0] = -1
    k_new, v_new = (torch.randn((q.shape[0],) + k_cache.shape[2:], dtype=q.dtype, device=q.device) for _ in "kv")
    ours, theirs = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    store_kv(k_new, v_new, *ours, slots)
    torch_store_kv(k_new, v_new, *theirs, slots)
    diffs["store_kv"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))
    for name, diff in diffs.items():
        if not diff <= tol:
            raise AssertionError(f"{name} differs from chapter 04's torch version: max abs diff {diff:.3g} > {tol}")
    return diffs


# Peak HBM bandwidth in bytes/s by device name, most specific name first.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
                  ("A100", 2.0e12)]


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes/s a device-to-device copy moves, reads and writes counted, timed like the kernels.

    The data sheet's peak is never reached; a plain copy shows what this GPU's
    memory really gives, so a kernel's bandwidth is also held against it.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def main(argv=None) -> None:
    import argparse
    import json
    parser = argparse.ArgumentParser(description="check and benchmark the paged-attention kernels")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096, help="context length of every sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    # SmolLM2-135M's attention: 9 query heads sharing 3 KV heads of size 64.
    parser.add_argument("--n-q-heads", type=int, default=9)
    parser.add_argument("--n-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--json", help="write the figures to this file")
    opts = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, opts.dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    report = {"interpreted": INTERPRETED, "dtype": opts.dtype, "block_size": opts.block_size,
              "n_q_heads": opts.n_q_heads, "n_kv_heads": opts.n_kv_heads, "head_dim": opts.head_dim}

    if INTERPRETED:
        # The interpreter runs every program in Python: check a tiny shape only.
        batch, ctx = 2, 3 * opts.block_size + 1
        args = make_paged_inputs(batch, ctx, opts.n_q_heads, opts.n_kv_heads, opts.head_dim, opts.block_size, dtype)
        diffs = check_against_reference(args, tol)
        print(f"Triton interpreter (TRITON_INTERPRET=1): batch {batch}, ctx {ctx}, {opts.dtype}: max abs diff vs chapter 04 "
              + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()) + f" (all <= {tol})")
        print("Interpreter timings are not a speed figure, so none are printed; run on a CUDA GPU to benchmark.")
        report.update(batch=batch, ctx=ctx, max_abs_diff=diffs)
    else:
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        peak = next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)
        args = make_paged_inputs(opts.batch, opts.ctx, opts.n_q_heads, opts.n_kv_heads, opts.head_dim,
                                 opts.block_size, dtype, device)
        diffs = check_against_reference(args, tol)
        print(f"{name}: batch {opts.batch}, ctx {opts.ctx}, {opts.dtype}: max abs diff vs chapter 04 "
              + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
        q, k_cache = args[0], args[1]
        # Bytes that must cross HBM once: every sequence's K and V (ctx tokens
        # x n_kv_heads x head_dim, twice) + q read + out written. Block-table
        # reads and split-K's partials are not counted: they are overhead.
        elem = k_cache.element_size()
        kv_bytes = 2 * opts.batch * opts.ctx * opts.n_kv_heads * opts.head_dim * elem
        total_bytes = kv_bytes + 2 * q.numel() * elem
        num_splits = default_num_splits(opts.batch, opts.n_kv_heads, args[3].shape[1] * opts.block_size, device)
        copy = copy_bandwidth(device)
        print(f"  device-to-device copy: {copy / 1e9:7.0f} GB/s (reads and writes counted)")
        report.update(device=name, batch=opts.batch, ctx=opts.ctx, bytes=total_bytes, max_abs_diff=diffs,
                      peak_bytes_per_s=peak, num_splits=num_splits, copy_bytes_per_s=copy)
        for label, fn in (("decode", lambda: _launch_decode(*args)),
                          ("split_k", lambda: _launch_split_k(*args, num_splits=num_splits))):
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # L2 flushed between runs
            gbps = total_bytes / (ms * 1e-3) / 1e9
            frac = gbps * 1e9 / peak if peak else None
            report[label] = {"ms": ms, "GB_per_s": gbps, "fraction_of_peak": frac, "fraction_of_copy": gbps * 1e9 / copy}
            peak_text = f"{100 * frac:.0f}% of {peak / 1e12:.2f} TB/s peak" if peak else "peak bandwidth unknown"
            extra = f" ({num_splits} splits)" if label == "split_k" else ""
            print(f"  {label:8s}{extra}: {1000 * ms:8.1f} us  {gbps:7.0f} GB/s  {100 * gbps * 1e9 / copy:.0f}% of the "
                  f"copy rate, {peak_text}")
        if peak:
            report["best_fraction_of_peak"] = max(report["decode"]["fraction_of_peak"],
                                                  report["split_k"]["fraction_of_peak"])
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {opts.json}")
    # This file's prefill runs every new token as a decode; the query-tile kernel
    # reads each sequence's K/V once per tile instead, and has its own check and bench.
    print("Prefill and mixed steps: `python -m minicb.tile_attention` checks the query-tile kernel "
          "(minicb/tile_attention.py) and, on a GPU, times it beside this file's paged_prefill_attention.")


if __name__ == "__main__":
    main()
