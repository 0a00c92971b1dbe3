"""The engine's parts, made from one EngineConfig, out of the reference's code or a student's.

In this file you will learn what an engine is made of, in one place:

    parts = EngineParts.from_environment(config)     # whose code: MINICB_IMPL is read here, and only here
    attention = parts.attention(model)               # an attention backend (minicb/attention_backends.py)
    speculator = parts.speculator()                  # chapter 11's, or None
    token_mask = parts.token_mask()                  # chapter 12's Grammar and mask_logits (guided requests)
    allocator = parts.allocator(num_blocks)          # chapter 03's, or chapter 07's caching one
    scheduler = parts.scheduler(allocator, model, speculator, seq_ids)   # chapter 06's, or 08's
    pool, runner = parts.runner(model, num_blocks, attention)               # eager, or chapter 10's

`Engine` (minicb/engine.py) calls these in its constructor and holds what they
return; nothing on the engine's path looks a part up again. Each chapter's
module comes from `minicb.impl.load`: the reference (`minicb.scheduler`, ...)
by default, a student's exercise file with `MINICB_IMPL=student` (or a file
being graded, `MINICB_IMPL_FILE`), narrowed to some chapters by
`MINICB_IMPL_ONLY`. `EngineParts.reference(config)` never reads the
environment. A part the student did not write is the reference's, so one
chapter's unfinished stubs never break another's grade.

The server's engine thread takes chapter 09's three functions from here too
(`serve_loop()`), and `demo` asks `students()` whose code it runs.
"""
from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Iterator

from minicb import impl
from minicb.attention_backends import (CpuDecodeAttention, StudentAttention, TorchAttention, TritonAttention,
                                       TritonTileAttention)
from minicb.config import EngineConfig
from minicb.paged_attention import KVPool

# The chapter modules an engine is built from (the rest of impl.CHAPTERS run outside it).
ENGINE_MODULES = ("block_allocator", "paged_attention", "triton_attention", "scheduler", "prefix_cache",
                  "chunked_prefill", "serve.loop", "cuda_graphs", "speculative", "structured.token_mask")


class EngineParts:
    """Builds each part of an engine from `config`, taking every chapter's classes from `module(name)`.

    students: the chapter modules that are a student's code rather than the
    reference's (an attention module of a student's runs through its checked
    functions, and the Numba and tile kernels, which are the reference's own, never replace it).
    """

    def __init__(self, config: EngineConfig, load=None, students: frozenset[str] = frozenset()):
        config.validate()
        self.config = config
        self._load = load or (lambda name: importlib.import_module(f"minicb.{name}"))
        self._students = students
        self._used: list[str] = []  # the chapter modules asked for so far, in order

    @classmethod
    def reference(cls, config: EngineConfig) -> EngineParts:
        """minicb's own code for every part, whatever the environment says."""
        return cls(config)

    @classmethod
    def from_environment(cls, config: EngineConfig) -> EngineParts:
        """The reference, or a student's code where MINICB_IMPL / MINICB_IMPL_FILE / MINICB_IMPL_ONLY say."""
        return cls(config, impl.load, frozenset(m for m in impl.student_modules() if m in ENGINE_MODULES))

    def module(self, name: str) -> ModuleType:
        """Chapter module `name` ("scheduler", "serve.loop", ...), loaded when first asked for."""
        if name not in self._used:
            self._used.append(name)
        return self._load(name)  # impl.load caches a file once executed

    def students(self) -> list[str]:
        """The chapter modules the parts built so far came from a student's file, in chapter order."""
        return [name for name in ENGINE_MODULES if name in self._students and name in self._used]

    def references(self) -> list[str]:
        """The chapter modules the parts built so far came from minicb itself, in chapter order."""
        return [name for name in ENGINE_MODULES if name not in self._students and name in self._used]

    # ---- the parts -----------------------------------------------------------------

    def num_blocks(self, model) -> int:
        """KV blocks the allocator hands out: EngineConfig.num_blocks, or what the memory budget holds."""
        cfg, ec = model.config, self.config
        if ec.num_blocks is not None:
            return ec.num_blocks
        budget = KVPool.memory_budget(model.device, ec.gpu_memory_fraction, ec.cpu_kv_gib)
        num_blocks = KVPool.num_blocks_for_memory(budget, cfg.num_layers, ec.block_size, cfg.num_kv_heads,
                                                  cfg.head_dim, model.dtype)
        # More than every slot at full context can never be used; a small model
        # would otherwise get a huge pool (and a huge block map in every trace).
        return min(num_blocks, ec.max_num_seqs * math.ceil(cfg.max_position_embeddings / ec.block_size))

    def attention(self, model) -> TorchAttention | StudentAttention:
        """The attention backend for EngineConfig.attention on the model's device and dtype."""
        ec = self.config
        torch_kernels = self.module("paged_attention")
        torch_backend = (StudentAttention(torch_kernels) if "paged_attention" in self._students
                         else TorchAttention(torch_kernels))
        if ec.attention == "torch":
            if "paged_attention" in self._students or ec.cpu_decode == "gather":
                return torch_backend
            from minicb import cpu_attention  # imports Numba, which only this backend needs
            if cpu_attention.applies_to(model.device, model.dtype):
                return CpuDecodeAttention(torch_kernels, cpu_attention)
            return torch_backend
        kernels = self.module("triton_attention")  # imports triton
        # Whether this process runs Triton interpreted (TRITON_INTERPRET=1, a CPU): the reference
        # module records it, and a student's file was defined under the same setting.
        interpreted = importlib.import_module("minicb.triton_attention").INTERPRETED
        # Under the interpreter a prompt through Python-level kernel programs takes
        # minutes: chapter 04's prefill runs it, unless the tile kernel is asked for.
        prefill_backend = torch_backend if interpreted else None
        if "triton_attention" in self._students:
            return StudentAttention(kernels, prefill_backend)
        if ec.tile_prefill or (ec.tile_prefill is None and not interpreted):
            from minicb import tile_attention
            return TritonTileAttention(kernels, tile_attention)
        return TritonAttention(kernels, prefill_backend)

    def speculator(self):
        """Chapter 11's Speculator, or None when speculation and jump-forward are off."""
        ec = self.config
        if ec.speculative_ngram is None and not ec.jump_forward:
            return None
        speculator = self.module("speculative").Speculator(ec.speculative_ngram or 1, ec.num_speculative_tokens)
        if ec.speculative_ngram is None:  # jump-forward alone (chapter 12): the verifier, no n-gram drafts
            from minicb.structured.guide import VerifierOnly
            return VerifierOnly(speculator)
        return speculator

    def token_mask(self) -> ModuleType:
        """Chapter 12's module: the Grammar guided requests compile to (its masks and matchers), and
        mask_logits, which puts a mask on their rows (minicb/structured/guide.py's Grammars use it)."""
        return self.module("structured.token_mask")

    def allocator(self, num_blocks: int):
        """A new, empty block allocator: chapter 07's caching one, or chapter 03's."""
        if self.config.enable_prefix_caching:
            return self.module("prefix_cache").CachingBlockAllocator(num_blocks, self.config.block_size)
        return self.module("block_allocator").BlockAllocator(num_blocks, self.config.block_size)

    def scheduler(self, allocator, model, speculator, seq_ids: Iterator[int]):
        """A new scheduler over `allocator`: chapter 08's chunked one, or chapter 06's.

        seq_ids: the engine's counter, so ids keep counting across a reset."""
        ec = self.config
        Scheduler = (self.module("chunked_prefill").ChunkedScheduler if ec.enable_chunked_prefill
                     else self.module("scheduler").Scheduler)
        return Scheduler(allocator, ec.max_num_seqs, model.config.max_position_embeddings,
                         model.config.eos_token_ids, ec.max_num_batched_tokens, ec.watermark, speculator,
                         seq_ids=seq_ids)

    def sequence_type(self) -> type:
        """The Sequence class the scheduler's module defines (a student's file may define its own)."""
        return self.module("scheduler").Sequence

    def runner(self, model, num_blocks: int, attention) -> tuple[KVPool, object]:
        """The KV pool and the runner: eager, or chapter 10's, which replays decode-only steps from CUDA graphs.

        With chapter 10's runner the pool has one block more than the allocator
        hands out: the scratch block, where the padding rows write their K/V.
        """
        cfg, ec = model.config, self.config
        graphing = self.module("cuda_graphs")
        mode = graphing.runner_mode(ec.cuda_graphs, model.device, attention)
        pool = KVPool(cfg.num_layers, num_blocks + (1 if mode else 0), ec.block_size, cfg.num_kv_heads,
                      cfg.head_dim, model.dtype, model.device, hidden_size=cfg.hidden_size)
        if mode is None:
            from minicb.cpu_threads import thread_policy
            from minicb.model_runner import ModelRunner
            return pool, ModelRunner(model, pool, attention, thread_policy(ec.cpu_threads, model.device))
        return pool, graphing.DecodeGraphs(model, pool, attention, ec.max_num_seqs, scratch_block=num_blocks,
                                           capture=mode == "graphs")

    def serve_loop(self) -> ModuleType:
        """Chapter 09's module: take_commands, apply_commands and group_step, for the server's engine thread."""
        return self.module("serve.loop")

