"""Chapter 11: speculative decoding leaves the output distribution exactly the model's.

The oracle is arithmetic: on a tiny model with a 4-token vocabulary, the exact
probability of every three-token continuation (t1, t2, t3) of one prompt is
p(t1) * p(t2 | t1) * p(t3 | t1, t2), each factor a softmax of the model's
logits. The engine, with prompt lookup on, samples the same prompt under 2,000
seeds. The prompt holds every token, so whatever t1 is, lookup finds it earlier
and proposes a draft for t2: the first decode step always verifies a draft,
and t2 and t3 come from the rejection sampler (an accepted draft, a residual
draw, or a bonus token). A chi-square test compares the counts with the exact
distribution at significance 0.001.

tests/engine/test_speculative.py shows that this test can fail: the same run with a
rejection sampler that draws from p instead of the residual max(0, p - q) after
a rejection -- the bug that makes speculation lossy -- is rejected by a wide margin.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from minicb.engine import Engine, EngineConfig
from minicb.model import DenseAttention, random_model, tiny_config
from minicb.sampling import SamplingParams

GRADED_MODULE = "speculative"
pytestmark = pytest.mark.usefixtures("one_task")

VOCAB = 4
MODEL = random_model(tiny_config(vocab_size=VOCAB), seed=11)
PROMPT = [0, 1, 2, 3, 1, 0, 3, 2]  # every token appears, so lookup (n = 1) always finds t1 earlier
NUM_SAMPLES = 2000
ALPHA = 0.001


def exact_distribution() -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) for every continuation, from dense forwards of the model (temperature 1)."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        prefixes = list(probs)
        ids = torch.tensor([PROMPT + list(prefix) for prefix in prefixes])  # [P, T]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        nxt = MODEL(ids, positions, DenseAttention())[:, -1].softmax(-1)  # [P, V]
        probs = {prefix + (t,): probs[prefix] * float(nxt[i, t]) for i, prefix in enumerate(prefixes)
                 for t in range(VOCAB)}
    return probs


def sample_counts(speculator=None) -> tuple[dict[tuple[int, ...], int], int, int]:
    """Counts of (t1, t2, t3) over NUM_SAMPLES seeds with speculation on, drafts verified, drafts accepted.
    `speculator` replaces the engine's own (to run a broken one)."""
    engine = Engine(MODEL, EngineConfig(block_size=4, max_num_seqs=256, num_blocks=256 * 4,
                                        speculative_ngram=1, num_speculative_tokens=1))
    if speculator is not None:
        engine.speculator = engine.scheduler.speculator = speculator
    for seed in range(NUM_SAMPLES):
        engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True))
    counts, drafts, accepted = dict.fromkeys(itertools.product(range(VOCAB), repeat=3), 0), 0, 0
    while engine.has_unfinished():
        for seq in engine.step().finished:
            counts[tuple(seq.output_token_ids)] += 1
            drafts += seq.num_draft_tokens
            accepted += seq.num_accepted_tokens
    return counts, drafts, accepted


def chi_square(counts: dict, probs: dict) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value); cells expected below 5 are pooled into one."""
    total = sum(counts.values())
    cells, pooled_seen, pooled_expected = [], 0, 0.0
    for key, p in probs.items():
        if total * p >= 5:
            cells.append((counts[key], total * p))
        else:
            pooled_seen, pooled_expected = pooled_seen + counts[key], pooled_expected + total * p
    if pooled_expected > 0:
        cells.append((pooled_seen, pooled_expected))
    statistic = sum((seen - expected) ** 2 / expected for seen, expected in cells)
    dof = len(cells) - 1
    # The chi-square survival function: the regularised upper incomplete gamma Q(dof/2, x/2).
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value


def worst_cells(counts: dict, probs: dict, n: int = 5) -> str:
    total = sum(counts.values())
    rows = sorted(probs, key=lambda k: -abs(counts[k] - total * probs[k]))[:n]
    return ", ".join(f"{k}: seen {counts[k]}, expected {total * probs[k]:.1f}" for k in rows)


@pytest.mark.task(2)
def test_speculation_keeps_the_three_token_distribution():
    probs = exact_distribution()
    counts, drafts, accepted = sample_counts()
    # Every request verifies one draft at its first decode step; if none did, this tests nothing.
    assert drafts == NUM_SAMPLES, f"{drafts} drafts verified over {NUM_SAMPLES} requests; expected one each"
    assert 0 < accepted < drafts, f"{accepted} of {drafts} drafts accepted; the test needs both outcomes"
    statistic, dof, p_value = chi_square(counts, probs)
    assert p_value > ALPHA, (
        f"the tokens sampled with speculation do not follow the model's distribution: chi-square {statistic:.1f} "
        f"with {dof} degrees of freedom, p = {p_value:.2g} < {ALPHA}. Largest gaps: {worst_cells(counts, probs)}")
