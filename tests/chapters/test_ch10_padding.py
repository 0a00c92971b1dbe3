"""Chapter 10, task 2: a decode step's rows padded to its bucket, harmless to every real row.

`pad_decode_inputs` is checked against an oracle built row by row here (real
rows as given, padding rows pointing at the scratch block), with and without
padding rows, and for its errors. Then inside the engine's runner (on a CPU it
runs eagerly, through the same static buffers): after a padded step only the
real tokens' slots and the scratch slot changed in the pool, and the real rows'
logits are those of the eager runner's step, with 0, 1 or 5 padding rows.

Run against your own code with `python -m minicb check 10`.
"""
import copy

import pytest
import torch

from minicb import impl
from minicb.model_runner import prepare
from test_cuda_graphs import changed_slots, decoding_engine, eager_logits

GRADED_MODULE = "cuda_graphs"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = [pytest.mark.usefixtures("one_task"), pytest.mark.task(2)]
ROWS = ["token ids", "positions", "slots", "context lengths"]


def padded_by_hand(token_ids, positions, slots, block_tables, bucket, scratch_block, block_size, max_blocks):
    """The oracle: (inputs [4, bucket] int64, tables [bucket, max_blocks] int32), one row at a time."""
    inputs = torch.zeros(4, bucket, dtype=torch.int64)
    tables = torch.full((bucket, max_blocks), scratch_block, dtype=torch.int32)
    for row in range(bucket):
        if row < len(token_ids):
            inputs[:, row] = torch.tensor([token_ids[row], positions[row], slots[row], positions[row] + 1])
            tables[row, :len(block_tables[row])] = torch.tensor(block_tables[row])
        else:  # a padding row: token 0 at position 0, one token of context, all in the scratch block
            inputs[:, row] = torch.tensor([0, 0, scratch_block * block_size, 1])
    return inputs, tables


def compare(args) -> None:
    before = copy.deepcopy(args)
    got_inputs, got_tables = impl.load("cuda_graphs").pad_decode_inputs(*args)
    # The lists are the scheduler's own (block_tables are the allocator's live tables): padding
    # them in place would hand every later step scratch blocks as if they were the sequence's.
    assert args == before, (f"pad_decode_inputs changed its arguments: {before} became {args}; "
                            f"pad copies, never the caller's lists")
    want_inputs, want_tables = padded_by_hand(*args)
    for name, got, want in (("inputs", got_inputs, want_inputs), ("tables", got_tables, want_tables)):
        assert isinstance(got, torch.Tensor), f"{name} is a {type(got).__name__}, want a torch.Tensor"
        assert (got.shape, got.dtype, got.device.type) == (want.shape, want.dtype, "cpu"), (
            f"{name}: shape {tuple(got.shape)}, {got.dtype} on {got.device}; want {tuple(want.shape)}, "
            f"{want.dtype} on the CPU")
    problems = [f"inputs {ROWS[i]}: {got_inputs[i].tolist()}, want {want_inputs[i].tolist()}"
                for i in range(4) if not torch.equal(got_inputs[i], want_inputs[i])]
    problems += [f"tables row {r}: {got_tables[r].tolist()}, want {want_tables[r].tolist()}"
                 for r in range(want_tables.shape[0]) if not torch.equal(got_tables[r], want_tables[r])]
    assert not problems, f"pad_decode_inputs{args}:\n  " + "\n  ".join(problems[:6])


def test_three_sequences_padded_to_eight():
    # block_size 4: sequence 0 is at position 5 (slot 1 * 4 + 1 = 5 in its second block, 7).
    compare(([11, 22, 33], [5, 0, 12], [29, 8, 50], [[3, 7], [2], [9, 1, 4, 12]], 8, 15, 4, 6))


def test_a_full_bucket_has_no_padding_row():
    compare(([5, 6, 7, 8], [3, 4, 9, 1], [3, 16, 21, 4], [[0], [4, 2], [1, 5, 6], [1]], 4, 7, 4, 3))


def test_one_sequence_with_a_full_table():
    compare(([9], [10], [10], [[4, 0, 2]], 2, 5, 4, 3))


@pytest.mark.parametrize("args, match", [
    (([], [], [], [], 4, 7, 4, 3), "no sequences"),
    (([1, 2, 3], [0, 0, 0], [0, 4, 8], [[0], [1], [2]], 2, 7, 4, 3), "bucket=2"),
    (([1, 2], [0], [0, 4], [[0], [1]], 4, 7, 4, 3), "positions"),
    (([1], [0], [0], [[0, 1, 2, 3]], 4, 7, 4, 3), "max_blocks=3"),
], ids=["none", "over-the-bucket", "lengths-differ", "table-too-long"])
def test_bad_steps_are_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        impl.load("cuda_graphs").pad_decode_inputs(*args)


# ---- inside the engine's runner (eager on a CPU) ---------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_rows_write_only_the_scratch_block(backend, device):
    if backend == "torch" and device.startswith("cuda"):
        pytest.skip("on CUDA the runner captures graphs, which need the Triton decode (see runner_mode)")
    engine = decoding_engine(backend, device)
    runner, seqs = engine.runner, list(engine.scheduler.running)
    assert runner.bucket_for(len(seqs)) == 4  # 3 sequences: one padding row
    before = [c.clone() for c in engine.pool.k_caches + engine.pool.v_caches]
    calls = []
    decode = runner.decode
    runner.decode = lambda batch: calls.append(batch.num_seqs) or decode(batch)
    engine.step()
    assert calls == [3], "the decode-only step should have gone through the runner"
    # Each sequence's token of this step is now its last computed one.
    real = {divmod(slot, 4) for seq in seqs for slot in engine.allocator.slot_mapping(
        seq.seq_id, seq.num_computed_tokens - 1, seq.num_computed_tokens)}
    changed = changed_slots(before, engine.pool.k_caches + engine.pool.v_caches)
    scratch = {(runner.scratch_block, 0)}
    assert real <= changed, f"the real tokens' slots {sorted(real - changed)} were not written"
    assert changed - real == scratch, (f"the step wrote outside its own slots and the scratch slot: "
                                       f"{sorted(changed - real - scratch)} (block, offset)")
    assert all(runner.scratch_block not in engine.allocator.block_table(s.seq_id) for s in seqs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_never_changes_a_real_rows_logits(backend, device):
    if backend == "torch" and device.startswith("cuda"):
        pytest.skip("on CUDA the runner captures graphs, which need the Triton decode (see runner_mode)")
    engine = decoding_engine(backend, device)
    runner, out = engine.runner, engine.scheduler.schedule()  # a decode-only step: its slots are allocated
    batch = prepare(out, engine.allocator)
    assert runner.takes(batch) and batch.num_seqs == 3
    want = eager_logits(engine, batch)  # [3, V], no padding at all: the eager runner
    got = {}
    for buckets in ([4], [8], [3]):  # 1 padding row, 5, none (on CUDA: replays of the 4 and 8 graphs, 3 eager)
        runner.buckets = buckets
        got[buckets[0]] = runner.decode(batch).clone()  # [3, V]; the same K/V written again
    for bucket, logits in got.items():
        assert logits.shape == want.shape, f"bucket {bucket}: logits {tuple(logits.shape)}, want {tuple(want.shape)}"
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"bucket {bucket}: {m}")
        assert torch.equal(logits.argmax(-1), want.argmax(-1)), f"bucket {bucket}: greedy tokens changed"
