"""Chapter 06: the continuous-batching engine -- one step at a time.

In this file you will learn how the pieces of the earlier chapters become a
serving loop. `Engine.step()` does, in order:

    1. schedule     the scheduler picks how many tokens each request computes (decodes,
                    prompts, chunks of prompts), within one token budget
    2. prepare      one packed batch on the host: token ids, positions, slot mapping,
                    block tables, context lengths (minicb/model_runner.py)
    3. forward      the runner makes ONE model call over the ragged batch, decodes and
                    prefills together (or replays a CUDA graph, chapter 10)
    4. sample       a token for each sequence that computed its last token, with its own
                    generator (n tokens for a request whose n completions fork now; the
                    accepted drafts and one more for a request verifying drafts, chapter 11)
    5. postprocess  the scheduler appends tokens, forks completions, evicts finished
                    sequences and frees their blocks

and returns a `StepOutput`: every new token, named by its request and
completion, and the sequences that finished. Because a finished sequence leaves at the end of the
step that finished it, the next step's `schedule()` can put a waiting request
straight into its slot: no row of the batch ever idles while work is waiting.
That is the whole trick.

    engine = Engine(model, EngineConfig(max_num_seqs=8))
    rid = engine.add_request([1, 422, 88], SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        out = engine.step()
        for seq in out.finished:            # each finished completion is handed out once,
            print(seq.owner_id, seq.completion, seq.output_token_ids, seq.finish_reason)  # then forgotten

The engine keeps a request (one `Sequence`, minicb/scheduler.py) only while it
waits or runs, so a server can run it for weeks. With `keep_traces` it also
records a `StepTrace` per step for the pictures (minicb/trace.py).
`minicb.llm.LLM` wraps this with a tokenizer, progress bars and output objects.
Chapter text: chapters/06-continuous-batching/README.md.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from minicb import impl
from minicb.config import EngineConfig  # the settings (minicb/config.py); importable from here too
from minicb.model import Model
from minicb.model_runner import ModelRunner, prepare
from minicb.paged_attention import KVPool
from minicb.paged_model import attention_kernels
from minicb.sampling import SamplingParams, make_generator, sample
from minicb.scheduler import RequestRejected, Sequence, SchedulerOutput
from minicb.trace import SlotState, StepTrace


class NewToken(NamedTuple):
    """One sampled token, named by what the caller knows: its request and which completion."""

    request_id: int  # the id add_request returned
    completion: int  # which of the request's n completions (0 when n = 1)
    token: int


@dataclass
class StepOutput:
    """What one step did to requests. The engine keeps none of it."""

    new_tokens: list[NewToken] = field(default_factory=list)  # in batch order
    # Completions that ended this step (seq.owner_id and seq.completion name them); the engine has let go of them.
    finished: list[Sequence] = field(default_factory=list)
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
        self.num_blocks = num_blocks
        Speculator = impl.load("speculative").Speculator
        Speculator(1, ec.num_speculative_tokens)  # refuse a bad k even while speculation is off
        self.speculator = (None if ec.speculative_ngram is None
                           else Speculator(ec.speculative_ngram, ec.num_speculative_tokens))
        self.scheduler, self.allocator = self._build_scheduler()
        # The runner: eager, or chapter 10's, which replays decode-only steps from CUDA
        # graphs. With it the pool has one block more than the allocator hands out:
        # the scratch block, where the runner's padding rows write their K/V.
        graphing = impl.load("cuda_graphs")  # chapter 10's runner: buckets and padding
        mode = graphing.runner_mode(ec.cuda_graphs, model.device, self.kernels)
        self.pool = KVPool(cfg.num_layers, num_blocks + (1 if mode else 0), ec.block_size, cfg.num_kv_heads,
                           cfg.head_dim, model.dtype, model.device)
        self.runner = (graphing.DecodeGraphs(model, self.pool, self.kernels, ec.max_num_seqs,
                                             scratch_block=num_blocks, capture=mode == "graphs") if mode
                       else ModelRunner(model, self.pool, self.kernels))
        self.requests: dict[int, Sequence] = {}  # request_id -> its state, while it waits or runs (every completion)
        keep = ec.keep_traces
        if keep is not None and (not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep_traces={keep!r}; it must be 0 (none), a positive int (the last N steps) "
                             f"or None (every step)")
        self.traces: deque[StepTrace] = deque(maxlen=keep)
        self.num_steps = 0

    def _build_scheduler(self):
        """A new scheduler over a new, empty allocator of `num_blocks` blocks: (scheduler, allocator)."""
        cfg, ec = self.model.config, self.config
        # The chapter components come through impl.load, so MINICB_IMPL=student
        # runs this very loop on the student's allocator and scheduler.
        if ec.enable_prefix_caching:
            allocator = impl.load("prefix_cache").CachingBlockAllocator(self.num_blocks, ec.block_size)
        else:
            allocator = impl.load("block_allocator").BlockAllocator(self.num_blocks, ec.block_size)
        scheduling = impl.load("scheduler")
        self.Sequence = scheduling.Sequence
        Scheduler = (impl.load("chunked_prefill").ChunkedScheduler if ec.enable_chunked_prefill
                     else scheduling.Scheduler)
        scheduler = Scheduler(allocator, ec.max_num_seqs, cfg.max_position_embeddings, cfg.eos_token_ids,
                              ec.max_num_batched_tokens, ec.watermark, self.speculator)
        return scheduler, allocator

    def reset(self) -> list[int]:
        """Forget every request and every cached block, keeping the pool's memory; return the
        ids of the requests dropped (every completion's).

        For after a step raised (a server keeps serving). The step may have stopped
        anywhere between schedule and postprocess, so nothing the scheduler or the
        allocator holds can be trusted: with prefix caching, blocks got their keys when
        they were scheduled, for K/V the forward never wrote. So both are built anew.
        Request ids keep counting: an id never names two requests, so an abort that
        arrives late for a dropped one cannot hit a new one.
        """
        dropped = list(self.requests)
        ids = getattr(self.scheduler, "_ids", None)  # a student's scheduler may count its own way
        self.scheduler, self.allocator = self._build_scheduler()
        if ids is not None:
            self.scheduler._ids = ids
        self.requests.clear()
        return dropped

    # ---- requests -------------------------------------------------------------------

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected (a ValueError naming the field at fault and a code) if the
        request can never be served. Changes nothing.

        These are all the rules a request must pass; `LLM` and the server ask here rather
        than restating them. It reads only sizes fixed at construction, so a server may
        call it from any thread.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        try:
            params.validate()  # the fields may have been changed after construction
        except ValueError as e:  # SamplingParams names the field first: "top_p=0.0; it must be in (0, 1]"
            raise RequestRejected(str(e), str(e).split("=", 1)[0], "invalid_value") from None
        # The scheduler's checks first: they cost nothing, and they bound the prompt that
        # the scan below walks by the model's context (a 100,000-id prompt is refused at once).
        self.scheduler.check_request(prompt_token_ids, params)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestRejected(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}", "prompt",
                                  "token_id_out_of_range")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> int:
        """Queue a request; returns its id. Raises (and queues nothing) if it can never be served."""
        prompt_token_ids = list(prompt_token_ids)
        self.check_request(prompt_token_ids, params)
        rid = self.scheduler.new_request_id()
        seq = self.Sequence(rid, prompt_token_ids, params,
                            arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        # Each completion samples with its own generator (seeded: seed and completion index).
        seq.generator = make_generator(params, self.model.device)
        seq.sibling_generators = [make_generator(params, self.model.device, c) for c in range(1, params.n)]
        self.scheduler.add(seq)
        self.requests[rid] = seq
        return rid

    def abort(self, request_id: int, completion: int | None = None) -> list[Sequence]:
        """Stop a request's waiting or running completions now (one, or all); returns them, and forgets them.

        request_id is what add_request returned. Each returned sequence ends with
        finish_reason "abort". Completion 0 of an n > 1 request aborted before its
        prompt was computed takes the other completions with it: they were never
        forked, and its `siblings_to_come` says how many. KeyError if none of them
        waits or runs.
        """
        victims = [seq for seq in self.requests.values() if seq.owner_id == request_id
                   and (completion is None or seq.completion == completion)]
        if not victims:
            which = "" if completion is None else f" completion {completion}"
            raise KeyError(f"request {request_id}{which} is not waiting or running")
        now = time.perf_counter()
        for seq in victims:
            self.scheduler.abort(seq.request_id)
            del self.requests[seq.request_id]
            seq.finish_time = now
        return victims

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------

    def step(self) -> StepOutput:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()  # 1. schedule
        seqs = out.sequences  # decodes first, then prefills
        # Who computed what where, read before postprocess frees the finished ones' slots.
        # (Admitted requests start at num_computed_tokens = their cached prefix.)
        work = [(s.request_id, s.slot, "decode" if s.is_decoding else "prefill", out.num_new_tokens(s),
                 s.num_computed_tokens) for s in seqs]
        num_outputs = [len(s.output_token_ids) for s in seqs]  # what each had before this step
        sampled: list[list[int]] = [[] for _ in seqs]
        if seqs:
            logits = self.runner(prepare(out, self.allocator))  # 2. prepare, 3. forward: [S, V]
            sampled = self.sample(out, logits)  # 4. sample
        now = time.perf_counter()
        finished = self.scheduler.postprocess(out, sampled, now)  # 5. postprocess
        for seq in out.forked:  # completions born this step (n > 1)
            self.requests[seq.request_id] = seq
        for seq in finished:
            del self.requests[seq.request_id]  # handed out below; the engine keeps nothing
        result = StepOutput(finished=finished)
        # The tokens postprocess appended, in batch order: a speculating request's run in order,
        # and a request that forked now in completion order (its completions' first tokens).
        born = {}
        for child in out.forked:
            born.setdefault(child.parent_id, []).append(child)
        appended = [(completion, token) for seq, before in zip(seqs, num_outputs)
                    for completion in [seq] + born.get(seq.request_id, [])
                    for token in completion.output_token_ids[before if completion is seq else 0:]]
        for completion, token in appended:
            result.new_tokens.append(NewToken(completion.owner_id, completion.completion, token))
            completion.token_times.append(now)  # for inter-token latency
        self.num_steps += 1
        if self.traces.maxlen != 0:
            result.trace = self._trace(out, work, sampled, appended, result, time.perf_counter() - t0)
            self.traces.append(result.trace)
        return result

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[list[int]]:
        """The tokens of each scheduled sequence (out.sequences order), from logits [R, V], one row each
        (1 + k rows for a decode verifying k drafts: minicb/model_runner.py).

        A sequence that computed its last token gets one token, from its own
        generator; a request with n > 1 completions that has not forked yet gets n,
        all from its row, each from its completion's generator. A chunk of a
        longer prompt (chapter 08) gets none: its last row predicts a prompt token.
        A request verifying k drafts has k + 1 rows, and gets what the speculator
        accepts of them plus one more token (chapter 11).
        """
        rows, params, generators, counts, verified = [], [], [], [], {}
        row = 0
        for i, seq in enumerate(out.sequences):
            drafts = out.drafts(seq)
            if drafts:
                verified[i] = self.speculator.verify(logits[row:row + len(drafts) + 1], drafts, seq.params,
                                                     seq.generator)
                row += len(drafts) + 1
                counts.append(0)
                continue
            done = seq.num_computed_tokens + out.num_new_tokens(seq) == seq.num_tokens
            completions = [seq.generator] + seq.sibling_generators if done else []
            rows += [row] * len(completions)
            params += [seq.params] * len(completions)
            generators += completions
            counts.append(len(completions))
            row += 1
        tokens = sample(logits[rows], params, generators) if rows else []
        sampled, start = [], 0
        for i, count in enumerate(counts):
            sampled.append(verified.get(i, tokens[start:start + count]))
            start += count
        return sampled

    def _trace(self, out, work, sampled, appended, result: StepOutput, seconds: float) -> StepTrace:
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
            new_tokens=[(seq.request_id, token) for seq, token in appended],
            speculation=[(seq.request_id, out.drafts(seq), len(tokens) - 1, tokens[-1])
                         for seq, tokens in zip(out.sequences, sampled) if out.drafts(seq)],
            cached_free_blocks=self.allocator.cached_free_blocks(),
            shared_blocks=sorted(block for block, count in holders.items() if count > 1),
            cached_tokens=[(request_id, cached) for request_id, _, _, _, cached in work if request_id in admitted],
            # Chunked prefill never exceeds it; whole-prompt admission uses it to admit, but a
            # prompt longer than the budget still runs whole when nothing else does.
            token_budget=self.config.max_num_batched_tokens,
        )
