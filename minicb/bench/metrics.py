"""The benchmark's numbers: how fast an engine is, and why.

In this file you will learn what each column of `python -m minicb bench`
means and how it is computed:
- throughput (output tokens/s, requests/s) says how much work the machine gets
  through; latency (per request: mean, p50, p99), TTFT (time to first token)
  and TPOT (time per output token after the first) say how long a user waits;
- slot utilisation (useful tokens / tokens computed), busy slots (the share of
  slot-steps that held a live request) and KV memory waste (reserved KV slots
  that hold no token) say *why* one engine beats another.

Everything here is a plain function on plain numbers: no model, no clock.
tests/tools/test_bench.py checks each one against values worked out by hand, and
chapter 02's counters (minicb/static_batching.py) against `static_batch_tokens`.
The engines that produce the numbers are in runners.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


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
    token_times: list[float] | None = None  # when each output token existed; None if the engine cannot say

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
    # Inter-token latency: every gap between two consecutive tokens of a request, pooled.
    # Its p99 is what a streaming reader feels when a long prefill stalls a step.
    itls = [b - a for t in timings if t.token_times for a, b in zip(t.token_times, t.token_times[1:])]
    output_tokens = sum(t.num_output_tokens for t in timings)
    return {
        "requests": len(timings), "output_tokens": output_tokens, "wall_s": wall,
        "output_tok_s": output_tokens / wall, "req_s": len(timings) / wall,
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_mean_s": sum(t.ttft for t in timings) / len(timings),
        "tpot_mean_s": sum(tpots) / len(tpots) if tpots else None,
        "itl_mean_s": sum(itls) / len(itls) if itls else None,
        "itl_p99_s": percentile(itls, 99) if itls else None,
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
            if slot.seq_id is not None and slot.phase in ("prefill", "decode"):
                cached[slot.seq_id] = cached.get(slot.seq_id, 0) + slot.num_tokens
        for rid, drafts, accepted, _ in trace.speculation:  # rejected drafts were rolled back (chapter 11)
            cached[rid] -= len(drafts) - accepted
        for rid, _ in trace.finished:
            cached.pop(rid, None)  # finished requests free their blocks in the same step
        reserved = (trace.num_blocks - trace.num_free_blocks) * block_size
        if reserved > peak[0]:
            peak = (reserved, sum(cached[r] for r in trace.running if r in cached))
    return peak
