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


# ----------------------------------------------------------------------------
# Grammars for the tiny random model (chapter 12), whose 256 tokens have no text of their own.


class TinyTokenizer:
    """Text for the tiny model's tokens, so grammars can mask them: tokens 0, 1 and 2 are special
    (2 is its EOS), 3..127 are the byte of their own number, and 128..255 are two lowercase letters
    each ("aa", "ab", ..., "hp"), so a token may be longer than one step of the automaton."""

    def __init__(self):
        pairs = [bytes([a, b]) for a in b"abcdefgh" for b in b"abcdefghijklmnop"]
        self.token_bytes = [b"", b"", b""] + [bytes([i]) for i in range(3, 128)] + pairs  # 256 entries
        self._ids = {piece: i for i, piece in enumerate(self.token_bytes) if piece}

    def encode(self, text: str) -> list[int]:
        """Longest match first, left to right."""
        data, ids = text.encode("utf-8"), []
        while data:
            piece = data[:2] if data[:2] in self._ids else data[:1]
            ids.append(self._ids[piece])
            data = data[len(piece):]
        return ids


def tiny_grammars(jump_forward: bool = False, backend: str = "minicb"):
    """An engine's Grammars for random_model()'s vocabulary (EOS 2)."""
    from minicb.structured.guide import Grammars
    from minicb.structured.token_mask import TokenVocabulary

    tokenizer = TinyTokenizer()
    return Grammars(TokenVocabulary(tokenizer.token_bytes, [2], [0, 1]), tokenizer, [2], backend, jump_forward)


def tokens_with_each_setting(name: str, settings: tuple[str, str], calls: list) -> dict:
    """Six greedy prompts through an LLM on the tiny model once per value of EngineConfig field `name`.

    calls: a list a patched kernel appends to whenever it runs. Returns
    {value: (each prompt's tokens, how many kernel calls that run made)}, so a test
    can ask that one value runs its kernel, the other never does, and both give
    the same tokens.
    """
    from minicb import LLM, SamplingParams
    from minicb.model import random_model

    model = random_model(seed=9)
    prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]
    runs = {}
    for value in settings:
        before = len(calls)
        llm = LLM.from_model(model, max_num_seqs=3, block_size=4, num_blocks=40, **{name: value})
        tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)]
        runs[value] = (tokens, len(calls) - before)
    return runs
