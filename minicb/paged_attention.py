"""Paged attention in plain PyTorch: the KV cache as a pool of fixed-size blocks.

You will learn:
- how a KV pool of `[num_blocks, block_size, n_kv_heads, head_dim]` tensors
  holds many sequences at once, and how `store_kv` writes new keys and values
  into it through a slot mapping;
- how attention finds a sequence's keys again by walking its block table;
- two ways to compute decode attention over paged K/V: gather the blocks into a
  dense tensor (version 1), or visit them one block at a time with an online
  softmax that never holds the whole context (version 2, the shape of every
  fused kernel, including chapter 05's Triton one);
- attention for a ragged batch of prompts packed into one tensor (`cu_seqlens_q`);
- why the engine checks its arguments once per step and runs unchecked twins
  of these functions inside the forward, which never read a tensor on the host.

Run `python -m minicb.paged_attention` for a check and benchmark against dense
attention. Chapter 04 (chapters/04-paged-attention/README.md) explains it all.

Shapes used throughout:
    q             [num_seqs, n_q_heads, head_dim]               one query token per sequence (decode)
    k/v_cache     [num_blocks, block_size, n_kv_heads, head_dim]  one layer of the pool
    block_tables  [num_seqs, max_blocks] int   logical block j of sequence i -> physical block id
    context_lens  [num_seqs] int               tokens of sequence i stored in the pool, new one included
"""
from __future__ import annotations

import torch

# ----------------------------------------------------------------------------
# Argument checks, shared with chapter 05's Triton kernels.
#
# A wrong block id here does not crash: it silently reads another request's
# keys. So every public function checks its arguments and says exactly what
# was wrong. The checks read context_lens and block_tables on the host, which
# on CUDA waits for the GPU to finish everything queued before it (a sync).
# That is fine for one call, but the model calls attention in every layer, and
# a forward that syncs cannot be captured as a CUDA graph (a later chapter).
# So the engine checks once per step instead, on the Python lists it builds
# the batch from (`AttentionMetadata` in minicb/paged_model.py), and inside the
# forward it calls the `*_unchecked` twin of each function below, which takes
# every size it needs as a Python int and reads no tensor's value on the host.


def _is_int(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def _require_tensors(**named) -> None:
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_paged_args(q, k_cache, v_cache, block_tables, context_lens) -> None:
    """Raise TypeError/ValueError naming the bad value if the decode arguments don't fit together."""
    _require_tensors(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, n_q_heads, head_dim] (3 dims), got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, n_kv_heads, head_dim] (4 dims), "
                             f"got shape {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype, got q {q.dtype}, "
                        f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"q, k_cache and v_cache must be floating point, got {q.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got q on {q.device}, k_cache on "
                         f"{k_cache.device}, v_cache on {v_cache.device}, block_tables on "
                         f"{block_tables.device}, context_lens on {context_lens.device}")

    num_seqs, n_q_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"head_dim mismatch: q has head_dim {head_dim} but the cache has {cache_head_dim}")
    if n_kv_heads < 1 or n_q_heads % n_kv_heads != 0:
        raise ValueError(f"n_q_heads ({n_q_heads}) must be a multiple of n_kv_heads ({n_kv_heads}) "
                         f"so each KV head serves a whole group of query heads")

    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks] (2 dims), got shape "
                         f"{tuple(block_tables.shape)}")
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be [num_seqs] (1 dim), got shape {tuple(context_lens.shape)}")
    if not _is_int(block_tables):
        raise TypeError(f"block_tables must have an integer dtype (int32 or int64), got {block_tables.dtype}")
    if not _is_int(context_lens):
        raise TypeError(f"context_lens must have an integer dtype (int32 or int64), got {context_lens.dtype}")
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(f"q has {num_seqs} sequences but block_tables has {block_tables.shape[0]} rows "
                         f"and context_lens has {context_lens.shape[0]} entries; all three must agree")
    if num_seqs == 0:
        return

    # Values. The common case (all valid) costs a few small reductions; the
    # slower search for the first bad entry runs only to write the message.
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    shortest, longest = (int(x) for x in context_lens.aminmax())
    if shortest < 1 or longest > capacity:
        lens = context_lens.tolist()
        i = next(i for i, n in enumerate(lens) if n < 1 or n > capacity)
        raise ValueError(f"context_lens[{i}] = {lens[i]} is out of range: each sequence needs at least "
                         f"1 token and at most max_blocks * block_size = {max_blocks} * {block_size} = "
                         f"{capacity}")
    # Only the blocks a sequence actually uses must be valid; the rest of its
    # row is padding and may hold anything (-1 is customary).
    block_starts = torch.arange(0, capacity, block_size, device=context_lens.device)  # [max_blocks]
    in_use = block_starts[None, :] < context_lens[:, None]  # [num_seqs, max_blocks]
    lowest, highest = (int(x) for x in torch.where(in_use, block_tables, 0).aminmax())
    if lowest < 0 or highest >= num_blocks:
        bad = (in_use & ((block_tables < 0) | (block_tables >= num_blocks))).nonzero()
        i, j = (int(x) for x in bad[0])
        raise ValueError(f"block_tables[{i}, {j}] = {int(block_tables[i, j])} is not a block id: sequence "
                         f"{i} has context length {int(context_lens[i])}, so it uses its first "
                         f"{-(-int(context_lens[i]) // block_size)} blocks, and each must be in "
                         f"[0, num_blocks) = [0, {num_blocks})")


# ----------------------------------------------------------------------------
# Writing: store_kv puts this step's new keys and values into their slots.
#
# The block allocator (chapter 03) already decided where every token lives and
# flattened it into one number per token, slot = block_id * block_size + offset.
# Writing is then a scatter: token t goes to k_cache[slot // block_size, slot % block_size].
# The tokens of one step can belong to many sequences and land in scattered
# blocks; the scatter neither knows nor cares.


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [num_tokens, n_kv_heads, head_dim] into the pool at slot_mapping [num_tokens].

    Slots < 0 are padding and are skipped. Writes in place.
    """
    _require_tensors(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, n_kv_heads, head_dim], got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, n_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k has (n_kv_heads, head_dim) = {tuple(k.shape[1:])} but the cache holds "
                         f"{tuple(k_cache.shape[2:])}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"k, v and the caches must share one dtype, got k {k.dtype}, v {v.dtype}, "
                        f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens] = [{k.shape[0]}], got shape "
                         f"{tuple(slot_mapping.shape)}")
    if not _is_int(slot_mapping):
        raise TypeError(f"slot_mapping must have an integer dtype, got {slot_mapping.dtype}")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")

    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0  # [num_tokens] False for padding
    slots = slot_mapping[keep].long()  # int64: block_id * block_size can pass 2**31 in a large pool
    if slots.numel() == 0:
        return
    if int(slots.max()) >= num_blocks * block_size:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())}, but the pool has only "
                         f"num_blocks * block_size = {num_blocks} * {block_size} = "
                         f"{num_blocks * block_size} slots")
    store_kv_unchecked(k[keep], v[keep], k_cache, v_cache, slots)


def store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping) -> None:
    """store_kv for slots already known to lie in the pool, none of them padding. Reads nothing on the host."""
    slots = slot_mapping.long()
    block_size = k_cache.shape[1]
    # Index block and offset separately rather than flattening the cache with
    # .view(-1, ...): that also works on a cache that is a strided view.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


# ----------------------------------------------------------------------------
# Reading, version 1: gather the blocks into a dense tensor, then attend.
#
# Each sequence's block table lists its physical blocks in logical order, so
# selecting pool rows with the whole table lays every sequence's keys out
# contiguously again:
#
#   k_cache.index_select(0, table.flatten())  [num_seqs * num_used_blocks, block_size, n_kv_heads, head_dim]
#   .view                                     [num_seqs, num_used_blocks * block_size, n_kv_heads, head_dim]
#
# After that it is ordinary batched attention with a length mask. Shorter
# sequences are padded to the longest one and the mask hides the padding; with
# one query token per sequence that waste is cheap, and one batched call over
# all sequences beats a Python loop over them by far on a CPU.
#
# GQA without copies: query head h reads KV head h // group, where
# group = n_q_heads // n_kv_heads. Viewing q [S, n_q_heads, D] as
# [S, n_kv_heads, group, D] makes each KV head's group of query heads look like
# `group` query *positions* of a single head. In decode none of them is masked
# differently, so one attention call over [S, n_kv_heads, T, D] keys serves the
# whole group, and the KV heads are never repeated in memory.


def _gather(cache, table):
    """cache [num_blocks, B, Hkv, D], table [S, nb] int64 -> [S, nb * B, Hkv, D], each row in logical order."""
    num_seqs, num_used_blocks = table.shape
    # index_select on dim 0 is much faster on a CPU than cache[table] (general advanced indexing).
    rows = cache.index_select(0, table.reshape(-1))
    return rows.view(num_seqs, num_used_blocks * cache.shape[1], *cache.shape[2:])


def _attend(queries, keys, values, mask, scale):
    """Masked attention in fp32. queries [N, Hkv, M, D], keys/values [N, Hkv, T, D], mask [N, 1, M or 1, T] bool."""
    return torch.nn.functional.scaled_dot_product_attention(
        queries.float(), keys.float(), values.float(), attn_mask=mask, scale=scale)  # [N, Hkv, M, D]


def decode_plan(block_tables, context_lens, max_context_len: int, block_size: int):
    """What the gather reads, worked out once: (table [S, nb] int64, mask [S, 1, 1, nb * B] bool).

    nb is the number of blocks the longest sequence uses, from max_context_len,
    a Python int: taking it from context_lens.max() would read a tensor on the
    host. Entries past a sequence's last block may hold anything (often -1);
    pointing them at block 0 keeps the gather in bounds, and the mask hides
    what it reads. Every layer of a step reads the same blocks, so the engine
    builds this once per step and hands it to all of them.
    """
    num_used_blocks = -(-max_context_len // block_size)  # the longest sequence's, not the table width
    positions = torch.arange(num_used_blocks * block_size, device=context_lens.device)  # [T]
    visible = positions[None, :] < context_lens[:, None]  # [S, T] key t exists for sequence s
    in_use = visible[:, ::block_size]  # [S, nb] a block is in use when its first slot is
    table = torch.where(in_use, block_tables[:, :num_used_blocks].long(), 0)
    return table, visible[:, None, None, :]


def attend_gathered(q, k_cache, v_cache, table, mask, scale=None):
    """Version 1 once its plan is known: gather, then one masked attention. Returns [num_seqs, n_q_heads, head_dim]."""
    num_seqs, n_q_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    keys = _gather(k_cache, table).transpose(1, 2)  # [S, T, Hkv, D] -> [S, Hkv, T, D]
    values = _gather(v_cache, table).transpose(1, 2)  # [S, Hkv, T, D]
    queries = q.reshape(num_seqs, n_kv_heads, n_q_heads // n_kv_heads, head_dim)  # [S, Hkv, G, D]
    out = _attend(queries, keys, values, mask, scale)  # [S, Hkv, G, D]
    return out.reshape(num_seqs, n_q_heads, head_dim).to(q.dtype)


def paged_decode_attention_gather(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Decode attention by gathering each sequence's blocks to dense K/V. Returns [num_seqs, n_q_heads, head_dim]."""
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    # The checks have read context_lens on the host already; one more read is free.
    table, mask = decode_plan(block_tables, context_lens, int(context_lens.max()), k_cache.shape[1])
    return attend_gathered(q, k_cache, v_cache, table, mask, scale)


# ----------------------------------------------------------------------------
# Reading, version 2: one block at a time, with an online softmax.
#
# Version 1 materialises dense copies of K and V. A fused kernel can't afford
# that: it streams the blocks through fast on-chip memory and keeps only a
# running summary per query head. softmax(s) @ V needs the max and the sum over
# *all* scores, but both can be carried along and corrected:
#
#   m   running max of the scores seen so far         [S, Hkv, G]
#   l   running sum of exp(score - m)                 [S, Hkv, G]
#   acc running sum of exp(score - m) * v             [S, Hkv, G, D]
#
# When a new block raises the max from m to m', every earlier term was
# computed relative to m, so multiplying l and acc by exp(m - m') rebases them
# onto m'. After the last block, out = acc / l. The loop runs over blocks, not
# over sequences: step j handles block j of every sequence at once.


def paged_decode_attention_online(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Decode attention block by block with a running max and sum. Returns [num_seqs, n_q_heads, head_dim]."""
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    table, _ = decode_plan(block_tables, context_lens, int(context_lens.max()), block_size)
    # Scaling q once is cheaper than scaling every score.
    queries = q.float().reshape(num_seqs, n_kv_heads, group, head_dim) * scale  # [S, Hkv, G, D]

    running_max = torch.full((num_seqs, n_kv_heads, group), float("-inf"), device=q.device)
    running_sum = torch.zeros(num_seqs, n_kv_heads, group, device=q.device)
    acc = torch.zeros(num_seqs, n_kv_heads, group, head_dim, device=q.device)
    offsets = torch.arange(block_size, device=q.device)  # [B]
    for j, block_start in enumerate(range(0, table.shape[1] * block_size, block_size)):
        keys = k_cache.index_select(0, table[:, j]).float()  # [S, B, Hkv, D]
        values = v_cache.index_select(0, table[:, j]).float()  # [S, B, Hkv, D]
        valid = (block_start + offsets)[None, :] < context_lens[:, None]  # [S, B]

        scores = torch.einsum("shgd,sbhd->shgb", queries, keys)  # [S, Hkv, G, B]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        # Block 0 always holds position 0, so after it the max is finite; a
        # finished sequence's all -inf block then leaves it as it was
        # (rescale = 1, probs = 0), and exp(-inf - finite) = 0 wipes the empty start.
        new_max = torch.maximum(running_max, scores.amax(dim=-1))  # [S, Hkv, G]
        rescale = torch.exp(running_max - new_max)  # [S, Hkv, G]
        probs = torch.exp(scores - new_max[..., None])  # [S, Hkv, G, B]
        running_sum = running_sum * rescale + probs.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.einsum("shgb,sbhd->shgd", probs, values)
        running_max = new_max
    out = acc / running_sum[..., None]  # [S, Hkv, G, D]
    return out.view(num_seqs, n_q_heads, head_dim).to(q.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """The decode attention the model calls: version 1, the faster of the two in PyTorch."""
    return paged_decode_attention_gather(q, k_cache, v_cache, block_tables, context_lens, scale)


# The engine's decode, unchecked: the arguments were checked once for the whole
# step, and plan = decode_plan(...) was built once and is shared by every layer.
# Chapter 05's Triton backend has the same pair, with a plan of its own.
def paged_decode_attention_unchecked(q, k_cache, v_cache, plan, scale=None):
    """Version 1 from a prepared plan (table, mask). Reads nothing on the host. Returns like q."""
    return attend_gathered(q, k_cache, v_cache, *plan, scale)


# ----------------------------------------------------------------------------
# Prefill over a ragged batch.
#
# Prompts of different lengths are packed end to end into one q tensor, and
# cu_seqlens_q marks where each one starts:
#
#   q rows:        [ a a a a a | b b | c c c c c c c | d ]
#   cu_seqlens_q:  [0,         5,    7,              14, 15]
#
# Sequence i's queries are the last q_len = cu[i+1] - cu[i] tokens of its
# context: q_len == context_len is a fresh prompt, q_len < context_len a prompt
# continuing after tokens already cached, q_len == 1 a decode. The query at
# position p sees keys 0..p (causal), all read from the pool, so store_kv must
# have written this step's keys first.
#
# Here a loop over sequences is the right tool. Padding the batch would cost
# max_q_len * max_context scores for every sequence, so one long prompt beside
# many short ones would multiply the work; each loop iteration is instead one
# large attention call, next to which the Python overhead is small. Rows with
# q_len == 1 (decodes mixed into the batch) do go together, through the batched
# decode path, so a mixed batch pays one call for all of them.
#
# The GQA fold works here too: the [q_len, Hkv, G, D] queries of one sequence
# become [Hkv, G * q_len, D], one head per KV head with G * q_len query rows,
# and the causal mask is repeated G times down the rows to match.


def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale=None):
    """Causal attention for packed queries q [total_q_tokens, n_q_heads, head_dim]; returns the same shape."""
    starts, lens = check_prefill_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    if len(starts) == 1:
        return q.clone()  # no sequences, no tokens
    return paged_prefill_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                                             starts, lens, scale)


def check_prefill_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q):
    """Raise TypeError/ValueError naming the bad value unless the ragged batch fits together.

    Returns cu_seqlens_q and context_lens as Python lists (read on the host once,
    here), for the callers that loop over them. minicb/tile_attention.py checks with it too.
    """
    _require_tensors(q=q, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q)
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q_tokens, n_q_heads, head_dim] (3 dims), got shape {tuple(q.shape)}")
    if cu_seqlens_q.dim() != 1 or not _is_int(cu_seqlens_q):
        raise TypeError(f"cu_seqlens_q must be a 1-D integer tensor [num_seqs + 1], got shape "
                        f"{tuple(cu_seqlens_q.shape)} and dtype {cu_seqlens_q.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks] (2 dims), got shape "
                         f"{tuple(block_tables.shape)}")
    if cu_seqlens_q.shape[0] != block_tables.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 entries; got {cu_seqlens_q.shape[0]} "
                         f"for {block_tables.shape[0]} sequences (block_tables rows)")
    starts = cu_seqlens_q.tolist()
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    if starts[0] != 0 or starts[-1] != q.shape[0] or min(q_lens, default=1) < 1:
        raise ValueError(f"cu_seqlens_q must start at 0, grow by at least 1 per sequence and end at "
                         f"total_q_tokens = {q.shape[0]}; got {starts}")
    # Each sequence's last query row is an ordinary decode query, so the decode
    # checks cover the pool, the tables and the lengths.
    last_rows = torch.tensor(starts[1:], dtype=torch.long, device=q.device) - 1  # [num_seqs]; long, even when empty
    check_paged_args(q[last_rows], k_cache, v_cache, block_tables, context_lens)
    lens = context_lens.tolist()
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        if q_len > n:
            raise ValueError(f"sequence {i} has {q_len} query tokens but context length {n}; its queries "
                             f"are the last tokens of its context, so q_len must be <= context_len")
    return starts, lens


def paged_prefill_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                                      query_starts: list[int], lens: list[int], scale=None):
    """paged_prefill_attention for arguments already checked, with cu_seqlens_q and context_lens
    also given as Python lists (query_starts, lens): the loop below runs on them, so it reads
    no tensor on the host. cu_seqlens_q itself is unused here (the Triton prefill reads it)."""
    q_lens = [end - start for start, end in zip(query_starts[:-1], query_starts[1:])]
    n_q_heads, head_dim = q.shape[1:]
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(q)

    decodes = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decodes:
        rows = torch.tensor([query_starts[i] for i in decodes], device=q.device)  # their q rows
        plan = decode_plan(block_tables[decodes], context_lens[decodes], max(lens[i] for i in decodes), block_size)
        out[rows] = attend_gathered(q[rows], k_cache, v_cache, *plan, scale)
    for i, (q_len, n) in enumerate(zip(q_lens, lens)):
        if q_len == 1:
            continue
        start = query_starts[i]
        table = block_tables[i:i + 1, :-(-n // block_size)].long()  # [1, blocks of sequence i]
        # The sequence's n keys: cut off the slots past n in its last block, so that SDPA sums over the
        # same keys in the same order as a dense forward of the whole text (HF's), and the result is
        # the same to the bit; a longer, masked key range rounds differently (1e-7 an output).
        keys = _gather(k_cache, table)[:, :n].transpose(1, 2)  # [1, Hkv, n, D]
        values = _gather(v_cache, table)[:, :n].transpose(1, 2)  # [1, Hkv, n, D]
        queries = q[start:start + q_len].reshape(q_len, n_kv_heads, group, head_dim)
        queries = queries.permute(1, 2, 0, 3).reshape(1, n_kv_heads, group * q_len, head_dim)  # [1, Hkv, G*q_len, D]

        # Query r sits at position n - q_len + r; key t is visible when t <= that.
        q_positions = torch.arange(n - q_len, n, device=q.device)  # [q_len]
        causal = torch.arange(n, device=q.device)[None, :] <= q_positions[:, None]  # [q_len, n]
        mask = causal.repeat(group, 1)[None, None]  # [1, 1, G*q_len, n], rows ordered (g, r) like the queries

        attended = _attend(queries, keys, values, mask, scale)  # [1, Hkv, G*q_len, D]
        attended = attended.view(n_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)  # [q_len, Hkv, G, D]
        out[start:start + q_len] = attended.reshape(q_len, n_q_heads, head_dim).to(q.dtype)
    return out


# ----------------------------------------------------------------------------
# The pool: one K and one V cache per layer, all sharing one block numbering.
#
# A block id names the same slot range in every layer, so the allocator hands
# out ids once per sequence and every layer uses the same block table.


class KVPool:
    """Per-layer K/V caches, each [num_blocks, block_size, n_kv_heads, head_dim].

    With `hidden_size`, the pool also keeps every computed token's final hidden
    state (the last layer's output, before the final norm) beside its K/V:
    `hidden` [num_blocks * block_size, hidden_size], row = slot. A block then
    holds all a later request needs to score the tokens in it: logits are one
    lm_head away (prompt logprobs, minicb/logprobs.py), even when the block came
    from the prefix cache and was computed for somebody else. It costs
    hidden_size / (2 * num_layers * n_kv_heads * head_dim) of the K/V's memory
    (576 / 11,520 = 5% for SmolLM2) and one row copy per computed token.
    """

    def __init__(self, num_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype, device,
                 hidden_size: int | None = None):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim, self.dtype = n_kv_heads, head_dim, dtype
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        # Zeros, not torch.empty: attention masks unused slots to probability 0,
        # but 0 * NaN is NaN, so whatever a masked slot holds must be finite.
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.hidden = None if hidden_size is None else torch.zeros(num_blocks * block_size, hidden_size, dtype=dtype,
                                                                   device=device)  # [slots, hidden]
        self.bytes_per_block = self.block_bytes(num_layers, block_size, n_kv_heads, head_dim, dtype)
        self.total_bytes = self.bytes_per_block * num_blocks

    @staticmethod
    def block_bytes(num_layers, block_size, n_kv_heads, head_dim, dtype) -> int:
        """Bytes one block id holds: K and V, in every layer."""
        element_size = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * block_size * n_kv_heads * head_dim * element_size

    @staticmethod
    def num_blocks_for_memory(budget_bytes, num_layers, block_size, n_kv_heads, head_dim, dtype) -> int:
        """How many blocks fit in budget_bytes (at least one, or ValueError)."""
        per_block = KVPool.block_bytes(num_layers, block_size, n_kv_heads, head_dim, dtype)
        if budget_bytes < per_block:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no KV block; one block of {block_size} "
                             f"tokens x {num_layers} layers x K and V needs {per_block} bytes")
        return int(budget_bytes // per_block)

    @staticmethod
    def memory_budget(device, gpu_fraction=0.5, cpu_gib=1.0) -> int:
        """Bytes to give the KV pool: a fraction of free GPU memory, or a fixed figure on CPU."""
        device = torch.device(device)
        if device.type == "cuda":
            if not 0.0 < gpu_fraction <= 1.0:
                raise ValueError(f"gpu_fraction must be in (0, 1], got {gpu_fraction}")
            free_bytes, _ = torch.cuda.mem_get_info(device)
            return int(free_bytes * gpu_fraction)
        if cpu_gib <= 0:
            raise ValueError(f"cpu_gib must be positive, got {cpu_gib}")
        return int(cpu_gib * 2**30)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block src onto block dst in every layer (copy-on-write of a shared block)."""
        for name, block in (("src", src), ("dst", dst)):
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"{name} block id {block} is out of range [0, {self.num_blocks})")
        for k_cache, v_cache in zip(self.k_caches, self.v_caches):
            k_cache[dst].copy_(k_cache[src])
            v_cache[dst].copy_(v_cache[src])
        if self.hidden is not None:
            b = self.block_size
            self.hidden[dst * b:(dst + 1) * b].copy_(self.hidden[src * b:(src + 1) * b])

    def store_hidden(self, slot_mapping: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep each new token's final hidden state at its slot. slot_mapping [N] int64, hidden [N, hidden_size].
        A pool made without hidden_size keeps nothing."""
        if self.hidden is not None:
            self.hidden.index_copy_(0, slot_mapping, hidden.to(self.hidden.dtype))


# ----------------------------------------------------------------------------
# Check and benchmark: python -m minicb.paged_attention
#
# Each version is first compared with dense attention on the same keys laid
# out contiguously per sequence, then timed beside it. Dense gets its
# [S, Hkv, T, D] K/V for free (and the same GQA fold), so the ratio is the
# price of paging: the gather version first copies
# 2 * num_seqs * T * n_kv_heads * head_dim elements out of the pool, and the
# online version copies as much, block by block, in many more small steps.
# The three are timed in turns, and each keeps its best time, so a busy
# machine slows them alike.
#
# The last column counts the gather version's minor page faults per call.
# Its dense copies are new tensors of several MB each call. glibc may hand
# such a buffer back to the OS when it is freed, and then every 4 KB page of
# the next one is faulted in again on first write, which can cost more than
# the copy itself. Inside the engine the heap stays warm (20 decode steps of
# SmolLM2 on 32 chat prompts took 0 page faults), so a large count here means
# the ratio is part allocator, part paging. Run with
#   MALLOC_TRIM_THRESHOLD_=10000000000 MALLOC_MMAP_THRESHOLD_=1000000000
# to see the copy alone.

if __name__ == "__main__":
    import time

    import torch.nn.functional as F

    def make_problem(context_lens, n_q_heads, n_kv_heads, head_dim, block_size, seed=0):
        """A pool whose blocks are handed out in a random order; -1 pads the table."""
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in context_lens]
        num_blocks = sum(blocks_per_seq) + 1
        k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
        v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
        order = torch.randperm(num_blocks, generator=gen)
        block_tables = torch.full((len(context_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
        taken = 0
        for i, count in enumerate(blocks_per_seq):
            block_tables[i, :count] = order[taken:taken + count]
            taken += count
        q = torch.randn(len(context_lens), n_q_heads, head_dim, generator=gen)
        return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)

    def dense_attention(q, keys, values, mask):
        # q [S, Hq, D]; keys/values [S, Hkv, T, D] contiguous; mask [S, 1, 1, T] -> [S, Hq, D]
        num_seqs, n_kv_heads, _, head_dim = keys.shape
        grouped = q.view(num_seqs, n_kv_heads, -1, head_dim)
        return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask).reshape(q.shape)

    def best_times_ms(functions, repeats=7):
        """Run the functions in turns; the best time of each, in ms."""
        best = [float("inf")] * len(functions)
        for _ in range(repeats + 1):  # the first round warms up
            for i, fn in enumerate(functions):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
        return [1e3 * t for t in best]

    def page_faults_per_call(fn, calls=5) -> float:
        """Minor page faults per call: fresh memory pages the kernel had to map in."""
        try:
            import resource  # Unix only
        except ImportError:
            return float("nan")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            fn()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls

    torch.manual_seed(0)
    cases = [  # (label, context_lens, n_q_heads, n_kv_heads, head_dim, block_size)
        ("SmolLM2 layer, 32 seqs x 256", [256] * 32, 9, 3, 64, 16),
        ("SmolLM2 layer, 32 seqs ragged 1..512", torch.randint(1, 513, (32,)).tolist(), 9, 3, 64, 16),
        ("SmolLM2 layer, 4 seqs x 2048", [2048] * 4, 9, 3, 64, 16),
        ("MHA 16 heads x 128, 8 seqs x 1024", [1024] * 8, 16, 16, 128, 32),
    ]
    print(f"{'case':38} {'dense':>9} {'gather':>8} {'online':>8} {'gather faults':>14}   "
          f"(gather and online as multiples of dense; page faults per gather call)")
    for label, lens, n_q_heads, n_kv_heads, head_dim, block_size in cases:
        args = make_problem(lens, n_q_heads, n_kv_heads, head_dim, block_size)
        q, k_cache, v_cache, block_tables, context_lens = args
        # The dense layout, built once outside the timing: [S, Hkv, T, D] per cache.
        num_seqs, max_len = len(lens), max(lens)
        table = torch.where(block_tables >= 0, block_tables, 0).long()
        keys, values = (cache[table].view(num_seqs, -1, n_kv_heads, head_dim)[:, :max_len].transpose(1, 2)
                        .contiguous() for cache in (k_cache, v_cache))
        mask = (torch.arange(max_len)[None, :] < context_lens[:, None])[:, None, None, :]
        expected = dense_attention(q, keys, values, mask)
        for version in (paged_decode_attention_gather, paged_decode_attention_online):
            diff = (version(*args) - expected).abs().max().item()
            assert diff < 1e-4, f"{version.__name__} differs from dense by {diff:.2e} on {label}"
        dense_ms, gather_ms, online_ms = best_times_ms([
            lambda: dense_attention(q, keys, values, mask),
            lambda: paged_decode_attention_gather(*args),
            lambda: paged_decode_attention_online(*args),
        ])
        faults = page_faults_per_call(lambda: paged_decode_attention_gather(*args))
        print(f"{label:38} {dense_ms:6.2f} ms {gather_ms / dense_ms:7.2f}x {online_ms / dense_ms:7.2f}x "
              f"{faults:14.0f}")
