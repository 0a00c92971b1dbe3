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

A decode verifying k draft tokens (chapter 11) is k + 1 decode rows, one per
token, each with the context up to its own position: the newest token a7 with
drafts d8, d9 is rows (a7, context 8), (d8, 9), (d9, 10), all with a's block
table. That is chapter 08's offset causal mask, written as one context length
per row, and it is correct because every layer stores the step's K/V before
any row attends. So verification runs on the decode kernels (and in the
decode-only CUDA graphs), and every row's logits come back: [rows, vocab].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minicb.cpu_threads import FixedThreads
from minicb.model import Model
from minicb.paged_attention import KVPool
from minicb.paged_model import AttentionMetadata, PagedAttention


@dataclass
class StepBatch:
    """One step's model inputs on the host. Row i's new tokens are the i-th run of token_ids.

    A row is a sequence's new tokens, except that a decode verifying k drafts is k + 1 rows.
    """

    token_ids: list[int]  # [N] every new token, row after row
    positions: list[int]  # [N] each new token's position in its sequence
    slot_mapping: list[int]  # [N] the pool slot each new token's K/V goes to
    block_tables: list[list[int]]  # per row: its sequence's physical blocks
    context_lens: list[int]  # per row: tokens it attends over, its new ones included
    num_new_tokens: list[int]  # per row: how many new tokens
    num_decodes: int  # the first num_decodes rows compute exactly 1 token (decodes; a verifying one is 1 + k rows)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write, before the forward

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
    (then its drafts, one row each, chapter 11).
    """
    num_decode_rows = sum(1 + len(out.drafts(seq)) for seq in out.decodes)
    batch = StepBatch([], [], [], [], [], [], num_decode_rows, list(out.block_copies))
    for seq in out.sequences:
        start = seq.num_computed_tokens
        end = start + out.num_new_tokens(seq)
        tokens = (seq.token_ids + out.drafts(seq))[start:end]
        slots = allocator.slot_mapping(seq.seq_id, start, end)
        table = allocator.block_table(seq.seq_id)
        rows = [(p, p + 1) for p in range(start, end)] if out.drafts(seq) else [(start, end)]
        for row_start, row_end in rows:
            batch.token_ids += tokens[row_start - start:row_end - start]
            batch.positions += range(row_start, row_end)
            batch.slot_mapping += slots[row_start - start:row_end - start]
            batch.block_tables.append(list(table))
            batch.context_lens.append(row_end)
            batch.num_new_tokens.append(row_end - row_start)
    return batch


class ModelRunner:
    """Runs a StepBatch through the model over the paged pool, eagerly: one forward a step."""

    def __init__(self, model: Model, pool: KVPool, attention, threads=None):
        # attention: the engine's backend (minicb/attention_backends.py), the same object every step.
        # threads: how many CPU threads the forward runs on (minicb/cpu_threads.py): SharedCores follows
        # the machine's load, FixedThreads (None) leaves torch's setting alone.
        self.model, self.pool, self.attention = model, pool, attention
        self.threads = threads or FixedThreads()

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """-> logits [num_seqs, vocab]: each row's last new token's (every token of a verifying decode's)."""
        self.threads.adjust()  # between steps, on the thread that runs them: once a second at most it measures
        for src, dst in batch.block_copies:  # copy-on-write of shared blocks, before anything writes
            self.pool.copy_block(src, dst)
        return self.forward(batch)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        device = self.model.device
        meta = AttentionMetadata.build(batch.block_tables, batch.context_lens, batch.num_new_tokens,
                                       batch.slot_mapping, batch.num_decodes, device)
        attention = PagedAttention(self.pool.k_caches, self.pool.v_caches, meta, self.attention)
        input_ids = torch.tensor([batch.token_ids], device=device)  # [1, N]
        positions = torch.tensor([batch.positions], device=device)  # [1, N]
        return self.run_model(input_ids, positions, attention, meta, meta.last_token_index())[0]  # [S, V]

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: PagedAttention,
                  meta: AttentionMetadata, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward, keeping each new token's final hidden state in the pool at its KV slot
        (KVPool.store_hidden: what prompt logprobs read later). input_ids, positions [1, N] -> logits."""
        hidden = self.model.hidden_states(input_ids, positions, attention)  # [1, N, hidden]
        self.pool.store_hidden(meta.slot_mapping, hidden[0])
        return self.model.logits(hidden, logits_at)
