"""Chapter 12, all tasks together: your trie walk, mask, accept, rollback and fork inside the engine.

The other chapter 12 tests grade each task on its own, with the reference
standing in for the others. Here the engine (minicb/engine.py) takes its
grammar code from your file alone: minicb's backend compiles each request's
grammar to your `Grammar` (whose masks your `allowed_tokens_trie` makes), every
guided row is masked by your `mask_logits`, and each completion's state is your
`Matcher`. On the tiny random model with tests/engine/engine_support.py's
vocabulary, four grammars (two regexes, a choice, a JSON schema), the oracle is
the reference's engine serving the same requests:

- greedy: the same tokens and finish reasons, and every text that ended by
  itself matches its grammar;
- seeded sampling at temperature 1 with n = 2: the same masks give the same
  draws, so the same tokens, completion by completion.

`check 12` shows it as the row "all", with the composition tests of
tests/chapters/test_ch12_engine.py and the distribution through the engine of
tests/chapters/test_ch12_distribution.py.
"""
import pytest

from minicb.sampling import SamplingParams
from test_ch12_engine import GRAMMARS, PROMPTS, assert_same, serve


def guided(**params) -> list:
    return [(prompt, SamplingParams(structured=structured, **params)) for prompt, structured in zip(PROMPTS, GRAMMARS)]


@pytest.mark.task("all")
def test_greedy_guided_text_is_the_references():
    got, _ = serve(guided(max_tokens=24))  # yours first: a stub fails fast
    want, _ = serve(guided(max_tokens=24), reference=True)
    assert_same(got, want, "greedy")
    assert any(seq.finish_reason == "stop" for seq in got.values()), "no guided request ended by itself"


@pytest.mark.task("all")
def test_seeded_guided_sampling_is_the_references():
    got, _ = serve(guided(max_tokens=24, temperature=1.0, seed=11, n=2))
    want, _ = serve(guided(max_tokens=24, temperature=1.0, seed=11, n=2), reference=True)
    assert_same(got, want, "seeded, n = 2")
