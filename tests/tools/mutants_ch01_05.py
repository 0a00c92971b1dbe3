"""Planted bugs in chapters 01-05 of kinds tests/tools/test_mutants.py's first list does not have.

Each is a Mutant (tests/tools/mutant_support.py): a plain text edit of the reference's
source, graded as `check N --file` grades a submission; the grade must fail on a test
of what the code does (test_mutants.py runs them).
"""
from __future__ import annotations

from mutant_support import RUN_STATIC_WRAPPER, Mutant


MUTANTS: list[Mutant] = [
    # ---- chapter 01: naive generation
    Mutant(1, 1, "the no-cache loop makes a fresh generator every step, so a seeded request repeats its first draws",
           "generate_no_cache",
           [("    generator = make_generator(params, model.device)\n", ""),
            ("    while True:\n", "    while True:\n        generator = make_generator(params, model.device)\n")]),
    Mutant(1, 1, "the no-cache loop never checks the prompt, so an empty or too-long one is not refused",
           "generate_no_cache", [("    check_prompt(prompt_ids, cfg.max_position_embeddings)\n", "")]),
    Mutant(1, 2, "the cache's causal mask forgets the cached offset, so a later chunk misses the earlier keys",
           "ContiguousKVCache.__call__", [(".tril(diagonal=start)", ".tril()")]),
    Mutant(1, 2, "the overflow check refuses a forward that fills the cache exactly", "ContiguousKVCache.__call__",
           [("if end > self.max_len:", "if end >= self.max_len:")]),
    Mutant(1, 3, "the cached loop sizes the cache for the prompt alone, so the first decode overflows",
           "generate_with_cache", [("max_len = min(len(prompt_ids) + params.max_tokens,", "max_len = min(len(prompt_ids),")]),
    # ---- chapter 02: static batching
    Mutant(2, 1, "left_pad gives each token its column as position, counting the pads in front", "left_pad",
           [("positions = (mask.long().cumsum(-1) - 1).clamp(min=0)",
             "positions = torch.arange(P).expand(len(prompts), P)")]),
    Mutant(2, 1, "left_pad builds the padding mask as int64, not bool", "left_pad",
           [("mask = torch.zeros(len(prompts), P, dtype=torch.bool)", "mask = torch.zeros(len(prompts), P, dtype=torch.long)")]),
    Mutant(2, 2, "the padded cache inverts the mask: True marks the pads", "PaddedKVCache.__init__",
           [("self.padding_mask[:, :P] = padding_mask", "self.padding_mask[:, :P] = ~padding_mask")]),
    Mutant(2, 3, "every row of a batch samples from the first row's generator", "run_batch",
           [("generators = [make_generator(p, device) for p in params]", "generators = [make_generator(params[0], device)] * B")],
           RUN_STATIC_WRAPPER),
    Mutant(2, 3, "a row's context is the padded length P plus its tokens, so a short prompt stops early when it fills",
           "run_batch", [("len(prompts[row]) + len(outputs[row]), cfg.max_position_embeddings",
                          "P + len(outputs[row]), cfg.max_position_embeddings")], RUN_STATIC_WRAPPER),
    Mutant(2, 3, "the batch ends its rows only once the padded cache has no column left for the step after next",
           "run_batch", [("cache.seq_len >= max_len", "cache.seq_len > max_len")], RUN_STATIC_WRAPPER),
    # ---- chapter 03: the block allocator
    Mutant(3, 1, "blocks_needed rounds up with // + 1, so an exact multiple of the block size takes a block too many",
           "BlockAllocator.blocks_needed", [("return -(-num_tokens // self.block_size)", "return num_tokens // self.block_size + 1")]),
    Mutant(3, 1, "free of an unknown or already freed id returns quietly, so a double free goes unnoticed",
           "BlockAllocator.free", [("    table = self._lookup(seq_id)\n",
                                    "    if seq_id not in self._block_tables:\n        return\n    table = self._lookup(seq_id)\n")]),
    Mutant(3, 3, "can_append forgets that a shared last block must be copied first", "BlockAllocator.can_append",
           [(" or self._ref_counts[table[-1]] > 1", "")]),
    Mutant(3, 3, "fork gives the child the parent's table itself, not a copy, so the child's appends grow the parent",
           "BlockAllocator.fork", [("self._block_tables[child_id] = list(table)", "self._block_tables[child_id] = table")]),
    Mutant(3, 4, "slot accepts the position one past the sequence's end", "BlockAllocator.slot",
           [("not 0 <= position < num_tokens", "not 0 <= position <= num_tokens")]),
    Mutant(3, 5, "memory_waste divides by zero when there are no sequences", "memory_waste",
           [("100.0 * (reserved - used) / reserved if reserved else 0.0", "100.0 * (reserved - used) / reserved")]),
    # ---- chapter 04: paged attention in PyTorch
    Mutant(4, 1, "store_kv's pool check lets slot num_blocks * block_size through (off by one)", "store_kv",
           [("if int(slots.max()) >= num_blocks * block_size:", "if int(slots.max()) > num_blocks * block_size:")]),
    Mutant(4, 1, "store_kv drops the dtype check and lets the pool cast what it is given", "store_kv",
           [("if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):", "if False:")]),
    Mutant(4, 2, "the gather pairs query head h with KV head h % n_kv_heads", "attend_gathered",
           [("queries = q.reshape(num_seqs, n_kv_heads, n_q_heads // n_kv_heads, head_dim)",
             "queries = q.reshape(num_seqs, n_q_heads // n_kv_heads, n_kv_heads, head_dim).transpose(1, 2)"),
            ("return out.reshape(num_seqs, n_q_heads, head_dim)",
             "return out.transpose(1, 2).reshape(num_seqs, n_q_heads, head_dim)")],
           recompile=("paged_decode_attention_gather",)),
    Mutant(4, 3, "the online version applies the scale twice, to q and again to the scores",
           "paged_decode_attention_online",
           [('scores = torch.einsum("shgd,sbhd->shgb", queries, keys)',
             'scores = torch.einsum("shgd,sbhd->shgb", queries, keys) * scale')]),
    Mutant(4, 4, "the prefill repeats its causal mask row by row, not group by group, so rows meet the wrong mask",
           "paged_prefill_attention_unchecked", [("causal.repeat(group, 1)", "causal.repeat_interleave(group, dim=0)")],
           recompile=("paged_prefill_attention",)),
    Mutant(4, 4, "the prefill ignores a scale it is given", "paged_prefill_attention_unchecked",
           [("scale = head_dim ** -0.5 if scale is None else scale", "scale = head_dim ** -0.5")],
           recompile=("paged_prefill_attention",)),
    # ---- chapter 05: paged attention in Triton (host-side bugs: the kernels are shared)
    Mutant(5, 1, "store_kv writes before it checks, so a rejected call has already changed the pool", "store_kv",
           [("    check_store_args(k, v, k_cache, v_cache, slot_mapping)\n"
             "    store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping)\n",
             "    store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping)\n"
             "    check_store_args(k, v, k_cache, v_cache, slot_mapping)\n")]),
    Mutant(5, 2, "the decode wrapper passes a contiguous copy's strides for q, wrong for a strided view",
           "_launch_decode", [("*q.stride(), *out.stride()", "*q.contiguous().stride(), *out.stride()")],
           recompile=("paged_decode_attention",)),
    Mutant(5, 3, "split-K sizes its splits from the table's width in blocks, not in tokens", "_launch_split_k",
           [("capacity = block_tables.shape[1] * block_size", "capacity = block_tables.shape[1]")],
           recompile=("paged_decode_attention_split_k",)),
    Mutant(5, 3, "split-K ignores a scale it is given", "_launch_split_k",
           [("scale = head_dim ** -0.5 if scale is None else float(scale)", "scale = head_dim ** -0.5")],
           recompile=("paged_decode_attention_split_k",)),
    Mutant(5, 4, "prefill treats every prompt as fresh, forgetting the cached tokens before its rows",
           "paged_prefill_attention_unchecked",
           [("row_context = (context_lens.long()[seq_of_row] - (ends - 1 - rows)).to(context_lens.dtype)",
             "row_context = (rows - cu_seqlens_q[:-1].long()[seq_of_row] + 1).to(context_lens.dtype)")],
           recompile=("paged_prefill_attention",)),
    Mutant(5, 4, "prefill ignores a scale it is given", "paged_prefill_attention_unchecked",
           [("block_tables[seq_of_row], row_context, scale)", "block_tables[seq_of_row], row_context)")],
           recompile=("paged_prefill_attention",)),
]
