"""What happened in one engine step, as plain data.

The engines (chapter 02's static batcher and chapter 06's continuous batcher)
return one `StepTrace` per step. Everything that draws the engine -- the
terminal timeline in the demo, the matplotlib figures, the Jupyter widgets in
`minicb.viz` -- reads these records and nothing else. No tensors live here, so
a trace can be saved as JSON, replayed later, or built by hand in a test.

Chapter 06 (chapters/06-continuous-batching/README.md) explains each field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# What a slot did during a step.
#   "prefill": it computed the prompt (or a chunk of it) of a newly admitted request
#   "decode":  it computed one new token of a running request
#   "wasted":  static batching only -- the request in it already finished, but the
#              row is still part of the padded batch, so the model computes it anyway
#   "empty":   nothing is in the slot; nothing is computed
PHASES = ("prefill", "decode", "wasted", "empty")


# A trace names sequences by seq_id (minicb/scheduler.py's Sequence: one completion of a
# request). A request with n = 1 is one sequence, whose seq_id is the request's id; the
# pictures draw each sequence in a colour of its own. Chapter 02's rows are its requests.
@dataclass
class SlotState:
    seq_id: int | None  # which sequence occupies the slot (None when empty)
    phase: str  # one of PHASES
    num_tokens: int = 0  # tokens this slot computed in this step (prompt length for a prefill)


@dataclass
class StepTrace:
    step: int  # 0, 1, 2, ... within one run
    slots: list[SlotState]  # one entry per slot (max_num_seqs, or the static batch size)
    admitted: list[int] = field(default_factory=list)  # sequences that entered a slot this step
    finished: list[tuple[int, str]] = field(default_factory=list)  # (seq_id, "stop" | "length")
    preempted: list[int] = field(default_factory=list)  # sequences sent back to the waiting queue
    waiting: list[int] = field(default_factory=list)  # waiting queue after the step, front first
    running: list[int] = field(default_factory=list)  # sequences holding a slot after the step
    num_free_blocks: int = 0  # free KV blocks after the step
    num_blocks: int = 0  # size of the KV pool (0 for the contiguous-cache engines)
    block_owners: list[int | None] = field(default_factory=list)  # physical block -> seq_id, None = free
    num_tokens: int = 0  # tokens the forward pass computed, wasted rows and padding included
    num_useful_tokens: int = 0  # tokens that belong to a live request (no padding, no finished rows)
    time_s: float = 0.0  # wall-clock seconds the step took
    new_tokens: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, token id) sampled this step
    cached_free_blocks: list[int] = field(default_factory=list)  # prefix caching: free, but K/V kept for reuse
    shared_blocks: list[int] = field(default_factory=list)  # held by more than one sequence (a shared prefix, n > 1)
    # (seq_id, prompt tokens served from the prefix cache) for each sequence admitted this step
    cached_tokens: list[tuple[int, int]] = field(default_factory=list)
    # The scheduler's token budget (max_num_batched_tokens): what one step may compute.
    # 0 = none or unknown (the static engines, traces from before it was recorded).
    token_budget: int = 0
    # Speculative decoding (chapter 11): (seq_id, draft tokens it verified, how many of them the
    # model accepted, the token it added after them: the correction, or the bonus if all were accepted).
    speculation: list[tuple[int, list[int], int, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "StepTrace":
        d = dict(d)
        d["slots"] = [SlotState(**s) for s in d["slots"]]
        d["finished"] = [tuple(f) for f in d["finished"]]
        d["new_tokens"] = [tuple(t) for t in d.get("new_tokens", [])]
        d["cached_tokens"] = [tuple(t) for t in d.get("cached_tokens", [])]
        d["speculation"] = [tuple(t) for t in d.get("speculation", [])]
        return StepTrace(**d)


def save_traces(traces: list[StepTrace], path: str) -> None:
    with open(path, "w") as f:
        json.dump([t.to_dict() for t in traces], f)


def load_traces(path: str) -> list[StepTrace]:
    with open(path) as f:
        return [StepTrace.from_dict(d) for d in json.load(f)]
