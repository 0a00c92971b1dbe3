"""Prometheus metrics: what an operator watches while the server runs.

In this file you will learn which few numbers tell whether a serving engine is
healthy, and where each one is measured:

    minicb_requests_running / _waiting      the scheduler's two queues, after each step:
                                            a waiting queue that keeps growing means the
                                            engine cannot keep up with the arrivals
    minicb_kv_blocks_used / _cached / _total  the paged pool: used blocks belong to live
                                            requests; cached ones are free but keep a
                                            prefix's K/V (prefix caching)
    minicb_generation_tokens_total          output tokens; its rate() is the throughput
    minicb_prompt_tokens_total              prompt tokens queued
    minicb_time_to_first_token_seconds      arrival at the server -> first token (histogram)
    minicb_inter_token_latency_seconds      one token -> the next of the same completion
    minicb_completions_finished_total{reason}  stop / length / abort
    minicb_requests_rejected_total{status}  400 (bad request) and 503 (queue full)
    minicb_requests_too_slow_total          aborted because the client read so slowly that
                                            max_buffered_steps steps piled up for it
    minicb_engine_steps_total               engine steps run

The engine thread (minicb/serve/loop.py) sets the gauges and observes the
histograms after each step; prometheus_client's metrics are thread-safe, and a
scrape (`GET /metrics`) reads them from the event loop. Each server has its own
registry, so two servers in one process (the tests start several) never share a
counter.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the Prometheus text format's media type, for the route

# Seconds. A CPU step of SmolLM2 takes ~0.1 s, a GPU step ~10 ms; first tokens wait for a queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("minicb_requests_running", "Sequences holding a slot.", registry=r)
        self.waiting = Gauge("minicb_requests_waiting", "Sequences in the scheduler's waiting queue.", registry=r)
        self.kv_used = Gauge("minicb_kv_blocks_used", "KV blocks held by live sequences.", registry=r)
        self.kv_cached = Gauge("minicb_kv_blocks_cached",
                               "Free KV blocks whose K/V the prefix cache keeps for reuse.", registry=r)
        self.kv_total = Gauge("minicb_kv_blocks_total", "KV blocks in the pool.", registry=r)
        self.generation_tokens = Counter("minicb_generation_tokens", "Output tokens generated.", registry=r)
        self.prompt_tokens = Counter("minicb_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.steps = Counter("minicb_engine_steps", "Engine steps run.", registry=r)
        self.draft_tokens = Counter("minicb_spec_draft_tokens", "Speculative decoding: draft tokens verified.",
                                    registry=r)
        self.accepted_tokens = Counter("minicb_spec_accepted_tokens",
                                       "Speculative decoding: draft tokens the model accepted.", registry=r)
        self.num_drafts = self.num_accepted = 0  # the two counters' totals, for the rate
        self.acceptance_rate = Gauge("minicb_spec_acceptance_rate",
                                     "Speculative decoding: accepted / verified draft tokens so far (0 before any).",
                                     registry=r)
        self.ttft = Histogram("minicb_time_to_first_token_seconds", "Arrival at the server to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("minicb_inter_token_latency_seconds",
                             "Time between two consecutive tokens of one completion.", buckets=ITL_BUCKETS, registry=r)
        self.completions = Counter("minicb_completions_finished", "Completions ended, by finish reason.",
                                   ["reason"], registry=r)
        self.rejected = Counter("minicb_requests_rejected", "Requests refused, by HTTP status.", ["status"],
                                registry=r)
        self.too_slow = Counter("minicb_requests_too_slow",
                                "Requests aborted because their client fell max_buffered_steps steps behind.",
                                registry=r)

    # ---- engine thread ----------------------------------------------------------------

    def step(self, out, ttfts: list[float], itls: list[float]) -> None:
        """One step ran (its StepOutput): count its tokens and finished sequences, observe the latencies."""
        self.steps.inc()
        self.generation_tokens.inc(len(out.new_tokens))
        if out.num_draft_tokens:  # speculative decoding verified drafts this step
            drafts, accepted = out.num_draft_tokens, out.num_accepted_tokens
            self.draft_tokens.inc(drafts)
            self.accepted_tokens.inc(accepted)
            self.num_drafts, self.num_accepted = self.num_drafts + drafts, self.num_accepted + accepted
            self.acceptance_rate.set(self.num_accepted / self.num_drafts)
        for seq in out.finished:
            self.completions.labels(seq.finish_reason).inc()
        for seconds in ttfts:
            self.ttft.observe(seconds)
        for seconds in itls:
            self.itl.observe(seconds)

    def finished(self, reason: str) -> None:
        self.completions.labels(reason).inc()

    def engine_state(self, stats) -> None:
        """The queues and the pool as an EngineStats says (after a step, or after aborts)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_total.set(stats.num_blocks)
        # Prefix caching counts cached blocks as free (they can be handed out); "used" is what live sequences hold.
        self.kv_used.set(stats.num_blocks - stats.num_free_blocks)
        self.kv_cached.set(stats.num_cached_free_blocks)

    # ---- event loop ------------------------------------------------------------------

    def accepted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def rejected_request(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def too_slow_request(self) -> None:
        self.too_slow.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
