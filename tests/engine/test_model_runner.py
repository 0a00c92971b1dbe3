"""The model runner of minicb/model_runner.py: one step's host inputs, built once, and the eager forward.

`prepare()` is checked on the example in model_runner.py's docstring (two
decodes, then a 3-token chunk of a prompt, with hand-picked block tables), whose
numbers were worked out by hand. `ModelRunner` is checked against the model run
densely over each sequence from its first token (no cache at all): a step of
prompts, one chunked, then a mixed step of decodes, the rest of that prompt and a
copy-on-write decode whose K/V are right only if the block copy runs before the
forward. Chapter 10's DecodeGraphs, the other runner, is tests/engine/test_cuda_graphs.py's.
"""
import dataclasses

import torch

from minicb import paged_attention
from minicb.attention_backends import TorchAttention
from minicb.block_allocator import BlockAllocator
from minicb.model import DenseAttention, random_model
from minicb.model_runner import ModelRunner, StepBatch, prepare
from minicb.paged_attention import KVPool
from minicb.sampling import SamplingParams
from minicb.scheduler import Sequence, SchedulerOutput


class TableAllocator:
    """Fixed block tables, as an allocator reports them: the docstring example's, which no real
    allocator hands out in that order. Records the token ranges it is asked for."""

    def __init__(self, tables: dict[int, list[int]], block_size: int):
        self.tables, self.block_size, self.asked = tables, block_size, []

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.tables[seq_id])

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        self.asked.append((seq_id, start, end))
        table = self.tables[seq_id]
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]


def sequence(seq_id: int, tokens: list[int], num_outputs: int, num_computed: int) -> Sequence:
    seq = Sequence(seq_id, tokens[:len(tokens) - num_outputs], SamplingParams(max_tokens=8))
    seq.output_token_ids = tokens[len(tokens) - num_outputs:]
    seq.num_computed_tokens = num_computed
    return seq


def differences(got: StepBatch, want: StepBatch) -> list[str]:
    return [f"{f.name}: {getattr(got, f.name)}, want {getattr(want, f.name)}" for f in dataclasses.fields(StepBatch)
            if getattr(got, f.name) != getattr(want, f.name)]


def test_prepare_builds_the_docstring_example():
    # block_size 4. a: 8 tokens, its newest (position 7) to compute; b: 6 tokens, position 5;
    # c: a 7-token prompt whose first 4 are computed, the other 3 this step. Token ids name
    # their sequence and position: a7 = 107, b5 = 205, c4 = 304.
    a = sequence(0, [100 + p for p in range(8)], num_outputs=1, num_computed=7)
    b = sequence(1, [200 + p for p in range(6)], num_outputs=1, num_computed=5)
    c = sequence(2, [300 + p for p in range(7)], num_outputs=0, num_computed=4)
    allocator = TableAllocator({0: [0, 3], 1: [2, 9], 2: [4, 5]}, block_size=4)
    out = SchedulerOutput(decodes=[a, b], prefills=[c], num_scheduled={0: 1, 1: 1, 2: 3}, block_copies=[(1, 3)])
    got = prepare(out, allocator)
    want = StepBatch(token_ids=[107, 205, 304, 305, 306], positions=[7, 5, 4, 5, 6],
                     slot_mapping=[3 * 4 + 3, 9 * 4 + 1, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2],
                     block_tables=[[0, 3], [2, 9], [4, 5]], context_lens=[8, 6, 7], num_new_tokens=[1, 1, 3],
                     num_decodes=2, block_copies=[(1, 3)])
    wrong = differences(got, want)
    assert not wrong, "prepare() on the docstring's example:\n  " + "\n  ".join(wrong)
    assert allocator.asked == [(0, 7, 8), (1, 5, 6), (2, 4, 7)], f"slot ranges asked for: {allocator.asked}"
    assert (got.num_seqs, got.is_decode_only) == (3, False), (got.num_seqs, got.is_decode_only)


def test_prepare_makes_a_decode_with_drafts_one_row_per_token():
    # Chapter 11: a (block_size 4, 8 tokens, newest at position 7) verifies drafts 901, 902
    # beside b's plain decode: three decode rows at positions 7, 8, 9, each attending up to itself.
    a = sequence(0, [100 + p for p in range(8)], num_outputs=1, num_computed=7)
    b = sequence(1, [200 + p for p in range(6)], num_outputs=1, num_computed=5)
    allocator = TableAllocator({0: [0, 3, 6], 1: [2, 9]}, block_size=4)
    out = SchedulerOutput(decodes=[a, b], num_scheduled={0: 3, 1: 1}, draft_token_ids={0: [901, 902]})
    got = prepare(out, allocator)
    want = StepBatch(token_ids=[107, 901, 902, 205], positions=[7, 8, 9, 5],
                     slot_mapping=[3 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 9 * 4 + 1],
                     block_tables=[[0, 3, 6]] * 3 + [[2, 9]], context_lens=[8, 9, 10, 6], num_new_tokens=[1, 1, 1, 1],
                     num_decodes=4)
    wrong = differences(got, want)
    assert not wrong, "prepare() with drafts:\n  " + "\n  ".join(wrong)
    assert got.is_decode_only, "a step of decodes, drafts or not, is decode-only"


def test_which_batches_are_decode_only():
    allocator = TableAllocator({0: [0, 3], 1: [2, 9]}, block_size=4)
    a = sequence(0, [100 + p for p in range(8)], num_outputs=1, num_computed=7)
    b = sequence(1, [200 + p for p in range(6)], num_outputs=1, num_computed=5)
    cases = {
        "two decodes": (SchedulerOutput(decodes=[a, b], num_scheduled={0: 1, 1: 1}), True),
        "a decode and a 1-token prompt": (SchedulerOutput(decodes=[a], prefills=[b], num_scheduled={0: 1, 1: 1}),
                                          False),
        "nothing": (SchedulerOutput(), False),
    }
    wrong = {name: batch.is_decode_only for name, (out, want) in cases.items()
             if (batch := prepare(out, allocator)).is_decode_only != want}
    assert not wrong, f"is_decode_only wrong for: {wrong}"


# ---- the eager runner against the model run densely ------------------------------------------------


def dense_last_logits(model, tokens: list[int]) -> torch.Tensor:
    """The oracle: the model over the whole sequence, no cache -> the last token's logits [V]."""
    ids = torch.tensor([tokens], device=model.device)
    positions = torch.arange(len(tokens), device=model.device)[None]
    return model(ids, positions, DenseAttention())[0, -1]


def check_rows(model, out: SchedulerOutput, logits: torch.Tensor, step: str) -> None:
    """Row i of logits [S, V] must be the dense forward's over sequence i's tokens up to its last new one."""
    assert logits.shape == (len(out.sequences), model.config.vocab_size), f"{step}: logits {tuple(logits.shape)}"
    problems = []
    for row, seq in enumerate(out.sequences):
        end = seq.num_computed_tokens + out.num_new_tokens(seq)
        diff = (logits[row] - dense_last_logits(model, seq.token_ids[:end])).abs().max().item()
        if diff > 1e-4:
            problems.append(f"row {row} (sequence {seq.seq_id}, tokens up to {end}): max |diff| {diff:.2e}")
    assert not problems, f"{step}: the runner's logits differ from the dense forward's:\n  " + "\n  ".join(problems)


def test_the_eager_runner_equals_the_dense_forward_with_chunks_and_copy_on_write():
    model = random_model(seed=4)
    cfg, block_size = model.config, 4
    allocator = BlockAllocator(num_blocks=32, block_size=block_size)
    pool = KVPool(cfg.num_layers, 32, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
    runner = ModelRunner(model, pool, TorchAttention(paged_attention))  # chapter 04's reference kernels
    prompts = {0: 6, 1: 9, 2: 11, 3: 6}  # request 2 comes in two chunks; request 3 is forked after its prompt
    seqs = {rid: sequence(rid, [(13 * rid + 7 * t) % 250 + 3 for t in range(n)], 0, 0) for rid, n in prompts.items()}

    # Step 1: the prompts, request 2's first 5 tokens only.
    first = {0: 6, 1: 9, 2: 5, 3: 6}
    for rid, n in first.items():
        allocator.allocate(rid, n)
    out = SchedulerOutput(prefills=list(seqs.values()), num_scheduled=first)
    check_rows(model, out, runner(prepare(out, allocator)), "step 1 (prompts)")
    for rid, n in first.items():
        seqs[rid].num_computed_tokens = n

    # Between the steps: requests 0 and 1 sample a token; request 3 forks into request 4, which
    # shares its blocks and samples a token of its own. Request 4's last block is half full and
    # shared, so growing it is a copy-on-write: request 4's block is new and must first get the
    # prompt's K/V that request 3's holds.
    allocator.fork(3, 4)
    seqs[4] = sequence(4, seqs[3].prompt_token_ids, 0, 6)
    for rid, token in ((0, 17), (1, 29), (4, 41)):
        seqs[rid].output_token_ids.append(token)
    copies = [copy for rid in (0, 1, 4) if (copy := allocator.append(rid)) is not None]
    for _ in range(6):
        allocator.append(2)
    assert len(copies) == 1, f"request 4's token should need exactly one block copy; got {copies}"
    shared_before = [cache[copies[0][0]].clone() for cache in pool.k_caches + pool.v_caches]

    # Step 2: three decodes, then the rest of request 2's prompt.
    out = SchedulerOutput(decodes=[seqs[0], seqs[1], seqs[4]], prefills=[seqs[2]],
                          num_scheduled={0: 1, 1: 1, 4: 1, 2: 6}, block_copies=copies)
    batch = prepare(out, allocator)
    assert (batch.num_decodes, batch.num_new_tokens, batch.block_copies) == (3, [1, 1, 1, 6], copies)
    check_rows(model, out, runner(batch), "step 2 (decodes, a chunk, a copy-on-write decode)")
    shared_after = [cache[copies[0][0]] for cache in pool.k_caches + pool.v_caches]
    assert all(torch.equal(x, y) for x, y in zip(shared_before, shared_after)), \
        "the block request 3 still holds was written; request 4's token belongs in its copy"
