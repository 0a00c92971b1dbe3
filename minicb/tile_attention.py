"""One paged attention for a whole mixed step: tiles of query tokens over the paged pool, in Triton.

In this file you will learn:
- why chapter 05's prefill, which runs every new token as a decode of its own,
  reads a sequence's keys and values once per new token, and how a kernel
  that takes a *tile* of new tokens reads them once per tile instead;
- how one program stacks BLOCK_Q new tokens x the query heads of one KV head
  (GQA) into the rows of one matrix, so that every K/V tile it loads serves
  all of them;
- the causal mask for new tokens that follow cached ones: new token r of a
  sequence sits at position context_len - q_len + r and sees the keys at
  positions <= its own;
- why a decode is simply q_len = 1, so that one launch serves a whole mixed
  step (decodes, prompt chunks and whole prompts together), as vLLM's unified
  Triton attention does;
- how the launch grid comes from a tile plan built on the host, once per step,
  so that launching reads nothing back from the GPU.

Run `python -m minicb.tile_attention`: on a CUDA GPU it checks the tile kernel
against chapter 04 and times it beside chapter 05's prefill on SmolLM2's shapes;
on a CPU it runs under the Triton interpreter, on small shapes, and checks
correctness only (interpreter timings mean nothing).

Shapes (the calling convention of chapter 04's paged_prefill_attention):
    q             [total_q, n_q_heads, head_dim]                  every sequence's new tokens, packed
    cu_seqlens_q  [num_seqs + 1] int                              sequence i owns q rows cu[i]:cu[i+1]
    k/v_cache     [num_blocks, block_size, n_kv_heads, head_dim]  one layer of the pool, new K/V stored
    block_tables  [num_seqs, max_blocks] int                      logical block -> physical block id
    context_lens  [num_seqs] int                                  tokens stored, the new ones included
    out           like q
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# As in chapter 05: the interpreter must be chosen before triton is imported,
# and only where a program starts. Run as a script, this file is that place.
if __name__ == "__main__":
    from minicb.triton_mode import choose_triton_mode
    choose_triton_mode()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Chapter 04 checks the arguments and is the oracle; chapter 05 gives the
# device and pool checks, the matrix product helper and its own prefill to compare with.
from minicb.paged_attention import _require_tensors, check_prefill_args  # noqa: E402
from minicb.paged_attention import paged_prefill_attention as torch_paged_prefill_attention  # noqa: E402
from minicb.triton_attention import INTERPRETED, _check_device, _check_pools, _matmul  # noqa: E402
from minicb.triton_attention import paged_prefill_attention_unchecked as rows_prefill_unchecked  # noqa: E402

# ----------------------------------------------------------------------------
# The tile.
#
# Chapter 05's decode program holds the `group` query heads of one KV head as
# the rows of a [GROUP_PAD, head_dim] matrix, so that every K/V tile it loads
# serves all of them. A tile program stacks BLOCK_Q consecutive new tokens of
# one sequence the same way, token after token:
#
#   row = t * GROUP_PAD + g     t: new token first + t of the sequence, g: its g-th query head of this KV head
#
#   q tile [BLOCK_Q * GROUP_PAD, head_dim], e.g. SmolLM2 (group 3, GROUP_PAD 4), BLOCK_Q 4:
#     rows  0- 3   token first + 0: heads 3k, 3k+1, 3k+2, and one padding row
#     rows  4- 7   token first + 1: ...
#     rows 12-15   token first + 3: ...
#
# Every K/V tile loaded is then multiplied with BLOCK_Q * GROUP_PAD rows
# instead of GROUP_PAD, and a sequence's keys are read ceil(q_len / BLOCK_Q)
# times instead of q_len times. The rows differ only in their position, that
# is in how much of the context each may see: the causal mask.


@triton.jit
def _tile_attention_kernel(
    out_ptr,             # [total_q, n_q_heads, head_dim] output
    q_ptr,               # [total_q, n_q_heads, head_dim] new tokens, packed
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, n_kv_heads, head_dim] pools
    block_tables_ptr,    # [num_seqs, max_blocks] int
    context_lens_ptr,    # [num_seqs] int: tokens stored, the new ones included
    cu_seqlens_q_ptr,    # [num_seqs + 1] int: sequence i owns q rows cu[i]:cu[i+1]
    tiles_ptr,           # [num_tiles, 2] int32: (sequence, its first new token in this tile)
    scale, group, head_dim,  # group = n_q_heads // n_kv_heads
    stride_q_token, stride_q_head, stride_q_dim,
    stride_out_token, stride_out_head, stride_out_dim,
    stride_table_seq, stride_table_block,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_cache_dim,
    BLOCK_SIZE: tl.constexpr,    # tokens per KV block
    BLOCK_Q: tl.constexpr,       # new tokens per tile (a power of 2)
    GROUP_PAD: tl.constexpr,     # group rounded up to a power of 2 (more when tl.dot needs 16 rows)
    HEAD_DIM_PAD: tl.constexpr,  # head_dim rounded up to a power of 2
    TILE: tl.constexpr,          # keys per loop step
    USE_DOT: tl.constexpr,
):
    # grid = (num_tiles, n_kv_heads). The plan says which sequence, and which of
    # its new tokens, this program serves; the batch says where they are.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    first = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    num_cached = tl.load(context_lens_ptr + seq) - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    query = first + rows // GROUP_PAD                  # [BLOCK_M] which new token of the sequence
    in_group = rows % GROUP_PAD                        # [BLOCK_M] which head of the KV head's group
    row_ok = (query < q_len) & (in_group < group)      # the last tile of a sequence may run past it
    position = num_cached + query                      # [BLOCK_M] the row's position in its sequence
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < head_dim
    # int64 before multiplying by a stride: offsets into big tensors pass 2**31 elements.
    token = (q_start + query).to(tl.int64)             # [BLOCK_M] row of q
    head = kv_head * group + in_group                  # [BLOCK_M] query head
    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :] * stride_q_dim
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]; padding rows are 0

    # The tile's last new token sees the most: keys at positions [0, end).
    end = num_cached + tl.minimum(first + BLOCK_Q, q_len)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    k_head = k_cache_ptr + kv_head * stride_cache_head
    v_head = v_cache_ptr + kv_head * stride_cache_head
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)   # running max score per row
    l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # running sum of exp(score - m) * v
    # The block table is walked once for the whole tile: this loop is what the
    # BLOCK_Q rows share. Tokens are located one by one, as in chapter 05, so
    # TILE need not match the block size.
    for key_start in range(0, end, TILE):
        keys = key_start + tl.arange(0, TILE)                                      # [TILE] positions
        key_ok = keys < end
        block_ids = tl.load(table + (keys // BLOCK_SIZE) * stride_table_block, mask=key_ok, other=0).to(tl.int64)
        slots = block_ids * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_token  # [TILE] int64
        k_t = tl.load(k_head + slots[None, :] + dims[:, None] * stride_cache_dim,
                      mask=key_ok[None, :] & dim_ok[:, None], other=0.0)            # [HEAD_DIM_PAD, TILE]
        v = tl.load(v_head + slots[:, None] + dims[None, :] * stride_cache_dim,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)              # [TILE, HEAD_DIM_PAD]

        scores = _matmul(q, k_t, USE_DOT) * scale                                  # [BLOCK_M, TILE]
        # Causal: a row sees the keys at or before its own position. Every key
        # before num_cached is visible to every row, so only the last tiles
        # really need the mask; one loop with it everywhere keeps the kernel
        # short (a faster one splits the loop in two, as FlashAttention does).
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is visible to every row (padding rows included: their position
        # is >= 0 too) and lies in the first tile, so after it m is finite, and
        # a later row of scores that is all -inf leaves m, l and acc as they were.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])                                        # [BLOCK_M, TILE]
        l = l * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + _matmul(p, v, USE_DOT)
        m = m_new
    out = acc / l[:, None]
    out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :] * stride_out_dim
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------
# The tile plan: which (sequence, first new token) each program takes.
#
# It depends only on how many new tokens each sequence has, which the engine
# knows on the host (cu_seqlens_q as a list), so it is built there once per
# step and shared by every layer. The grid is its length, a Python int:
# computing the number of tiles on the GPU would mean reading it back.


@dataclass(frozen=True)
class TilePlan:
    tiles: torch.Tensor  # [num_tiles, 2] int32 on the pool's device: (sequence, first new token of the tile)
    block_q: int  # new tokens per tile


def uses_tensor_cores(k_cache: torch.Tensor) -> bool:
    """tl.dot on a GPU for 16-bit K/V (as in chapter 05); otherwise an exact fp32 multiply-and-sum."""
    head_dim_pad = triton.next_power_of_2(k_cache.shape[3])
    return k_cache.is_cuda and k_cache.dtype in (torch.float16, torch.bfloat16) and head_dim_pad >= 16


def default_block_q(max_q_len: int, k_cache: torch.Tensor) -> int:
    """New tokens per tile: enough to fill tensor cores, never more than the longest sequence needs.

    With tensor cores, 16 tokens x SmolLM2's 4 padded heads make 64 rows. The
    multiply-and-sum holds a [rows, head_dim, TILE] product in registers, so it
    gets small tiles. A decode-only step gets tiles of one token: a decode program.
    """
    cap = 16 if uses_tensor_cores(k_cache) else 4
    return min(cap, triton.next_power_of_2(max(1, max_q_len)))


def tile_plan(query_starts: list[int], k_cache: torch.Tensor, block_q: int | None = None) -> TilePlan:
    """Cut every sequence's new tokens into tiles of block_q, from cu_seqlens_q as a Python list.

    k_cache only says the device and dtype; nothing is read from it."""
    q_lens = [end - start for start, end in zip(query_starts[:-1], query_starts[1:])]
    if block_q is None:
        block_q = default_block_q(max(q_lens, default=1), k_cache)
    if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a positive power of 2 (it sizes a tl.arange), got {block_q!r}")
    tiles = [(seq, first) for seq, q_len in enumerate(q_lens) for first in range(0, q_len, block_q)]
    tiles_tensor = torch.tensor(tiles, dtype=torch.int32).reshape(len(tiles), 2)  # reshape: [] -> [0, 2]
    return TilePlan(tiles=tiles_tensor.to(k_cache.device), block_q=block_q)


def _launch_config(group: int, block_q: int, k_cache: torch.Tensor) -> dict:
    """Constexpr sizes and warps for the tile kernel."""
    use_dot = uses_tensor_cores(k_cache)
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = triton.next_power_of_2(k_cache.shape[3])
    if use_dot:
        # tl.dot needs at least 16 rows: pad the group further, as chapter 05 does, for small tiles.
        group_pad = max(group_pad, 16 // block_q)
        tile = 64 if block_q * group_pad <= 64 else 32  # keep K, V and scores in registers as rows grow
    else:
        # Cap the [rows, head_dim, TILE] product near 8K fp32 values, like chapter 05's decode.
        tile = max(16, min(64, 8192 // (block_q * group_pad * head_dim_pad)))
    num_warps = 4 if block_q * group_pad <= 64 else 8
    return dict(BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, GROUP_PAD=group_pad, HEAD_DIM_PAD=head_dim_pad,
                TILE=tile, USE_DOT=use_dot, num_warps=num_warps)


# ----------------------------------------------------------------------------
# Wrappers: check on the host (once), plan, launch.


def check_tile_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q) -> list[int]:
    """Raise TypeError/ValueError naming the bad value unless the step fits together; returns cu_seqlens_q as a list.

    Chapter 05's device check (which device the kernels were built for), then
    chapter 04's prefill checks (shapes, dtypes, offsets, lengths, block ids),
    then chapter 05's pool check (one set of strides for K and V)."""
    _require_tensors(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens,
                     cu_seqlens_q=cu_seqlens_q)
    _check_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens,
                  cu_seqlens_q=cu_seqlens_q)
    query_starts, _ = check_prefill_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    _check_pools(k_cache, v_cache)
    return query_starts


def paged_attention_tiles(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale=None,
                          block_q=None) -> torch.Tensor:
    """Causal paged attention for a ragged step of new tokens (decodes are q_len = 1). Returns out like q.

    Sequence i's new tokens are q[cu_seqlens_q[i]:cu_seqlens_q[i+1]], the last
    tokens of its context_lens[i]; their K/V must already be in the pool. The
    same arguments and answers as chapter 04's paged_prefill_attention.
    block_q (new tokens per tile, a power of 2) defaults to default_block_q()."""
    query_starts = check_tile_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    plan = tile_plan(query_starts, k_cache, block_q)
    return paged_attention_tiles_unchecked(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, plan,
                                           scale)


def paged_attention_tiles_unchecked(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                                    plan: TilePlan, scale=None) -> torch.Tensor:
    """paged_attention_tiles for arguments already checked, with the step's plan. Reads nothing on the host."""
    total_q, n_q_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tiles = plan.tiles.shape[0]
    if num_tiles == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else float(scale)
    group = n_q_heads // n_kv_heads
    _tile_attention_kernel[(num_tiles, n_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, plan.tiles, scale, group, head_dim,
        *q.stride(), *out.stride(), *block_tables.stride(), *k_cache.stride(),
        **_launch_config(group, plan.block_q, k_cache))
    return out


# ----------------------------------------------------------------------------
# Check against chapter 04, then (on CUDA) time beside chapter 05's prefill.


def make_ragged_inputs(q_lens, context_lens, n_q_heads, n_kv_heads, head_dim, block_size, dtype=torch.float32,
                       device="cpu", seed=0):
    """A ragged step over a pool whose blocks are handed out in shuffled order, as after a long run.

    Table entries past a sequence's last block are -1, the table has a spare
    column, and two blocks belong to nobody, so a kernel that reads past a
    context reads garbage and fails a comparison.
    Returns q, k_cache, v_cache, block_tables (int32), context_lens (int32), cu_seqlens_q (int32)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_needed) + 2
    physical = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(context_lens), max(blocks_needed, default=0) + 1), -1, dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_needed):
        block_tables[i, :count] = physical[taken:taken + count]
        taken += count
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), n_q_heads, head_dim, generator=gen).to(dtype)
    cu_seqlens_q = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, block_tables, lens, cu_seqlens_q)]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def main(argv=None) -> None:
    import argparse
    parser = argparse.ArgumentParser(description="check the tile kernel against chapter 04 and, on a GPU, time it "
                                                 "beside chapter 05's row-per-decode prefill")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--batch", type=int, default=4, help="sequences per prefill case (GPU)")
    opts = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, opts.dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64, blocks of 16 tokens.
    heads = dict(n_q_heads=9, n_kv_heads=3, head_dim=64, block_size=16)

    if INTERPRETED:
        # The interpreter runs every program in Python: one small mixed step. Two
        # decodes, a chunk that starts mid-block behind 19 cached tokens, a whole prompt.
        q_lens, context_lens = [1, 1, 21, 33], [40, 7, 40, 33]
        args = make_ragged_inputs(q_lens, context_lens, dtype=dtype, **heads)
        expected = torch_paged_prefill_attention(*args)
        diff = max_abs_diff(paged_attention_tiles(*args), expected)
        print(f"Triton interpreter (TRITON_INTERPRET=1), {opts.dtype}, SmolLM2 heads, q_lens {q_lens}, "
              f"context_lens {context_lens}: tile kernel vs chapter 04, max abs diff {diff:.2e} (tolerance {tol})")
        print("Interpreter timings are not a speed figure, so none are printed; run on a CUDA GPU to benchmark.")
        if not diff <= tol:
            raise SystemExit(f"the tile kernel differs from chapter 04 by {diff:.3g} > {tol}")
        return

    device = torch.device("cuda")
    cases = [(f"{opts.batch} x {chunk} new after {cached} cached", [chunk] * opts.batch, [cached + chunk] * opts.batch)
             for cached in (0, 2048) for chunk in (64, 256, 1024)]
    # A mixed step as continuous batching makes it: many decodes and one prompt chunk.
    cases.append(("32 decodes at 2048 + 512 new after 1024", [1] * 32 + [512], [2048] * 32 + [1536]))
    print(f"{torch.cuda.get_device_name(device)}, {opts.dtype}, SmolLM2 heads (9 q / 3 kv / 64), block 16. "
          f"rows: chapter 05's prefill (one decode per new token); tiles: this file (plan built outside the timing).")
    print(f"{'case':42} {'rows ms':>9} {'tiles ms':>9} {'rows/tiles':>10} {'max abs diff':>13}")
    for label, q_lens, context_lens in cases:
        args = make_ragged_inputs(q_lens, context_lens, dtype=dtype, device=device, **heads)
        expected = torch_paged_prefill_attention(*args)
        diff = max_abs_diff(paged_attention_tiles(*args), expected)
        if not diff <= tol:
            raise SystemExit(f"{label}: the tile kernel differs from chapter 04 by {diff:.3g} > {tol}")
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        plan = tile_plan(starts, args[1])
        rows_ms = triton.testing.do_bench(lambda: rows_prefill_unchecked(*args, starts, context_lens),
                                          warmup=25, rep=100, return_mode="median")
        tiles_ms = triton.testing.do_bench(lambda: paged_attention_tiles_unchecked(*args, plan),
                                           warmup=25, rep=100, return_mode="median")
        print(f"{label:42} {rows_ms:9.3f} {tiles_ms:9.3f} {rows_ms / tiles_ms:9.2f}x {diff:13.2e}")


if __name__ == "__main__":
    main()
