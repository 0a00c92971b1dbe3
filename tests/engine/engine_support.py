"""What the engine tests share: one step over the paged pool, built by hand.

A test that runs the model forward without the engine (to count its host reads,
or to hold one attention backend against another) needs the step's inputs the
way the model runner's prepare() builds them: each sequence allocated, its new
tokens' ids, positions and slots, and the step's AttentionMetadata.
"""
from __future__ import annotations

import torch

from minicb.block_allocator import BlockAllocator
from minicb.paged_attention import KVPool
from minicb.paged_model import AttentionMetadata


def paged_step(model, seqs: list[tuple[int, int]], num_decodes: int, block_size: int = 4, num_blocks: int = 32,
               kv_seed: int | None = None):
    """(input_ids [1, N], positions [1, N], AttentionMetadata, KVPool) of one step on the model's device.

    seqs: (context length, new tokens) per sequence, the num_decodes decodes first (as the
    scheduler orders them); a sequence's new tokens are the last of its context. kv_seed:
    fill the pool with random K/V from this seed, as if the cached tokens had been computed
    earlier (None leaves it as KVPool makes it).
    """
    cfg, device = model.config, model.device
    allocator = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    pool = KVPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype, device)
    if kv_seed is not None:
        gen = torch.Generator().manual_seed(kv_seed)
        for cache in pool.k_caches + pool.v_caches:
            cache.copy_(torch.randn(cache.shape, generator=gen))  # copy_ casts to the pool's dtype and device
    input_ids, positions, slots, tables = [], [], [], []
    for seq_id, (n, new) in enumerate(seqs):
        allocator.allocate(seq_id, n)
        input_ids += [(7 * seq_id + p) % cfg.vocab_size for p in range(n - new, n)]
        positions += range(n - new, n)
        slots += allocator.slot_mapping(seq_id, n - new, n)
        tables.append(allocator.block_table(seq_id))
    meta = AttentionMetadata.build(tables, [n for n, _ in seqs], [new for _, new in seqs], slots, num_decodes,
                                   device)
    return (torch.tensor([input_ids], device=device), torch.tensor([positions], device=device), meta, pool)
