"""Chapter 06: the continuous-batching engine -- one step at a time.

In this file you will learn how the pieces of the earlier chapters become a
serving loop. `Engine.step()` does, in order:

    1. schedule     the scheduler picks the decodes and the newly admitted prefills
    2. prepare      one packed batch: input ids, positions, and AttentionMetadata
                    (slot mapping, block tables, context lengths, query offsets)
    3. forward      ONE model call over the ragged batch, decodes and prefills together
    4. sample       one token per sequence, each with its own generator
    5. postprocess  append tokens, evict finished sequences, free their blocks

and returns a `StepOutput`: the new token of every scheduled request, and the
requests that finished. Because a finished sequence leaves at the end of the
step that finished it, the next step's `schedule()` can put a waiting request
straight into its slot: no row of the batch ever idles while work is waiting.
That is the whole trick.

    engine = Engine(model, EngineConfig(max_num_seqs=8))
    rid = engine.add_request([1, 422, 88], SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        out = engine.step()
        for seq in out.finished:            # each finished request is handed out once,
            print(seq.request_id, seq.output_token_ids, seq.finish_reason)  # then forgotten

The engine keeps a request (one `Sequence`, minicb/scheduler.py) only while it
waits or runs, so a server can run it for weeks. With `keep_traces` it also
records a `StepTrace` per step for the pictures (minicb/trace.py).
`minicb.llm.LLM` wraps this with a tokenizer, progress bars and output objects.
Chapter text: chapters/06-continuous-batching/README.md.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from minicb import impl
from minicb.model import Model
from minicb.paged_attention import KVPool
from minicb.paged_model import AttentionMetadata, PagedAttention, attention_kernels
from minicb.sampling import SamplingParams, make_generator, sample
from minicb.scheduler import Sequence
from minicb.trace import SlotState, StepTrace


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; None = from the memory budget below
    max_num_seqs: int = 32  # slots: sequences decoding together
    max_num_batched_tokens: int = 4096  # new tokens per step, caps how much prefill joins a step
    attention: str = "torch"  # "torch" (chapter 04) or "triton" (chapter 05)
    watermark: float = 0.01  # fraction of blocks kept free at admission
    gpu_memory_fraction: float = 0.5  # KV budget on CUDA: this fraction of free memory
    cpu_kv_gib: float = 1.0  # KV budget on CPU
    # StepTraces to keep in Engine.traces: 0 records none (the default: a long-running
    # server needs none), N keeps the last N steps, None keeps every step.
    keep_traces: int | None = 0
    # Keep computed full blocks under a key of their prefix and share them with later
    # requests that start the same way (minicb/prefix_cache.py). Greedy outputs are
    # the same either way; chapter 07's text says why it is off by default.
    enable_prefix_caching: bool = False
    # Cut prompts into chunks that fill what the running requests' decodes leave of
    # max_num_batched_tokens, so no step computes more than that (minicb/chunked_prefill.py,
    # chapter 08). Off: chapter 06's scheduler admits each prompt whole.
    enable_chunked_prefill: bool = False
    # Replay decode-only steps from CUDA graphs, one per batch-size bucket (minicb/cuda_graphs.py).
    # None: on for CUDA with attention="triton", off otherwise. True on a CPU runs the same
    # runner eagerly (a CPU has no graphs), through its static buffers and bucket padding.
    cuda_graphs: bool | None = None


@dataclass
class StepOutput:
    """What one step did to requests. The engine keeps none of it."""

    new_tokens: list[tuple[int, int]] = field(default_factory=list)  # (request_id, token), batch order
    forked: list[tuple[int, int]] = field(default_factory=list)  # (parent_id, child_id): n > 1 completions born
    finished: list[Sequence] = field(default_factory=list)  # ended this step; the engine has let go of them
    trace: StepTrace | None = None  # the step's picture, when keep_traces asks for one


class Engine:
    def __init__(self, model: Model, config: EngineConfig | None = None):
        self.model, self.config = model, config or EngineConfig()
        cfg, ec = model.config, self.config
        num_blocks = ec.num_blocks
        if num_blocks is None:
            budget = KVPool.memory_budget(model.device, ec.gpu_memory_fraction, ec.cpu_kv_gib)
            num_blocks = KVPool.num_blocks_for_memory(budget, cfg.num_layers, ec.block_size,
                                                      cfg.num_kv_heads, cfg.head_dim, model.dtype)
            # More than every slot at full context can never be used; a small model
            # would otherwise get a huge pool (and a huge block map in every trace).
            num_blocks = min(num_blocks, ec.max_num_seqs * -(-cfg.max_position_embeddings // ec.block_size))
        self.kernels = attention_kernels(ec.attention)
        # The chapter components come through impl.load, so MINICB_IMPL=student
        # runs this very loop on the student's allocator and scheduler.
        if ec.enable_prefix_caching:
            allocator = impl.load("prefix_cache").CachingBlockAllocator(num_blocks, ec.block_size)
        else:
            allocator = impl.load("block_allocator").BlockAllocator(num_blocks, ec.block_size)
        scheduling = impl.load("scheduler")
        self.Sequence = scheduling.Sequence
        Scheduler = (impl.load("chunked_prefill").ChunkedScheduler if ec.enable_chunked_prefill
                     else scheduling.Scheduler)
        self.scheduler = Scheduler(
            allocator, ec.max_num_seqs, cfg.max_position_embeddings, cfg.eos_token_ids,
            ec.max_num_batched_tokens, ec.watermark)
        self.allocator = allocator
        # With the decode runner, the pool has one block more than the allocator hands out:
        # the scratch block, where the runner's padding rows write their K/V.
        graphing = impl.load("cuda_graphs")  # chapter 10's runner: buckets and padding
        mode = graphing.runner_mode(ec.cuda_graphs, model.device, self.kernels)
        self.pool = KVPool(cfg.num_layers, num_blocks + (1 if mode else 0), ec.block_size, cfg.num_kv_heads,
                           cfg.head_dim, model.dtype, model.device)
        self.graphs = (graphing.DecodeGraphs(model, self.pool, self.kernels, ec.max_num_seqs,
                                             scratch_block=num_blocks, capture=mode == "graphs") if mode else None)
        self.requests: dict[int, Sequence] = {}  # request_id -> its state, while it waits or runs
        keep = ec.keep_traces
        if keep is not None and (not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep_traces={keep!r}; it must be 0 (none), a positive int (the last N steps) "
                             f"or None (every step)")
        self.traces: deque[StepTrace] = deque(maxlen=keep)
        self._ids = itertools.count()
        self.num_steps = 0

    # ---- requests -------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never be served. Changes nothing."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # the fields may have been changed after construction
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        self.scheduler.check_request(prompt_token_ids, params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> int:
        """Queue a request; returns its id. Raises (and queues nothing) if it can never be served."""
        prompt_token_ids = list(prompt_token_ids)
        self.check_request(prompt_token_ids, params)
        rid = next(self._ids)
        seq = self.Sequence(rid, prompt_token_ids, params,
                            arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        seq.generator = make_generator(params, self.model.device)
        self.scheduler.add(seq)
        self.requests[rid] = seq
        return rid

    def abort(self, request_id: int) -> Sequence:
        """Stop a waiting or running request now; returns it (finish_reason "abort"), and forgets it."""
        if self.scheduler.abort(request_id) is None:
            raise KeyError(f"request {request_id} is not waiting or running")
        seq = self.requests.pop(request_id)
        seq.finish_time = time.perf_counter()
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------

    def step(self) -> StepOutput:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for src, dst in out.block_copies:  # copy-on-write of shared blocks (prefix sharing)
            self.pool.copy_block(src, dst)
        seqs = out.sequences  # decodes first, then prefills
        # Who computed what where, read before postprocess frees the finished ones' slots.
        # (Admitted requests start at num_computed_tokens = their cached prefix.)
        work = [(s.request_id, s.slot, "decode" if i < len(out.decodes) else "prefill", out.num_new_tokens(s),
                 s.num_computed_tokens) for i, s in enumerate(seqs)]
        # Where each sequence's computed tokens end after this step. A sequence that
        # reaches its last token gets a sampled token; a chunk of a longer prompt
        # (chapter 08) gets None: its last row's logits predict a prompt token.
        ends = [s.num_computed_tokens + out.num_new_tokens(s) for s in seqs]
        tokens: list[int | None] = [None] * len(seqs)
        if seqs:
            if self.graphs is not None and self.graphs.takes(out):  # decode-only: static buffers, a captured graph
                logits = self.graphs.decode(seqs, self.allocator)  # [1, S, V]
            else:
                input_ids, positions, meta = self.prepare(out)
                attention = PagedAttention(self.pool.k_caches, self.pool.v_caches, meta, self.kernels)
                logits = self.model(input_ids, positions, attention, logits_at=meta.last_token_index())  # [1, S, V]
            done = [i for i, (s, end) in enumerate(zip(seqs, ends)) if end == s.num_tokens]
            if done:
                sampled = sample(logits[0, done], [seqs[i].params for i in done], [seqs[i].generator for i in done])
                for i, token in zip(done, sampled):
                    tokens[i] = token
            if self.config.enable_prefix_caching:  # their K/V are computed now: key the full blocks
                for seq, end in zip(seqs, ends):
                    self.allocator.cache_full_blocks(seq.request_id, seq.token_ids[:end])
            forked = self._fork_completions(seqs, logits[0], out, tokens)
        else:
            forked = []
        now = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            if token is not None:
                seq.token_times.append(now)  # for inter-token latency; postprocess appends the token
        finished = self.scheduler.postprocess(out, tokens, now)
        for seq in finished:
            del self.requests[seq.request_id]  # handed out below; the engine keeps nothing
        self.num_steps += 1
        result = StepOutput(new_tokens=[(s.request_id, t) for s, t in zip(out.sequences, tokens) if t is not None],
                            finished=finished, forked=forked)
        if self.traces.maxlen != 0:
            result.trace = self._trace(out, work, result, time.perf_counter() - t0)
            self.traces.append(result.trace)
        return result

    def _fork_completions(self, seqs, logits, out, tokens) -> list[tuple[int, int]]:
        """Parallel sampling: a request with n > 1 that just computed its prompt becomes n completions.

        Its other n - 1 first tokens are sampled from the same logits row, each with
        its own generator, and each child shares all the parent's blocks
        (allocator.fork): the prompt is computed once. The shared last block is
        copied when a child first writes into it (chapter 03's copy-on-write; the
        copies reach the pool through out.block_copies). The children join this
        step's prefills, so postprocess() appends their tokens like anyone's.
        logits [S, V] rows in seqs order; tokens is extended in place.
        """
        forked = []
        for row, parent in enumerate(seqs):
            if parent.forked or parent.params.n == 1 or tokens[row] is None:
                continue  # (None: a chunk of its prompt is still to come)
            parent.forked = True
            for completion in range(1, parent.params.n):
                rid = next(self._ids)
                child = self.Sequence(rid, list(parent.prompt_token_ids), parent.params,
                                      arrival_time=parent.arrival_time, parent_id=parent.request_id)
                child.generator = make_generator(parent.params, self.model.device, completion)
                child.num_cached_tokens = parent.num_cached_tokens
                self.allocator.fork(parent.request_id, rid)
                self.scheduler.adopt(child)
                self.requests[rid] = child
                out.prefills.append(child)
                tokens.append(sample(logits[row:row + 1], [parent.params], [child.generator])[0])
                forked.append((parent.request_id, rid))
        return forked

    def prepare(self, out) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pack the scheduled sequences into one batch: input_ids, positions [1, N] and metadata."""
        input_ids, positions, slots, tables, context_lens, num_new = [], [], [], [], [], []
        for seq in out.sequences:
            start = seq.num_computed_tokens  # the uncached tokens, or the next chunk of them
            end = start + out.num_new_tokens(seq)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.allocator.slot_mapping(seq.request_id, start, end)
            tables.append(self.allocator.block_table(seq.request_id))
            context_lens.append(end)
            num_new.append(end - start)
        device = self.model.device
        meta = AttentionMetadata.build(tables, context_lens, num_new, slots, len(out.decodes), device)
        return (torch.tensor([input_ids], device=device), torch.tensor([positions], device=device), meta)

    def _trace(self, out, work, result: StepOutput, seconds: float) -> StepTrace:
        slots = [SlotState(None, "empty", 0) for _ in range(self.config.max_num_seqs)]
        for request_id, slot, phase, num_tokens, _ in work:
            slots[slot] = SlotState(request_id, phase, num_tokens)
        num_tokens = sum(s.num_tokens for s in slots)
        admitted = set(out.admitted)
        holders = Counter(block for seq in self.scheduler.running
                          for block in self.allocator.block_table(seq.request_id))
        return StepTrace(
            step=self.num_steps - 1, slots=slots,
            admitted=list(out.admitted),
            finished=[(s.request_id, s.finish_reason) for s in result.finished],
            preempted=list(out.preempted),
            waiting=[s.request_id for s in self.scheduler.waiting],
            running=[s.request_id for s in self.scheduler.running],
            num_free_blocks=self.allocator.num_free_blocks,
            num_blocks=self.allocator.num_blocks,
            block_owners=self.allocator.block_owners(),
            num_tokens=num_tokens, num_useful_tokens=num_tokens,  # no padding, no idle rows
            time_s=seconds,
            new_tokens=list(result.new_tokens),
            cached_free_blocks=(self.allocator.cached_free_blocks() if self.config.enable_prefix_caching else []),
            shared_blocks=sorted(block for block, count in holders.items() if count > 1),
            cached_tokens=[(request_id, cached) for request_id, _, _, _, cached in work if request_id in admitted],
            # Chunked prefill never exceeds it; whole-prompt admission uses it to admit, but a
            # prompt longer than the budget still runs whole when nothing else does.
            token_budget=self.config.max_num_batched_tokens,
        )
