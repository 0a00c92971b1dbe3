"""Chapter 10 exercise: which CUDA graphs to capture, which one a step replays, and its padding rows.

Fill in the stubs below, task by task. The text is
chapters/10-the-gpu-step/README.md; the tests are tests/test_ch10_*.py. Run
them against this file with

    python -m minicb check 10

Given (minicb/cuda_graphs.py documents it): the decode runner, DecodeGraphs, a
ModelRunner (minicb/model_runner.py) -- its static buffers, the scratch block,
capture, replay, and the eager forward a CPU runs instead. The class at the
bottom of this file is that runner, calling your three functions where the
reference calls its own; the engine builds it and hands it every step's batch
(EngineConfig(cuda_graphs=True) on a CPU runs it eagerly, with your padding).
"""
from __future__ import annotations

import torch  # noqa: F401  # you will need it

from minicb.cuda_graphs import DecodeGraphs as _GivenDecodeGraphs
from minicb.cuda_graphs import runner_mode  # noqa: F401  # given: when the engine has a runner


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Task 1: the batch sizes that get a graph, ascending: 1, 2, 4, 8 (those below max_num_seqs),
    then 16, 24, 32, ... (every 8 below max_num_seqs), and max_num_seqs itself.
    batch_buckets(32) -> [1, 2, 4, 8, 16, 24, 32]; batch_buckets(20) -> [1, 2, 4, 8, 16, 20].
    ValueError naming the value unless max_num_seqs is an int >= 1."""
    raise NotImplementedError(
        "Chapter 10, task 1: batch_buckets() — see chapters/10-the-gpu-step/README.md#task-1")


def smallest_bucket(buckets: list[int], num_seqs: int) -> int | None:
    """Task 1: the smallest of `buckets` (ascending) that holds num_seqs rows, or None when num_seqs
    is over the largest (the runner then runs the step eagerly). ValueError naming the value unless
    num_seqs is an int >= 1."""
    raise NotImplementedError(
        "Chapter 10, task 1: smallest_bucket() — see chapters/10-the-gpu-step/README.md#task-1")


def pad_decode_inputs(token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
                      bucket: int, scratch_block: int, block_size: int,
                      max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Task 2: a decode step's n rows padded to `bucket` rows, as two CPU tensors:
      inputs [4, bucket] int64: rows token ids, positions, slots, context lengths (position + 1);
      tables [bucket, max_blocks] int32: each real row's block table, then scratch_block to the end.
    A padding row: token 0, position 0, slot scratch_block * block_size, context 1, table all
    scratch_block. ValueError naming the value: n < 1, n > bucket, lists of different lengths,
    a block table longer than max_blocks."""
    raise NotImplementedError(
        "Chapter 10, task 2: pad_decode_inputs() — see chapters/10-the-gpu-step/README.md#task-2")


class DecodeGraphs(_GivenDecodeGraphs):
    """Given: minicb/cuda_graphs.py's runner, on your functions above (these three methods are all it
    changes). Read them to see where the runner calls each one."""

    def buckets_up_to(self, max_num_seqs: int) -> list[int]:
        return batch_buckets(max_num_seqs)  # once, when the runner is built: the graphs to capture

    def bucket_for(self, num_seqs: int) -> int | None:
        return smallest_bucket(self.buckets, num_seqs)  # every decode-only step: the graph it replays

    def pad(self, token_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every decode-only step: what it copies into the static buffers
        return pad_decode_inputs(token_ids, positions, slots, block_tables, bucket, self.scratch_block,
                                 self.pool.block_size, self.max_blocks)
