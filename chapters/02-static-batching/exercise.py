"""Chapter 02 exercises: static batching with left padding.

Fill in each stub, then run `python -m minicb check 2`. The chapter text
(chapters/02-static-batching/README.md) explains every task.

Chapter 01 is given in full (minicb/naive.py): its ContiguousKVCache is the
base class of task 2, and its loop is the model of task 3. So are the stats
and result dataclasses, `step_trace` (one StepTrace per forward), and
`run_static` (at the bottom), which cuts the prompts into batches and calls
*your* run_batch for each.
"""
from __future__ import annotations

import time  # noqa: F401  (for the seconds each trace records)

import torch

from minicb import static_batching as _reference
from minicb.model import Model
from minicb.naive import ContiguousKVCache, Generation, check_prompt  # noqa: F401  # given (chapter 01)
from minicb.sampling import SamplingParams, finish_reason, make_generator, sample  # noqa: F401  # given
from minicb.static_batching import StaticResult, StaticStats  # given
from minicb.static_batching import step_trace  # noqa: F401  # given: one StepTrace per forward, see run_batch
from minicb.trace import StepTrace


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prompts -> input_ids [B, P], padding_mask [B, P] bool, positions [B, P], all on `device`.

    P is the longest prompt. Each row is right-aligned: pad_id fills the columns
    before a shorter prompt. padding_mask is True on real tokens. A real token's
    position is its index in its own prompt (0, 1, 2, ...), whatever padding
    precedes it; pad columns may get any position (they are masked).
    """
    raise NotImplementedError(
        "Chapter 2, task 1: left_pad() — see chapters/02-static-batching/README.md#task-1")


class PaddedKVCache(ContiguousKVCache):
    """Chapter 01's cache, plus a mask saying which cached columns hold padding.

    Chapter 01's __call__ already combines its causal mask with
    `self.key_mask(end)`; this class only has to answer that question.
    """

    def __init__(self, model: Model, padding_mask: torch.Tensor, max_len: int):
        """padding_mask [B, P] bool (True = real), from left_pad; max_len >= P columns in all.

        Build the parent cache for B rows and max_len columns, and keep a
        [B, max_len] bool mask: the prompt's mask in the first P columns, True
        after them (every generated token is real).
        """
        raise NotImplementedError(
            "Chapter 2, task 2: PaddedKVCache.__init__() — see chapters/02-static-batching/README.md#task-2")

    def key_mask(self, end: int) -> torch.Tensor:
        """Which of the first `end` cached columns may be attended: [B, end] bool."""
        raise NotImplementedError(
            "Chapter 2, task 2: PaddedKVCache.key_mask() — see chapters/02-static-batching/README.md#task-2")


def run_batch(model: Model, prompts: list[list[int]], params: list[SamplingParams],
              stats: StaticStats, traces: list[StepTrace], request_ids: list[int],
              num_slots: int) -> list[Generation]:
    """Generate for one static batch until every row has finished; one Generation per prompt.

    Like chapter 01's generate_with_cache, for B rows at once. Left-pad the
    prompts (pad id 0), size a PaddedKVCache for P + the largest max_tokens
    (no more than the context), prefill all rows in one forward with logits at
    column P - 1, then decode one token per row per step. Each row continues
    from its own next position (its last prompt position + 1), and has its own
    generator. A finished row keeps running -- that is the waste this chapter
    measures -- but its tokens are thrown away. Stop when every row has finished.

    Add to `stats` (shared by all batches of a run):
      prompt_tokens     real prompt tokens              padding_tokens   B * P - real
      computed_tokens   B * P at the prefill, then B per decode step
      useful_tokens     real prompt tokens, then the live rows of each decode step
      idle_slot_steps   the finished rows of each decode step
      steps             one per forward        generated_tokens  tokens returned
    Append to `traces`, after sampling at each forward:
      step_trace(len(traces), request_ids, phases, tokens, finished_now, done,
                 num_slots, width, seconds)
    phases: per row "prefill" at the first step, then "decode" (live) or
    "wasted" (finished); tokens: per row, the prompt length at the prefill,
    then 1 (live) or 0; finished_now: (request id, reason) of rows that ended
    at this step; done: all rows have ended; width: P at the prefill, else 1.
    """
    raise NotImplementedError(
        "Chapter 2, task 3: run_batch() — see chapters/02-static-batching/README.md#task-3")


# ---- given ---------------------------------------------------------------------

def run_static(model: Model, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               batch_size: int = 16, batch_runner=None) -> StaticResult:
    """Serve `prompts` in consecutive static batches of `batch_size`, in order.

    Given: minicb.static_batching.run_static, told to call *your* run_batch
    (the one above) for each batch, unless another batch_runner is passed.
    """
    return _reference.run_static(model, prompts, params, batch_size, batch_runner=batch_runner or run_batch)
