"""The sampling rules a client may set: min_tokens, the three penalties and min_p.

The oracle is HF transformers' logits processors on the same logits:
RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor (given EOS
and the stop tokens) and MinPLogitsWarper after TemperatureLogitsWarper. HF has
no presence or frequency penalty, so OpenAI's formula is written out plainly
below (`penalised`) and compared with instead.

First the rules one by one on random logits and random histories: the processed
logits, the greedy choice and, for sampled rows, the distribution drawn from.
Then the engine on the tiny random model: its greedy text with a rule equals a
reference loop that recomputes the whole sequence each step and applies HF's
processors to the logits, with speculation (chapter 11) off and on; and with
speculation on, seeded sampling under the rules still follows the exact
distribution (chi-square, as chapter 11's distribution test).

And the greedy choice itself: greedy_tokens (NumPy's argmax on a CPU) against
torch.argmax on ties, NaN and infinities.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper)

from minicb import LLM
from minicb.engine import Engine, EngineConfig
from minicb.model import DenseAttention, random_model, tiny_config
from minicb.naive import first_difference, generate_with_cache
from minicb.sampling import (SamplingParams, apply_rules, draw, filter_logits, finish_reason, greedy_tokens,
                             make_generator, probabilities, sample)
from test_ch11_distribution import chi_square, worst_cells

VOCAB = 64
EOS = [2]


def random_case(seed: int, rows: int = 6):
    """(logits [rows, VOCAB], histories): logits of both signs; prompts and outputs that repeat ids."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, VOCAB, generator=gen)
    histories = []
    for _ in range(rows):
        prompt_len, output_len = int(torch.randint(1, 12, (), generator=gen)), int(torch.randint(0, 12, (), generator=gen))
        pool = torch.randint(0, VOCAB, (6,), generator=gen)  # few distinct ids: counts above 1
        prompt = pool[torch.randint(0, 6, (prompt_len,), generator=gen)].tolist()
        output = pool[torch.randint(0, 6, (output_len,), generator=gen)].tolist()
        histories.append((prompt, output))
    return logits, histories


def penalised(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties, token by token. logits [V] -> [V]."""
    want = logits.clone()
    for token in set(output):
        want[token] -= frequency * output.count(token) + presence
    return want


def hf_processed(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                 eos_token_ids: list[int]) -> torch.Tensor:
    """One row through HF's processors (and the formula above), in apply_rules' order. logits [V] -> [V]."""
    input_ids = torch.tensor([prompt + output])  # [1, T]: HF sees the whole sequence so far
    scores = logits[None].clone()  # [1, V]
    ends = params.stop_token_ids + ([] if params.ignore_eos else eos_token_ids)
    if params.min_tokens and ends:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, ends)(input_ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(input_ids, scores)
    return penalised(scores[0], output, params.presence_penalty, params.frequency_penalty)


def hf_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then HF's min-p warper, then softmax. logits [V] -> [V]."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits[None].clone())
    return MinPLogitsWarper(params.min_p)(None, scores).softmax(-1)[0]


def check_rows(got: torch.Tensor, want: torch.Tensor, histories, what: str, atol: float = 0.0) -> None:
    """got [R, V] equals want (-inf where it has -inf, the rest within atol), or says which row and token
    differ and what the row had seen."""
    for r in range(got.shape[0]):
        seen = f"{what}, row {r} (prompt {histories[r][0]}, output {histories[r][1]})"
        masked, hf_masked = torch.isinf(got[r]), torch.isinf(want[r])
        assert torch.equal(masked, hf_masked), (
            f"{seen}: -inf at {masked.nonzero().flatten().tolist()}, HF's at {hf_masked.nonzero().flatten().tolist()}")
        gap = (got[r] - want[r]).masked_fill(hf_masked, 0.0).abs()  # [V]
        token = int(gap.argmax())
        assert gap[token] <= atol, (
            f"{seen}: token {token} has {float(got[r, token]):.6f}, HF's {float(want[r, token]):.6f} "
            f"(gap {float(gap[token]):.3g}, allowed {atol})")


def check_greedy(logits, params, histories, want, what: str) -> None:
    """sample() on greedy params picks the argmax of the HF-processed logits, row by row."""
    got = sample(logits, params, [None] * len(params), histories, EOS)
    assert got == want.argmax(-1).tolist(), (
        f"{what}: greedy picked {got}, the argmax of HF's processed logits is {want.argmax(-1).tolist()}")


# ----------------------------------------------------------------------------
# Each rule against HF's processor (or the formula), on random logits and histories.


def test_greedy_tokens_follow_torch_argmax():
    # On a CPU in float32 the greedy choice is NumPy's argmax; it must pick what torch.argmax
    # picks on every row: ties (the first), NaN (counted largest), -inf and +inf, a strided view.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=gen)
    logits[1, [3, 7, 20]] = 9.0  # three equal maxima
    logits[2, 11] = float("nan")
    logits[2, 30] = float("nan")
    logits[3] = float("-inf")
    logits[4, 5] = float("inf")
    logits[5, :] = 0.0  # every column equal
    for name, case in [("rows", logits), ("columns of the transpose", logits.t().contiguous().t()),
                       ("every other column", logits[:, ::2]), ("float64", logits.double()),
                       ("wanting gradients", logits.clone().requires_grad_())]:
        want = torch.argmax(case.detach(), dim=-1).tolist()
        assert greedy_tokens(case) == want, f"{name}: greedy_tokens {greedy_tokens(case)}, torch.argmax {want}"


def test_the_worked_example_in_apply_rules():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    got = apply_rules(torch.tensor([[2.0, -1.0, 0.5]]), [params], [([0], [1, 1])], EOS)
    assert got.tolist() == [[1.0, -3.0, 0.5]], f"the docstring's example gives {got.tolist()}"


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_matches_hf(penalty, seed):
    logits, histories = random_case(seed)
    params = [SamplingParams(repetition_penalty=penalty)] * len(histories)
    got = apply_rules(logits, params, histories, EOS)
    want = torch.stack([hf_processed(logits[r], *histories[r], params[r], EOS) for r in range(len(histories))])
    check_rows(got, want, histories, f"repetition_penalty={penalty}")  # the same division: exact
    check_greedy(logits, params, histories, want, f"repetition_penalty={penalty}")


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore_eos"])
@pytest.mark.parametrize("min_tokens", [1, 4, 20])
def test_min_tokens_matches_hf(min_tokens, ignore_eos):
    # Make EOS and the stop tokens the favourites, so that masking them changes the greedy choice.
    # Row r has generated r tokens: min_tokens 1, 4 and 20 mask rows 0, 0-3 and all.
    logits, histories = random_case(seed=min_tokens, rows=8)
    histories = [(prompt, list(range(10, 10 + r))) for r, (prompt, _) in enumerate(histories)]
    stops = [5, 7]
    logits[:, EOS + stops] += 20.0
    params = [SamplingParams(max_tokens=32, min_tokens=min_tokens, stop_token_ids=stops, ignore_eos=ignore_eos)] * 8
    got = apply_rules(logits, params, histories, EOS)
    want = torch.stack([hf_processed(logits[r], *histories[r], params[r], EOS) for r in range(8)])
    check_rows(got, want, histories, f"min_tokens={min_tokens}, ignore_eos={ignore_eos}")
    check_greedy(logits, params, histories, want, f"min_tokens={min_tokens}")


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.4), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_match_the_formula(presence, frequency):
    logits, histories = random_case(seed=4)
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * len(histories)
    got = apply_rules(logits, params, histories, EOS)
    want = torch.stack([hf_processed(logits[r], *histories[r], params[r], EOS) for r in range(len(histories))])
    check_rows(got, want, histories, f"presence_penalty={presence}, frequency_penalty={frequency}", atol=1e-6)
    check_greedy(logits, params, histories, want, f"presence {presence}, frequency {frequency}")
    # The prompt never counts: a token only in the prompt keeps its logit exactly.
    for r, (prompt, output) in enumerate(histories):
        for token in set(prompt) - set(output):
            assert got[r, token] == logits[r, token], f"row {r}: prompt-only token {token} was penalised"


def test_all_rules_at_once_match_hf_in_order():
    logits, histories = random_case(seed=5, rows=10)
    logits[:, EOS] += 8.0
    params = [SamplingParams(max_tokens=20, min_tokens=6, repetition_penalty=1.7, presence_penalty=0.8,
                             frequency_penalty=-0.3)] * 10
    got = apply_rules(logits, params, histories, EOS)
    want = torch.stack([hf_processed(logits[r], *histories[r], params[r], EOS) for r in range(10)])
    check_rows(got, want, histories, "all rules", atol=1e-6)
    check_greedy(logits, params, histories, want, "all rules")


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_matches_hf(min_p, temperature):
    logits, _ = random_case(seed=6)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    got = probabilities(logits, params)  # [R, V]
    want = torch.stack([hf_probabilities(row, params) for row in logits])
    for r in range(logits.shape[0]):
        kept, hf_kept = (got[r] > 0).nonzero().flatten().tolist(), (want[r] > 0).nonzero().flatten().tolist()
        assert kept == hf_kept, f"min_p={min_p}, temperature {temperature}, row {r}: kept {kept}, HF kept {hf_kept}"
        gap = (got[r] - want[r]).abs().max()
        assert gap <= 1e-6, f"min_p={min_p}, temperature {temperature}, row {r}: probabilities differ by {gap:.3g}"


def test_min_p_never_changes_a_greedy_choice():
    logits, histories = random_case(seed=7)
    greedy = sample(logits, [SamplingParams(min_p=0.9)] * len(histories), [None] * len(histories))
    assert greedy == logits.argmax(-1).tolist(), f"min_p changed greedy tokens: {greedy}"


def test_sampled_rows_draw_from_the_processed_distribution():
    # A small vocabulary, so that 20,000 draws estimate every probability closely.
    gen = torch.Generator().manual_seed(8)
    vocab, draws = 8, 20_000
    logits = torch.randn(1, vocab, generator=gen)
    logits[0, EOS] += 1.0
    prompt, output = [0, 3, 3], [4, 4, 4, 6]
    params = SamplingParams(max_tokens=16, temperature=0.8, min_p=0.08, min_tokens=5, repetition_penalty=1.4,
                            presence_penalty=0.3, frequency_penalty=0.2, seed=0)
    want = hf_probabilities(hf_processed(logits[0], prompt, output, params, EOS), params)  # [V]
    generator = make_generator(params, "cpu")
    counts = torch.zeros(vocab)
    for _ in range(draws // 1000):  # 1000 rows a call: one row each, the same history, the same stream
        tokens = sample(logits.expand(1000, vocab), [params] * 1000, [generator] * 1000, [(prompt, output)] * 1000,
                        EOS)
        counts += torch.bincount(torch.tensor(tokens), minlength=vocab)
    seen = counts / draws
    assert all(counts[t] == 0 for t in range(vocab) if want[t] == 0), (
        f"drew tokens the rules rule out: counts {counts.tolist()}, HF's probabilities {want.tolist()}")
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((seen - want).abs() <= 5 * sigma + 1e-9).all(), (
        f"frequencies {seen.tolist()} vs HF's probabilities {want.tolist()} (5 sigma: {(5 * sigma).tolist()})")


def test_draw_follows_the_probabilities_and_its_generator():
    # Zeros first, between and last: a token of probability 0 owns no stretch of the running sums.
    probs = torch.tensor([0.0, 0.05, 0.0, 0.6, 0.25, 0.1, 0.0])
    generator, draws = torch.Generator().manual_seed(3), 20_000
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(draws)]), minlength=len(probs))
    assert len(counts) == len(probs) and (counts[probs == 0] == 0).all(), (
        f"drew a token of probability 0: {counts.tolist()}")
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert ((counts / draws - probs).abs() <= 5 * sigma).all(), (
        f"frequencies {(counts / draws).tolist()} vs probabilities {probs.tolist()} (5 sigma: {(5 * sigma).tolist()})")
    # Every draw comes from the generator it is given: a seed repeats, and another seed differs.
    streams = [[draw(probs, g) for _ in range(40)] for g in (torch.Generator().manual_seed(seed) for seed in (7, 7, 8))]
    assert streams[0] == streams[1] != streams[2], f"seeds 7, 7 and 8 drew {streams}"


def sorted_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p over the whole row sorted, in float64: the rule as written, to hold filter_logits' search to it."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.double().softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    drop_sorted[0] = False
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("scale", [0.01, 1.0, 10.0])  # flat (a nucleus of most of the row), spread, peaked
@pytest.mark.parametrize("top_p", [1e-6, 0.5, 0.9, 0.999])
def test_top_p_keeps_what_sorting_the_whole_row_keeps(scale, top_p):
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(11)) * scale
    got, want = filter_logits(logits, 0, top_p), sorted_top_p(logits, top_p)
    kept, should = torch.isfinite(got), torch.isfinite(want)
    assert torch.equal(got, want), (
        f"top_p {top_p}, logits x {scale}: kept {int(kept.sum())} tokens, the sort keeps {int(should.sum())}; "
        f"they differ at {(kept != should).nonzero()[:5, 0].tolist()}")


# ----------------------------------------------------------------------------
# Honour or refuse: a rule is never accepted and then ignored.


class Untouchable(list):
    """Histories that fail the test if anything reads them."""

    def __getitem__(self, i):
        raise AssertionError("apply_rules read a history although no row has a rule")

    def __len__(self):
        raise AssertionError("apply_rules looked at the histories although no row has a rule")

    def __iter__(self):
        raise AssertionError("apply_rules read the histories although no row has a rule")


def test_no_rule_costs_nothing():
    logits, _ = random_case(seed=9)
    params = [SamplingParams(), SamplingParams(temperature=1.0, min_p=0.2, top_k=3)] * 3
    assert apply_rules(logits, params, Untouchable(), None) is logits, "with no rule the logits must come back as they are"


@pytest.mark.parametrize("field, value", [("min_tokens", 2), ("repetition_penalty", 1.2), ("presence_penalty", 0.5),
                                          ("frequency_penalty", -0.5)])
def test_a_rule_without_histories_is_refused_with_its_name(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"{field}={value!r} needs the tokens each row has seen"):
        sample(torch.zeros(2, VOCAB), [SamplingParams(), params], [None, None])
    # Chapter 01's loops call sample() without histories: they refuse such a request the same way.
    with pytest.raises(ValueError, match=field):
        generate_with_cache(random_model(seed=3), [5, 6, 7], SamplingParams(max_tokens=4, **{field: value}))


def test_min_tokens_without_eos_ids_is_refused():
    with pytest.raises(ValueError, match="min_tokens=3 masks EOS, so it needs the model's eos_token_ids"):
        sample(torch.zeros(1, VOCAB), [SamplingParams(min_tokens=3)], [None], [([1], [])])
    # With ignore_eos only the stop tokens are masked, and no EOS ids are needed.
    assert sample(torch.zeros(1, 4), [SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[0])], [None],
                  [([1], [])]) == [1]


@pytest.mark.parametrize("field, value, message", [
    ("min_tokens", -1, "min_tokens=-1; it must be an integer in [0, max_tokens], here [0, 8]"),
    ("min_tokens", 9, "min_tokens=9; it must be an integer in [0, max_tokens], here [0, 8]"),
    ("min_tokens", 2.5, "min_tokens=2.5; it must be an integer"),
    ("repetition_penalty", 0.0, "repetition_penalty=0.0; it must be a finite number > 0"),
    ("repetition_penalty", float("inf"), "repetition_penalty=inf; it must be a finite number > 0"),
    ("presence_penalty", 2.5, "presence_penalty=2.5; it must be in [-2, 2]"),
    ("frequency_penalty", -2.1, "frequency_penalty=-2.1; it must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty=nan; it must be in [-2, 2]"),
    ("min_p", -0.1, "min_p=-0.1; it must be in [0, 1]"),
    ("min_p", 1.5, "min_p=1.5; it must be in [0, 1]"),
])
def test_bad_values_are_refused_with_the_field_and_its_range(field, value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(max_tokens=8, **{field: value})
    assert str(error.value).startswith(message), f"{field}={value!r}: the message was {str(error.value)!r}"


def test_the_engine_refuses_a_bad_rule_naming_the_field():
    engine = Engine(random_model(seed=3), EngineConfig(block_size=4, num_blocks=16))
    params = SamplingParams()
    params.presence_penalty = 3.0  # changed after construction: the engine validates again
    with pytest.raises(ValueError) as error:
        engine.add_request([5, 6], params)
    assert getattr(error.value, "param", None) == "presence_penalty", f"refused as {error.value!r}"


# ----------------------------------------------------------------------------
# The engine's greedy text against a full-recompute loop with HF's processors.

SPECULATION = {"off": {}, "on": dict(speculative_ngram=2, num_speculative_tokens=3)}


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """Chapter 01's no-cache loop, each step's logits through HF's processors before the argmax."""
    eos, out = model.config.eos_token_ids, []
    while True:
        tokens = prompt + out
        ids, positions = torch.tensor([tokens]), torch.arange(len(tokens))[None]  # [1, T]
        logits = model(ids, positions, DenseAttention(), logits_at=torch.tensor([[len(tokens) - 1]]))[0, -1]  # [V]
        token = int(hf_processed(logits, prompt, out, params, eos).argmax())
        out.append(token)
        reason = finish_reason(token, len(out), params, eos, len(prompt) + len(out),
                               model.config.max_position_embeddings)
        if reason:
            return out, reason


def run_engine(model, prompts, params, **config):
    """(outputs, drafts proposed, drafts accepted) of LLM.generate on `model`."""
    outs = LLM.from_model(model, block_size=4, num_blocks=256, **config).generate(prompts, params, use_tqdm=False)
    return outs, sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)


def check_against_reference(model, prompts, params, speculation: str, what: str):
    outs, drafts, accepted = run_engine(model, prompts, params, **SPECULATION[speculation])
    for o in outs:
        want, want_reason = reference_greedy(model, o.prompt_token_ids, params)
        for c in o.outputs:
            assert (c.token_ids, c.finish_reason) == (want, want_reason), (
                f"{what}, speculation {speculation}, prompt {o.prompt_token_ids}, completion {c.index}: finish "
                f"{c.finish_reason!r} vs the reference's {want_reason!r}; "
                f"{first_difference(c.token_ids, want, ('engine', 'HF loop'))}")
    if speculation == "on":  # if no draft was accepted, the verify path was never tested
        assert accepted > 0, f"{what}: {drafts} drafts proposed and none accepted: the test says nothing"
    return outs


PROMPTS = [[5, 6, 7, 8] * 3, [10, 11, 12, 13, 14, 15], [40, 41, 40, 41, 40]]


@pytest.mark.parametrize("speculation", ["off", "on"])
@pytest.mark.parametrize("ends", ["eos", "stop token"])
@pytest.mark.parametrize("min_tokens", [4, 10])
def test_min_tokens_keeps_the_greedy_favourite_ending_out(min_tokens, speculation, ends):
    # Prompt 2's first greedy token is 4 (then 4, 4, 4): make 4 the end (EOS or a stop token), so that
    # without min_tokens the request ends at once, and with it the engine must go on past the favourite.
    # With min_tokens 4 and speculation on, the favourite comes back in a verify row after a draft:
    # an engine that counted that row's outputs without the drafts before it would mask it there.
    model, prompt = random_model(seed=3), PROMPTS[2]
    first = generate_with_cache(model, prompt, SamplingParams(max_tokens=1)).token_ids[0]
    if ends == "eos":
        model.config.eos_token_ids = [first]
        stop = []
    else:
        stop = [first]
    ended = generate_with_cache(model, prompt, SamplingParams(max_tokens=16, stop_token_ids=stop))
    assert ended.token_ids == [first] and ended.finish_reason == "stop", f"{ended}: the favourite must end it at once"
    params = SamplingParams(max_tokens=16, min_tokens=min_tokens, stop_token_ids=stop)
    outs = check_against_reference(model, [prompt], params, speculation, f"min_tokens={min_tokens}, {ends} {first}")
    tokens = outs[0].token_ids
    assert first not in tokens[:min_tokens], f"{ends} {first} came before min_tokens={min_tokens}: {tokens}"


@pytest.mark.parametrize("speculation", ["off", "on"])
@pytest.mark.parametrize("rules", [dict(repetition_penalty=1.2), dict(presence_penalty=-0.5, frequency_penalty=0.2),
                                   dict(repetition_penalty=1.05, presence_penalty=0.2, frequency_penalty=0.05)],
                         ids=["repetition", "presence and frequency", "all three"])
def test_penalties_change_greedy_text_as_hf_does(speculation, rules):
    model = random_model(seed=3)
    plain = [o.token_ids for o in run_engine(model, PROMPTS, SamplingParams(max_tokens=20))[0]]
    params = SamplingParams(max_tokens=20, **rules)
    outs = check_against_reference(model, PROMPTS, params, speculation, str(rules))
    assert [o.token_ids for o in outs] != plain, f"{rules} changed no greedy text: the test would pass without them"


def test_n_2_completions_share_the_row_and_then_keep_their_own_histories():
    # Both greedy completions fork from one row with the same history, and each then penalises its
    # own tokens: both equal the reference, with speculation on.
    params = SamplingParams(max_tokens=16, n=2, presence_penalty=-0.5, frequency_penalty=0.2, min_tokens=3)
    check_against_reference(random_model(seed=3), PROMPTS[:2], params, "on", "n = 2")


# ----------------------------------------------------------------------------
# Seeded sampling under the rules, with speculation on: still the exact distribution.

DIST_VOCAB = 4
DIST_MODEL = random_model(tiny_config(vocab_size=DIST_VOCAB), seed=11)
DIST_PROMPT = [0, 1, 2, 3, 1, 0, 3, 2]  # every token appears: lookup (n = 1) always proposes a draft
DIST_PARAMS = dict(max_tokens=3, temperature=1.0, ignore_eos=True, min_tokens=2, stop_token_ids=[3],
                   repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, min_p=0.15)
DIST_SAMPLES = 2000


def test_speculation_keeps_the_distribution_under_the_rules():
    # Exact P(t1, t2, t3): each factor is the HF-processed distribution after the prompt and the prefix.
    params = SamplingParams(**DIST_PARAMS)
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        prefixes = list(probs)
        ids = torch.tensor([DIST_PROMPT + list(prefix) for prefix in prefixes])  # [P, T]
        logits = DIST_MODEL(ids, torch.arange(ids.shape[1]).expand_as(ids), DenseAttention())[:, -1]  # [P, V]
        nxt = [hf_probabilities(hf_processed(logits[i], DIST_PROMPT, list(prefix), params, [2]), params)
               for i, prefix in enumerate(prefixes)]
        probs = {prefix + (t,): probs[prefix] * float(nxt[i][t]) for i, prefix in enumerate(prefixes)
                 for t in range(DIST_VOCAB)}
    assert sum(p == 0 for p in probs.values()) > 0, "the rules should rule some continuations out"

    engine = Engine(DIST_MODEL, EngineConfig(block_size=4, max_num_seqs=256, num_blocks=256 * 4,
                                             speculative_ngram=1, num_speculative_tokens=1))
    for seed in range(DIST_SAMPLES):
        engine.add_request(DIST_PROMPT, SamplingParams(**DIST_PARAMS, seed=seed))
    counts, drafts, accepted = dict.fromkeys(itertools.product(range(DIST_VOCAB), repeat=3), 0), 0, 0
    while engine.has_unfinished():
        for seq in engine.step().finished:
            key = tuple(seq.output_token_ids)  # a stop token before min_tokens would end it early
            counts[key] = counts.get(key, 0) + 1
            drafts, accepted = drafts + seq.num_draft_tokens, accepted + seq.num_accepted_tokens
    assert drafts >= DIST_SAMPLES and 0 < accepted < drafts, (
        f"{accepted} of {drafts} drafts accepted over {DIST_SAMPLES} requests: the test needs both outcomes")
    impossible = {key: n for key, n in counts.items() if n and probs.get(key, 0) == 0}
    assert not impossible, f"continuations the rules rule out were sampled: {impossible}"
    statistic, dof, p_value = chi_square(counts, probs)
    assert p_value > 0.001, (
        f"with the rules and speculation the tokens do not follow the processed distribution: chi-square "
        f"{statistic:.1f} with {dof} degrees of freedom, p = {p_value:.2g}. Largest gaps: {worst_cells(counts, probs)}")


@pytest.mark.parametrize("speculating", [False, True], ids=["plain", "speculation"])
@pytest.mark.parametrize("penalty", [1e-252, 1e300])
def test_a_penalty_past_float32_still_gives_tokens(penalty, speculating):
    """A repetition penalty of 1e-252 divides a positive logit past float32's range: the rule keeps
    it the largest finite logit, so sampling (and chapter 11's rejection sampling) stays defined."""
    spec = {"speculative_ngram": 1, "num_speculative_tokens": 3} if speculating else {}
    llm = LLM.from_model(random_model(seed=5), **spec)
    prompt = [7, 8, 7, 8, 7, 8, 7]
    for temperature in (0.0, 1.0):
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True,
                                                    repetition_penalty=penalty), use_tqdm=False)[0]
        assert len(out.token_ids) == 6 and all(0 <= t < 256 for t in out.token_ids), out.token_ids
