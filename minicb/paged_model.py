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
the ragged prefill over the rest. The kernels are an attention backend
(minicb/attention_backends.py): chapter 04's (attention="torch"), chapter 05's
(attention="triton"), with the query-tile prefill of minicb/tile_attention.py
when compiled, or a student's file. All answer one interface, so nothing here
asks which it holds.

The batch is checked once per step, on the host lists, when the metadata is
built and when `PagedAttention` is made; inside the forward the kernels run
unchecked and nothing reads a tensor's value on the host, which on a GPU would
stall every layer (tests/engine/test_host_syncs.py counts such reads).

`generate_paged` is the smallest loop that uses it: one sequence at a time, to
check that paging changes nothing (its greedy tokens equal chapter 01's).
Chapter 06's engine builds the same metadata for many sequences at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minicb.attention_backends import AttentionBackend
from minicb.block_allocator import BlockAllocator
from minicb.model import Model
from minicb.naive import Generation, check_prompt
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample

@dataclass
class AttentionMetadata:
    """Everything attention needs to know about a ragged batch. Built fresh each step, and checked then.

    The tensors are what the kernels read, on the model's device. The lists beside
    them hold the same numbers on the host, for whatever the forward needs as a
    Python int (where the prefills start in q, the longest decode, each prompt's
    length). Reading those back from the tensors would make the host wait for the
    GPU in every layer, and a forward that waits cannot be captured as a CUDA graph.
    """

    slot_mapping: torch.Tensor  # [N] int64: KV slot of each new token (block * block_size + offset)
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical blocks of each sequence (-1 padded)
    context_lens: torch.Tensor  # [S] int32: tokens each sequence attends over, new ones included
    cu_seqlens_q: torch.Tensor  # [S + 1] int32: sequence i's new tokens are q[cu[i]:cu[i+1]]
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    host_block_tables: list[list[int]]  # block_tables on the host, unpadded
    host_context_lens: list[int]  # context_lens on the host
    host_cu_seqlens_q: list[int]  # cu_seqlens_q on the host
    max_slot: int  # the largest slot in slot_mapping (-1 if no tokens)

    @staticmethod
    def build(block_tables: list[list[int]], context_lens: list[int], num_new_tokens: list[int],
              slot_mapping: list[int], num_decodes: int, device) -> "AttentionMetadata":
        """From plain Python lists (what the allocator hands out) to tensors on `device`.

        Raises ValueError naming the bad value if the lists don't describe a batch.
        These checks, and check_fits() against the pool, run once per step on the
        host, so the kernels inside the forward can run unchecked.
        """
        num_seqs = len(block_tables)
        if num_seqs == 0 or len(context_lens) != num_seqs or len(num_new_tokens) != num_seqs:
            raise ValueError(f"block_tables, context_lens and num_new_tokens need one entry per sequence (at least "
                             f"one); got {num_seqs}, {len(context_lens)} and {len(num_new_tokens)}")
        if not 0 <= num_decodes <= num_seqs:
            raise ValueError(f"num_decodes = {num_decodes} must be in [0, {num_seqs}] (the number of sequences)")
        for i, (q_len, n) in enumerate(zip(num_new_tokens, context_lens)):
            if not 1 <= q_len <= n:
                raise ValueError(f"sequence {i} has {q_len} new tokens and context length {n}; each sequence needs "
                                 f"1 <= new tokens <= context length (its new tokens are the last of its context)")
            if i < num_decodes and q_len != 1:
                raise ValueError(f"sequence {i} is one of the first num_decodes = {num_decodes} (decodes) but has "
                                 f"{q_len} new tokens; a decode has exactly 1")
        if len(slot_mapping) != sum(num_new_tokens):
            raise ValueError(f"slot_mapping has {len(slot_mapping)} slots for {sum(num_new_tokens)} new tokens; "
                             f"every new token needs one")
        if min(slot_mapping) < 0:
            i = next(i for i, slot in enumerate(slot_mapping) if slot < 0)
            raise ValueError(f"slot_mapping[{i}] = {slot_mapping[i]}: every new token of a step needs a slot >= 0")

        # Pad the rows with -1 in Python and make one tensor: one small tensor per
        # row would cost a few milliseconds a step at 32 sequences.
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([list(t) + [-1] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        cu = [0]
        for q_len in num_new_tokens:
            cu.append(cu[-1] + q_len)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(device),
            block_tables=tables.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device),
            num_decodes=num_decodes,
            host_block_tables=[list(t) for t in block_tables],
            host_context_lens=list(context_lens),
            host_cu_seqlens_q=cu,
            max_slot=max(slot_mapping),
        )

    def check_fits(self, num_blocks: int, block_size: int) -> None:
        """Raise ValueError naming the bad value unless every block id and slot lies in the pool.

        Chapter 04's check_paged_args asks the same of the tensors, which costs a
        host read per call; this asks it of the host lists, once per step.
        """
        if self.max_slot >= num_blocks * block_size:
            raise ValueError(f"slot_mapping holds slot {self.max_slot}, but the pool has only num_blocks * "
                             f"block_size = {num_blocks} * {block_size} = {num_blocks * block_size} slots")
        for i, (table, n) in enumerate(zip(self.host_block_tables, self.host_context_lens)):
            used = -(-n // block_size)  # blocks sequence i reads
            if used > len(table):
                raise ValueError(f"sequence {i} has context length {n}, which needs {used} blocks of {block_size}, "
                                 f"but its block table lists {len(table)}: {table}")
            for j, block in enumerate(table[:used]):
                if not 0 <= block < num_blocks:
                    raise ValueError(f"block_tables[{i}][{j}] = {block} is not a block id: each must be in "
                                     f"[0, num_blocks) = [0, {num_blocks})")

    @property
    def num_seqs(self) -> int:
        return len(self.host_context_lens)

    def last_token_index(self) -> torch.Tensor:
        """[1, S]: where each sequence's last new token sits in the packed batch (for its logits)."""
        return (self.cu_seqlens_q[1:] - 1).long()[None]


class PagedAttention:
    """The model's `attention` object for one forward over the paged pool.

    It checks the metadata against the pool once, when it is made (once per
    step), and asks the backend (minicb/attention_backends.py) for what every
    layer shares: the decode plan, the prefill's tile plan. Then each layer's
    call only launches kernels, unchecked, and reads no tensor's value on the host.
    """

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 metadata: AttentionMetadata, backend: AttentionBackend):
        self.k_caches, self.v_caches = k_caches, v_caches  # per layer [num_blocks, block_size, n_kv, hd]
        self.meta = meta = metadata
        self.backend = backend
        num_blocks, block_size = k_caches[0].shape[:2]
        meta.check_fits(num_blocks, block_size)
        d = meta.num_decodes  # decode tokens are q[:d], one per sequence
        # Prefill tokens are q[first:], with offsets relative to the first one.
        self.first_prefill_token = meta.host_cu_seqlens_q[d]
        self.prefill_starts = [start - self.first_prefill_token for start in meta.host_cu_seqlens_q[d:]]
        self.prefill_cu = meta.cu_seqlens_q[d:] - self.first_prefill_token
        # Every layer reads the same blocks, so what the kernels need to find them
        # (chapter 04: the gather table and length mask; the tile kernel: its tiles)
        # is built once, here.
        self.decode_plan = self.prefill_plan = None
        if d > 0:
            self.decode_plan = backend.plan_decode(meta.block_tables[:d], meta.context_lens[:d],
                                                   max(meta.host_context_lens[:d]), block_size)
        if meta.num_seqs > d:
            self.prefill_plan = backend.plan_prefill(self.prefill_starts, k_caches[0])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [1, N, n_heads, hd]; k, v [1, N, n_kv_heads, hd]
        meta, k_cache, v_cache, backend = self.meta, self.k_caches[layer], self.v_caches[layer], self.backend
        backend.store_kv(k[0], v[0], k_cache, v_cache, meta.slot_mapping)
        q = q[0]  # [N, n_heads, hd]
        d = meta.num_decodes
        parts = []
        if d > 0:
            parts.append(backend.decode(q[:d], k_cache, v_cache, self.decode_plan))
        if meta.num_seqs > d:
            parts.append(backend.prefill(q[self.first_prefill_token:], k_cache, v_cache, meta.block_tables[d:],
                                         meta.context_lens[d:], self.prefill_cu, self.prefill_starts,
                                         meta.host_context_lens[d:], self.prefill_plan))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out[None]  # [1, N, n_heads, hd]


def generate_paged(model: Model, prompt_ids: list[int], params: SamplingParams,
                   attention: str | AttentionBackend = "torch", block_size: int = 16) -> Generation:
    """Chapter 01's cached loop, with the contiguous cache swapped for blocks of a pool.

    attention: a backend, or EngineConfig.attention's name for the one an engine
    would build (with MINICB_IMPL=student, the student's kernels)."""
    cfg, device = model.config, model.device
    check_prompt(prompt_ids, cfg.max_position_embeddings)
    if isinstance(attention, str):
        from minicb.config import EngineConfig
        from minicb.parts import EngineParts  # here: the parts import this module
        attention = EngineParts.from_environment(EngineConfig(attention=attention)).attention(model)
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
        logits = model(ids, positions, PagedAttention(k_caches, v_caches, meta, attention),
                       logits_at=meta.last_token_index())  # [1, 1, V]
        token = sample(logits[:, -1], [params], [generator])[0]
        out.append(token)
        tokens.append(token)
        reason = finish_reason(token, len(out), params, cfg.eos_token_ids, len(tokens), cfg.max_position_embeddings)
        if reason:
            return Generation(out, reason)
        allocator.append(seq_id)  # room for the token we feed next
        new = [len(tokens) - 1]
