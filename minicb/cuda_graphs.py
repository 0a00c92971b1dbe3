"""CUDA graphs for decode steps: launch a whole forward with one call.

In this file you will learn why a small model's decode step on a GPU is slow
for a reason that has nothing to do with arithmetic, and how CUDA graphs fix it.

A decode step of SmolLM2 at batch 32 is about 9 GFLOP (2 x 135M weights x 32
tokens) and, at a few hundred tokens of context, under a GB of weights and K/V
to read: for a large GPU, well under a millisecond of work. But the forward is
written as small PyTorch operations: by a rough count, over thirty kernels per
layer (the norms, projections, rotary embedding, store, attention, MLP and
residuals), some thousand launches for 30 layers. Each costs the host Python,
PyTorch dispatch and driver work, microseconds apiece, and most of these kernels
take the GPU less than that. So the GPU waits for the host, and the step lasts
as long as the host's launch loop. (`python tools/cuda_graph_bench.py` measures it.)

A CUDA graph records the launches of one forward once (`torch.cuda.graph`),
with their arguments, and replays all of them with a single call. What it
records, and so what it forbids:

- fixed addresses: every kernel reads and writes the same tensors at every
  replay. A step's inputs must be copied into *static buffers* captured once,
  and its output is read from the tensor the capture produced;
- fixed shapes and fixed launch grids: one graph per batch size. Graphs are
  captured for a few *buckets* (1, 2, 4, 8, 16, 24, 32, ...), and a step of 13
  sequences replays the 16 graph with 3 padding rows;
- nothing that reads back to the host: no `.item()`, no `if tensor:`, no shape
  that depends on a tensor's values. minicb's forward was written that way
  (tests/engine/test_host_syncs.py); the one exception is chapter 04's PyTorch
  decode, whose gather is as wide as the longest context, a value that changes
  every step. So graphs need chapter 05's Triton decode, which walks each
  block table only as far as its own length, inside the kernel.

Padding rows must be harmless. A padding row decodes a dummy token at
position 0 with a context of one token, and its K/V go to a *scratch block*:
one block at the end of the pool that the allocator never hands out, so no
sequence owns it. Its table row names only that block. Each row's attention
reads only its own blocks, and the projections and norms work row by row, so a
padding row cannot change a real row's output.

Only decode-only steps replay a graph. A step with prompts in it has a
different number of tokens every time, and runs eagerly, as before.

    runner = DecodeGraphs(model, pool, attention, max_num_seqs=32, scratch_block=pool.num_blocks - 1,
                          capture=True)
    logits = runner(prepare(out, allocator))  # [num_seqs, vocab]: a replay when decode-only, else eager

`DecodeGraphs` is a `ModelRunner` (minicb/model_runner.py): it takes the same
`StepBatch` the eager runner takes, replays a graph for a decode-only batch
that fits a bucket, and hands every other batch to the eager forward it
inherits. The engine holds one runner and never asks which kind.

On a CPU there are no graphs: with `capture=False` the same runner fills the
same static buffers, pads to the same buckets and runs the forward eagerly. The
tests check the padding that way, on the CPU (tests/engine/test_cuda_graphs.py and
tests/chapters/test_ch10_*.py).

The chapter's exercise is the three functions the runner calls: `batch_buckets`
and `smallest_bucket` (task 1, which graphs to capture and which one a step
replays) and `pad_decode_inputs` (task 2, a step's rows padded to its bucket).
The runner reaches them through three one-line methods (`buckets_up_to`,
`bucket_for`, `pad`), so the engine, whose parts come from this module or a
student's file (`EngineParts.runner`, minicb/parts.py), runs a student's
functions inside the same runner.

`python tools/cuda_graph_bench.py` times decode steps with and without graphs
(batch 32, SmolLM2's shape, bf16, on CUDA; tiny shapes on a CPU, eagerly).
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from minicb.model import Model
from minicb.model_runner import ModelRunner, StepBatch
from minicb.paged_attention import KVPool
from minicb.paged_model import AttentionMetadata, PagedAttention


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Task 1: the batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to max_num_seqs, and max_num_seqs.

    Small batches double (a graph per size would be many graphs for little gain);
    past 8 the steps are 8 rows, so a step pads at most 7 rows.
        batch_buckets(32) -> [1, 2, 4, 8, 16, 24, 32]      batch_buckets(20) -> [1, 2, 4, 8, 16, 20]
    """
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r}; it must be an int >= 1")
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def smallest_bucket(buckets: list[int], num_seqs: int) -> int | None:
    """Task 1: the smallest of `buckets` (sorted, ascending) that holds num_seqs rows; None if none does."""
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs={num_seqs!r}; a decode step has at least 1 sequence")
    return next((b for b in buckets if b >= num_seqs), None)


def pad_decode_inputs(token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
                      bucket: int, scratch_block: int, block_size: int,
                      max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Task 2: the host inputs of a decode step of n sequences, padded to `bucket` rows.

    token_ids, positions, slots: n ints each, one per sequence (its last token, that
    token's position, the pool slot its K/V go to); block_tables: n lists of block ids.
    Returns two CPU tensors, what the runner copies into its static buffers:
      inputs [4, bucket] int64: rows token ids, positions, slots, context lengths
                                (a real row's context is position + 1 tokens);
      tables [bucket, max_blocks] int32: each real row's block table, then scratch_block
                                to the end of the row.
    A padding row (rows n .. bucket - 1) is harmless: token 0 at position 0, context 1,
    its slot the scratch block's first (scratch_block * block_size), its table all
    scratch_block. ValueError naming the value: n < 1, n > bucket, lists of different
    lengths, a block table longer than max_blocks.
    """
    n = len(token_ids)
    if n < 1:
        raise ValueError("no sequences: a decode step pads 1 or more rows")
    if not len(positions) == len(slots) == len(block_tables) == n:
        raise ValueError(f"{n} token ids, {len(positions)} positions, {len(slots)} slots and {len(block_tables)} "
                         f"block tables; a decode step needs one of each per sequence")
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit bucket={bucket}; it must be >= the number of sequences")
    longest = max(len(table) for table in block_tables)
    if longest > max_blocks:
        raise ValueError(f"a block table of {longest} blocks is longer than max_blocks={max_blocks}")
    pad = bucket - n
    scratch_slot = scratch_block * block_size
    inputs = torch.tensor([list(token_ids) + [0] * pad,
                           list(positions) + [0] * pad,
                           list(slots) + [scratch_slot] * pad,
                           [p + 1 for p in positions] + [1] * pad], dtype=torch.int64)  # [4, bucket]
    tables = torch.full((bucket, max_blocks), scratch_block, dtype=torch.int32)  # [bucket, max_blocks]
    tables[:n, :longest] = torch.tensor([t + [scratch_block] * (longest - len(t)) for t in block_tables],
                                        dtype=torch.int32)
    return inputs, tables


def runner_mode(setting: bool | None, device: torch.device, attention) -> str | None:
    """How the engine runs decode-only steps: "graphs", "eager" (the runner without graphs) or None (no runner).

    setting is EngineConfig.cuda_graphs (checked there); attention the engine's
    backend (minicb/attention_backends.py), whose `capturable` says whether its
    decode can run inside a graph: chapter 05's reference Triton kernels. None
    (auto) captures graphs on CUDA when it can. True insists (and raises where
    graphs cannot work); on a CPU, where no graphs exist, it runs the runner
    eagerly, so the padding can be tested.
    """
    if setting is False:
        return None
    if torch.device(device).type != "cuda":
        return "eager" if setting else None
    if attention.capturable:
        return "graphs"
    if setting:
        raise ValueError("cuda_graphs=True needs attention='triton' (chapter 05's reference kernels): chapter "
                         "04's PyTorch decode gathers as many blocks as the longest context, a width that changes "
                         "every step, and a graph replays fixed shapes only; a student's kernels check their "
                         "arguments on the host")
    return None


class DecodeGraphs(ModelRunner):
    """Decode-only steps through static buffers, padded to a bucket; replayed from CUDA graphs when captured.

    The pool must hold one block more than the allocator hands out: `scratch_block`,
    where padding rows write their K/V.
    """

    def __init__(self, model: Model, pool: KVPool, attention, max_num_seqs: int, scratch_block: int,
                 capture: bool):
        if not 0 <= scratch_block < pool.num_blocks:
            raise ValueError(f"scratch_block={scratch_block} is not a block of the pool (num_blocks "
                             f"{pool.num_blocks}); make the pool one block larger than the allocator")
        super().__init__(model, pool, attention)
        self.buckets = self.buckets_up_to(max_num_seqs)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * pool.block_size  # every padding row writes here
        # Block tables are padded to the longest table a sequence can have, so that
        # one buffer serves every step, however long the contexts grow.
        self.max_blocks = math.ceil(model.config.max_position_embeddings / pool.block_size)
        rows, device = self.buckets[-1], model.device
        # The static buffers, at rest in the padding state: dummy token 0 at position 0,
        # writing to the scratch slot and reading one token from the scratch block.
        self.input_ids = torch.zeros(1, rows, dtype=torch.int64, device=device)  # [1, R]
        self.positions = torch.zeros(1, rows, dtype=torch.int64, device=device)  # [1, R]
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)  # [R]
        self.block_tables = torch.full((rows, self.max_blocks), scratch_block, dtype=torch.int32,
                                       device=device)  # [R, max_blocks]
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [R]
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)  # [R + 1]: one token each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> its captured forward
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the logits [1, bucket, V] its replay writes
        if capture:
            self.capture()

    # ---- the chapter's three functions (an exercise file's DecodeGraphs calls its own) --------

    def buckets_up_to(self, max_num_seqs: int) -> list[int]:
        return batch_buckets(max_num_seqs)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs rows (None if none does)."""
        return smallest_bucket(self.buckets, num_seqs)

    def pad(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> inputs [4, bucket] int64, tables [bucket, max_blocks] int32 (pad_decode_inputs)."""
        return pad_decode_inputs(token_ids, positions, slots, block_tables, bucket, self.scratch_block,
                                 self.pool.block_size, self.max_blocks)

    # ---- what a step needs --------------------------------------------------------------

    def takes(self, batch: StepBatch) -> bool:
        """Whether a batch is decode-only and fits a bucket."""
        return batch.is_decode_only and batch.num_seqs <= self.buckets[-1]

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """-> logits [num_seqs, V]: a decode-only batch through the buffers, anything else eagerly."""
        return self.decode(batch) if self.takes(batch) else super().forward(batch)

    def metadata(self, bucket: int, host_tables: list[list[int]], host_lens: list[int],
                 max_slot: int) -> AttentionMetadata:
        """The AttentionMetadata of a padded decode step: views of the static buffers, and the host lists."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket], cu_seqlens_q=self.cu_seqlens_q[:bucket + 1],
            num_decodes=bucket, host_block_tables=host_tables, host_context_lens=host_lens,
            host_cu_seqlens_q=list(range(bucket + 1)), max_slot=max_slot)

    def run_bucket(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        """The eager forward over the first `bucket` rows of the buffers -> logits [1, bucket, V].

        This is what a graph captures. PagedAttention checks the metadata against
        the pool and builds the decode plan here, outside the forward.
        """
        attention = PagedAttention(self.pool.k_caches, self.pool.v_caches, meta, self.attention)
        return self.run_model(self.input_ids[:, :bucket], self.positions[:, :bucket], attention, meta)

    # ---- capture, once --------------------------------------------------------------------

    def capture(self) -> None:
        """Capture one graph per bucket, the largest first, all sharing one memory pool.

        The buffers are at rest (every row padding) throughout, so the warm-up runs
        write K/V only into the scratch block. Warm-up runs on a side stream first:
        they compile the Triton kernels and let cuBLAS choose its kernels, neither
        of which may happen during a capture.
        """
        if self.model.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; on a CPU the runner runs eagerly (capture=False)")
        memory = torch.cuda.graph_pool_handle()  # the graphs run one at a time, so they can share memory
        for bucket in reversed(self.buckets):
            meta = self.metadata(bucket, [[self.scratch_block]] * bucket, [1] * bucket, self.scratch_slot)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.run_bucket(bucket, meta)
            torch.cuda.current_stream().wait_stream(side)
            # PagedAttention is built outside the capture (it checks on the host); its
            # decode plan for the Triton kernels is the static buffers themselves.
            attention = PagedAttention(self.pool.k_caches, self.pool.v_caches, meta, self.attention)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                self.outputs[bucket] = self.run_model(self.input_ids[:, :bucket], self.positions[:, :bucket],
                                                      attention, meta)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    # ---- one decode step ----------------------------------------------------------------------

    def decode(self, batch: StepBatch) -> torch.Tensor:
        """One decode-only step (each sequence computes its newest token) -> logits [num_seqs, V].

        1. check the batch's rows against the pool, once (as PagedAttention does for an eager step)
        2. pad them to the bucket (pad_decode_inputs) and copy them into the static buffers
        3. replay the bucket's graph (or, uncaptured, run the forward eagerly)
        The logits are a view of the graph's output: read them before the next step.
        """
        n = batch.num_seqs
        bucket = self.bucket_for(n) if batch.is_decode_only else None
        if bucket is None:
            raise ValueError(f"a batch of {n} sequences, {batch.num_decodes} of them decodes; the runner takes "
                             f"decode-only batches of 1 to {self.buckets[-1]}")
        pad = bucket - n
        meta = self.metadata(bucket, batch.block_tables + [[self.scratch_block]] * pad,
                             batch.context_lens + [1] * pad, max(batch.slot_mapping + [self.scratch_slot]))
        meta.check_fits(self.pool.num_blocks, self.pool.block_size)

        # The padded rows, on the host: small inputs as one [4, bucket] int64 tensor, the
        # tables as one [bucket, max_blocks]; then one copy each to the device.
        inputs, table_rows = self.pad(batch.token_ids, batch.positions, batch.slot_mapping, batch.block_tables,
                                      bucket)
        inputs = inputs.to(self.model.device)
        self.input_ids[0, :bucket].copy_(inputs[0])
        self.positions[0, :bucket].copy_(inputs[1])
        self.slot_mapping[:bucket].copy_(inputs[2])
        self.context_lens[:bucket].copy_(inputs[3])
        self.block_tables[:bucket].copy_(table_rows)

        if bucket in self.graphs:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]
        else:
            logits = self.run_bucket(bucket, meta)
        return logits[0, :n]  # [n, V]: the padding rows' logits are dropped


# ----------------------------------------------------------------------------
# Counting what the host does: the notebook's operator count


def operator_calls(fn) -> Counter:
    """Run fn() once under torch.profiler -> how many times it called each PyTorch operator.

    Only the outermost calls count (aten::linear calls aten::addmm inside it): each
    is one trip through Python and PyTorch's dispatcher, and on a GPU most launch a
    kernel (views such as aten::slice launch none).
        operator_calls(lambda: runner(batch)) -> Counter({"aten::mul": 22, ...})
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::")
                   and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::")))
