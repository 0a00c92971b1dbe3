"""Chapter 02: static batching -- many prompts in one forward, and what that wastes.

In this file you will learn:
- how to run prompts of different lengths together: *left*-pad them to one
  length, so every row's last prompt token sits in the same column and the new
  tokens line up; mask the padding out of attention; and give each row its own
  position ids (cumsum of the mask), so padding does not shift RoPE;
- why this wastes compute twice over:
    1. padding: a short prompt in a batch of long ones computes the pad columns;
    2. idle slots: the batch runs until its *longest* member finishes, and rows
       whose request already ended are computed anyway (nobody can join them).
  `run_static` counts both, and chapter 06 removes the second.

The per-prompt greedy tokens equal chapter 01's, token for token, in fp32
(tests/chapters/test_ch02_static_batching.py).

Chapter text: chapters/02-static-batching/README.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minicb.model import Model
from minicb.naive import ContiguousKVCache, Generation, check_prompt
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample
from minicb.trace import SlotState, StepTrace


class PaddedKVCache(ContiguousKVCache):
    """Chapter 01's cache, plus a mask saying which cached columns are padding.

    padding_mask [B, max_len] bool: True where the column holds a real token. Left
    padding puts the pad columns first, so every decode step appends at the same
    column for all rows.
    """

    def __init__(self, model: Model, padding_mask: torch.Tensor, max_len: int):
        super().__init__(model, padding_mask.shape[0], max_len)
        B, P = padding_mask.shape
        self.padding_mask = torch.ones(B, max_len, dtype=torch.bool, device=model.device)
        self.padding_mask[:, :P] = padding_mask  # generated columns are always real

    def key_mask(self, end: int) -> torch.Tensor:
        return self.padding_mask[:, :end]


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prompts -> input_ids [B, P], padding_mask [B, P] (True = real), positions [B, P].

        prompt A (3 tokens):  pad pad  a0  a1  a2      positions: 0 0 0 1 2
        prompt B (5 tokens):  b0  b1  b2  b3  b4      positions: 0 1 2 3 4
    """
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, P - len(p):] = torch.tensor(p)
        mask[row, P - len(p):] = True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # pads get 0; they are masked anyway
    return ids.to(device), mask.to(device), positions.to(device)


@dataclass
class StaticStats:
    prompt_tokens: int = 0  # real prompt tokens
    padding_tokens: int = 0  # pad columns computed in prefills
    generated_tokens: int = 0  # tokens returned to users
    idle_slot_steps: int = 0  # decode steps spent on rows whose request had already finished
    computed_tokens: int = 0  # every (row, column) the model ran over
    useful_tokens: int = 0  # of those, the ones that belonged to a live request
    steps: int = 0  # forward passes

    @property
    def utilisation(self) -> float:
        return self.useful_tokens / max(1, self.computed_tokens)


@dataclass
class StaticResult:
    generations: list[Generation]  # in prompt order
    stats: StaticStats
    traces: list[StepTrace] = field(default_factory=list)


def run_batch(model: Model, prompts: list[list[int]], params: list[SamplingParams],
              stats: StaticStats, traces: list[StepTrace], request_ids: list[int],
              num_slots: int) -> list[Generation]:
    """Generate for one static batch until every row has finished."""
    cfg, device = model.config, model.device
    B = len(prompts)
    ids, padding_mask, positions = left_pad(prompts, pad_id=0, device=device)
    P = ids.shape[1]
    max_len = min(P + max(p.max_tokens for p in params), cfg.max_position_embeddings)
    cache = PaddedKVCache(model, padding_mask, max_len)
    generators = [make_generator(p, device) for p in params]
    outputs: list[list[int]] = [[] for _ in range(B)]
    reasons: list[str | None] = [None] * B
    next_pos = positions[:, -1] + 1  # [B]: where each row's next token goes in its own numbering

    t0 = time.perf_counter()
    logits = model(ids, positions, cache, logits_at=torch.full((B, 1), P - 1, device=device))  # [B, 1, V]
    cache.advance(P)
    stats.prompt_tokens += sum(len(p) for p in prompts)
    stats.padding_tokens += B * P - sum(len(p) for p in prompts)
    stats.computed_tokens += B * P
    stats.useful_tokens += sum(len(p) for p in prompts)
    phases = ["prefill"] * B
    tokens_this_step = [len(p) for p in prompts]

    while True:
        stats.steps += 1
        finished_now = []
        tokens = sample(logits[:, -1], params, generators)
        for row in range(B):
            if reasons[row] is not None:
                continue  # a finished row still computed a token; we throw it away
            outputs[row].append(tokens[row])
            reasons[row] = finish_reason(tokens[row], len(outputs[row]), params[row], cfg.eos_token_ids,
                                         len(prompts[row]) + len(outputs[row]), cfg.max_position_embeddings)
            if reasons[row] is None and cache.seq_len >= max_len:
                # Not a stop rule of the request but of the batch: left padding
                # made every row as long as the longest prompt, and the padded
                # cache has no column left for another token.
                reasons[row] = "length"
            if reasons[row]:
                finished_now.append((request_ids[row], reasons[row]))
        done = all(r is not None for r in reasons)
        traces.append(step_trace(len(traces), request_ids, phases, tokens_this_step, finished_now,
                                 done, num_slots, P if phases[0] == "prefill" else 1, time.perf_counter() - t0))
        if done:
            break
        # Decode: every row runs, finished or not -- that is the price of a static batch.
        t0 = time.perf_counter()
        live = [r is None for r in reasons]
        phases = ["decode" if alive else "wasted" for alive in live]
        tokens_this_step = [1 if alive else 0 for alive in live]
        stats.computed_tokens += B
        stats.useful_tokens += sum(live)
        stats.idle_slot_steps += B - sum(live)
        step_ids = torch.tensor(tokens, device=device)[:, None]  # [B, 1]
        logits = model(step_ids, next_pos[:, None], cache)  # [B, 1, V]
        cache.advance(1)
        next_pos = next_pos + 1

    stats.generated_tokens += sum(len(o) for o in outputs)
    return [Generation(o, r) for o, r in zip(outputs, reasons)]


def step_trace(step: int, request_ids: list[int], phases: list[str], tokens: list[int],
               finished: list[tuple[int, str]], done: bool, num_slots: int, width: int,
               seconds: float) -> StepTrace:
    """The StepTrace of one forward of a static batch (one entry per row, in row order).

    step: index of this forward in the whole run (len(traces) before appending);
    request_ids: the batch's request ids; phases: per row "prefill" at the first
    forward, then "decode" (live) or "wasted" (already finished); tokens: per
    row, the prompt length at the prefill, then 1 (live) or 0; finished: the
    (request id, reason) of rows that ended at this step; done: every row has
    ended; num_slots: the batch size, so a short last batch shows empty slots;
    width: columns each row computed (P at the prefill, else 1); seconds: the
    forward's duration. chapter 06's engine records the same fields, so
    minicb.viz draws both runs alike.
    """
    slots = [SlotState(rid, ph, n) for rid, ph, n in zip(request_ids, phases, tokens)]
    slots += [SlotState(None, "empty", 0)] * (num_slots - len(slots))  # a short last batch
    return StepTrace(
        step=step, slots=slots,
        admitted=list(request_ids) if phases[0] == "prefill" else [],
        finished=finished,
        running=[] if done else list(request_ids),
        num_tokens=width * len(request_ids),
        num_useful_tokens=sum(tokens),
        time_s=seconds,
    )


def run_static(model: Model, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               batch_size: int = 16, batch_runner=None) -> StaticResult:
    """Serve `prompts` in consecutive static batches of `batch_size`, in order.

    batch_runner: what generates one batch, with run_batch's signature (above);
    None means this file's run_batch. Chapter 02's exercise passes the student's
    run_batch, so this same loop drives their code.
    """
    batch_runner = batch_runner or run_batch
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; it must be >= 1")
    params = params if isinstance(params, list) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
    for p in prompts:
        check_prompt(p, model.config.max_position_embeddings)
    stats, traces, generations = StaticStats(), [], []
    for start in range(0, len(prompts), batch_size):
        batch = list(range(start, min(start + batch_size, len(prompts))))
        generations += batch_runner(model, [prompts[i] for i in batch], [params[i] for i in batch],
                                    stats, traces, batch, batch_size)
    # The waiting queue in each trace: every request that has not started yet.
    started = 0
    for t in traces:
        started += len(t.admitted)
        t.waiting = list(range(started, len(prompts)))
    return StaticResult(generations, stats, traces)
