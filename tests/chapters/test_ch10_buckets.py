"""Chapter 10, task 1: which batch sizes get a graph, and which graph a step replays.

`batch_buckets(max_num_seqs)` is checked by hand and against the rule written
another way (powers of two up to 8, multiples of 8 past it, and max_num_seqs)
for every max_num_seqs from 1 to 130; `smallest_bucket(buckets, n)` against
the smallest bucket >= n found by search, on many bucket lists, and through the
engine's runner. Bad input is a ValueError naming the value.

Run against your own code with `python -m minicb check 10`.
"""
import pytest

from minicb import impl
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model

GRADED_MODULE = "cuda_graphs"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = [pytest.mark.usefixtures("one_task"), pytest.mark.task(1)]


def buckets_by_the_rule(max_num_seqs: int) -> list[int]:
    """The oracle: every size up to max_num_seqs that is 1, 2, 4 or 8, a multiple of 8, or max_num_seqs."""
    return [b for b in range(1, max_num_seqs + 1)
            if b == max_num_seqs or b in (1, 2, 4, 8) or (b > 8 and b % 8 == 0)]


def test_batch_buckets_by_hand():
    batch_buckets = impl.load("cuda_graphs").batch_buckets
    want = {32: [1, 2, 4, 8, 16, 24, 32], 20: [1, 2, 4, 8, 16, 20], 8: [1, 2, 4, 8], 5: [1, 2, 4, 5], 1: [1],
            64: [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64], 3: [1, 2, 3], 9: [1, 2, 4, 8, 9]}
    wrong = {m: (batch_buckets(m), b) for m, b in want.items() if batch_buckets(m) != b}
    assert not wrong, "\n".join(f"batch_buckets({m}) = {got}, want {b}" for m, (got, b) in wrong.items())


def test_batch_buckets_follow_the_rule_for_every_size():
    batch_buckets = impl.load("cuda_graphs").batch_buckets
    wrong = [(m, batch_buckets(m), buckets_by_the_rule(m)) for m in range(1, 131)
             if batch_buckets(m) != buckets_by_the_rule(m)]
    assert not wrong, f"{len(wrong)} of 130 sizes differ; the first: batch_buckets({wrong[0][0]}) = " \
                      f"{wrong[0][1]}, want {wrong[0][2]}"


@pytest.mark.parametrize("bad", [0, -4, 2.5, "8"])
def test_batch_buckets_rejects_what_is_not_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"max_num_seqs={bad!r}"):
        impl.load("cuda_graphs").batch_buckets(bad)


def test_smallest_bucket_by_hand():
    smallest_bucket = impl.load("cuda_graphs").smallest_bucket
    buckets = [1, 2, 4, 8, 16, 24, 32]
    picks = {n: smallest_bucket(buckets, n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 31, 32, 33, 100)}
    want = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 24, 24: 24, 25: 32, 31: 32, 32: 32,
            33: None, 100: None}
    wrong = {n: (picks[n], want[n]) for n in want if picks[n] != want[n]}
    assert not wrong, "\n".join(f"smallest_bucket({buckets}, {n}) = {got}, want {w}"
                                for n, (got, w) in wrong.items())


def test_smallest_bucket_against_a_search():
    smallest_bucket = impl.load("cuda_graphs").smallest_bucket
    lists = [[1], [3], [1, 2, 4, 5], [2, 6, 7], [1, 2, 4, 8, 16, 20], [4, 40, 41, 100]]
    wrong = []
    for buckets in lists:
        for n in range(1, buckets[-1] + 3):
            want = min((b for b in buckets if b >= n), default=None)
            got = smallest_bucket(list(buckets), n)
            if got != want:
                wrong.append(f"smallest_bucket({buckets}, {n}) = {got}, want {want}")
    assert not wrong, f"{len(wrong)} picks wrong:\n" + "\n".join(wrong[:10])


@pytest.mark.parametrize("bad", [0, -1])
def test_smallest_bucket_rejects_an_empty_step(bad):
    with pytest.raises(ValueError, match=f"num_seqs={bad}"):
        impl.load("cuda_graphs").smallest_bucket([1, 2, 4], bad)


def test_the_engines_runner_captures_your_buckets_and_picks_with_them():
    # EngineConfig(cuda_graphs=True) on a CPU: the runner, without graphs, built from impl.load("cuda_graphs").
    engine = Engine(random_model(seed=0), EngineConfig(max_num_seqs=20, cuda_graphs=True, num_blocks=16))
    runner = engine.runner
    assert runner.buckets == [1, 2, 4, 8, 16, 20], f"the runner's buckets for max_num_seqs=20: {runner.buckets}"
    picks = {n: runner.bucket_for(n) for n in (1, 3, 7, 9, 17, 20, 21)}
    assert picks == {1: 1, 3: 4, 7: 8, 9: 16, 17: 20, 20: 20, 21: None}, f"the runner picked {picks}"
