"""Chapter 05 exercise: paged attention in Triton.

Write the kernels and the wrappers that launch them. The text is
chapters/05-triton-attention/README.md; the tests are
tests/chapters/test_ch05_triton_attention.py. Run them against this file with

    MINICB_IMPL=student MINICB_IMPL_ONLY=triton_attention .venv/bin/pytest tests/chapters/test_ch05_*.py
    python -m minicb check 5            # the same, task by task

Without a GPU the kernels run under the Triton interpreter, so print() inside
a kernel works and shows numpy arrays. Shapes (the calling convention of
chapter 04):
    q             [num_seqs, n_q_heads, head_dim]
    k/v_cache     [num_blocks, block_size, n_kv_heads, head_dim]
    block_tables  [num_seqs, max_blocks] int
    context_lens  [num_seqs] int, the new token included
"""
import torch

# Given: the interpreter must be chosen before triton is imported (no GPU: interpret).
from minicb.triton_mode import choose_triton_mode

choose_triton_mode()

import triton  # noqa: E402, F401
import triton.language as tl  # noqa: E402, F401

# Given: the host-side argument checks, and the split-count heuristic. Call the
# checks first in every wrapper; each returns None or raises before any launch:
# - check_store_args(k, v, k_cache, v_cache, slot_mapping): TypeError naming a
#   wrong dtype (e.g. float16 against a float32 pool); ValueError naming a shape
#   that does not fit (as a tuple, e.g. (3, 1, 16)), a slot past the pool (the
#   slot, e.g. 32), or a device the kernels cannot read (e.g. meta).
# - check_attention_args(q, k_cache, v_cache, block_tables, context_lens): chapter
#   04's check_paged_args plus the device check: TypeError naming a wrong dtype;
#   ValueError naming a head_dim that differs, a context length past what the block
#   table holds (the length), a block id that is negative or past the pool (the id),
#   or a device the kernels cannot read (e.g. meta, or cpu when they are compiled
#   for a GPU).
# - default_num_splits(num_seqs, n_kv_heads, max_context, device) -> int: how many
#   pieces split-K cuts each sequence into when num_splits is None (2 on a CPU).
from minicb.triton_attention import check_attention_args, check_store_args, default_num_splits  # noqa: E402, F401  # given


# Task 1. Write a @triton.jit kernel with one program per new token that
# copies its [n_kv_heads, head_dim] keys and values to
# k_cache[slot // block_size, slot % block_size], and does nothing for slot < 0.
def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v [num_tokens, n_kv_heads, head_dim] into the pools at slot_mapping [num_tokens]. In place."""
    raise NotImplementedError(
        "Chapter 5, task 1: store_kv() — see chapters/05-triton-attention/README.md#task-1")


# Task 2. Write a decode kernel with grid (num_seqs, n_kv_heads): each program
# loads the query heads of its KV head's group, walks the sequence's block table
# tile by tile with an online softmax in fp32, and writes acc / l.
def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None) -> torch.Tensor:
    """Decode attention over the paged pool. Returns out like q."""
    raise NotImplementedError(
        "Chapter 5, task 2: paged_decode_attention() — see chapters/05-triton-attention/README.md#task-2")


# Task 3. Grid (num_seqs, n_kv_heads, num_splits): each split runs task 2's
# loop over its own token range and writes its (max, sum, acc) in fp32; a
# second kernel merges the splits of each (sequence, KV head).
def paged_decode_attention_split_k(q, k_cache, v_cache, block_tables, context_lens, scale=None,
                                   num_splits=None) -> torch.Tensor:
    """Flash-decoding. num_splits=None: default_num_splits(...). Returns out like q."""
    raise NotImplementedError(
        "Chapter 5, task 3: paged_decode_attention_split_k() — see chapters/05-triton-attention/README.md#task-3")


# Task 4. No new kernel: turn every new token into a decode with a shorter context.
def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                            scale=None) -> torch.Tensor:
    """Causal attention for q [total_new_tokens, n_q_heads, head_dim] packed by cu_seqlens_q [num_seqs + 1]."""
    raise NotImplementedError(
        "Chapter 5, task 4: paged_prefill_attention() — see chapters/05-triton-attention/README.md#task-4")
