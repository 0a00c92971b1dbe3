"""Chapter 12: sampling under a mask draws from the model's distribution renormalised over the allowed tokens.

Two oracles, both arithmetic:

- Task 2, on fixed logits: rows of 8 tokens, each with its own mask (one row
  allows nothing, so only its EOS ids may come), go through your `mask_logits`
  and then the engine's own `minicb.sampling.sample`, 2,000 draws a row, at
  temperature 1 and 0.7. The counts must follow p(t)^(1/T) over the allowed
  tokens, normalised (a chi-square test at significance 0.001), and greedy
  must pick the most likely allowed token. A mask that picks one token instead
  of masking (right for greedy only), or that hands the sampler probabilities
  where it expects logits, fails here by a wide margin.
- All tasks, through the engine: a tiny model with a 6-token vocabulary, a
  grammar whose states allow different tokens (and force some, which
  jump-forward verifies as drafts), and chapter 11's prompt lookup proposing
  drafts that the grammar cuts. The exact probability of every continuation is
  the product of the renormalised p at each step (dense forwards, the mask from
  the definition: each token walked alone); 2,000 seeded requests must follow it.
"""
from __future__ import annotations

import pytest
import torch

from minicb import impl
from minicb.engine import Engine, EngineConfig
from minicb.model import DenseAttention, random_model, tiny_config
from minicb.sampling import SamplingParams, StructuredOutput, sample
from minicb.structured.guide import Grammars
from minicb.structured.token_mask import Grammar, TokenVocabulary, allowed_tokens_brute_force

GRADED_MODULE = "structured.token_mask"
pytestmark = pytest.mark.usefixtures("one_task")

NUM_SAMPLES = 2000
ALPHA = 0.001


def chi_square(cells: list[tuple[int, float]], dof: int) -> float:
    """The p-value of sum (seen - expected)^2 / expected over (seen, expected) cells."""
    statistic = sum((seen - expected) ** 2 / expected for seen, expected in cells)
    # The chi-square survival function: the regularised upper incomplete gamma Q(dof/2, x/2).
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def pooled(counts: dict, probs: dict, total: int) -> list[tuple[int, float]]:
    """(seen, expected) per outcome, those expected below 5 pooled into one cell."""
    cells, seen, expected = [], 0, 0.0
    for key, p in probs.items():
        if total * p >= 5:
            cells.append((counts.get(key, 0), total * p))
        else:
            seen, expected = seen + counts.get(key, 0), expected + total * p
    if expected > 0:
        cells.append((seen, expected))
    unexpected = sum(n for key, n in counts.items() if probs.get(key, 0.0) == 0.0)
    assert unexpected == 0, (f"{unexpected} draws gave outcomes the grammar forbids: "
                             f"{sorted(k for k in counts if probs.get(k, 0.0) == 0.0)[:8]}")
    return cells


def gaps(counts: dict, probs: dict, total: int, n: int = 4) -> str:
    worst = sorted(probs, key=lambda k: -abs(counts.get(k, 0) - total * probs[k]))[:n]
    return ", ".join(f"{k}: seen {counts.get(k, 0)}, expected {total * probs[k]:.1f}" for k in worst)


# ---- task 2: fixed logits -----------------------------------------------------------------------

LOGITS = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.3],
                       [0.5, 2.5, 0.1, -0.3, 1.2, 0.0, 0.7, -2.0],
                       [3.0, 1.0, 0.0, 2.0, -1.0, 0.5, 0.2, 0.4]])
ALLOWED = torch.tensor([[True, False, True, False, True, True, False, False],  # not the top token (3)
                        [False, True, False, True, True, False, True, False],
                        [False] * 8])  # nothing: the EOS ids 6 and 7 instead
EOS = [6, 7]


def renormalised(row: int, temperature: float) -> dict[int, float]:
    allowed = ALLOWED[row] if ALLOWED[row].any() else torch.isin(torch.arange(8), torch.tensor(EOS))
    weights = torch.where(allowed, (LOGITS[row].double() / temperature).exp(), torch.tensor(0.0, dtype=torch.float64))
    return {t: float(w) for t, w in enumerate(weights / weights.sum())}


@pytest.mark.task(2)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_sampling_follows_the_renormalised_distribution(temperature):
    masked = impl.load(GRADED_MODULE).mask_logits(LOGITS.clone(), ALLOWED.clone(), list(EOS))  # [3, 8]
    gen = torch.Generator().manual_seed(12)
    params = SamplingParams(temperature=temperature)
    cells, dof, report = [], 0, []
    for row in range(3):
        rows = masked[row].expand(NUM_SAMPLES, -1).clone()  # [N, 8]: the engine samples each row on its own
        drawn = sample(rows, [params] * NUM_SAMPLES, [gen] * NUM_SAMPLES)
        counts = {t: drawn.count(t) for t in set(drawn)}
        probs = renormalised(row, temperature)
        row_cells = pooled(counts, {t: p for t, p in probs.items() if p > 0}, NUM_SAMPLES)
        assert not any(counts.get(t, 0) for t, p in probs.items() if p == 0), (
            f"row {row}: forbidden tokens were drawn: {[(t, counts[t]) for t, p in probs.items() if p == 0 and counts.get(t)]}")
        cells += row_cells
        dof += len(row_cells) - 1
        report.append(f"row {row}: {gaps(counts, probs, NUM_SAMPLES)}")
    p_value = chi_square(cells, dof)
    assert p_value > ALPHA, (
        f"at temperature {temperature}, the tokens drawn under your mask do not follow the model's distribution "
        f"renormalised over the allowed tokens: p = {p_value:.2g} < {ALPHA}. Largest gaps: " + "; ".join(report))


@pytest.mark.task(2)
def test_greedy_under_the_mask_takes_the_most_likely_allowed_token():
    masked = impl.load(GRADED_MODULE).mask_logits(LOGITS.clone(), ALLOWED.clone(), list(EOS))
    got = sample(masked, [SamplingParams()] * 3, [None] * 3)
    assert got == [5, 1, 7], (f"greedy under the mask chose {got}; want [5, 1, 7]: row 0's best allowed token is "
                              f"5 (3 is better but forbidden), row 1's 1, row 2 allows nothing but EOS 6 or 7")


# ---- all tasks: through the engine --------------------------------------------------------------

# 6 tokens: a, b, EOS, "ab", c, and a special one. The grammar: "ab" or "ba", then c, then a or b
# at least once. After "a" the grammar forces "bc", after "ab" it forces "c": jump-forward drafts.
PIECES = [b"a", b"b", b"", b"ab", b"c", b"<s>"]
PATTERN = "(ab|ba)c(a|b)+"
MODEL = random_model(tiny_config(vocab_size=len(PIECES)), seed=21)  # EOS 2
PROMPT = [0, 1, 4, 3, 4, 0, 1]  # every text token, so prompt lookup (n = 1) finds drafts
MAX_TOKENS = 6


class PieceTokenizer:
    """encode(text) -> ids for PIECES, longest piece first (jump-forward spells forced text with it)."""

    def encode(self, text: str) -> list[int]:
        data, ids = text.encode(), []
        while data:
            token = next(i for i in (3, 0, 1, 4) if data.startswith(PIECES[i]))
            ids.append(token)
            data = data[len(PIECES[token]):]
        return ids


def vocabulary() -> TokenVocabulary:
    return TokenVocabulary(PIECES, eos_token_ids=[2], special_token_ids=[5])


def exact_distribution() -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation the grammar allows, up to MAX_TOKENS or EOS: each step the
    model's softmax, dense, renormalised over the tokens the definition allows in the state reached."""
    grammar, vocab = Grammar.from_regex(PATTERN, vocabulary()), vocabulary()
    open_, done = {(): (1.0, grammar.start)}, {}
    for _ in range(MAX_TOKENS):
        prefixes = list(open_)
        ids = torch.tensor([PROMPT + list(prefix) for prefix in prefixes])  # [P, T]
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad():
            logits = MODEL(ids, positions, DenseAttention())[:, -1]  # [P, V]
        nxt = {}
        for i, prefix in enumerate(prefixes):
            prob, state = open_[prefix]
            allowed = torch.from_numpy(allowed_tokens_brute_force(grammar.dfa, vocab, state))
            p = logits[i].masked_fill(~allowed, float("-inf")).softmax(-1)
            for token in torch.nonzero(allowed)[:, 0].tolist():
                key = prefix + (token,)
                if token == 2 or len(key) == MAX_TOKENS:
                    done[key] = done.get(key, 0.0) + prob * float(p[token])
                else:
                    nxt[key] = (prob * float(p[token]), grammar.next_state(state, token))
        open_ = nxt
    return done


@pytest.mark.task("all")
def test_guided_sampling_in_the_engine_follows_the_renormalised_distribution():
    """Prompt lookup's drafts (cut by the grammar) and jump-forward's forced tokens verified, each request's
    200 completions forked from its prompt: NUM_SAMPLES completions in all, each drawn with its own seed."""
    probs = exact_distribution()
    grammars = Grammars(vocabulary(), PieceTokenizer(), [2], jump_forward=True)
    engine = Engine(MODEL, EngineConfig(block_size=4, max_num_seqs=200, num_blocks=200 * 4, speculative_ngram=1,
                                        num_speculative_tokens=2, jump_forward=True), grammars=grammars)
    per_request = 200
    for seed in range(NUM_SAMPLES // per_request):
        engine.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=per_request,
                                                  structured=StructuredOutput("regex", PATTERN)))
    counts, drafts, accepted = {}, 0, 0
    while engine.has_unfinished():
        out = engine.step()
        drafts, accepted = drafts + out.num_draft_tokens, accepted + out.num_accepted_tokens
        for seq in out.finished:
            key = tuple(seq.output_token_ids)
            counts[key] = counts.get(key, 0) + 1
    assert sum(counts.values()) == NUM_SAMPLES, f"{sum(counts.values())} completions finished, want {NUM_SAMPLES}"
    assert drafts > NUM_SAMPLES and 0 < accepted < drafts, (
        f"{accepted} of {drafts} drafts accepted over {NUM_SAMPLES} completions: the test needs drafts, accepted "
        f"and rejected ones")
    cells = pooled(counts, probs, NUM_SAMPLES)
    p_value = chi_square(cells, len(cells) - 1)
    assert p_value > ALPHA, (
        f"the engine's guided samples, with speculation, jump-forward and n = {per_request}, do not follow the "
        f"model's distribution renormalised over the allowed tokens: p = {p_value:.2g} < {ALPHA}. Largest gaps: "
        f"{gaps(counts, probs, NUM_SAMPLES)}")
