"""Chapter 11, tasks 1-3: prompt lookup, verification, and the rollback of rejected drafts.

Task 1, `propose_ngram`: by hand (the text's example, the latest match,
a continuation cut short by the end, no match, short contexts, k) and against
an oracle that lists every match, on random token lists.
Task 2, `accept_greedy` by hand; `rejection_sample` on hand-made p and q whose
answers are known: q(x) = p(x) always accepts, p(x) = 0 never does, the
correction after a rejection comes from max(0, p - q) (never the rejected
draft under a point mass, never a token where q covers p), the bonus comes
from the last row, and every draw comes from the generator it is given.
Task 3, `rollback` on a real chapter 03 BlockAllocator and a Sequence: the
computed count, the allocator's token slots, and which blocks go back.

Run against your own code with `python -m minicb check 11`.
"""
import random

import pytest
import torch

from minicb import impl
from minicb.sampling import SamplingParams
from minicb.scheduler import Sequence

GRADED_MODULE = "speculative"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")


# ---- task 1: prompt lookup ---------------------------------------------------------------


def lookup_oracle(token_ids: list[int], n: int, k: int) -> list[int]:
    """Every start of an earlier copy of the last n tokens (starting before them), the latest taken."""
    if len(token_ids) <= n:
        return []
    tail = token_ids[len(token_ids) - n:]
    starts = [s for s in range(len(token_ids) - n) if token_ids[s:s + n] == tail]
    return token_ids[max(starts) + n:][:k] if starts else []


def check_proposals(cases) -> None:
    """cases: [(token_ids, n, k, want)]; every wrong answer is listed."""
    propose_ngram = impl.load("speculative").propose_ngram
    wrong = []
    for token_ids, n, k, want in cases:
        got = propose_ngram(list(token_ids), n, k)
        if not isinstance(got, list) or got != want:
            wrong.append(f"propose_ngram({token_ids}, n={n}, k={k}) = {got!r}, want {want}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.task(1)
def test_propose_ngram_the_texts_example():
    check_proposals([([5, 6, 7, 8, 5, 6], 2, 3, [7, 8, 5])])


@pytest.mark.task(1)
def test_propose_ngram_the_latest_match_wins():
    check_proposals([
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, [8]),  # [1, 2] at 0 and at 3: the one at 3
        ([4, 7, 4, 5, 4], 1, 2, [5, 4]),  # 4 at 0 and 2: the one at 2
        # The latest match wins even where an earlier one would give more tokens.
        ([1, 2, 3, 1, 2, 3, 1, 2], 2, 4, [3, 1, 2]),
    ])


@pytest.mark.task(1)
def test_propose_ngram_a_match_near_the_end_gives_fewer_than_k():
    check_proposals([
        ([7, 7, 7, 7], 2, 3, [7]),  # the latest match starts at 1 and overlaps the last 2 tokens
        ([4, 4, 4], 2, 5, [4]),
        ([1, 1], 1, 4, [1]),
        ([3, 9, 3], 1, 4, [9, 3]),
    ])


@pytest.mark.task(1)
def test_propose_ngram_without_a_match_gives_nothing():
    check_proposals([
        ([1, 2, 3, 4], 2, 3, []),
        ([1, 2, 3], 1, 3, []),  # 3 never appeared before
        ([2, 3, 8, 5, 3], 2, 3, []),  # 3 did, but not after 5: the whole n-gram must match
        ([5, 1, 6, 2, 5, 1], 3, 3, []),
    ])


@pytest.mark.task(1)
def test_propose_ngram_a_context_of_n_tokens_or_fewer_gives_nothing():
    check_proposals([([], 1, 3, []), ([6], 1, 3, []), ([6, 6], 2, 3, []), ([6, 6], 3, 3, []),
                     ([6, 6, 6], 3, 3, [])])


@pytest.mark.task(1)
def test_propose_ngram_k_cuts_the_continuation():
    token_ids = [1, 2, 3, 4, 5, 6, 1, 2]
    check_proposals([(token_ids, 2, k, [3, 4, 5, 6, 1, 2][:k]) for k in range(1, 9)])


@pytest.mark.task(1)
def test_propose_ngram_against_an_oracle_on_random_contexts():
    rng = random.Random(11)
    cases = []
    for _ in range(400):
        token_ids = [rng.randrange(4) for _ in range(rng.randint(0, 16))]  # 4 ids: many repeats
        n, k = rng.randint(1, 4), rng.randint(1, 6)
        cases.append((token_ids, n, k, lookup_oracle(token_ids, n, k)))
    check_proposals(cases)


@pytest.mark.task(1)
def test_propose_ngram_matches_token_ids_not_their_text():
    # Token ids of several digits, whose decimal strings sit inside each other: a lookup that
    # compares joined text ("21 2" contains "1 2", "11,2" contains "1,2") finds matches that
    # are not there. The ids are whole symbols.
    check_proposals([([21, 2, 5, 1, 2], 2, 3, []), ([11, 2, 7, 1, 2], 2, 2, []), ([1, 12, 9, 1, 2], 2, 2, []),
                     ([3, 112, 4, 3, 11], 2, 2, []), ([12, 1, 5, 2, 1], 1, 2, [5, 2])])
    rng = random.Random(12)
    alphabet = [1, 2, 11, 12, 21, 112, 121, 211]  # every string here is inside some other one
    cases = []
    for _ in range(400):
        token_ids = [rng.choice(alphabet) for _ in range(rng.randint(2, 14))]
        n, k = rng.randint(1, 3), rng.randint(1, 4)
        cases.append((token_ids, n, k, lookup_oracle(token_ids, n, k)))
    check_proposals(cases)


# ---- task 2: greedy verification -------------------------------------------------------------


def check_greedy(argmax, drafts, want) -> None:
    got = impl.load("speculative").accept_greedy(list(argmax), list(drafts))
    assert got == want, f"accept_greedy(argmax={argmax}, drafts={drafts}) = {got!r}, want {want}"


@pytest.mark.task(2)
def test_accept_greedy_every_draft_accepted_brings_the_bonus_token():
    check_greedy([7, 8, 3], [7, 8], [7, 8, 3])


@pytest.mark.task(2)
def test_accept_greedy_the_first_draft_rejected():
    check_greedy([4, 8, 3], [7, 8], [4])  # the model's 4 replaces the draft 7; the 8 after it is not kept


@pytest.mark.task(2)
def test_accept_greedy_a_draft_in_the_middle_rejected():
    check_greedy([7, 8, 3], [7, 9], [7, 8])  # the text's example
    # The third draft equals argmax[2], but it follows a rejected one: it is not kept.
    check_greedy([7, 8, 3, 1], [7, 9, 3], [7, 8])


@pytest.mark.task(2)
def test_accept_greedy_without_drafts_gives_the_argmax():
    check_greedy([5], [], [5])


# ---- task 2: rejection sampling -----------------------------------------------------------


def rows(*probabilities) -> torch.Tensor:
    """[len, V] float32 from rows of probabilities."""
    return torch.tensor(probabilities, dtype=torch.float32)


def one_hot(token_ids, vocab_size) -> torch.Tensor:
    """[k, V] float32: the point mass prompt lookup's drafts come from."""
    return torch.nn.functional.one_hot(torch.tensor(token_ids), vocab_size).float()


def sample_many(target, drafts, draft_probs, trials, seed=0) -> list[list[int]]:
    """rejection_sample's answer for `trials` seeds (seed, seed + 1, ...), each a list of ints."""
    rejection_sample = impl.load("speculative").rejection_sample
    answers = []
    for s in range(seed, seed + trials):
        got = rejection_sample(target.clone(), list(drafts), draft_probs.clone(), torch.Generator().manual_seed(s))
        assert isinstance(got, list) and all(type(t) is int for t in got), (
            f"rejection_sample must return a list of Python ints; got {got!r}")
        assert 1 <= len(got) <= len(drafts) + 1, (
            f"rejection_sample with {len(drafts)} drafts returned {len(got)} tokens {got}; want 1 to {len(drafts) + 1}")
        answers.append(got)
    return answers


@pytest.mark.task(2)
def test_a_draft_the_draft_distribution_gives_as_often_as_the_model_is_always_accepted():
    # q(x) = p(x) at every position: min(1, p(x) / q(x)) = 1, so every draft stays and a bonus follows.
    p = rows([0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.0, 0.0, 0.5, 0.5])
    drafts = [3, 0, 1]
    answers = sample_many(p, drafts, p[:3], trials=60)
    wrong = [a for a in answers if a[:3] != drafts or len(a) != 4]
    assert not wrong, (f"with q = p every draft must be accepted (probability min(1, p(x)/q(x)) = 1) and a bonus "
                       f"token drawn; drafts {drafts} gave {wrong[0]} ({len(wrong)} of 60 seeds wrong)")
    bonus = {a[3] for a in answers}
    assert bonus <= {2, 3}, f"the bonus token comes from the last row, where only 2 and 3 have mass; got {bonus}"


@pytest.mark.task(2)
def test_a_draft_the_model_gives_no_chance_is_never_accepted_nor_returned():
    # p(x) = 0: the draft is rejected every time, and max(0, p - q) is 0 at x, so x never comes back.
    p = rows([0.5, 0.0, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25])
    for q, name in ((one_hot([1], 4), "a point mass"), (rows([0.2, 0.4, 0.2, 0.2]), "q = [0.2, 0.4, 0.2, 0.2]")):
        answers = sample_many(p, [1], q, trials=200)
        wrong = [a for a in answers if len(a) != 1 or a[0] == 1]
        assert not wrong, (f"draft 1 has p(1) = 0 (q: {name}): it must be rejected every time, and the correction "
                           f"drawn from max(0, p - q) is never 1; got {wrong[0]} ({len(wrong)} of 200 seeds)")


@pytest.mark.task(2)
def test_a_point_mass_draft_is_accepted_with_probability_p_and_never_resampled():
    # q = one-hot at x = 1, p(1) = 0.5: accepted half the time. On a rejection the residual
    # max(0, p - q) is p with x removed: 0 w.p. 0.2, 2 w.p. 0.6, 3 w.p. 0.2 -- never 1 again.
    p = rows([0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25])
    answers = sample_many(p, [1], one_hot([1], 4), trials=600)
    accepted = sum(a[0] == 1 and len(a) == 2 for a in answers)
    corrections = [a[0] for a in answers if len(a) == 1]
    again = sum(t == 1 for t in corrections)
    assert again == 0, (f"after rejecting draft 1, the correction came back 1 in {again} of {len(corrections)} "
                        f"rejections: it must be drawn from max(0, p - q), which is 0 at the draft when q is a "
                        f"point mass on it (drawing from p instead gives a draft rejected twice)")
    assert 240 <= accepted <= 360, (f"draft 1 with p(1) = 0.5 and q(1) = 1 was accepted {accepted} times in 600; "
                                    f"want about 300 (probability min(1, p(x)/q(x)) = 0.5)")
    share = sum(t == 2 for t in corrections) / len(corrections)
    assert 0.45 <= share <= 0.75, (f"corrections were 2 in {share:.0%} of rejections; the normalised residual "
                                   f"gives 2 with probability 0.3 / 0.5 = 60%")


@pytest.mark.task(2)
def test_the_correction_comes_from_max_of_zero_and_p_minus_q():
    # The text's worked example: p = [0.4, 0.3, 0.2, 0.1], q = [0.1, 0.6, 0.1, 0.2].
    # max(0, p - q) = [0.3, 0, 0.1, 0], normalised [0.75, 0, 0.25, 0]: a correction is 0 or 2,
    # never 3, though p(3) > 0 (q covers all of p there). Draft 0 has p/q = 4: always accepted.
    p = rows([0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25])
    q = rows([0.1, 0.6, 0.1, 0.2])
    for draft, accept_rate in ((1, 0.5), (3, 0.5)):
        answers = sample_many(p, [draft], q, trials=400)
        corrections = [a[0] for a in answers if len(a) == 1]
        outside = sorted({t for t in corrections} - {0, 2})
        assert not outside, (f"draft {draft}: corrections {outside} appeared; max(0, p - q) = [0.3, 0, 0.1, 0] "
                             f"gives only 0 or 2 (not p with the draft removed)")
        accepted = sum(len(a) == 2 and a[0] == draft for a in answers)
        assert abs(accepted / 400 - accept_rate) <= 0.1, (
            f"draft {draft}: accepted {accepted} times in 400; want about {accept_rate:.0%} = min(1, p(x)/q(x))")
        zeros = sum(t == 0 for t in corrections) / max(len(corrections), 1)
        assert 0.6 <= zeros <= 0.9, f"draft {draft}: corrections were 0 in {zeros:.0%}; want about 75% (0.3 / 0.4)"
    answers = sample_many(p, [0], q, trials=50)
    assert all(len(a) == 2 and a[0] == 0 for a in answers), (
        f"draft 0 has p(0)/q(0) = 4, so it must always be accepted; got {[a for a in answers if a[0] != 0][:3]}")


@pytest.mark.task(2)
def test_each_draft_draws_its_own_uniform():
    # Two point-mass drafts, each with p(x) = 0.5: each is kept with probability 0.5, on its own
    # coin. So 0, 1 and 2 drafts are kept a half, a quarter and a quarter of the time. One
    # uniform reused for both drafts keeps both whenever it keeps the first: half the time.
    p = rows([0.5, 0.3, 0.2, 0.0], [0.0, 0.5, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25])
    trials = 2000
    answers = sample_many(p, [0, 1], one_hot([0, 1], 4), trials=trials)
    # Drafts kept = the leading tokens equal to the drafts (a correction never equals its point-mass draft).
    kept = [next((i for i, (token, draft) in enumerate(zip(a, [0, 1])) if token != draft), min(len(a) - 1, 2))
            for a in answers]
    counts = [kept.count(i) for i in range(3)]
    want = [trials / 2, trials / 4, trials / 4]
    # A binomial count's spread here is at most sqrt(2000 * 0.25) ~ 22; 5 of them is generous.
    off = [(i, c, w) for i, (c, w) in enumerate(zip(counts, want)) if abs(c - w) > 5 * (trials * 0.25) ** 0.5]
    assert not off, (f"drafts kept 0 / 1 / 2 times in {counts} of {trials} runs; want about {want}. Each draft "
                     f"needs a fresh uniform from the generator: one draw shared by every draft keeps whole runs "
                     f"far too often")


@pytest.mark.task(2)
def test_rejection_stops_at_the_first_rejected_draft():
    # Draft 0 has p = 0 (always rejected); draft 1 would always be accepted. Nothing after the rejection counts.
    p = rows([0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])
    answers = sample_many(p, [0, 1], one_hot([0, 1], 4), trials=50)
    wrong = [a for a in answers if len(a) != 1 or a[0] not in (1, 2)]
    assert not wrong, (f"the first draft is always rejected here: the answer is one correction, 1 or 2, and the "
                       f"second draft is never looked at; got {wrong[0]} ({len(wrong)} of 50 seeds)")


@pytest.mark.task(2)
def test_the_bonus_token_comes_from_the_last_row():
    # Both drafts are certain (p(x) = 1), so both stay; the last row is a point mass on 3.
    p = rows([0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0])
    answers = sample_many(p, [1, 2], one_hot([1, 2], 4), trials=30)
    wrong = [a for a in answers if a != [1, 2, 3]]
    assert not wrong, (f"with both drafts accepted the bonus token is drawn from target_probs[k], the last row "
                       f"(a point mass on 3): want [1, 2, 3], got {wrong[0]} ({len(wrong)} of 30 seeds)")


@pytest.mark.task(2)
def test_a_seeded_generator_repeats_and_the_global_generator_is_left_alone():
    p = rows([0.3, 0.3, 0.2, 0.2], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25])
    q = rows([0.1, 0.6, 0.1, 0.2], [0.4, 0.1, 0.4, 0.1])
    torch.manual_seed(1234)
    want_global = torch.rand(4)
    torch.manual_seed(1234)
    first = sample_many(p, [1, 2], q, trials=40, seed=100)
    global_now = torch.rand(4)
    again = sample_many(p, [1, 2], q, trials=40, seed=100)
    assert first == again, ("the same seeds gave different answers: every random draw must come from the "
                            f"generator passed in; first run {first[:5]}, second {again[:5]}")
    assert torch.equal(global_now, want_global), ("rejection_sample drew from torch's global generator; every "
                                                  "draw must use the `generator` argument")
    assert len({tuple(a) for a in first}) > 1, f"40 different seeds all gave {first[0]}: the draws ignore the seed"


# ---- task 3: rollback --------------------------------------------------------------------------


def a_speculating_sequence(computed: int, slots: int, num_blocks: int = 8, block_size: int = 4):
    """(allocator, seq): seq 0 with a 6-token prompt, outputs up to `computed + 1` tokens in all,
    `computed` of them computed, and token slots for `slots` (its newest token and drafts included)."""
    allocator = impl.load("block_allocator").BlockAllocator(num_blocks, block_size)
    seq = Sequence(0, list(range(10, 16)), SamplingParams(max_tokens=32))
    seq.output_token_ids = list(range(20, 20 + computed + 1 - 6))
    allocator.allocate(0, slots)
    seq.num_computed_tokens = computed
    return allocator, seq


def check_rollback(computed: int, num_rejected: int, want_blocks: int, num_blocks: int = 8) -> None:
    """Roll back a step that computed up to `computed` tokens; seq 0 must keep the first want_blocks blocks."""
    allocator, seq = a_speculating_sequence(computed, computed, num_blocks)
    table, free, outputs = allocator.block_table(0), allocator.num_free_blocks, list(seq.output_token_ids)
    impl.load("speculative").rollback(allocator, seq, num_rejected)
    call = f"rollback of {num_rejected} from {computed} computed tokens (blocks of 4: {table})"
    want = computed - num_rejected
    assert seq.num_computed_tokens == want, f"{call}: seq.num_computed_tokens = {seq.num_computed_tokens}, want {want}"
    assert allocator.has(0), f"{call}: the sequence's blocks were all freed; only the rejected slots go"
    assert allocator.num_tokens(0) == want, (f"{call}: the allocator holds {allocator.num_tokens(0)} token slots for "
                                             f"it, want {want} (allocator.truncate to the computed count)")
    assert allocator.block_table(0) == table[:want_blocks], (
        f"{call}: block table {allocator.block_table(0)}, want its first {want_blocks}: {table[:want_blocks]}")
    returned = allocator.num_free_blocks - free
    assert returned == len(table) - want_blocks, (f"{call}: {returned} blocks went back to the pool, "
                                                  f"want {len(table) - want_blocks}")
    assert seq.output_token_ids == outputs, (f"{call}: output_token_ids changed to {seq.output_token_ids}; rollback "
                                             f"touches only the computed count and the allocator")


@pytest.mark.task(3)
def test_rollback_steps_the_computed_count_back_and_frees_the_last_block():
    check_rollback(computed=14, num_rejected=3, want_blocks=3)  # 14 -> 11 tokens: 4 blocks -> 3


@pytest.mark.task(3)
def test_rollback_inside_one_block_keeps_it():
    check_rollback(computed=14, num_rejected=1, want_blocks=4)  # 14 -> 13 tokens: still 4 blocks


@pytest.mark.task(3)
def test_rollback_to_a_block_boundary_frees_every_block_past_it():
    check_rollback(computed=13, num_rejected=5, want_blocks=2)  # 13 -> 8 tokens: exactly 2 full blocks


@pytest.mark.task(3)
def test_rollback_of_every_draft():
    check_rollback(computed=14, num_rejected=4, want_blocks=3)  # newest token + 4 drafts, all drafts rejected


@pytest.mark.task(3)
def test_rollback_of_nothing_changes_nothing():
    check_rollback(computed=14, num_rejected=0, want_blocks=4)


@pytest.mark.task(3)
def test_rollback_releases_a_shared_block_only_for_this_sequence():
    # Sequence 1 shares all four blocks (chapter 03's fork): sequence 0's rollback must drop its own
    # reference to the last block through the allocator, not hand the block back to the pool.
    allocator, seq = a_speculating_sequence(14, 14)
    allocator.fork(0, 1)
    table, free = allocator.block_table(0), allocator.num_free_blocks
    impl.load("speculative").rollback(allocator, seq, 3)
    assert allocator.block_table(0) == table[:3], f"sequence 0 keeps {allocator.block_table(0)}, want {table[:3]}"
    assert allocator.block_table(1) == table and allocator.num_tokens(1) == 14, (
        f"sequence 1's blocks changed to {allocator.block_table(1)} ({allocator.num_tokens(1)} tokens); "
        f"want {table} (14 tokens): roll back through allocator.truncate")
    assert allocator.num_free_blocks == free, (f"{allocator.num_free_blocks - free} blocks went back to the pool, "
                                               f"but sequence 1 still holds them all")
