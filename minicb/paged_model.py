"""Chapters 04-05: running the model over a paged KV pool.

In this file you will learn how the model from chapter 00 runs one forward over
a *ragged* batch -- some sequences decoding one token, others prefilling a whole
prompt -- with every sequence's keys and values scattered over KV blocks:

    input_ids   [1, N]   all new tokens of the step, packed: decodes first, then prefills
    positions   [1, N]   each token's position inside its own sequence
    metadata    AttentionMetadata: where each new token's K/V goes (slot_mapping),
                and where each sequence's past lives (block_tables, context_lens)

`PagedAttention` is the `attention(layer, q, k, v)` object the model calls in
every layer (see minicb/model.py). It stores the new K/V through the slot
mapping, then runs the decode kernel over the first `num_decodes` sequences and
the ragged prefill over the rest. The kernels come from chapter 04
(`minicb.paged_attention`, attention="torch") or chapter 05
(`minicb.triton_attention`, attention="triton"); both share one signature.

`generate_paged` is the smallest loop that uses it: one sequence at a time, to
check that paging changes nothing (its greedy tokens equal chapter 01's).
Chapter 06's engine builds the same metadata for many sequences at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minicb import impl
from minicb.block_allocator import BlockAllocator
from minicb.model import Model
from minicb.naive import Generation, check_prompt
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about a ragged batch. Built fresh each step."""

    slot_mapping: torch.Tensor  # [N] int64: KV slot of each new token (block * block_size + offset)
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical blocks of each sequence (-1 padded)
    context_lens: torch.Tensor  # [S] int32: tokens each sequence attends over, new ones included
    cu_seqlens_q: torch.Tensor  # [S + 1] int32: sequence i's new tokens are q[cu[i]:cu[i+1]]
    num_decodes: int  # the first num_decodes sequences have exactly one new token

    @staticmethod
    def build(block_tables: list[list[int]], context_lens: list[int], num_new_tokens: list[int],
              slot_mapping: list[int], num_decodes: int, device) -> "AttentionMetadata":
        """From plain Python lists (what the allocator hands out) to tensors on `device`."""
        width = max(len(t) for t in block_tables)
        tables = torch.full((len(block_tables), width), -1, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        cu = torch.zeros(len(num_new_tokens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(num_new_tokens, dtype=torch.int32).cumsum(0)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device),
            block_tables=tables.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
            cu_seqlens_q=cu.to(device),
            num_decodes=num_decodes,
        )

    def last_token_index(self) -> torch.Tensor:
        """[1, S]: where each sequence's last new token sits in the packed batch (for its logits)."""
        return (self.cu_seqlens_q[1:] - 1).long()[None]


def attention_kernels(name: str):
    """The module holding store_kv / paged_decode_attention / paged_prefill_attention for a backend."""
    if name == "torch":
        return impl.load("paged_attention")
    if name == "triton":
        return impl.load("triton_attention")
    raise ValueError(f"attention={name!r} is not a backend; choose one of {ATTENTION_BACKENDS}")


class PagedAttention:
    """The model's `attention` object for one forward over the paged pool."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 metadata: AttentionMetadata, kernels):
        self.k_caches, self.v_caches = k_caches, v_caches  # per layer [num_blocks, block_size, n_kv, hd]
        self.meta = metadata
        self.kernels = kernels
        # Ragged prefill: the backend's own, except under the Triton interpreter
        # (CPU), where running a whole prompt through Python-level kernel programs
        # takes minutes; there chapter 04's PyTorch prefill does it, and Triton keeps
        # store_kv and decode, the kernels chapter 05 is about.
        self.prefill = kernels.paged_prefill_attention
        if getattr(kernels, "INTERPRETED", False):
            self.prefill = impl.load("paged_attention").paged_prefill_attention

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [1, N, n_heads, hd]; k, v [1, N, n_kv_heads, hd]
        meta, k_cache, v_cache = self.meta, self.k_caches[layer], self.v_caches[layer]
        self.kernels.store_kv(k[0], v[0], k_cache, v_cache, meta.slot_mapping)
        q = q[0]  # [N, n_heads, hd]
        d = meta.num_decodes  # decode tokens are q[:d], one per sequence
        parts = []
        if d > 0:
            parts.append(self.kernels.paged_decode_attention(
                q[:d], k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d]))
        if meta.context_lens.shape[0] > d:
            cu = meta.cu_seqlens_q[d:] - meta.cu_seqlens_q[d]  # offsets relative to the first prefill token
            parts.append(self.prefill(q[meta.cu_seqlens_q[d]:], k_cache, v_cache,
                                      meta.block_tables[d:], meta.context_lens[d:], cu))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out[None]  # [1, N, n_heads, hd]


def generate_paged(model: Model, prompt_ids: list[int], params: SamplingParams, attention: str = "torch",
                   block_size: int = 16) -> Generation:
    """Chapter 01's cached loop, with the contiguous cache swapped for blocks of a pool."""
    cfg, device = model.config, model.device
    check_prompt(prompt_ids, cfg.max_position_embeddings)
    kernels = attention_kernels(attention)
    max_len = min(len(prompt_ids) + params.max_tokens, cfg.max_position_embeddings)
    allocator = BlockAllocator(num_blocks=-(-max_len // block_size), block_size=block_size)
    shape = (allocator.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    k_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(cfg.num_layers)]
    v_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(cfg.num_layers)]
    generator = make_generator(params, device)

    seq_id, tokens, out = 0, list(prompt_ids), []
    allocator.allocate(seq_id, len(tokens))
    new = list(range(len(tokens)))  # positions computed this step: the whole prompt first
    while True:
        meta = AttentionMetadata.build([allocator.block_table(seq_id)], [len(tokens)], [len(new)],
                                       allocator.slot_mapping(seq_id, new[0], new[-1] + 1),
                                       num_decodes=1 if len(new) == 1 else 0, device=device)
        ids = torch.tensor([tokens[new[0]:]], device=device)  # [1, len(new)]
        positions = torch.tensor([new], device=device)
        logits = model(ids, positions, PagedAttention(k_caches, v_caches, meta, kernels),
                       logits_at=meta.last_token_index())  # [1, 1, V]
        token = sample(logits[:, -1], [params], [generator])[0]
        out.append(token)
        tokens.append(token)
        reason = finish_reason(token, len(out), params, cfg.eos_token_ids, len(tokens), cfg.max_position_embeddings)
        if reason:
            return Generation(out, reason)
        allocator.append(seq_id)  # room for the token we feed next
        new = [len(tokens) - 1]
