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
                    sequences and frees their blocks, and returns what it did (a StepResult)

and returns a `StepOutput`, built from that result alone: every new token, named
by its request and completion, the sequences that finished, and what metrics
need (tokens computed, drafts, cached prompt tokens, the queues and the pool).
The engine is made of parts it is given: `EngineParts` (minicb/parts.py) builds
them from the `EngineConfig`, out of the reference's code or a student's. Because a finished sequence leaves at the end of the
step that finished it, the next step's `schedule()` can put a waiting request
straight into its slot: no row of the batch ever idles while work is waiting.
That is the whole trick.

    engine = Engine(model, EngineConfig(max_num_seqs=8))
    rid = engine.add_request([1, 422, 88], SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        out = engine.step()
        for seq in out.finished:            # each finished completion is handed out once,
            print(seq.request_id, seq.completion, seq.output_token_ids, seq.finish_reason)  # then forgotten

The engine keeps a request (its `Sequence`s, minicb/scheduler.py) only while it
waits or runs, so a server can run it for weeks. A step builds a `StepTrace`
for the pictures (minicb/trace.py) only when asked, `step(trace=True)`, or when
`keep_traces` keeps the last N.
`minicb.llm.LLM` wraps this with a tokenizer, progress bars and output objects.
Chapter text: chapters/06-continuous-batching/README.md.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from minicb.config import EngineConfig  # the settings (minicb/config.py); importable from here too
from minicb.cpu_ops import use_cpu_ops
from minicb.linear_backend import use_linear_backend
from minicb.logprobs import PromptScoreCache, PromptToScore, TokenLogprob, prompt_logprobs, token_logprobs
from minicb.model import Model
from minicb.model_runner import prepare
from minicb.parts import EngineParts
from minicb.sampling import SamplingParams, apply_rules, make_generator, sample
from minicb.scheduler import RequestRejected, Sequence, SchedulerOutput, StepResult
from minicb.structured.guide import Grammars
from minicb.trace import SlotState, StepTrace
from minicb.weights import cache_dir


class NewToken(NamedTuple):
    """One sampled token, named by what the caller knows: its request and which completion."""

    request_id: int  # the id add_request returned
    completion: int  # which of the request's n completions (0 when n = 1)
    token: int
    logprobs: TokenLogprob | None = None  # its score, when the request asked (SamplingParams.logprobs)


@dataclass(frozen=True)
class EngineLimits:
    """The sizes an engine is built with, fixed for its life: what a server needs to answer requests."""

    max_model_len: int  # the model's context: prompt + outputs
    num_blocks: int  # KV blocks the allocator hands out
    block_size: int
    max_num_seqs: int

    def default_max_tokens(self, prompt_len: int) -> int:
        """As many tokens as the context and the pool leave after the prompt; at least 1 (a prompt
        that leaves no room is the engine's check to refuse, naming the prompt)."""
        return max(1, min(self.max_model_len, self.num_blocks * self.block_size) - prompt_len)


@dataclass(frozen=True)
class EngineStats:
    """The queues and the pool at one moment: after a step, or after aborts (Engine.stats())."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int  # with prefix caching, cached blocks nobody holds count as free (they can be reused)
    num_cached_free_blocks: int  # free blocks that still hold a cached prefix (0 without caching)


@dataclass
class StepOutput:
    """What one step did. The engine keeps none of it; metrics, pictures and a server observe it."""

    new_tokens: list[NewToken] = field(default_factory=list)  # in batch order
    # Completions that ended this step (seq.request_id and seq.completion name them); the engine has let go of them.
    finished: list[Sequence] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens the forward computed: prompt chunks, decodes, drafts
    num_draft_tokens: int = 0  # chapter 11: draft tokens verified this step
    num_accepted_tokens: int = 0  # of them, accepted
    num_cached_tokens: int = 0  # prompt tokens of the requests admitted now that the prefix cache served
    # request_id -> its prompt's scores (None first), in the step its prompt was computed, when it asked
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    stats: EngineStats | None = None  # the queues and the pool after the step
    time_s: float = 0.0  # the step's wall time
    trace: StepTrace | None = None  # the step's picture, when keep_traces or the caller asks for one


class Engine:
    def __init__(self, model: Model, config: EngineConfig | None = None, parts: EngineParts | None = None,
                 grammars: Grammars | None = None):
        """An engine over `model`, made of what `parts` builds from `config`.

        parts: the factory of the parts (minicb/parts.py); by default the reference's
        code, or a student's where MINICB_IMPL says so. Everything the engine is
        made of is built here, once. grammars: what compiles requests' structured
        output (chapter 12, minicb/structured/guide.py), made from the model's
        tokenizer (`build` gives one); without it such requests are refused.
        """
        if parts is not None and config is not None and parts.config is not config:
            raise ValueError("Engine(model, config, parts): parts were made from another EngineConfig; pass "
                             "parts alone (the engine takes parts.config) or make them from this config")
        self.model, self.config = model, config or (parts.config if parts is not None else EngineConfig())
        self.config.validate()  # its fields may have been changed since it was made
        self.parts = parts or EngineParts.from_environment(self.config)
        # The matmul library of each packed linear layer, by row count: measured for "auto", or read
        # from what an earlier engine on this CPU measured (minicb/linear_backend.py).
        self.linear_choice = use_linear_backend(model, self.config.linear_backend,
                                                rows=sorted({1, 4, self.config.max_num_seqs}),
                                                cache=cache_dir() / "linear_choice.json")
        # A CPU model's norms, rotary and SwiGLU: compiled kernels or chapter 00's PyTorch (minicb/cpu_ops.py).
        self.cpu_ops = use_cpu_ops(model, self.config.cpu_ops)
        self.num_blocks = self.parts.num_blocks(model)
        self.seq_ids = itertools.count()  # every sequence's id (a request is named by its first), never reused
        self.attention = self.parts.attention(model)  # minicb/attention_backends.py
        self.speculator = self.parts.speculator()  # chapter 11's, or None
        self.allocator = self.parts.allocator(self.num_blocks)  # chapter 03's or 07's
        self.scheduler = self.parts.scheduler(self.allocator, model, self.speculator, self.seq_ids)
        self.pool, self.runner = self.parts.runner(model, self.num_blocks, self.attention)  # eager or chapter 10's
        self.Sequence = self.parts.sequence_type()
        self.limits = EngineLimits(model.config.max_position_embeddings, self.num_blocks, self.config.block_size,
                                   self.config.max_num_seqs)
        self.sequences: dict[int, Sequence] = {}  # seq_id -> its state, while it waits or runs (every completion)
        self.prompt_scores = PromptScoreCache(self.config.block_size)  # scored prompt blocks (minicb/logprobs.py)
        self.grammars = grammars
        if grammars is not None:  # chapter 12's code, the reference's or a student's, compiles and masks
            grammars.use(self.parts.token_mask())
        # Guided requests whose grammar is still compiling: seq_id -> (sequence, Future of the grammar).
        # They join the scheduler when it is ready (_admit_compiled), so nobody waits for a compile.
        self.compiling: dict[int, tuple[Sequence, Future]] = {}
        self.traces: deque[StepTrace] = deque(maxlen=self.config.keep_traces)
        self.num_steps = 0

    def reset(self) -> list[int]:
        """Forget every request and every cached block, keeping the pool's memory; return the
        ids of the requests dropped.

        For after a step raised (a server keeps serving). The step may have stopped
        anywhere between schedule and postprocess, so nothing the scheduler or the
        allocator holds can be trusted: with prefix caching, blocks got their keys when
        they were scheduled, for K/V the forward never wrote. So both are built anew.
        Request ids keep counting (the engine's counter goes to the new scheduler): an
        id never names two requests, so an abort that arrives late for a dropped one
        cannot hit a new one.
        """
        dropped = sorted({seq.request_id for seq in self.sequences.values()})
        self.allocator = self.parts.allocator(self.num_blocks)
        self.scheduler = self.parts.scheduler(self.allocator, self.model, self.speculator, self.seq_ids)
        self.sequences.clear()
        self.compiling.clear()
        return dropped

    def stats(self) -> EngineStats:
        """The queues and the pool now. Call it on the thread that owns the engine."""
        allocator = self.allocator
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), allocator.num_blocks,
                           allocator.num_free_blocks, len(allocator.cached_free_blocks()))

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
        if params.prompt_logprobs is not None and self.pool.hidden is None:
            raise RequestRejected("prompt_logprobs: this engine's KV pool keeps no hidden states (KVPool's "
                                  "hidden_size), so it cannot score prompts", "prompt_logprobs", "unsupported")
        if params.structured is not None:
            if self.grammars is None:
                raise RequestRejected("structured output needs the model's vocabulary, and this engine was built "
                                      "without a tokenizer (Engine(..., grammars=Grammars(tokenizer, ...)))",
                                      "structured", "unsupported")
            try:
                self.grammars.check(params.structured)
            except ValueError as e:  # a schema keyword or regex construct that is not supported, named
                raise RequestRejected(str(e), "structured", "unsupported_value") from None
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
        rid = next(self.seq_ids)  # the request's id is its first sequence's
        seq = self.Sequence(rid, prompt_token_ids, params,
                            arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        # Each completion samples with its own generator (seeded: seed and completion index).
        seq.generator = make_generator(params, self.model.device)
        seq.sibling_generators = [make_generator(params, self.model.device, c) for c in range(1, params.n)]
        self.sequences[rid] = seq
        if params.structured is not None:  # it waits for its grammar outside the scheduler (chapter 12)
            self.compiling[rid] = (seq, self.grammars.compile(params.structured))
        else:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: int, completion: int | None = None) -> list[Sequence]:
        """Stop a request's waiting or running completions now (one, or all); returns them, and forgets them.

        request_id is what add_request returned. Each returned sequence ends with
        finish_reason "abort". Completion 0 of an n > 1 request aborted before its
        prompt was computed takes the other completions with it: they were never
        forked, and its `siblings_to_come` says how many. KeyError if none of them
        waits or runs.
        """
        victims = [seq for seq in self.sequences.values() if seq.request_id == request_id
                   and (completion is None or seq.completion == completion)]
        if not victims:
            which = "" if completion is None else f" completion {completion}"
            raise KeyError(f"request {request_id}{which} is not waiting or running")
        now = time.perf_counter()
        for seq in victims:
            if self.compiling.pop(seq.seq_id, None) is None:  # not waiting for its grammar: the scheduler has it
                self.scheduler.abort(seq.seq_id)
            del self.sequences[seq.seq_id]
            seq.finish_time = now
        return victims

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.compiling)

    def _admit_compiled(self) -> list[Sequence]:
        """Hand the scheduler the guided requests whose grammar is ready, each with its Guide; return
        the ones whose grammar failed to compile (too large an automaton, say), ended with finish_reason
        "abort" and the reason in seq.error."""
        failed = []
        for seq_id, (seq, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[seq_id]
            if future.exception() is not None:
                seq.error, seq.finish_reason, seq.finish_time = str(future.exception()), "abort", time.perf_counter()
                del self.sequences[seq_id]
                failed.append(seq)
                continue
            seq.guide = self.grammars.guide(future.result())
            self.scheduler.add(seq)
        return failed

    def wait_for_grammars(self, timeout: float | None = None) -> None:
        """Block until no request waits for its grammar (for a caller with nothing else to step)."""
        for _, future in list(self.compiling.values()):
            future.exception(timeout)

    # ---- one step -------------------------------------------------------------------

    def step(self, trace: bool = False) -> StepOutput:
        """Run one step: schedule, prepare, forward, sample, postprocess. trace: build this step's
        StepTrace even when the engine keeps none (keep_traces=0), for a caller that draws it."""
        began = time.perf_counter()
        if self.compiling and not self.scheduler.has_unfinished():  # nothing to run but a compile: wait a little
            wait([future for _, future in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        failed = self._admit_compiled() if self.compiling else []  # chapter 12: grammars that are ready
        out = self.scheduler.schedule()  # 1. schedule
        tracing = trace or self.traces.maxlen != 0
        placed = out.placements() if tracing else []  # who ran where: postprocess frees finished slots
        sampled, scores, prompt_scores = [], [], {}
        if not out.is_empty:
            logits = self.runner(prepare(out, self.allocator))  # 2. prepare, 3. forward: [rows, V]
            sampled = self.sample(out, logits)  # 4. sample
            scores, prompt_scores = self.score(out, logits, sampled), self.score_prompts(out)  # if asked
        result = self.scheduler.postprocess(out, sampled, time.perf_counter())  # 5. postprocess
        self._advance_guides(result)
        output = self._output(out, result, began, scores, prompt_scores)
        output.finished += failed
        if tracing:
            output.trace = self._trace(out, placed, sampled, result, output.time_s)
            self.traces.append(output.trace)  # a deque of maxlen 0 keeps nothing
        return output

    def _output(self, out: SchedulerOutput, result: StepResult, began: float, scores: list[list[TokenLogprob]],
                prompt_scores: dict[int, list]) -> StepOutput:
        """The step's StepOutput, from what postprocess returned; the engine lets go of finished completions.

        scores[i] (score's) are out.sequences[i]'s sampled tokens' scores, in sampled order;
        postprocess appended those tokens to the completions in that order (a forking
        request's to its n completions, one each), so each appended token takes the next score.
        """
        self.num_steps += 1
        for seq in result.forked:
            self.sequences[seq.seq_id] = seq
        for seq in result.finished:
            del self.sequences[seq.seq_id]  # handed out in the output; the engine keeps nothing
        pending: dict[int, deque] = {}  # seq_id of a completion -> the scores of the tokens appended to it
        for seq, entries in zip(out.sequences, scores):
            if entries and out.drafts(seq):
                pending[seq.seq_id] = deque(entries)
            elif entries:  # one token, or the first token of each of its n completions
                forked = sorted((c for c in out.forked if c.request_id == seq.request_id), key=lambda c: c.completion)
                for completion, entry in zip([seq] + forked, entries):
                    pending[completion.seq_id] = deque([entry])
        new_tokens = []
        for c, token in result.new_tokens:
            entry = pending[c.seq_id].popleft() if c.seq_id in pending else None
            if entry is not None:
                c.logprobs.append(entry)
            new_tokens.append(NewToken(c.request_id, c.completion, token, entry))
        admitted = set(out.admitted)
        return StepOutput(
            new_tokens=new_tokens, prompt_logprobs=prompt_scores,
            finished=result.finished, num_computed_tokens=sum(out.num_scheduled.values()),
            num_draft_tokens=result.num_draft_tokens, num_accepted_tokens=result.num_accepted_tokens,
            num_cached_tokens=sum(s.num_cached_tokens for s in out.prefills if s.seq_id in admitted
                                  and s.num_preemptions == 0),
            stats=self.stats(), time_s=time.perf_counter() - began)

    def _advance_guides(self, result: StepResult) -> None:
        """Chapter 12: each guided completion's grammar state takes the tokens postprocess gave it.
        A completion forked this step starts from its parent's state before the parent's first token."""
        for child in result.forked:
            parent = self.sequences[child.request_id]  # completion 0: its seq_id is the request's id
            child.guide = parent.guide.fork() if parent.guide is not None else None
        for seq, token in result.new_tokens:
            if seq.guide is not None:
                seq.guide.accept(token)

    def sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[list[int]]:
        """The tokens of each scheduled sequence (out.sequences order), from logits [R, V], one row each
        (1 + k rows for a decode verifying k drafts: minicb/model_runner.py).

        A sequence that computed its last token gets one token, from its own
        generator; a request with n > 1 completions that has not forked yet gets n,
        all from its row, each from its completion's generator. A chunk of a
        longer prompt (chapter 08) gets none: its last row predicts a prompt token.
        A request verifying k drafts has k + 1 rows, and gets what the speculator
        accepts of them plus one more token (chapter 11).
        A request's rules that read its history (min_tokens, penalties) apply to
        its rows first: row j of a verify comes after the output and drafts[:j].
        So does a guided request's grammar mask (chapter 12), before them.
        """
        rows, params, generators, histories, counts, verified = [], [], [], [], [], {}
        guided = {}  # index into rows of a guided sequence's first row -> (its Guide, its rows)
        eos = self.model.config.eos_token_ids
        row = 0
        for i, seq in enumerate(out.sequences):
            drafts = out.drafts(seq)
            if drafts:
                seen = None if not seq.params.history_rules else [  # row j's history: output + drafts[:j]
                    (seq.prompt_token_ids, seq.output_token_ids + drafts[:j]) for j in range(len(drafts) + 1)]
                scored = logits[row:row + len(drafts) + 1]
                if seq.guide is not None:
                    scored = seq.guide.mask_rows(scored, drafts)
                scored = apply_rules(scored, [seq.params] * (len(drafts) + 1), seen, eos)
                verified[i] = self.speculator.verify(scored, drafts, seq.params, seq.generator)
                row += len(drafts) + 1
                counts.append(0)
                continue
            done = seq.num_computed_tokens + out.num_new_tokens(seq) == seq.num_tokens
            completions = [seq.generator] + seq.sibling_generators if done else []
            if completions and seq.guide is not None:
                guided[len(rows)] = (seq.guide, len(completions))
            rows += [row] * len(completions)
            params += [seq.params] * len(completions)
            generators += completions
            histories += [(seq.prompt_token_ids, seq.output_token_ids)] * len(completions)  # lists, not copies
            counts.append(len(completions))
            row += 1
        # [len(rows), V]: a copy, which a grammar's mask may write. Unguided rows sampled once each, in
        # order (all decoding, none forking), read the logits themselves: the copy of 32 x 49,152 floats
        # took 1.5 ms of a step, and sampling writes nothing (apply_rules copies before it changes a row).
        unchanged = not guided and rows == list(range(logits.shape[0]))
        picked = logits if unchanged else logits[rows]
        if guided:  # one mask over all rows (a free row allows everything), applied in one pass
            allowed = torch.ones(picked.shape, dtype=torch.bool, device=picked.device)
            for first, (guide, count) in guided.items():  # n > 1: a forking request's n rows share one state
                allowed[first:first + count] = guide.allowed([]).to(picked.device)
            picked = self.grammars.mask_logits(picked, allowed)
        tokens = sample(picked, params, generators, histories, eos) if rows else []
        sampled, start = [], 0
        for i, count in enumerate(counts):
            sampled.append(verified.get(i, tokens[start:start + count]))
            start += count
        return sampled

    def score(self, out: SchedulerOutput, logits: torch.Tensor, sampled: list[list[int]]) -> list[list[TokenLogprob]]:
        """The scores of the sampled tokens of the sequences that asked (params.logprobs), from the rows
        they were sampled from (minicb/logprobs.py); [] for the others. [] for all, at no cost, when
        nobody asked.

        A verifying decode's token j comes from its row j; every other sequence's
        tokens (1, or n when it forks now) from its one row.
        """
        if all(seq.params.logprobs is None for seq in out.sequences):
            return []
        rows, tokens, counts, row = [], [], [], 0  # one scoring call for the whole step
        for seq, sampled_tokens in zip(out.sequences, sampled):
            asks = seq.params.logprobs is not None
            count = len(sampled_tokens) if asks else 0
            rows += [row + j for j in range(count)] if out.drafts(seq) else [row] * count
            tokens += sampled_tokens[:count]
            counts.append(count)
            row += 1 + len(out.drafts(seq))
        k = max(seq.params.logprobs or 0 for seq in out.sequences)
        entries = token_logprobs(logits[rows], tokens, k)
        scores, start = [], 0
        for seq, count in zip(out.sequences, counts):
            mine = entries[start:start + count]
            scores.append([TokenLogprob(e.token_id, e.logprob, e.rank, e.top[:seq.params.logprobs]) for e in mine])
            start += count
        return scores

    def score_prompts(self, out: SchedulerOutput) -> dict[int, list[TokenLogprob | None]]:
        """request_id -> the prompt's scores, for each request that asked (params.prompt_logprobs) and
        whose prompt is now all computed, once (completion 0 carries them: a forked completion
        recomputing its prompt after a preemption scores nothing). They are read from the final
        hidden states the pool keeps at the prompt's slots, whichever step, chunk or cached block
        computed them, all of the step's prompts in one scoring call (minicb/logprobs.py)."""
        ready = [seq for seq in out.prefills
                 if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None and seq.completion == 0
                 and seq.num_computed_tokens + out.num_new_tokens(seq) >= len(seq.prompt_token_ids)]
        if not ready:
            return {}

        def hidden_at(seq: Sequence) -> Callable[[int, int], torch.Tensor]:
            def at(start: int, end: int) -> torch.Tensor:  # [end - start, hidden], positions [start, end)
                slots = self.allocator.slot_mapping(seq.seq_id, start, end)
                return self.pool.hidden[torch.tensor(slots, dtype=torch.int64, device=self.pool.hidden.device)]
            return at

        prompts = [PromptToScore(seq.prompt_token_ids, seq.params.prompt_logprobs, hidden_at(seq)) for seq in ready]
        for seq, entries in zip(ready, prompt_logprobs(self.model, prompts, self.prompt_scores)):
            seq.prompt_logprobs = entries
        return {seq.request_id: seq.prompt_logprobs for seq in ready}

    def _trace(self, out: SchedulerOutput, placed, sampled, result: StepResult, seconds: float) -> StepTrace:
        slots = [SlotState(None, "empty", 0) for _ in range(self.config.max_num_seqs)]
        for seq_id, slot, phase, num_tokens, _ in placed:
            slots[slot] = SlotState(seq_id, phase, num_tokens)
        num_tokens = sum(s.num_tokens for s in slots)
        admitted = set(out.admitted)
        holders = Counter(block for seq in self.scheduler.running
                          for block in self.allocator.block_table(seq.seq_id))
        return StepTrace(
            step=self.num_steps - 1, slots=slots,
            admitted=list(out.admitted),
            finished=[(s.seq_id, s.finish_reason) for s in result.finished],
            preempted=list(out.preempted),
            waiting=[s.seq_id for s in self.scheduler.waiting],
            running=[s.seq_id for s in self.scheduler.running],
            num_free_blocks=self.allocator.num_free_blocks,
            num_blocks=self.allocator.num_blocks,
            block_owners=self.allocator.block_owners(),
            num_tokens=num_tokens, num_useful_tokens=num_tokens,  # no padding, no idle rows
            time_s=seconds,
            new_tokens=[(seq.seq_id, token) for seq, token in result.new_tokens],
            speculation=[(seq.seq_id, out.drafts(seq), len(tokens) - 1, tokens[-1])
                         for seq, tokens in zip(out.sequences, sampled) if out.drafts(seq)],
            cached_free_blocks=self.allocator.cached_free_blocks(),
            shared_blocks=sorted(block for block, count in holders.items() if count > 1),
            cached_tokens=[(seq_id, cached) for seq_id, _, _, _, cached in placed if seq_id in admitted],
            # Chunked prefill never exceeds it; whole-prompt admission uses it to admit, but a
            # prompt longer than the budget still runs whole when nothing else does.
            token_budget=self.config.max_num_batched_tokens,
        )
