"""Chapter 11 on the reference only: the settings it refuses, and the power of its distribution test.

(The tests/chapters/test_ch11_*.py files grade a student's chapter 11; these use no
student code, so they would pass on the untouched stubs and do not belong there.)
"""
from __future__ import annotations

import pytest
import torch

from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.sampling import probabilities
from minicb.speculative import Speculator
from test_ch11_distribution import VOCAB, chi_square, exact_distribution, sample_counts

MODEL = random_model(seed=3)


@pytest.mark.parametrize("setting, match", [
    (dict(speculative_ngram=0), "speculative_ngram=0; it must be an integer >= 1"),
    (dict(speculative_ngram=2, num_speculative_tokens=0), "num_speculative_tokens=0; it must be an integer >= 1"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens=-1"),
    (dict(speculative_ngram=2, num_speculative_tokens=8, max_num_batched_tokens=8),
     "num_speculative_tokens=8.*9 tokens in a step.*max_num_batched_tokens=8"),
])
def test_bad_settings_are_refused_with_the_value(setting, match):
    with pytest.raises(ValueError, match=match):
        Engine(MODEL, EngineConfig(**setting))


def redraw_from_p(target_probs, draft_token_ids, draft_probs, generator=None):
    """The classic bug: after a rejection, sample from p (the draft can come out again) instead of the residual."""
    tokens = []
    for i, x in enumerate(draft_token_ids):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand((), generator=generator) * q[x] < p[x]:
            tokens.append(x)
            continue
        tokens.append(int(torch.multinomial(p, 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator)))
    return tokens


def test_the_chi_square_catches_a_sampler_that_redraws_from_p():
    class Lossy(Speculator):
        def verify(self, logits, draft_token_ids, params, generator):
            target = probabilities(logits, params)
            point_mass = torch.nn.functional.one_hot(torch.tensor(draft_token_ids), VOCAB).to(target.dtype)
            return redraw_from_p(target, draft_token_ids, point_mass, generator)

    counts, _, _ = sample_counts(Lossy(1, 1))
    statistic, dof, p_value = chi_square(counts, exact_distribution())
    assert p_value < 1e-6, (f"a lossy rejection sampler passed the chi-square (statistic {statistic:.1f}, {dof} "
                            f"degrees of freedom, p = {p_value:.2g}): the distribution test has no power")
