"""Chapter 12, tasks 1-4: the token mask of a state, the mask on the logits, and a request's matcher.

Task 1, `allowed_tokens_trie`: by hand (the text's examples: a token whose walk
dies midway, EOS only in an accepting state, special tokens never, a token that
ends inside a UTF-8 character), then against the definition (each token walked
on its own, `allowed_tokens_brute_force`) in every state of random small
vocabularies, and against the reference on SmolLM2's 49,152 tokens.
Task 2, `mask_logits`: forbidden tokens at -inf, allowed logits untouched, the
softmax renormalised over the allowed (the text's numbers), a row of its own
per mask, EOS for a row that allows nothing, the input left as it was.
(tests/chapters/test_ch12_distribution.py samples under it.)
Task 3, `Grammar.next_state` and `Matcher.accept`: every (state, token) against
the DFA walked byte by byte, EOS and special tokens, refusals that change
nothing, nothing after EOS, and random walks whose text always matches.
Task 4, `Matcher.rollback` and `Matcher.fork`: back to exactly where the matcher
was, EOS rolled back, bad counts refused without a change; a fork at the same
place that moves on its own.

Run against your own code with `python -m minicb check 12`.
"""
from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from minicb import impl
from minicb.structured.regex import compile_regex
from minicb.structured.token_mask import TokenVocabulary, allowed_tokens_brute_force

GRADED_MODULE = "structured.token_mask"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")


def code():
    return impl.load(GRADED_MODULE)


def small_vocab(pieces: list[bytes]) -> TokenVocabulary:
    """The pieces as tokens 0.., then EOS and one special token (the last two ids)."""
    return TokenVocabulary(pieces + [b"</s>", b"<|sp|>"], eos_token_ids=[len(pieces)],
                           special_token_ids=[len(pieces) + 1])


def differences(vocab: TokenVocabulary, got, want, limit: int = 6) -> str:
    """Which tokens differ, with their bytes: 'token 3 b'ab': yours True, the definition False'."""
    got, want = np.asarray(got, dtype=bool), np.asarray(want, dtype=bool)
    diff = np.flatnonzero(got != want)
    shown = ", ".join(f"token {int(t)} {vocab.token_bytes[t]!r}: yours {bool(got[t])}, want {bool(want[t])}"
                      for t in diff[:limit])
    return f"{len(diff)} of {vocab.vocab_size} tokens differ; {shown}"


# ---- task 1: the allowed tokens of a state ----------------------------------------------------


def check_trie(pattern: str, vocab: TokenVocabulary, states=None) -> None:
    """Your allowed_tokens_trie in every state (or these) against the definition, each token walked alone."""
    dfa = compile_regex(pattern)
    for state in range(dfa.num_states) if states is None else states:
        got = code().allowed_tokens_trie(dfa, vocab, state)
        assert isinstance(got, np.ndarray) and got.shape == (vocab.vocab_size,) and got.dtype == bool, (
            f"allowed_tokens_trie must return a numpy bool array of shape [{vocab.vocab_size}]; got "
            f"{type(got).__name__} {getattr(got, 'dtype', '')} {getattr(got, 'shape', '')}")
        want = allowed_tokens_brute_force(dfa, vocab, state)
        assert (got == want).all(), f"pattern {pattern!r}, state {state}: {differences(vocab, got, want)}"


@pytest.mark.task(1)
def test_trie_the_texts_example():
    vocab = small_vocab([b"a", b"ab", b"b"])
    dfa = compile_regex("a")
    got = code().allowed_tokens_trie(dfa, vocab, dfa.start)
    assert got.tolist() == [True, False, False, False, False], (
        f"pattern 'a', tokens a, ab, b, EOS, special, at the start: got {got.tolist()}; only 'a' can start "
        f"the text ('ab' dies at its second byte, and the empty text is no match, so no EOS)")
    after_a = dfa.walk(dfa.start, b"a")
    got = code().allowed_tokens_trie(dfa, vocab, after_a)
    assert got.tolist() == [False, False, False, True, False], (
        f"pattern 'a' after 'a' (a whole match): got {got.tolist()}; only EOS may come")


@pytest.mark.task(1)
def test_trie_a_token_whose_walk_dies_midway_is_not_allowed():
    # 'c' dies at once, so 'cb' must not be walked on from some other node's state: its 'b' would live
    # after 'a'. 'abb' lives for two bytes and dies at its third.
    vocab = small_vocab([b"a", b"ab", b"abb", b"c", b"cb", b"b"])
    dfa = compile_regex("ab")
    got = code().allowed_tokens_trie(dfa, vocab, dfa.start)
    want = allowed_tokens_brute_force(dfa, vocab, dfa.start)
    assert want.tolist()[:6] == [True, True, False, False, False, False]
    assert (got == want).all(), f"pattern 'ab' at the start: {differences(vocab, got, want)}"


@pytest.mark.task(1)
def test_trie_eos_only_where_the_text_is_a_whole_match_and_never_a_special_token():
    vocab = small_vocab([b"a", b"aa", b"b"])
    dfa = compile_regex("a{2,3}")  # accepting after 2 or 3 a's only
    for text, accepting in ((b"", False), (b"a", False), (b"aa", True), (b"aaa", True)):
        state = dfa.walk(dfa.start, text)
        got = code().allowed_tokens_trie(dfa, vocab, state)
        assert bool(got[3]) == accepting, (
            f"pattern 'a{{2,3}}' after {text!r}: EOS allowed {bool(got[3])}; it must be allowed exactly where "
            f"the text so far is a whole match ({accepting} here)")
        assert not got[4], f"after {text!r}: a special token (<|sp|>) was allowed; a grammar never allows one"
    check_trie("a{2,3}", vocab)


@pytest.mark.task(1)
def test_trie_a_token_may_end_inside_a_character():
    e_acute = "é".encode()  # b'\xc3\xa9'
    vocab = small_vocab([e_acute[:1], e_acute[1:], e_acute, b"e", e_acute + b"!"])
    dfa = compile_regex("é+!")
    got = code().allowed_tokens_trie(dfa, vocab, dfa.start).tolist()
    assert got[:5] == [True, False, True, False, True], (
        f"pattern 'é+!' at the start, tokens 0xC3, 0xA9, 'é', 'e', 'é!': got {got[:5]}; the first byte of 'é' "
        f"alone is a token the automaton must allow (it stops inside the character), its second byte alone not")
    check_trie("é+!", vocab)


@pytest.mark.task(1)
def test_trie_agrees_with_the_definition_in_every_state_of_random_vocabularies():
    rng = random.Random(12)
    alphabet = ["a", "b", '"', "{", "}", "é", "😀", " "]
    patterns = ["(ab|é)*", '\\{"a": "[^"]*"\\}', "[^a]{1,3}", "😀?b+", "(a|é|😀){2,4}", "a b|b a"]
    for _ in range(40):
        pieces = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.3:
                pieces.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 3))))
            else:
                pieces.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))).encode())
        vocab = small_vocab(pieces)  # duplicates, prefixes of each other and partial characters included
        check_trie(rng.choice(patterns), vocab)


@pytest.fixture(scope="module")
def smollm2_vocab():
    from minicb.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    eos = sorted({tokenizer.hf.eos_token_id, tokenizer.hf.convert_tokens_to_ids("<|im_end|>")})
    return tokenizer, TokenVocabulary.from_tokenizer(tokenizer, eos)


@pytest.mark.task(1)
def test_trie_on_smollm2s_vocabulary(smollm2_vocab):
    """A JSON object's states, met by walking random allowed tokens, on all 49,152 tokens."""
    from minicb.structured.token_mask import Grammar, allowed_tokens_vectorized

    _, vocab = smollm2_vocab
    reference = Grammar.from_regex(r'\{"name": "[a-zA-Z ]{1,20}", "age": (0|[1-9][0-9]?)\}', vocab)
    rng, state, states = np.random.default_rng(0), reference.start, [reference.start]
    for _ in range(12):
        token = int(rng.choice(np.flatnonzero(reference.mask(state).numpy() & vocab.text_token)))
        state = reference.next_state(state, token)
        states.append(state)
    for state in dict.fromkeys(states):
        got = code().allowed_tokens_trie(reference.dfa, vocab, state)
        want = allowed_tokens_vectorized(reference.dfa, vocab, state)
        assert (np.asarray(got) == want).all(), f"state {state}: {differences(vocab, got, want)}"


# ---- task 2: the mask on the logits ------------------------------------------------------------


def masked(logits, allowed, eos=(3,)):
    before_logits, before_allowed = logits.clone(), allowed.clone()
    out = code().mask_logits(logits, allowed, list(eos))
    assert torch.equal(logits, before_logits) and torch.equal(allowed, before_allowed), (
        "mask_logits changed its input; return a copy (the engine scores the unmasked logits afterwards)")
    assert isinstance(out, torch.Tensor) and out.shape == logits.shape and out.dtype == logits.dtype, (
        f"mask_logits must return a tensor of the logits' shape {tuple(logits.shape)} and dtype {logits.dtype}")
    return out


@pytest.mark.task(2)
def test_mask_logits_the_texts_example():
    # p = (0.5, 0.2, 0.2, 0.1); the grammar allows tokens 0 and 2: (0.5, 0, 0.2, 0) / 0.7.
    logits = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log()
    allowed = torch.tensor([[True, False, True, False]])
    out = masked(logits, allowed)
    assert out[0, 1] == float("-inf") and out[0, 3] == float("-inf"), f"forbidden tokens not at -inf: {out}"
    assert torch.equal(out[0, [0, 2]], logits[0, [0, 2]]), f"allowed logits changed: {out} from {logits}"
    probs = out.softmax(-1)[0]
    want = torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0])
    assert torch.allclose(probs, want, atol=1e-6), f"softmax of the masked row {probs.tolist()}, want {want.tolist()}"


@pytest.mark.task(2)
def test_mask_logits_each_row_its_own_mask():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, generator=gen) * 3
    allowed = torch.rand(5, 9, generator=gen) < 0.5
    allowed[:, 0] = True  # no row empty here
    out = masked(logits, allowed, eos=(8,))
    want = torch.where(allowed, logits, torch.tensor(float("-inf")))
    bad = [r for r in range(5) if not torch.equal(out[r], want[r])]
    assert not bad, f"rows {bad} differ; row {bad[0]}: got {out[bad[0]].tolist()}, want {want[bad[0]].tolist()}"


@pytest.mark.task(2)
def test_mask_logits_a_row_that_allows_nothing_allows_eos():
    logits = torch.arange(12.0).reshape(2, 6)
    allowed = torch.tensor([[False] * 6, [True, False, True, False, False, False]])
    out = masked(logits, allowed, eos=(4, 5))
    want = torch.tensor([[float("-inf")] * 4 + [4.0, 5.0], [6.0, float("-inf"), 8.0] + [float("-inf")] * 3])
    assert torch.equal(out, want), (f"row 0 allows nothing: it must allow the EOS ids 4 and 5 instead (their "
                                    f"logits kept), and row 1 stay as its mask says; got {out.tolist()}")


@pytest.mark.task(2)
def test_mask_logits_keeps_the_dtype_and_the_exact_values():
    logits = torch.tensor([[1.25, -3.5, 1e30, -1e-30]], dtype=torch.float64)
    out = masked(logits, torch.tensor([[True, True, True, False]]))
    assert out.dtype == torch.float64 and out[0, :3].tolist() == [1.25, -3.5, 1e30] and out[0, 3] == float("-inf")


# ---- task 3: the state after a token -----------------------------------------------------------


@pytest.mark.task(3)
def test_next_state_walks_every_token_from_every_state():
    vocab = small_vocab([b"a", b"ab", b"b", b"ba", b"abab", b"c", "é".encode()[:1]])
    for pattern in ["(ab)+", "a?b{1,3}", "(a|b)*c", "é|ab"]:
        grammar = code().Grammar.from_regex(pattern, vocab)
        dfa, wrong = grammar.dfa, []
        for state in range(dfa.num_states):
            for token in range(vocab.vocab_size):
                got = grammar.next_state(state, token)
                if token == vocab.eos_token_ids[0]:
                    want = state if dfa.accepting[state] else -1
                elif token in vocab.special_token_ids:
                    want = -1
                else:
                    want = dfa.walk(state, vocab.token_bytes[token])
                if got != want:
                    wrong.append(f"next_state({state}, {token} {vocab.token_bytes[token]!r}) = {got!r}, want {want}")
        assert not wrong, f"pattern {pattern!r}:\n" + "\n".join(wrong[:8])


@pytest.mark.task(3)
def test_next_state_depends_on_the_state():
    vocab = small_vocab([b"a", b"b"])
    grammar = code().Grammar.from_regex("ab|ba", vocab)
    start, after_b = grammar.start, grammar.dfa.walk(grammar.start, b"b")
    first = grammar.next_state(start, 0)  # 'a' at the start: alive
    second = grammar.next_state(after_b, 0)  # 'a' after 'b': the whole match 'ba'
    again = grammar.next_state(start, 0)
    assert (first, second, again) == (grammar.dfa.walk(start, b"a"), grammar.dfa.walk(after_b, b"a"), first), (
        f"token 'a' from the start, after 'b', from the start again: {first}, {second}, {again}; want "
        f"{grammar.dfa.walk(start, b'a')}, {grammar.dfa.walk(after_b, b'a')}, {grammar.dfa.walk(start, b'a')}")
    assert grammar.next_state(grammar.dfa.walk(start, b"ab"), 0) == -1, "'a' after 'ab' leaves the grammar: -1"


@pytest.mark.task(3)
def test_next_state_refuses_a_token_id_outside_the_vocabulary():
    grammar = code().Grammar.from_regex("a", small_vocab([b"a"]))
    for bad in (3, -1, 1.0, "0"):
        with pytest.raises(ValueError):
            grammar.next_state(grammar.start, bad)


@pytest.mark.task(3)
def test_accept_takes_allowed_tokens_and_refuses_the_rest_changing_nothing():
    vocab = small_vocab([b"a", b"b", b"ab"])
    grammar = code().Grammar.from_regex("ab(ab)*", vocab)
    matcher = code().Matcher(grammar)
    eos = vocab.eos_token_ids[0]
    assert matcher.accept(1) is False and matcher.states == [grammar.start] and matcher.token_ids == [], (
        f"'b' cannot start 'ab(ab)*': accept must return False and change nothing; states {matcher.states}, "
        f"token_ids {matcher.token_ids}")
    assert matcher.accept(eos) is False and matcher.num_accepted == 0, "EOS before a whole match is refused"
    assert matcher.accept(0) is True and matcher.accept(1) is True, "'a' then 'b' are allowed"
    want_states = [grammar.start, grammar.dfa.walk(0, b"a"), grammar.dfa.walk(0, b"ab")]
    assert matcher.states == want_states and matcher.token_ids == [0, 1], (
        f"after 'a', 'b': states {matcher.states}, token_ids {matcher.token_ids}; want {want_states}, [0, 1]")
    assert matcher.accept(2) is True and matcher.state == grammar.dfa.walk(0, b"abab")
    assert matcher.accept(eos) is True and matcher.is_finished, "EOS after a whole match ends the text"
    for token in (0, 2, eos):
        assert matcher.accept(token) is False, f"a finished matcher accepted token {token}; nothing comes after EOS"
    assert matcher.token_ids == [0, 1, 2, eos] and len(matcher.states) == 5, (matcher.states, matcher.token_ids)


@pytest.mark.task(3)
def test_accept_random_walks_end_in_a_match():
    """Random allowed tokens until EOS: the state is always the DFA's after the bytes accepted, and the text
    a finished matcher took matches the pattern."""
    from engine_support import TinyTokenizer

    spell = TinyTokenizer().token_bytes
    vocab = TokenVocabulary(spell, [2], [0, 1])
    rng = np.random.default_rng(5)
    for pattern in [r"[a-h]{2,6}(!|\?)", r'\{"k": (0|[1-9][0-9]{0,2})\}', r"(yes|no|maybe so)"]:
        grammar = code().Grammar.from_regex(pattern, vocab)
        for _ in range(10):
            matcher = code().Matcher(grammar)
            while not matcher.is_finished:
                token = int(rng.choice(np.flatnonzero(allowed_tokens_brute_force(grammar.dfa, vocab, matcher.state))))
                assert matcher.accept(token), f"{pattern!r}: token {token} {spell[token]!r} is allowed, yet refused"
                text = b"".join(spell[t] for t in matcher.token_ids if t != 2)
                assert matcher.state == grammar.dfa.walk(grammar.start, text), (
                    f"{pattern!r} after {text!r}: state {matcher.state}, the DFA says "
                    f"{grammar.dfa.walk(grammar.start, text)}")
            assert re.fullmatch(pattern, text.decode()), f"the matcher finished on {text!r}, no match of {pattern!r}"


# ---- task 4: rollback and fork -----------------------------------------------------------------


def walked(pattern: str, text: bytes):
    """A matcher (of the graded module's class) that accepted `text` one byte token at a time."""
    from engine_support import TinyTokenizer

    vocab = TokenVocabulary(TinyTokenizer().token_bytes, [2], [0, 1])
    grammar = code().Grammar.from_regex(pattern, vocab)
    matcher = code().Matcher(grammar)
    for byte in text:
        assert matcher.accept(byte), f"{pattern!r} refused {chr(byte)!r} of {text!r}"
    return matcher


@pytest.mark.task(4)
def test_rollback_goes_back_to_exactly_where_the_matcher_was():
    text = b'{"k": 123}'
    for k in range(len(text) + 1):
        matcher = walked(r'\{"k": [0-9]{1,3}\}', text)
        want = walked(r'\{"k": [0-9]{1,3}\}', text[:len(text) - k])
        matcher.rollback(k)
        assert (matcher.states, matcher.token_ids) == (want.states, want.token_ids), (
            f"{len(text)} tokens accepted, rollback({k}): states {matcher.states}, token_ids {matcher.token_ids}; "
            f"want the matcher after {len(text) - k} tokens: {want.states}, {want.token_ids}")
        assert matcher.accept(text[len(text) - k] if k else 2), "after a rollback the next token is allowed again"


@pytest.mark.task(4)
def test_rollback_of_eos_reopens_the_text():
    matcher = walked("ab?", b"a")
    assert matcher.accept(2) and matcher.is_finished
    matcher.rollback(1)
    assert not matcher.is_finished and matcher.can_end and matcher.token_ids == [ord("a")], (
        f"rolling back the EOS must leave the matcher after 'a', open again: token_ids {matcher.token_ids}")
    assert matcher.accept(ord("b")), "'b' is allowed again after the EOS was rolled back"


@pytest.mark.task(4)
def test_rollback_refuses_a_bad_count_changing_nothing():
    matcher = walked("[a-z]+", b"abc")
    states, token_ids = list(matcher.states), list(matcher.token_ids)
    for bad in (-1, 4, 1.5, "1", None):
        with pytest.raises(ValueError):
            matcher.rollback(bad)
        assert (matcher.states, matcher.token_ids) == (states, token_ids), (
            f"rollback({bad!r}) was refused but changed the matcher: {matcher.states}, {matcher.token_ids}")


@pytest.mark.task(4)
def test_fork_is_an_independent_copy_at_the_same_place():
    matcher = walked("[a-h]{1,8}", b"abc")
    twin = matcher.fork()
    assert twin is not matcher and twin.grammar is matcher.grammar, (
        "a fork is a new matcher on the same grammar (the grammar's masks are shared by every request)")
    assert (twin.states, twin.token_ids) == (matcher.states, matcher.token_ids), (
        f"the fork must start where its parent is: {twin.states}, {twin.token_ids} against "
        f"{matcher.states}, {matcher.token_ids}")
    before = (list(twin.states), list(twin.token_ids))
    assert matcher.accept(ord("d")) and matcher.num_accepted == 4
    assert (twin.states, twin.token_ids) == before, (
        f"the parent accepted 'd' and its fork moved too: {twin.token_ids}; a fork copies the lists, it must "
        f"not share them")
    twin.rollback(2)
    assert matcher.token_ids == list(b"abcd") and len(matcher.states) == 5, (
        f"the fork rolled back 2 tokens and its parent lost some too: {matcher.token_ids}")
    Matcher = code().Matcher
    assert Matcher.accept(twin, ord("h")) and twin.token_ids == list(b"ah"), twin.token_ids
    assert matcher.token_ids == list(b"abcd"), f"the fork accepted 'h' and its parent moved: {matcher.token_ids}"


@pytest.mark.task(4)
def test_a_fork_of_a_finished_matcher_is_finished():
    matcher = walked("ab", b"ab")
    assert matcher.accept(2)
    twin = matcher.fork()
    assert twin.is_finished and twin.token_ids == [ord("a"), ord("b"), 2], twin.token_ids
