"""Chapter 04 exercise: paged attention in PyTorch.

Write the four functions below. The text is chapters/04-paged-attention/README.md;
the tests are tests/chapters/test_ch04_paged_attention.py. Run them against this file with

    MINICB_IMPL=student MINICB_IMPL_ONLY=paged_attention .venv/bin/pytest tests/chapters/test_ch04_*.py
    python -m minicb check 4            # the same, task by task

Shapes (the calling convention every attention backend shares):
    q             [num_seqs, n_q_heads, head_dim]                 decode: one query per sequence
    k/v_cache     [num_blocks, block_size, n_kv_heads, head_dim]  one layer of the pool
    block_tables  [num_seqs, max_blocks] int                      entries past a sequence's last block: anything
    context_lens  [num_seqs] int                                  tokens in the pool, the new one included
Query head h reads KV head h // (n_q_heads // n_kv_heads). Compute the softmax
in float32 whatever the input dtype and return q's dtype; scale defaults to
head_dim ** -0.5.
"""
from __future__ import annotations

import torch  # noqa: F401

# Given:
# - check_paged_args(q, k_cache, v_cache, block_tables, context_lens): call it first
#   in every attention function. It returns None, or raises TypeError (a wrong dtype)
#   or ValueError (a wrong shape, a context length outside [1, max_blocks * block_size],
#   a block id a sequence uses that is not in [0, num_blocks)) naming the bad entry and
#   its value, e.g. "block_tables[1, 0] = 6 is not a block id: ...".
# - KVPool(num_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype, device):
#   the engine's pool, one zeroed k and v cache per layer (k_caches[layer],
#   v_caches[layer]); the tests and the engine build it, your functions get one layer.
from minicb.paged_attention import KVPool, check_paged_args  # noqa: F401  # given


# Task 1. slot = block_id * block_size + offset; a slot < 0 is padding and
# writes nothing. Validate shapes and dtypes with messages that name them.
def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [num_tokens, n_kv_heads, head_dim] into the pool at slot_mapping [num_tokens]. In place."""
    raise NotImplementedError(
        "Chapter 4, task 1: store_kv() — see chapters/04-paged-attention/README.md#task-1")


# Task 2. Gather each sequence's blocks into dense [num_seqs, T, n_kv_heads, head_dim]
# keys and values, then one batched attention with a length mask. No Python
# loop over sequences, and no repeat_interleave of the KV heads.
def paged_decode_attention_gather(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Decode attention through block tables, version 1. Returns [num_seqs, n_q_heads, head_dim]."""
    raise NotImplementedError(
        "Chapter 4, task 2: paged_decode_attention_gather() — see chapters/04-paged-attention/README.md#task-2")


# Task 3. Loop over block index j (not over sequences): score block j of every
# sequence, then update a running max m, running sum l and accumulator acc,
# rescaling the old l and acc by exp(m_old - m_new). Never build the whole context.
def paged_decode_attention_online(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """Decode attention through block tables, version 2 (online softmax). Returns [num_seqs, n_q_heads, head_dim]."""
    raise NotImplementedError(
        "Chapter 4, task 3: paged_decode_attention_online() — see chapters/04-paged-attention/README.md#task-3")


# Given: the name the model calls for decode.
def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None):
    """The decode attention the model calls: your version 1."""
    return paged_decode_attention_gather(q, k_cache, v_cache, block_tables, context_lens, scale)


# Task 4. q is packed: sequence i's queries are q[cu[i]:cu[i+1]], the LAST
# q_len tokens of its context_lens[i] tokens; causal within the sequence.
# Raise ValueError for offsets that don't fit (see the README).
def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale=None):
    """Causal attention for packed queries q [total_q_tokens, n_q_heads, head_dim]; returns the same shape."""
    raise NotImplementedError(
        "Chapter 4, task 4: paged_prefill_attention() — see chapters/04-paged-attention/README.md#task-4")
