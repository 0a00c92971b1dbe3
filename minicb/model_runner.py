"""The model runner: one step's inputs, built once, and the forward that runs them.

In this file you will learn the boundary between deciding and computing. The
scheduler (minicb/scheduler.py) decides, in plain Python, which tokens of which
sequences a step computes. `prepare()` turns that decision into the host lists
a forward needs -- token ids, positions, the KV slot of every new token, block
tables, context lengths -- in one pass, and nothing else builds them. A runner
turns them into tensors and runs the model once:

    out = scheduler.schedule()                 # who computes what
    batch = prepare(out, allocator)            # StepBatch: host lists, decodes first
    logits = runner(batch)                     # [num_seqs, vocab]: each sequence's last new token

`ModelRunner` runs every step eagerly. Chapter 10's `DecodeGraphs`
(minicb/cuda_graphs.py) is a runner too: it pads a decode-only batch to a
bucket and replays a CUDA graph, and hands every other batch to the eager
forward it inherits from here. The engine holds one runner and never asks which.

For a batch of three sequences -- two decodes, then a 3-token chunk of a prompt
whose first 4 tokens are computed (block_size 4):

    token_ids      [ a7  b5 | c4 c5 c6 ]        num_new_tokens [1, 1, 3]
    positions      [  7   5 |  4  5  6 ]        context_lens   [8, 6, 7]
    slot_mapping   [ 3*4+3, 9*4+1 | 5*4+0, 5*4+1, 5*4+2 ]   (block * block_size + offset)
    block_tables   [[0, 3], [2, 9], [4, 5]]     num_decodes    2
    logits_rows    [0, 1, 4]                    (each sequence's last new token)

A request verifying k draft tokens (chapter 11) computes its newest token and
the drafts, and gets logits at all k + 1 of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minicb.model import Model
from minicb.paged_attention import KVPool
from minicb.paged_model import AttentionMetadata, PagedAttention


@dataclass
class StepBatch:
    """One step's model inputs on the host. Sequence i's new tokens are the i-th run of token_ids."""

    token_ids: list[int]  # [N] every new token, sequence after sequence
    positions: list[int]  # [N] each new token's position in its sequence
    slot_mapping: list[int]  # [N] the pool slot each new token's K/V goes to
    block_tables: list[list[int]]  # per sequence: its physical blocks
    context_lens: list[int]  # per sequence: tokens it attends over, its new ones included
    num_new_tokens: list[int]  # per sequence: how many new tokens
    num_decodes: int  # the first num_decodes sequences compute exactly 1 token
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write, before the forward
    # [R] where in token_ids the logits are wanted: each sequence's last new token, and for a
    # request verifying k drafts (chapter 11) its last k + 1, so R = num_seqs + all drafts.
    logits_rows: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def is_decode_only(self) -> bool:
        return 0 < self.num_seqs == self.num_decodes


def prepare(out, allocator) -> StepBatch:
    """The StepBatch of a SchedulerOutput: its sequences in batch order (decodes first).

    Sequence `seq` computes positions [seq.num_computed_tokens, + out.num_new_tokens(seq)):
    the uncached part of a prompt, a chunk of it, or the newest token of a decode
    followed by its drafts (chapter 11).
    """
    batch = StepBatch([], [], [], [], [], [], len(out.decodes), list(out.block_copies))
    for seq in out.sequences:
        start = seq.num_computed_tokens
        end = start + out.num_new_tokens(seq)
        drafts = out.drafts(seq)
        batch.token_ids += (seq.token_ids + drafts)[start:end]
        batch.logits_rows += range(len(batch.token_ids) - 1 - len(drafts), len(batch.token_ids))
        batch.positions += range(start, end)
        batch.slot_mapping += allocator.slot_mapping(seq.request_id, start, end)
        batch.block_tables.append(allocator.block_table(seq.request_id))
        batch.context_lens.append(end)
        batch.num_new_tokens.append(end - start)
    return batch


class ModelRunner:
    """Runs a StepBatch through the model over the paged pool, eagerly: one forward a step."""

    def __init__(self, model: Model, pool: KVPool, kernels):
        self.model, self.pool, self.kernels = model, pool, kernels

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """-> logits [R, vocab]: each sequence's last new token's, and a speculating one's drafts' (batch.logits_rows)."""
        for src, dst in batch.block_copies:  # copy-on-write of shared blocks, before anything writes
            self.pool.copy_block(src, dst)
        return self.forward(batch)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """-> logits [R, vocab], one row for each of batch.logits_rows."""
        device = self.model.device
        meta = AttentionMetadata.build(batch.block_tables, batch.context_lens, batch.num_new_tokens,
                                       batch.slot_mapping, batch.num_decodes, device)
        attention = PagedAttention(self.pool.k_caches, self.pool.v_caches, meta, self.kernels)
        input_ids = torch.tensor([batch.token_ids], device=device)  # [1, N]
        positions = torch.tensor([batch.positions], device=device)  # [1, N]
        logits_at = torch.tensor([batch.logits_rows], device=device)  # [1, R]
        return self.model(input_ids, positions, attention, logits_at=logits_at)[0]  # [R, V]
