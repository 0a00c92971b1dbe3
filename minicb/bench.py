"""The benchmark: minicb's three engines against HF transformers, on the same weights.

In this file you will learn how to measure a serving engine honestly:
- throughput (output tokens/s, requests/s) says how much work the machine gets
  through; latency (per request: mean, p50, p99), TTFT (time to first token)
  and TPOT (time per output token after the first) say how long a user waits;
- slot utilisation (useful tokens / tokens computed), busy slots (the share
  of slot-steps that held a live request) and KV memory waste (reserved KV
  slots that hold no token) say *why* one engine beats another;
- every engine sees the same prompts, the same greedy parameters and the same
  clock, and the ratios come from one run, so noise hits them all alike.

    python -m minicb bench                        # the chat workload, 100 prompts
    python -m minicb bench --quick                # every engine, 8 prompts, 16 tokens
    python -m minicb bench --workload all --out build/bench/bench.json

The engines:
    minicb-naive       chapter 01: one prompt at a time, contiguous KV cache
    minicb-static      chapter 02: padded batches of --slots that run until their longest row ends
    minicb-continuous  chapter 06: paged KV, --slots rows refilled every step
    hf-generate        transformers `generate()` on left-padded batches of --hf-batch
    hf-generate-batch  transformers' own continuous batching (the manager behind `generate_batch`)

The workloads:
    chat     the bundled prompts in the chat template; answers end at EOS or --max-tokens
    random   random token prompts; long-tailed output lengths, EOS ignored (HF has no
             ignore_eos, so its engines forbid EOS instead: the same work, other tokens)
    poisson  the chat prompts (random ones if the model has no tokenizer), arriving
             at --rate requests/s. Batch engines are simulated as a server would run
             them: when the engine is free, the next batch takes every request that
             has arrived (up to the batch size) and later arrivals wait for the next one.

KV waste counts what each cache layout reserves but never fills: a contiguous cache
(naive, static, hf-generate) reserves a full row per request, so it is summed over
batches; the paged cache is measured at the step holding the most blocks. HF's
paged cache is opaque from outside, so its utilisation, busy slots and waste read n/a.

It is a benchmark, not a test: timings on a shared CPU are noisy (try --threads 1
when other jobs run). Before timing, it checks on 4 prompts that static and
continuous batching give naive's greedy tokens, and stops if they do not.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import random
import sys
import time
from dataclasses import dataclass

import torch

from minicb.llm import LLM
from minicb.naive import first_difference, generate_with_cache
from minicb.sampling import SamplingParams
from minicb.static_batching import run_static
from minicb.viz import summarize

ENGINES = ("minicb-naive", "minicb-static", "minicb-continuous", "hf-generate", "hf-generate-batch")
WORKLOADS = ("chat", "random", "poisson")


# ----------------------------------------------------------------------------
# Metrics: plain functions on plain numbers (tests/test_bench.py checks them by hand).


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating between the two nearest ranks (as numpy does).

    Interpolation matters for small runs: with 8 requests, p99 is not "the
    worst one" but 93% of the way from the 7th to the 8th latency.
    """
    if not values:
        raise ValueError("percentile of an empty list; give at least one value")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}; it must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tpot(latency: float, ttft: float, num_output_tokens: int) -> float | None:
    """Time per output token after the first; None for a one-token answer (there is no 'after')."""
    if num_output_tokens < 2:
        return None
    return (latency - ttft) / (num_output_tokens - 1)


@dataclass
class RequestTiming:
    arrival: float  # seconds since the run started; the *scheduled* arrival, so queueing counts
    first_token: float  # when the first output token existed (end of the forward that made it)
    finish: float  # when the last output token existed
    num_output_tokens: int  # including the EOS that ended the answer

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def latency(self) -> float:
        return self.finish - self.arrival


def summarize_timings(timings: list[RequestTiming]) -> dict:
    """Throughput over the whole run (first arrival to last finish) and per-request latencies.

    Under Poisson arrivals an engine faster than the arrival rate idles between
    requests, so its tok/s is capped by the rate; compare latencies there instead.
    """
    wall = max(t.finish for t in timings) - min(t.arrival for t in timings)
    latencies = [t.latency for t in timings]
    tpots = [x for x in (tpot(t.latency, t.ttft, t.num_output_tokens) for t in timings) if x is not None]
    output_tokens = sum(t.num_output_tokens for t in timings)
    return {
        "requests": len(timings), "output_tokens": output_tokens, "wall_s": wall,
        "output_tok_s": output_tokens / wall, "req_s": len(timings) / wall,
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_mean_s": sum(t.ttft for t in timings) / len(timings),
        "tpot_mean_s": sum(tpots) / len(tpots) if tpots else None,
    }


def static_batch_tokens(prompt_lens: list[int], output_lens: list[int]) -> tuple[int, int]:
    """(computed, useful) tokens of one padded batch that runs until its longest row ends.

    The prefill computes every row at the padded length P; then each decode step
    computes every row, finished or not. Token k of a row is sampled after
    forward k, so a row producing n tokens is fed n - 1 of them back.
        computed = B * P + B * (max n - 1)
        useful   = sum(p) + sum(n - 1)
    A batch of one (the naive engine) wastes nothing: computed == useful.
    """
    B, P, steps = len(prompt_lens), max(prompt_lens), max(output_lens) - 1
    return B * P + B * steps, sum(prompt_lens) + sum(n - 1 for n in output_lens)


def busy_slot_steps(output_lens: list[int], num_slots: int) -> tuple[int, int]:
    """(busy, total) slot-steps of one static batch run in an engine of `num_slots` rows.

    The batch takes max(n) forward passes (token k of a row comes from forward k).
    A row is busy for the n steps that make its n tokens; a finished row, and a
    slot the batch left empty, are idle until the batch ends.
        busy = sum(n),  total = num_slots * max(n)
    Continuous batching has no finished rows, but its slots stand empty when the
    queue runs dry, so this share, not utilisation, is what its throughput follows.
    """
    if len(output_lens) > num_slots:
        raise ValueError(f"a batch of {len(output_lens)} requests does not fit in {num_slots} slots")
    return sum(output_lens), num_slots * max(output_lens)


def waste_pct(reserved: int, used: int) -> float:
    """Share of reserved KV slots (one slot holds one token's K and V) that hold nothing."""
    if not 0 <= used <= reserved:
        raise ValueError(f"used={used} KV slots, reserved={reserved}; need 0 <= used <= reserved")
    return 100.0 * (reserved - used) / reserved if reserved else 0.0


def paged_kv_at_peak(traces, block_size: int) -> tuple[int, int]:
    """(reserved, used) KV slots at the step where the paged engine held the most blocks.

    Only StepTraces are needed: a request's cached length is the sum of the
    tokens its slot computed since it was (re)admitted, and a preempted request
    starts again from nothing (it is recomputed). Reserved = allocated blocks * block_size.
    """
    cached: dict[int, int] = {}  # request id -> tokens in the KV cache
    peak = (0, 0)
    for trace in traces:
        for rid in trace.preempted:
            cached.pop(rid, None)
        for slot in trace.slots:
            if slot.request_id is not None and slot.phase in ("prefill", "decode"):
                cached[slot.request_id] = cached.get(slot.request_id, 0) + slot.num_tokens
        for rid, _ in trace.finished:
            cached.pop(rid, None)  # finished requests free their blocks in the same step
        reserved = (trace.num_blocks - trace.num_free_blocks) * block_size
        if reserved > peak[0]:
            peak = (reserved, sum(cached[r] for r in trace.running if r in cached))
    return peak


# ----------------------------------------------------------------------------
# Workloads: a request is prompt token ids, its own output budget, and whether EOS ends it.


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)


def chat_requests(tokenizer, num_prompts: int, max_tokens: int) -> list[Request]:
    from minicb.data import load_chat_prompts
    return [Request(tokenizer.apply_chat_template([{"role": "user", "content": text}]), max_tokens)
            for text in load_chat_prompts(num_prompts)]


def random_requests(vocab_size: int, num_prompts: int, max_tokens: int, max_prompt_len: int,
                    seed: int) -> list[Request]:
    """Uniform prompt lengths in [8, max_prompt_len]; output lengths lognormal with median
    max_tokens / 4 and sigma 1, capped at max_tokens: most answers are short, a few run to the cap."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)  # skip the first ids: in real vocabularies they are special tokens
    requests = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(low, vocab_size) for _ in range(rng.randint(8, max(8, max_prompt_len)))]
        out_len = min(max_tokens, max(1, round(rng.lognormvariate(math.log(max(1, max_tokens / 4)), 1.0))))
        requests.append(Request(prompt, out_len, ignore_eos=True))
    return requests


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` requests/s; the first arrives at 0."""
    if rate <= 0:
        raise ValueError(f"rate={rate} requests/s; it must be > 0")
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# ----------------------------------------------------------------------------
# Running the batch engines (naive = batches of one) under one serving loop.


class StepClock:
    """Records the time at the end of every forward pass of `module`.

    In every engine here, token k of a request is sampled right after forward k
    of its batch, so these stamps give each request's first-token and finish times
    without touching the engines' code.
    """

    def __init__(self, module: torch.nn.Module):
        self.module, self.times = module, []
        self.cuda = next(module.parameters()).is_cuda

    def __enter__(self):
        # A forward hook runs right after module.forward returns, on every call.
        self.handle = self.module.register_forward_hook(self._stamp)
        return self

    def _stamp(self, *_):
        if self.cuda:
            torch.cuda.synchronize()  # kernels run asynchronously; wait so the stamp is real
        self.times.append(time.perf_counter())

    def __exit__(self, *_):
        self.handle.remove()


@dataclass
class EngineResult:
    token_ids: list[list[int]]  # per request, in request order
    timings: list[RequestTiming]  # per request, in request order
    utilisation: float | None = None  # useful / computed tokens; None where we cannot see inside
    kv_waste_pct: float | None = None  # reserved KV slots holding no token
    busy_slots: float | None = None  # slot-steps holding a live request / all slot-steps


def serve_in_batches(run_batch, requests: list[Request], arrivals: list[float] | None,
                     batch_size: int, desc: str, progress: bool = True) -> EngineResult:
    """Serve requests FIFO in static batches, as a server would.

    run_batch(list[Request]) -> (token lists, forward-end times, KV slots reserved).
    When the engine is free, the next batch takes every request that has arrived
    (up to batch_size); with no arrival times, everything arrives at 0.
    """
    from tqdm.auto import tqdm

    arrivals = arrivals or [0.0] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    tokens, timings = [None] * len(requests), [None] * len(requests)
    computed = useful = reserved = used = busy = slot_steps = 0
    start, next_up = time.perf_counter(), 0
    with tqdm(total=len(requests), desc=desc, unit="req", disable=not progress) as bar:
        while next_up < len(order):
            now = time.perf_counter() - start
            if arrivals[order[next_up]] > now:
                time.sleep(arrivals[order[next_up]] - now)  # idle until the next request arrives
                continue
            # Take what is here and go. Waiting to fill the batch would buy throughput
            # with latency; a static server that runs as soon as it can is the usual choice.
            batch = [i for i in order[next_up:next_up + batch_size] if arrivals[i] <= now]
            next_up += len(batch)
            outs, stamps, batch_reserved = run_batch([requests[i] for i in batch])
            for i, out in zip(batch, outs):
                # Token k exists after forward k: stamps[0] is the first token, stamps[n - 1] the last.
                tokens[i] = out
                timings[i] = RequestTiming(arrivals[i], stamps[0] - start, stamps[len(out) - 1] - start, len(out))
            prompt_lens = [len(requests[i].prompt_ids) for i in batch]
            # A batch's row holds its prompt and its answer; everything else it computed or
            # reserved (padding, rows already finished, unused cache) is waste.
            c, u = static_batch_tokens(prompt_lens, [len(o) for o in outs])
            computed, useful = computed + c, useful + u
            b, t = busy_slot_steps([len(o) for o in outs], batch_size)
            busy, slot_steps = busy + b, slot_steps + t
            reserved += batch_reserved
            used += sum(prompt_lens) + sum(len(o) for o in outs)
            bar.update(len(batch))
    return EngineResult(tokens, timings, useful / computed, waste_pct(reserved, used), busy / slot_steps)


def minicb_batch_runner(model, static: bool):
    """run_batch for serve_in_batches: chapter 02's padded batch, or chapter 01's loop (batch of one)."""
    context = model.config.max_position_embeddings

    def run(batch: list[Request]):
        with StepClock(model) as clock:
            if static:
                gens = run_static(model, [r.prompt_ids for r in batch], [r.params() for r in batch],
                                  batch_size=len(batch)).generations
            else:
                gens = [generate_with_cache(model, batch[0].prompt_ids, batch[0].params())]
        # Both contiguous caches reserve rows * (padded prompt + max_tokens) slots up front,
        # because nobody knows in advance which row will run longest.
        longest = max(len(r.prompt_ids) for r in batch)
        return [g.token_ids for g in gens], clock.times, len(batch) * min(context, longest + max(
            r.max_tokens for r in batch))

    return run


def hf_batch_runner(hf_model, eos_id: int):
    """run_batch for serve_in_batches: HF generate() on one left-padded batch."""
    from transformers import GenerationConfig

    device = hf_model.device

    def run(batch: list[Request]):
        # Left padding, as in chapter 02: every row's last prompt token sits in column P - 1,
        # so the new tokens line up; the attention mask keeps the pads out of attention.
        P = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), P), eos_id, dtype=torch.long)  # pad with EOS, as HF suggests
        mask = torch.zeros(len(batch), P, dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, P - len(r.prompt_ids):] = 1
        steps = max(r.max_tokens for r in batch)
        ignore_eos = batch[0].ignore_eos
        # HF has no ignore_eos: min_new_tokens forbids EOS instead, so the token
        # *values* differ from minicb's on the random workload; the amount of work does not.
        config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps if ignore_eos else 0,
                                  do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id)
        with StepClock(hf_model) as clock:
            out = hf_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                    generation_config=config)[:, P:].tolist()  # [B, steps taken]
        rows = []
        for r, row in zip(batch, out):
            row = row[:r.max_tokens]
            if not ignore_eos and eos_id in row:
                row = row[:row.index(eos_id) + 1]  # after EOS come pads
            rows.append(row)
        # HF's DynamicCache grows with the batch: every row holds the padded prompt + the longest output.
        return rows, clock.times, len(batch) * (P + max(len(r) for r in rows))

    return run


# ----------------------------------------------------------------------------
# The continuous engines run their own loops and take arrivals themselves.


def kv_blocks_for(requests: list[Request], slots: int, block_size: int) -> int:
    """KV blocks for `slots` of the longest request at once, plus one spare block per slot.

    Both paged engines get this same pool, so neither wins by having more memory,
    and neither ever has to preempt.
    """
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    return slots * (math.ceil(longest / block_size) + 1)


def run_minicb_continuous(llm, requests: list[Request], arrivals: list[float] | None,
                          progress: bool = True) -> EngineResult:
    outs = llm.generate([r.prompt_ids for r in requests], [r.params() for r in requests],
                        use_tqdm=progress, arrival_times=arrivals)
    timings = [RequestTiming(o.metrics.arrival_time, o.metrics.first_token_time, o.metrics.finish_time,
                             len(o.token_ids)) for o in outs]
    # Utilisation is 100% by construction (no padding, no finished rows); the table says so
    # anyway, because that is the difference from static batching. Busy slots show what is
    # left idle: slots stand empty once the queue runs dry.
    reserved, used = paged_kv_at_peak(llm.traces, llm.engine.config.block_size)
    summary = summarize(llm.traces)
    return EngineResult([o.token_ids for o in outs], timings, summary["utilisation"], waste_pct(reserved, used),
                        1 - summary["idle_slot_steps"] / summary["slot_steps"])


def run_hf_continuous(hf_model, requests: list[Request], arrivals: list[float] | None, eos_id: int,
                      slots: int, num_blocks: int, page_size: int, progress: bool = True) -> EngineResult:
    """HF transformers' continuous batching. `generate_batch` wraps this same manager; we drive
    the manager ourselves so that requests can arrive over time and have their own lengths."""
    from tqdm.auto import tqdm
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_requests_per_batch=slots,
        max_batch_tokens=4096,  # minicb's default max_num_batched_tokens
        allow_block_sharing=False)  # prefix caching off: minicb does not share prefixes either
    generation = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests), do_sample=False,
                                  eos_token_id=eos_id, pad_token_id=eos_id)
    arrivals = arrivals or [0.0] * len(requests)
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    results = {}
    with hf_model.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=config,
                                                      block=True, timeout=5) as manager, \
            tqdm(total=len(requests), desc="hf-generate-batch", unit="req", disable=not progress) as bar:
        start = time.perf_counter()
        # The manager runs its own loop on a background thread; this thread only feeds it
        # requests at their arrival times and collects finished ones.
        while len(results) < len(requests):
            while pending and arrivals[pending[0]] <= time.perf_counter() - start:
                i = pending.pop(0)
                manager.add_request(requests[i].prompt_ids, request_id=str(i), max_new_tokens=requests[i].max_tokens,
                                    record_timestamps=True, eos_token_id=-1 if requests[i].ignore_eos else eos_id)
            # eos_token_id=-1 above means "no EOS" in HF's manager. Poll briefly while
            # arrivals are due, so they are not admitted late; otherwise block.
            result = manager.get_result(timeout=0.01 if pending else 1.0)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                results[int(result.request_id)] = result
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("HF's continuous-batching thread stopped before every request finished")
    # Arrival is the scheduled time, as for the other engines: a late admission counts against HF.
    timings = [RequestTiming(arrivals[i], results[i].timestamps[0] - start,
                             results[i].timestamps[-1] - start, len(results[i].generated_tokens))
               for i in range(len(requests))]
    return EngineResult([list(results[i].generated_tokens) for i in range(len(requests))], timings)


# ----------------------------------------------------------------------------
# The correctness guard, then one workload through every engine.


def check_minicb_agrees(model, requests: list[Request], slots: int, block_size: int, attention: str) -> list[str]:
    """Static and continuous greedy tokens must equal naive's. Returns the mismatches."""
    # 32 tokens are plenty to catch a wrong mask or a wrong block table, and keep the check short.
    few = [Request(r.prompt_ids, min(r.max_tokens, 32), r.ignore_eos) for r in requests[:4]]
    prompts, params = [r.prompt_ids for r in few], [r.params() for r in few]
    # Naive decoding is the oracle: one prompt, one contiguous cache, nothing shared.
    naive = [generate_with_cache(model, p, sp).token_ids for p, sp in zip(prompts, params)]
    static = [g.token_ids for g in run_static(model, prompts, params, batch_size=slots).generations]
    llm = LLM.from_model(model, None, max_num_seqs=slots, attention=attention, block_size=block_size,
                         num_blocks=kv_blocks_for(few, slots, block_size))
    continuous = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return [f"{name}, prompt {i}: {first_difference(got, expected, (name, 'naive'))}"
            for name, outs in (("minicb-static", static), ("minicb-continuous", continuous))
            for i, (expected, got) in enumerate(zip(naive, outs)) if expected != got]


def run_workload(engines: dict, requests: list[Request], arrivals: list[float] | None) -> dict:
    """engines: name -> callable(requests, arrivals, progress) -> EngineResult. Returns name -> metrics row."""
    rows, tokens = {}, {}
    for name, run in engines.items():
        try:
            result = run(requests, arrivals, True)
        except Exception as e:  # one broken engine must not cost the others' numbers
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name} failed: {rows[name]['error']}", file=sys.stderr)
            continue
        tokens[name] = result.token_ids
        rows[name] = {**summarize_timings(result.timings), "utilisation": result.utilisation,
                      "busy_slots": result.busy_slots, "kv_waste_pct": result.kv_waste_pct}
    # Ratios from this one run, so that machine noise affects numerator and denominator alike.
    for baseline in ("hf-generate", "minicb-static"):
        base = rows.get(baseline, {}).get("output_tok_s")
        for row in rows.values():
            if "error" not in row:
                row[f"speedup_vs_{baseline}"] = row["output_tok_s"] / base if base else None
    # How many answers equal minicb-continuous's, token for token (a count, not a failure:
    # fp32 kernels differ in summation order, which can flip a near-tie argmax).
    reference = tokens.get("minicb-continuous")
    for name, outs in tokens.items():
        comparable = reference is not None and not (name.startswith("hf") and requests[0].ignore_eos)
        rows[name]["same_as_continuous"] = sum(a == b for a, b in zip(outs, reference)) if comparable else None
    return rows


# ----------------------------------------------------------------------------
# Reporting: a markdown table, a JSON file, a PNG.


def _fmt(value, spec: str, suffix: str = "", scale: float = 1.0) -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def markdown_table(rows: dict, num_requests: int) -> str:
    header = ("| engine | out tok/s | req/s | latency mean | p50 | p99 | TTFT mean | TPOT mean | slot util | "
              "busy slots | KV waste | vs hf-generate | vs minicb-static | same as continuous |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} |" + " |" * (header.count(" | ") - 1))
            continue
        same = None if r["same_as_continuous"] is None else f"{r['same_as_continuous']}/{num_requests}"
        lines.append(" | ".join([
            f"| {name}", _fmt(r["output_tok_s"], ".1f"), _fmt(r["req_s"], ".2f"),
            _fmt(r["latency_mean_s"], ".2f", " s"), _fmt(r["latency_p50_s"], ".2f", " s"),
            _fmt(r["latency_p99_s"], ".2f", " s"), _fmt(r["ttft_mean_s"], ".2f", " s"),
            _fmt(r["tpot_mean_s"], ".1f", " ms", 1000),
            _fmt(r["utilisation"], ".0f", "%", 100), _fmt(r.get("busy_slots"), ".0f", "%", 100),
            _fmt(r["kv_waste_pct"], ".0f", "%"),
            _fmt(r.get("speedup_vs_hf-generate"), ".2f", "x"), _fmt(r.get("speedup_vs_minicb-static"), ".2f", "x"),
            (same or "n/a") + " |"]))
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.2 * len(workloads)), squeeze=False, sharey="row")
    for (name, w), (ax_tput, ax_lat) in zip(workloads.items(), axes):
        ok = {e: r for e, r in w["engines"].items() if "error" not in r}
        ax_tput.barh(list(ok), [r["output_tok_s"] for r in ok.values()], color="tab:blue")
        ax_tput.set_xlabel("output tokens / s (higher is better)")
        ax_lat.barh(list(ok), [r["latency_mean_s"] for r in ok.values()], color="tab:orange", label="mean")
        ax_lat.scatter([r["latency_p99_s"] for r in ok.values()], list(ok), color="black", marker="|", s=200,
                       label="p99", zorder=3)
        ax_lat.set_xlabel("request latency, s (lower is better)")
        ax_lat.legend(loc="best")
        ax_tput.set_title(f"{name}: {w['description']}", loc="left", fontsize=9)
        ax_tput.invert_yaxis()  # engines top to bottom, in table order (shared with the latency panel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info(args, argv: list[str], device: torch.device) -> dict:
    from importlib.metadata import version
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m minicb bench " + " ".join(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "transformers": version("transformers"), "threads": torch.get_num_threads(),
        "model": args.model or "embedded SmolLM2-135M-Instruct", "dtype": args.dtype,
        "slots": args.slots, "hf_batch": args.hf_batch, "block_size": args.block_size, "attention": args.attention,
    }


# ----------------------------------------------------------------------------
# The command line.


def parse_args(argv: list[str]) -> argparse.Namespace:
    from minicb.__main__ import add_model_args

    ap = argparse.ArgumentParser(prog="python -m minicb bench", description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--workload", default="chat", choices=[*WORKLOADS, "all"])
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens at most per request")
    ap.add_argument("--slots", type=int, default=32, help="minicb static batch size and continuous max_num_seqs")
    ap.add_argument("--hf-batch", type=int, default=16, help="batch size of hf-generate")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size (minicb) and page size (HF)")
    ap.add_argument("--attention", default="torch", choices=["torch", "triton"])
    ap.add_argument("--rate", type=float, default=1.0, help="poisson workload: requests per second")
    ap.add_argument("--random-max-prompt", type=int, default=256, help="random workload: longest prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice). On a CPU shared with other jobs, 1 can be "
                         "many times faster: a parallel op waits for its slowest thread")
    ap.add_argument("--out", default="build/bench/bench.json", help="JSON path; bench.md and bench.png go beside it")
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 prompts, 16 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 8, 16
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    for name in ("num_prompts", "max_tokens", "slots", "hf_batch", "block_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    return args


def build_requests(workload: str, args, tokenizer, vocab_size: int) -> tuple[list[Request], list[float] | None, str]:
    """The requests, their arrival times (None = all at once) and a one-line description."""
    if workload == "random" or tokenizer is None:
        requests = random_requests(vocab_size, args.num_prompts, args.max_tokens, args.random_max_prompt, args.seed)
        description = (f"{len(requests)} random prompts of 8-{args.random_max_prompt} tokens, lognormal output "
                       f"lengths capped at {args.max_tokens}, EOS ignored")
    else:
        requests = chat_requests(tokenizer, args.num_prompts, args.max_tokens)
        description = f"{len(requests)} chat prompts, greedy, EOS or {args.max_tokens} tokens"
    if workload != "poisson":
        return requests, None, description
    return (requests, poisson_arrivals(len(requests), args.rate, args.seed),
            description + f", Poisson arrivals at {args.rate:g} req/s")


def write_report(report: dict, out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    meta = report["meta"]
    md = [f"# minicb bench, {meta['date']}", "", f"`{meta['command']}`", "",
          f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['threads']} threads, "
          f"{meta['model']} in {meta['dtype']}, slots {meta['slots']}, hf batch {meta['hf_batch']}, "
          f"block size {meta['block_size']}, attention {meta['attention']}"]
    for workload, w in report["workloads"].items():
        md += ["", f"## {workload}: {w['description']}", "", markdown_table(w["engines"], w["requests"])]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"\nwrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model, resolve_checkpoint

    # minicb and HF load the very same checkpoint files (a GGUF is converted once and cached).
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    try:
        tokenizer = load_tokenizer(args.model)
    except (OSError, ValueError):
        tokenizer = None  # a bare checkpoint: only random prompts can be made for it
    eos_id = tokenizer.eos_token_id if tokenizer else model.config.eos_token_ids[0]
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    if tokenizer is None and "chat" in workloads:
        if args.workload == "chat":
            print("error: the chat workload needs a tokenizer and this model has none; use --workload random",
                  file=sys.stderr)
            return 2
        workloads.remove("chat")
        print("this model has no tokenizer: skipping the chat workload; poisson uses random prompts")

    hf_models = {}

    def hf(name: str):
        # One copy per HF engine: continuous batching switches the model's attention to a paged one.
        if name not in hf_models:
            from transformers import AutoModelForCausalLM
            hf_models[name] = AutoModelForCausalLM.from_pretrained(
                str(resolve_checkpoint(args.model)), dtype=model.dtype, attn_implementation="sdpa",
            ).to(model.device).eval()
        return hf_models[name]

    report = {"meta": machine_info(args, argv, model.device), "workloads": {}}
    for workload in workloads:
        requests, arrivals, description = build_requests(workload, args, tokenizer, model.config.vocab_size)
        print(f"\n== {workload}: {description}")
        mismatches = check_minicb_agrees(model, requests, args.slots, args.block_size, args.attention)
        if mismatches:
            print("minicb engines disagree with naive greedy decoding; not timing them:\n  " + "\n  ".join(mismatches),
                  file=sys.stderr)
            return 1

        # Each engine closes over this workload's settings; run(requests, arrivals, progress)
        # lets the same closure serve the warm-up and the timed run.
        num_blocks = kv_blocks_for(requests, args.slots, args.block_size)
        llm = LLM.from_model(model, tokenizer, max_num_seqs=args.slots, attention=args.attention,
                             block_size=args.block_size, num_blocks=num_blocks)
        engines = {
            "minicb-naive": lambda reqs, arr, progress: serve_in_batches(
                minicb_batch_runner(model, static=False), reqs, arr, 1, "minicb-naive", progress),
            "minicb-static": lambda reqs, arr, progress: serve_in_batches(
                minicb_batch_runner(model, static=True), reqs, arr, args.slots, "minicb-static", progress),
            "minicb-continuous": lambda reqs, arr, progress: run_minicb_continuous(llm, reqs, arr, progress),
            "hf-generate": lambda reqs, arr, progress: serve_in_batches(
                hf_batch_runner(hf("hf-generate"), eos_id), reqs, arr, args.hf_batch, "hf-generate", progress),
            "hf-generate-batch": lambda reqs, arr, progress: run_hf_continuous(
                hf("hf-generate-batch"), reqs, arr, eos_id, args.slots, num_blocks, args.block_size, progress),
        }
        engines = {name: run for name, run in engines.items() if name in args.engines.split(",")}
        # Warm up every engine off the clock: first-call allocations, lazy imports, kernel compiles.
        warm = [Request(r.prompt_ids, min(r.max_tokens, 4), r.ignore_eos) for r in requests[:2]]
        for run in engines.values():
            try:
                run(warm, None, False)
            except Exception:
                pass  # the timed run meets the same error and reports it in its row
        rows = run_workload(engines, requests, arrivals)
        report["workloads"][workload] = {"description": description, "requests": len(requests), "engines": rows}
        print("\n" + markdown_table(rows, len(requests)))

    write_report(report, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
