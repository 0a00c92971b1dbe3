"""Chapter 10 exercise: which CUDA graphs to capture, which one a step replays, and its padding rows.

Fill in the stubs below, task by task. The text is
chapters/10-the-gpu-step/README.md; the tests are tests/chapters/test_ch10_*.py. Run
them against this file with

    python -m minicb check 10

Given: the decode runner DecodeGraphs, a chapter 06 ModelRunner (minicb/model_runner.py)
with static buffers sized for the largest bucket, a scratch block (one pool block more
than the allocator hands out; padding rows write their K/V there), one CUDA graph
captured per bucket on a GPU, and, on a CPU, the same padded forward run eagerly. It
calls your three functions: batch_buckets once when it is built (the graphs to capture),
then at every decode-only step smallest_bucket (the graph to replay; None: run that step
eagerly, unpadded) and pad_decode_inputs (the rows it copies into its buffers). The
class at the bottom of this file is that runner, calling your functions where the
reference calls its own; the engine builds it and hands it every step's batch
(EngineConfig(cuda_graphs=True) on a CPU runs it eagerly, with your padding).
"""
from __future__ import annotations

import torch  # noqa: F401  # you will need it

from minicb.cuda_graphs import DecodeGraphs as _GivenDecodeGraphs
# given: runner_mode(setting, device, attention) -> "graphs", "eager" or None, how the engine runs
# decode-only steps for EngineConfig.cuda_graphs = setting (you do not call it)
from minicb.cuda_graphs import runner_mode  # noqa: F401


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Task 1: the batch sizes that get a graph, ascending: 1, 2, 4, 8 (those below max_num_seqs),
    then 16, 24, 32, ... (every 8 below max_num_seqs), and max_num_seqs itself.
    batch_buckets(32) -> [1, 2, 4, 8, 16, 24, 32]; batch_buckets(20) -> [1, 2, 4, 8, 16, 20].
    Unless max_num_seqs is an int >= 1, ValueError naming it as max_num_seqs= and the value's
    repr: max_num_seqs=0, max_num_seqs=2.5, max_num_seqs='8' (the string "8")."""
    raise NotImplementedError(
        "Chapter 10, task 1: batch_buckets() — see chapters/10-the-gpu-step/README.md#task-1")


def smallest_bucket(buckets: list[int], num_seqs: int) -> int | None:
    """Task 1: the smallest of `buckets` (ascending) that holds num_seqs rows, or None when num_seqs
    is over the largest (the runner then runs the step eagerly). Unless num_seqs is an int >= 1,
    ValueError naming it as num_seqs= and the value: num_seqs=0, num_seqs=-1."""
    raise NotImplementedError(
        "Chapter 10, task 1: smallest_bucket() — see chapters/10-the-gpu-step/README.md#task-1")


def pad_decode_inputs(token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
                      bucket: int, scratch_block: int, block_size: int,
                      max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Task 2: a decode step's n rows padded to `bucket` rows, as two CPU tensors:
      inputs [4, bucket] int64: rows token ids, positions, slots, context lengths (position + 1);
      tables [bucket, max_blocks] int32: each real row's block table, then scratch_block to the end.
    A padding row: token 0, position 0, slot scratch_block * block_size, context 1, table all
    scratch_block. ValueError, with these words in the message: "no sequences" for n < 1; the
    bucket as bucket=2 for n over bucket; the list's name, e.g. "positions", for lists of
    different lengths; the limit as max_blocks=3 for a block table longer than max_blocks. It changes none of its arguments: block_tables are the
    allocator's live tables."""
    raise NotImplementedError(
        "Chapter 10, task 2: pad_decode_inputs() — see chapters/10-the-gpu-step/README.md#task-2")


class DecodeGraphs(_GivenDecodeGraphs):
    """Given: the runner described at the top of this file, on your functions above (these three
    methods are all it changes). Read them to see where the runner calls each one."""

    def buckets_up_to(self, max_num_seqs: int) -> list[int]:
        return batch_buckets(max_num_seqs)  # once, when the runner is built: the graphs to capture

    def bucket_for(self, num_seqs: int) -> int | None:
        return smallest_bucket(self.buckets, num_seqs)  # every decode-only step: the graph it replays

    def pad(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every decode-only step: what it copies into the static buffers
        return pad_decode_inputs(token_ids, positions, slots, block_tables, bucket, self.scratch_block,
                                 self.pool.block_size, self.max_blocks)
