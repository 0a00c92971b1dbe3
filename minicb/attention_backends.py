"""Attention backends: one interface for every set of paged-attention kernels the engine runs.

In this file you will learn how the engine can run chapter 04's PyTorch code,
chapter 05's Triton kernels, a compiled CPU decode or a student's exercise file
without ever asking which one it holds. Each backend answers the same five calls,
made by `PagedAttention` (minicb/paged_model.py):

    plan = backend.plan_decode(block_tables, context_lens, max_context_len, block_size)  # once a step
    tiles = backend.plan_prefill(query_starts, k_cache)                                  # once a step
    backend.store_kv(k, v, k_cache, v_cache, slot_mapping)                               # every layer
    out[:D] = backend.decode(q[:D], k_cache, v_cache, plan)                              # every layer
    out[D:] = backend.prefill(q[D:], k_cache, v_cache, block_tables, context_lens,
                              cu_seqlens_q, query_starts, lens, tiles)                   # every layer

and says one thing about itself: `capturable`, whether its decode may run
inside a CUDA graph (chapter 10), which needs fixed shapes and no host reads.

    backend            decode                               prefill                       capturable
    TorchAttention     chapter 04's gather (a plan per step)  chapter 04's ragged loop      no (its width changes)
    CpuDecodeAttention Numba, reading the blocks in place    chapter 04's                  no
    TritonAttention    chapter 05's kernel                   chapter 05's (or 04's, interpreted)  yes
    TritonTileAttention chapter 05's kernel                  the query-tile kernel         yes
    StudentAttention   an exercise file's checked functions  its prefill                   no

The per-layer calls run unchecked: `PagedAttention` checks a step's metadata
against the pool once, on the host, before the first layer. A student's module
has only the checked public functions, which give the same answers and check
(and read the host) in every layer: slower, but graded exactly as written.

Which backend an engine gets is decided once, from EngineConfig (`attention`,
`cpu_decode`, `tile_prefill`), by `EngineParts.attention` (minicb/parts.py).
Chapter texts: chapters/04-paged-attention, 05-triton-attention, 08-chunked-prefill.
"""
from __future__ import annotations

from types import ModuleType

import torch


class TorchAttention:
    """Chapter 04's reference kernels (minicb/paged_attention.py): the gather decode and the ragged prefill."""

    capturable = False  # the gather's width is the longest context, which changes every step

    def __init__(self, kernels: ModuleType):
        self.kernels = kernels  # a module with the *_unchecked functions and decode_plan

    def plan_decode(self, block_tables, context_lens, max_context_len: int, block_size: int):
        """What every layer's decode shares this step (block_tables [D, max_blocks], context_lens [D])."""
        return self.kernels.decode_plan(block_tables, context_lens, max_context_len, block_size)

    def plan_prefill(self, query_starts: list[int], k_cache: torch.Tensor):
        """What every layer's prefill shares this step; None for a prefill that needs nothing."""
        return None

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        # k, v [N, n_kv, hd]; caches [num_blocks, block_size, n_kv, hd]; slot_mapping [N]
        self.kernels.store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, plan) -> torch.Tensor:
        # q [D, n_heads, hd] -> [D, n_heads, hd]
        return self.kernels.paged_decode_attention_unchecked(q, k_cache, v_cache, plan)

    def prefill(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, query_starts, lens,
                plan) -> torch.Tensor:
        # q [P, n_heads, hd], the prefill tokens; cu_seqlens_q and query_starts relative to q[0]
        return self.kernels.paged_prefill_attention_unchecked(q, k_cache, v_cache, block_tables, context_lens,
                                                              cu_seqlens_q, query_starts, lens)


class CpuDecodeAttention(TorchAttention):
    """Chapter 04's backend with its decode and store_kv compiled for the CPU (minicb/cpu_attention.py, fp32).

    The same online softmax, but reading each block where it lies instead of
    gathering a copy of every sequence's K/V first; and the same writes, in one
    call a layer instead of six.
    """

    def __init__(self, kernels: ModuleType, cpu_kernels: ModuleType):
        super().__init__(kernels)
        self.cpu_kernels = cpu_kernels

    def plan_decode(self, block_tables, context_lens, max_context_len: int, block_size: int):
        return block_tables, context_lens  # the kernel walks the tables itself

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.cpu_kernels.store_kv_unchecked(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, plan) -> torch.Tensor:
        return self.cpu_kernels.paged_decode_attention_unchecked(q, k_cache, v_cache, *plan)


class TritonAttention(TorchAttention):
    """Chapter 05's Triton kernels (minicb/triton_attention.py).

    `prefill_backend`, when given, does the prefill instead: under the Triton
    interpreter on a CPU a whole prompt through Python-level kernel programs
    takes minutes, so chapter 04's PyTorch prefill runs it, and Triton keeps
    store_kv and decode, the kernels chapter 05 is about.
    """

    capturable = True  # the decode kernel walks fixed-shape tables and reads nothing on the host

    def __init__(self, kernels: ModuleType, prefill_backend: TorchAttention | None = None):
        super().__init__(kernels)
        self.prefill_backend = prefill_backend

    def prefill(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, query_starts, lens,
                plan) -> torch.Tensor:
        backend = self.prefill_backend
        if backend is None:
            return super().prefill(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, query_starts,
                                   lens, plan)
        return backend.prefill(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, query_starts, lens,
                               backend.plan_prefill(query_starts, k_cache))


class TritonTileAttention(TritonAttention):
    """Chapter 05's decode, with prefills (and prefill chunks) on the query-tile kernel of minicb/tile_attention.py.

    That kernel reads a sequence's K/V once per tile of new tokens, where chapter
    05's prefill reads it once per new token. Its tile plan is built once a step.
    """

    def __init__(self, kernels: ModuleType, tile_kernels: ModuleType):
        super().__init__(kernels)
        self.tile_kernels = tile_kernels

    def plan_prefill(self, query_starts: list[int], k_cache: torch.Tensor):
        return self.tile_kernels.tile_plan(query_starts, k_cache)

    def prefill(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, query_starts, lens,
                plan) -> torch.Tensor:
        return self.tile_kernels.paged_attention_tiles_unchecked(q, k_cache, v_cache, block_tables, context_lens,
                                                                 cu_seqlens_q, plan)


class StudentAttention:
    """A student's chapter 04 or 05 exercise file, through its public (checked) functions.

    It runs exactly as written, so a grade measures the student's code. Like
    TritonAttention it may hand its prefill to another backend (the interpreter case).
    """

    capturable = False  # its functions check their arguments, which reads the host

    def __init__(self, kernels: ModuleType, prefill_backend: TorchAttention | StudentAttention | None = None):
        self.kernels, self.prefill_backend = kernels, prefill_backend

    def plan_decode(self, block_tables, context_lens, max_context_len: int, block_size: int):
        return block_tables, context_lens

    def plan_prefill(self, query_starts: list[int], k_cache: torch.Tensor):
        return None

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, plan) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, k_cache, v_cache, *plan)

    def prefill(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, query_starts, lens,
                plan) -> torch.Tensor:
        if self.prefill_backend is not None:
            return self.prefill_backend.prefill(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
                                                query_starts, lens, plan)
        return self.kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)


AttentionBackend = TorchAttention | StudentAttention  # what PagedAttention and the runners accept
