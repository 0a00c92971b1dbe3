"""The public API: `LLM` and its outputs, on top of chapter 06's engine.

    from minicb import LLM, SamplingParams
    llm = LLM()                                   # embedded SmolLM2; cuda if available else cpu
    outs = llm.generate(["What is 2+2?"], SamplingParams(max_tokens=64))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].metrics

Prompts are strings (tokenized as they are), token-id lists, or, through
`chat`, lists of {"role", "content"} messages (the model's chat template is
applied). Everything is checked before anything is queued: a bad request raises
a ValueError naming what was wrong, and the same `LLM` keeps serving.

`build(model, **engine_config)` makes what an `LLM` runs on (the model, its
tokenizer, an engine); the server (minicb/serve/server.py) uses it too. Engine
settings are EngineConfig's fields by name (minicb/config.py says what each does).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Iterator, NamedTuple

from minicb.engine import Engine, EngineConfig
from minicb.logprobs import TokenLogprob
from minicb.model import Model
from minicb.sampling import SamplingParams
from minicb.scheduler import RequestRejected, Sequence
from minicb.trace import StepTrace


@dataclass
class RequestMetrics:
    arrival_time: float  # seconds since the generate() call started
    first_token_time: float | None  # when the first output token was sampled
    finish_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (enable_prefix_caching)
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled, like the others
    # Speculative decoding (speculative_ngram): draft tokens proposed and accepted, and the decode
    # steps it took (each yields 1 token, plus the drafts it accepted).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_decode_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / proposed drafts; None if none were proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """1 + accepted drafts per decode step: each step's own token plus the drafts it accepted (1.0
        without speculation); None before any decode step."""
        return (self.num_decode_steps + self.num_accepted_tokens) / self.num_decode_steps if self.num_decode_steps \
            else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive output tokens (ITL), len(token_times) - 1 of them."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of a request's n completions (SamplingParams.n)."""

    index: int  # 0 .. n-1
    token_ids: list[int]  # generated tokens, with the EOS/stop token that ended them
    text: str | None  # decoded (special tokens skipped); None without a tokenizer
    finish_reason: str  # "stop" | "length" | "abort"
    # SamplingParams.logprobs: each token's score (minicb/logprobs.py: logprob, rank, top k); else None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    index: int  # position in the list given to generate()
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, with the EOS/stop token that ended them (completion 0's)
    text: str | None  # decoded (special tokens skipped); None without a tokenizer
    finish_reason: str  # "stop" | "length" | "abort"
    metrics: RequestMetrics  # completion 0's times; first_token_time is the request's first token
    outputs: list[CompletionOutput] = field(default_factory=list)  # all n completions (one when n = 1)
    # SamplingParams.prompt_logprobs: each prompt token's score, None for the first; else None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class StreamEvent:
    index: int  # which prompt
    token_id: int
    output: RequestOutput | None = None  # set on the request's last token (its last completion's)
    completion: int = 0  # which of the request's n completions the token belongs to


class Built(NamedTuple):
    """What `build` makes: a model, its tokenizer (None if it has none) and an engine on the model."""

    model: Model
    tokenizer: object | None  # minicb.tokenizer.Tokenizer: encode, decode, apply_chat_template
    engine: Engine


def engine_config_from(settings: dict) -> EngineConfig:
    """EngineConfig from {field: value}, refusing a name that is not a field, with the allowed ones."""
    names = [f.name for f in fields(EngineConfig)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(f"unknown engine setting(s) {', '.join(map(repr, unknown))}; the settings are "
                        f"EngineConfig's fields (minicb/config.py): {', '.join(names)}")
    return EngineConfig(**settings)


def build(model: str | None = None, device: str | None = None, dtype: str = "float32", **engine_config) -> Built:
    """Load a model and its tokenizer and build an engine on them: what `LLM` and the server run.

    model: None for the embedded SmolLM2, a .gguf file, or an HF checkpoint directory.
    device: None for cuda when available, else cpu. engine_config: EngineConfig's
    fields, checked by name before anything loads; unset ones keep its defaults.
    """
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    config = engine_config_from(engine_config)  # a misspelt setting costs no loading time
    net = load_model(model, device=device, dtype=dtype)
    tokenizer = None
    try:
        tokenizer = load_tokenizer(model)
    except (OSError, ValueError):
        if model is None:
            raise  # the embedded model always has a tokenizer; this is a real error
    return Built(net, tokenizer, Engine(net, config, grammars=grammars_for(tokenizer, net, config)))


def grammars_for(tokenizer, net: Model, config: EngineConfig):
    """What compiles structured output for an engine on `net` (chapter 12); None without a tokenizer."""
    if tokenizer is None:
        return None
    from minicb.structured.guide import Grammars
    return Grammars.for_tokenizer(tokenizer, net.config.eos_token_ids, net.config.vocab_size, config.structured_backend,
                                  config.jump_forward)


class LLM:
    """A model, its tokenizer and a continuous-batching engine."""

    def __init__(self, model: str | None = None, device: str | None = None, dtype: str = "float32",
                 **engine_config):
        """model: None for the embedded SmolLM2, a .gguf file, or an HF checkpoint directory.
        device: None for cuda when available, else cpu.
        engine_config: the engine's settings, EngineConfig's fields by name; each field's help
        in minicb/config.py (or `python -m minicb serve --help`) says what it does. Among them:
        max_num_seqs (slots), num_blocks (the KV pool), attention ("torch" or "triton"),
        enable_prefix_caching (chapter 07; metrics.num_cached_tokens says how many prompt
        tokens it served), enable_chunked_prefill with max_num_batched_tokens (chapter 08),
        cuda_graphs (chapter 10), speculative_ngram and num_speculative_tokens (chapter 11).
        `llm.traces` holds every step of the last call, for the pictures (the engine builds a
        StepTrace for whoever asks; its own keep_traces is about Engine.traces).
        An unknown setting raises a TypeError that lists the allowed ones."""
        self._setup(*build(model, device, dtype, **engine_config))

    @classmethod
    def from_model(cls, net: Model, tokenizer=None, **engine_config) -> "LLM":
        """Wrap an already built model, e.g. `minicb.model.random_model()` in tests.
        engine_config: EngineConfig's fields, as above."""
        llm = cls.__new__(cls)
        config = engine_config_from(engine_config)
        llm._setup(net, tokenizer, Engine(net, config, grammars=grammars_for(tokenizer, net, config)))
        return llm

    def _setup(self, net: Model, tokenizer, engine: Engine) -> None:
        self.model, self.tokenizer, self.engine = net, tokenizer, engine
        self.traces: list[StepTrace] = []  # the last call's steps, for minicb.viz, the demo and the bench

    # ---- turning user input into token ids -------------------------------------------

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            if not prompt:
                raise ValueError("the prompt is empty; give at least one token")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _requests(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = [self._encode(p) for p in prompts]
        params = params if params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        # All or nothing: check every request before queueing any. The engine's verdict
        # (a RequestRejected, which is a ValueError) keeps its field and code, and says which prompt.
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                self.engine.check_request(p, sp)
            except RequestRejected as e:
                raise RequestRejected(f"prompt {i}: {e}", e.param, e.code) from None
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return prompts, params

    # ---- running -----------------------------------------------------------------------

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
               arrival_times: list[float] | None = None) -> Iterator[StreamEvent]:
        """Yield each new token as it is sampled. `arrival_times` (seconds from now) simulates online traffic.

        Every request is checked here, before the first token: a bad one raises
        at once and nothing is queued.
        """
        prompts, params = self._requests(prompts, params)
        if arrival_times is not None and len(arrival_times) != len(prompts):
            raise ValueError(f"got {len(arrival_times)} arrival times for {len(prompts)} prompts")
        return self._events(prompts, params, arrival_times)

    def _events(self, prompts, params, arrival_times) -> Iterator[StreamEvent]:
        # Everything here comes from what engine.step() returns: the new tokens, each
        # named by its request and completion, and the finished completions, which
        # the engine hands over and forgets.
        arrivals = sorted(range(len(prompts)), key=lambda i: arrival_times[i] if arrival_times else 0.0)
        start = time.perf_counter()
        index_of: dict[int, int] = {}  # request id -> prompt index
        done: dict[int, dict[int, Sequence]] = {}  # prompt index -> completion -> finished Sequence
        live: set[int] = set()  # this call's requests with a completion still waiting or running
        self.traces = []
        pending = list(arrivals)
        try:
            while pending or self.engine.has_unfinished():
                now = time.perf_counter() - start
                while pending and (arrival_times is None or arrival_times[pending[0]] <= now):
                    i = pending.pop(0)
                    arrive = start + (arrival_times[i] if arrival_times else 0.0)
                    rid = self.engine.add_request(prompts[i], params[i], arrival_time=arrive)
                    index_of[rid], done[i] = i, {}
                    live.add(rid)
                if not self.engine.has_unfinished():
                    time.sleep(max(0.0, arrival_times[pending[0]] - now))  # idle until the next arrival
                    continue
                step = self.engine.step(trace=True)
                self.traces.append(step.trace)
                for seq in step.finished:
                    i = index_of[seq.request_id]
                    done[i][seq.completion] = seq
                    if len(done[i]) == params[i].n:
                        live.discard(seq.request_id)
                # A request's output goes with the last token of its last completion to finish
                # (several of its completions can finish in the same step).
                last_token_of = {index_of[t.request_id]: k for k, t in enumerate(step.new_tokens)}
                for k, t in enumerate(step.new_tokens):
                    i = index_of[t.request_id]
                    last = len(done[i]) == params[i].n and last_token_of[i] == k
                    output = self._output(done[i], i, start) if last else None
                    yield StreamEvent(i, t.token, output, t.completion)
        finally:
            for rid in live:  # a caller that stops early leaves nothing running
                self.engine.abort(rid)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, arrival_times: list[float] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        from tqdm.auto import tqdm

        events = self.stream(prompts, params, arrival_times)
        outputs: dict[int, RequestOutput] = {}
        total = None if isinstance(prompts, str) else len(prompts)
        with tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm) as bar:
            for event in events:
                if event.output is not None:
                    outputs[event.index] = event.output
                    bar.update(1)
        return [outputs[i] for i in sorted(outputs)]

    def chat(self, conversations: list[list[dict]], params=None, **kwargs) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        return self.generate([self.tokenizer.apply_chat_template(c) for c in conversations], params, **kwargs)

    def _output(self, completions: dict[int, Sequence], index: int, start: float) -> RequestOutput:
        """A finished request's output from its completions' Sequences, with times relative to `start`."""
        rel = (lambda t: None if t is None else t - start)
        decode = (lambda ids: self.tokenizer.decode(ids) if self.tokenizer else None)
        outputs = [CompletionOutput(c, list(seq.output_token_ids), decode(seq.output_token_ids), seq.finish_reason,
                                    list(seq.logprobs) if seq.params.logprobs is not None else None)
                   for c, seq in sorted(completions.items())]
        first = completions[0]
        return RequestOutput(
            index=index, prompt_token_ids=list(first.prompt_token_ids), token_ids=outputs[0].token_ids,
            text=outputs[0].text, finish_reason=outputs[0].finish_reason,
            metrics=RequestMetrics(rel(first.arrival_time), rel(first.first_token_time), rel(first.finish_time),
                                   first.num_preemptions, first.num_cached_tokens,
                                   [t - start for t in first.token_times], first.num_draft_tokens,
                                   first.num_accepted_tokens, first.num_decode_steps),
            outputs=outputs, prompt_logprobs=first.prompt_logprobs,
        )
