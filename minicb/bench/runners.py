"""The benchmark's engines: every engine behind one call, on one clock.

In this file you will learn how to time different engines fairly:
- every engine is a function run(requests, arrivals, progress) -> EngineResult,
  with the token ids and one RequestTiming per request, so one table holds them all;
- the batch engines (chapter 01's loop as batches of one, chapter 02's static
  batches, HF `generate()`) run under one serving loop, `serve_in_batches`: when
  the engine is free, the next batch takes every request that has arrived (up to
  the batch size) and later arrivals wait for the next one;
- the continuous engines (chapter 06's `LLM`, HF's continuous-batching manager)
  run their own loops and take the arrival times themselves;
- per-token times come from a forward hook (`StepClock`), so no engine's code
  needs a timer inside it;
- before anything is timed, `check_minicb_agrees` makes sure static and
  continuous batching give naive's greedy tokens: a fast wrong engine is no result.

The engines:
    minicb-naive       chapter 01: one prompt at a time, contiguous KV cache
    minicb-static      chapter 02: padded batches of --slots that run until their longest row ends
    minicb-continuous  chapter 06: paged KV, --slots rows refilled every step
    minicb-prefix-cache  the same, with prefix caching on (minicb/prefix_cache.py); not in the
                       default set: name it, e.g. for --workload shared-prefix
    minicb-chunked     minicb-continuous with chunked prefill, --max-num-batched-tokens a step
                       (minicb/chunked_prefill.py); not in the default set: name it, e.g. for
                       --workload long-prompt
    minicb-eager       minicb-continuous with cuda_graphs=False: every step launched eagerly. On
                       CUDA with --attention triton, minicb-continuous replays decode steps from
                       CUDA graphs (minicb/cuda_graphs.py), so the pair shows what graphs save;
                       on a CPU the two are the same engine. Not in the default set
    minicb-spec        minicb-continuous with speculative decoding by prompt lookup (minicb/speculative.py,
                       --speculative-ngram, default 2, and --num-speculative-tokens); not in the
                       default set: name it, e.g. for --workload repeat
    hf-generate        transformers `generate()` on left-padded batches of --hf-batch
    hf-generate-batch  transformers' own continuous batching (the manager behind `generate_batch`)

KV waste counts what each cache layout reserves but never fills: a contiguous cache
(naive, static, hf-generate) reserves a full row per request, so it is summed over
batches; the paged cache is measured at the step holding the most blocks. HF's
paged cache is opaque from outside, so its utilisation, busy slots and waste read n/a.

    python -m minicb bench --quick --engines minicb-static,minicb-continuous
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from minicb.bench.metrics import (RequestTiming, busy_slot_steps, paged_kv_at_peak, static_batch_tokens,
                                  summarize_timings, waste_pct)
from minicb.bench.workloads import Request
from minicb.llm import LLM
from minicb.naive import first_difference, generate_with_cache
from minicb.static_batching import run_static
from minicb.viz import summarize

ENGINES = ("minicb-naive", "minicb-static", "minicb-continuous", "minicb-prefix-cache", "minicb-chunked",
           "minicb-eager", "minicb-spec", "hf-generate", "hf-generate-batch")
DEFAULT_ENGINES = tuple(e for e in ENGINES
                        if e not in ("minicb-prefix-cache", "minicb-chunked", "minicb-eager", "minicb-spec"))


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
    prefill_tokens: int | None = None  # prompt tokens the forwards computed (minicb's paged engines)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache instead
    tokens_per_step: float | None = None  # 1 + accepted drafts per decode step (above 1 only with speculation)


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
                timings[i] = RequestTiming(arrivals[i], stamps[0] - start, stamps[len(out) - 1] - start, len(out),
                                           [stamp - start for stamp in stamps[:len(out)]])
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
                             len(o.token_ids), o.metrics.token_times) for o in outs]
    # Utilisation is 100% by construction (no padding, no finished rows); the table says so
    # anyway, because that is the difference from static batching. Busy slots show what is
    # left idle: slots stand empty once the queue runs dry.
    reserved, used = paged_kv_at_peak(llm.traces, llm.engine.config.block_size)
    summary = summarize(llm.traces)
    prefill = sum(slot.num_tokens for t in llm.traces for slot in t.slots if slot.phase == "prefill")
    decode_steps = sum(o.metrics.num_decode_steps for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    return EngineResult([o.token_ids for o in outs], timings, summary["utilisation"], waste_pct(reserved, used),
                        1 - summary["idle_slot_steps"] / summary["slot_steps"], prefill,
                        sum(o.metrics.num_cached_tokens for o in outs),
                        (decode_steps + accepted) / decode_steps if decode_steps else None)


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
                             results[i].timestamps[-1] - start, len(results[i].generated_tokens),
                             [stamp - start for stamp in results[i].timestamps])
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


BASELINES = ("hf-generate", "hf-generate-batch", "minicb-static")  # the "vs" columns


def run_workload(engines: dict, requests: list[Request], arrivals: list[float] | None, rounds: int = 1) -> dict:
    """engines: name -> callable(requests, arrivals, progress) -> EngineResult. Returns name -> metrics row.

    With rounds > 1 the engines run in turns, round after round (A, B, C, A, B, C, ...),
    so a slow stretch of a shared machine falls on every engine alike. An engine's row
    is then its median round by output tok/s, with every round's figure in
    `output_tok_s_rounds`; a ratio is the median over rounds of the two engines'
    figures in the same round. An engine that fails in any round reports that error.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}; give a whole number >= 1")
    runs = {name: [] for name in engines}  # name -> [(row, token ids)] per round
    errors = {}
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    for _ in range(rounds):
        for name, run in engines.items():
            if name in errors:
                continue
            try:
                began, cpu_began = time.perf_counter(), time.process_time()
                result = run(requests, arrivals, True)
                # Cores the process used over the run (all its threads, spinning included): beside
                # busy programs, the share of the machine the scheduler gave it (tools/busy_bench.py).
                cores = (time.process_time() - cpu_began) / (time.perf_counter() - began)
            except Exception as e:  # one broken engine must not cost the others' numbers
                errors[name] = f"{type(e).__name__}: {e}"
                print(f"{name} failed: {errors[name]}", file=sys.stderr)
                continue
            row = {**summarize_timings(result.timings), "utilisation": result.utilisation,
                   "busy_slots": result.busy_slots, "kv_waste_pct": result.kv_waste_pct,
                   "prefill_tokens": result.prefill_tokens, "tokens_per_step": result.tokens_per_step,
                   "cache_hit_pct": (None if result.cached_tokens is None
                                     else 100 * result.cached_tokens / prompt_tokens),
                   "cores": cores}
            runs[name].append((row, result.token_ids))
    rows = {}
    for name, done in runs.items():
        if name in errors:
            rows[name] = {"error": errors[name]}
            continue
        by_speed = sorted(done, key=lambda run: run[0]["output_tok_s"])
        rows[name] = {**by_speed[(len(by_speed) - 1) // 2][0],  # the median round (the lower of two middles)
                      "output_tok_s_rounds": [row["output_tok_s"] for row, _ in done]}
    # Ratios within a round, so that machine noise affects numerator and denominator alike.
    for baseline in BASELINES:
        base = rows.get(baseline, {}).get("output_tok_s_rounds")
        for row in rows.values():
            if "error" not in row:
                row[f"speedup_vs_{baseline}"] = (statistics.median(
                    a / b for a, b in zip(row["output_tok_s_rounds"], base)) if base else None)
    # How many answers equal minicb-continuous's, token for token, in every round (a count,
    # not a failure: fp32 kernels differ in summation order, which can flip a near-tie argmax).
    reference = None if "minicb-continuous" in errors else runs.get("minicb-continuous")
    for name, done in runs.items():
        if name in errors:
            continue
        comparable = reference is not None and not (name.startswith("hf") and requests[0].ignore_eos)
        rows[name]["same_as_continuous"] = (
            min(sum(a == b for a, b in zip(outs, ref)) for (_, outs), (_, ref) in zip(done, reference))
            if comparable else None)
    return rows
