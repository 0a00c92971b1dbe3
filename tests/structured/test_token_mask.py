"""minicb/structured/token_mask.py: the allowed tokens of a state, a request's matcher, and the oracle.

- The three ways to compute a mask (per-token brute force: the definition; the
  trie walk; the vectorized walk) agree, on SmolLM2's 49,152 tokens for states a
  decoder reaches, and on small random vocabularies for every state.
- Matcher: accept / refuse-and-change-nothing, rollback, fork, EOS only where
  the text is a whole match, nothing after EOS, jump-forward.
- The oracle: on states reached by walking random allowed tokens, minicb's mask
  is bit-identical to xgrammar's (the grammar engine vLLM and SGLang use)
  wherever the two define the same thing. Where they define it differently,
  a test says how, and holds the difference to exactly that.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.structured.backend import GrammarCache, MinicbCompiler, compile_grammar, make_compiler, to_regex
from minicb.structured.regex import compile_regex, complete_utf8_prefix
from minicb.structured.token_mask import (Grammar, TokenVocabulary, allowed_tokens_brute_force, allowed_tokens_trie,
                                          allowed_tokens_vectorized)

# Patterns the oracle runs: every construct of the dialect except `.` and \s \S, which xgrammar
# reads differently (test_xgrammar_differs_only_where_it_reads_the_pattern_differently).
ORACLE_PATTERNS = [
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
    r'"([^"\\]|\\["\\/bfnrt])*"',
    r"(yes|no|maybe)",
    r"[a-z]{2,6}@[a-z]+\.(com|org)",
    r"[αβγ]+ ?(é|è|ü)*",
    r"[\u4e00-\u9fff]{1,4}",
    r"[^a-z]{0,5}x",
    r"\w+ \d{2,3}",
    r'\{"name": "[A-Z][a-z]{0,8}", "age": [0-9]{1,2}\}',
    r"[^\n]*",
]


@pytest.fixture(scope="module")
def tokenizer():
    from minicb.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def vocab(tokenizer) -> TokenVocabulary:
    # SmolLM2's EOS is <|im_end|> (the model's eos_token_ids from its GGUF, and the HF tokenizer's eos_token).
    eos = sorted({tokenizer.hf.eos_token_id, tokenizer.hf.convert_tokens_to_ids("<|im_end|>")})
    return TokenVocabulary.from_tokenizer(tokenizer, eos)


@pytest.fixture(scope="module")
def xgrammar_compiler(vocab):
    pytest.importorskip("xgrammar")
    return make_compiler(vocab, "xgrammar")


def walk_states(grammar: Grammar, rng: np.random.Generator, steps: int,
                choose_from: np.ndarray | None = None) -> list[tuple[int, list[int]]]:
    """(state, token ids that led there) along one walk of random allowed text tokens from the start
    (only tokens where choose_from [V] is True, if given)."""
    choose_from = grammar.vocab.text_token if choose_from is None else choose_from & grammar.vocab.text_token
    out, tokens, state = [(grammar.start, [])], [], grammar.start
    for _ in range(steps):
        allowed = np.flatnonzero(grammar.mask(state).numpy() & choose_from)
        if not len(allowed):
            break
        token = int(rng.choice(allowed))
        state = grammar.next_state(state, token)
        tokens.append(token)
        out.append((state, list(tokens)))
    return out


def first_differences(vocab: TokenVocabulary, got: np.ndarray, want: np.ndarray, names=("minicb", "xgrammar"),
                      limit: int = 8) -> str:
    diff = np.flatnonzero(got != want)
    return f"{len(diff)} tokens differ; first: " + ", ".join(
        f"{int(t)} {vocab.token_bytes[t]!r} ({names[0]} {bool(got[t])}, {names[1]} {bool(want[t])})"
        for t in diff[:limit])


# ---- the three walks ------------------------------------------------------------------


def test_trie_layout_is_the_docstring_example():
    vocab = TokenVocabulary([b"a", b"ab", b"b", b"</s>"], eos_token_ids=[3])
    assert vocab.node_byte == [-1, ord("a"), ord("b"), ord("b")]
    assert vocab.node_depth == [0, 1, 2, 1]
    assert vocab.subtree_end == [4, 3, 3, 4]
    assert vocab.node_tokens == [(), (0,), (1,), (2,)]
    assert vocab.lengths.tolist() == [1, 2, 1, 0] and vocab.byte_matrix.shape == (4, 2)


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS[:6] + [r"\S+\s\d", r".{1,3}"])
def test_trie_vectorized_and_brute_force_agree_on_smollm2(vocab, pattern):
    grammar = Grammar.from_regex(pattern, vocab)
    rng = np.random.default_rng(len(pattern))
    states = sorted({s for s, _ in walk_states(grammar, rng, 12) + walk_states(grammar, rng, 12)})
    for i, state in enumerate(states):
        trie = allowed_tokens_trie(grammar.dfa, vocab, state)
        vector = allowed_tokens_vectorized(grammar.dfa, vocab, state)
        assert (trie == vector).all(), f"{pattern!r} state {state}: {first_differences(vocab, trie, vector, ('trie', 'vectorized'))}"
        if i < 2:  # the definition is slow (~0.4 s a state): the start and one more
            brute = allowed_tokens_brute_force(grammar.dfa, vocab, state)
            assert (trie == brute).all(), f"{pattern!r} state {state}: {first_differences(vocab, trie, brute, ('trie', 'brute force'))}"


# Small vocabularies of random byte strings: partial UTF-8 characters, duplicates, prefixes of each other.
token_strategy = st.one_of(st.binary(min_size=1, max_size=4),
                           st.text(alphabet="ab\"{}é😀", min_size=1, max_size=3).map(lambda t: t.encode("utf-8")))


@given(tokens=st.lists(token_strategy, min_size=1, max_size=40),
       pattern=st.sampled_from(["(ab|é)*", '\\{"a": "[^"]*"\\}', "[^a]{1,3}", "😀?b+", "(a|é|😀){2,4}"]))
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
def test_the_walks_agree_in_every_state_of_small_vocabularies(tokens, pattern):
    vocab = TokenVocabulary(tokens + [b"<eos>", b"<sp>"], eos_token_ids=[len(tokens)],
                            special_token_ids=[len(tokens) + 1])
    dfa = compile_regex(pattern)
    for state in range(dfa.num_states):
        brute = allowed_tokens_brute_force(dfa, vocab, state)
        assert (allowed_tokens_trie(dfa, vocab, state) == brute).all(), f"{pattern!r} state {state} {tokens}"
        assert (allowed_tokens_vectorized(dfa, vocab, state) == brute).all(), f"{pattern!r} state {state} {tokens}"
        assert brute[-1] == False and brute[-2] == bool(dfa.accepting[state])  # noqa: E712  (special; EOS)


def test_a_model_wider_than_its_tokenizer_gets_padding_ids_never_allowed(tokenizer):
    vocab = TokenVocabulary.from_tokenizer(tokenizer, [2], vocab_size=49152 + 64)
    mask = Grammar.from_regex("[^x]*", vocab).mask(0)
    assert mask.shape == (49152 + 64,) and not mask[49152:].any() and mask[:49152].any()
    with pytest.raises(ValueError, match="vocab_size=100; it must be at least the tokenizer's 49152 tokens"):
        TokenVocabulary.from_tokenizer(tokenizer, [2], vocab_size=100)


def test_special_tokens_and_eos(vocab, tokenizer):
    grammar = Grammar.from_regex(r"[^\n]*", vocab)  # allows any text, including "<|im_start|>" spelled out
    mask = grammar.mask(grammar.start)
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert not mask[im_start] and not mask[0], "a special token is control, never text a grammar allows"
    assert all(mask[e] for e in vocab.eos_token_ids), "the start of [^\\n]* is accepting, so EOS is allowed"
    assert not Grammar.from_regex("a+", vocab).mask(0)[vocab.eos_token_ids].any(), "'' is no match of a+: no EOS"


# ---- Grammar and Matcher --------------------------------------------------------------


def test_masks_are_cached_per_state(vocab):
    grammar = Grammar.from_regex(r"[0-9]{1,3}", vocab)
    first = grammar.mask(grammar.start)
    assert grammar.mask(grammar.start) is first and grammar.mask_hits == 1 and grammar.mask_misses == 1
    assert first.dtype == torch.bool and first.shape == (vocab.vocab_size,)
    assert grammar.compile_time_s > 0 and grammar.cache_info()["masks_cached"] == 1


def test_matcher_accepts_refuses_rolls_back_and_forks(vocab, tokenizer):
    grammar = Grammar.from_regex(r"(yes|no), (yes|no)", vocab)
    matcher = grammar.matcher()
    yes, comma, no = (tokenizer.encode(t) for t in ("yes", ",", " no"))
    assert len(yes) == 1 and len(comma) == 1 and len(no) == 1, "these texts are one SmolLM2 token each"
    assert not matcher.accept(no[0]) and matcher.num_accepted == 0, "' no' cannot start: refused, nothing changed"
    assert matcher.accept(yes[0]) and matcher.accept(comma[0]) and matcher.num_accepted == 2
    twin = matcher.fork()
    assert twin.accept(no[0]) and twin.can_end and not matcher.can_end, "a fork moves alone"
    assert not matcher.accept(vocab.eos_token_ids[0]), "EOS only where the text is a whole match"
    matcher.rollback(1)
    assert matcher.token_ids == yes and matcher.states == [grammar.start, grammar.next_state(0, yes[0])]
    with pytest.raises(ValueError, match=r"rollback\(5\).*\[0, 1\]"):
        matcher.rollback(5)
    for bad in (vocab.vocab_size, -1, True, "3"):
        with pytest.raises(ValueError, match=rf"token_id={bad!r}; it must be an integer in \[0, 49152\)"):
            matcher.accept(bad)
    assert matcher.accept(np.int64(comma[0])) and matcher.accept(torch.tensor(no[0])), "numpy and torch ints are ids"
    matcher.rollback(2)
    # The fork ends: EOS finishes it, it allows nothing more, and a rollback of the EOS reopens it.
    assert twin.accept(vocab.eos_token_ids[0]) and twin.is_finished and not twin.can_end
    assert not twin.mask().any() and not twin.accept(yes[0]) and twin.forced_tokens(tokenizer) == []
    twin.rollback(1)
    assert not twin.is_finished and twin.can_end and twin.mask()[vocab.eos_token_ids].all()


def test_every_text_the_matcher_takes_is_a_match(vocab, tokenizer):
    """Walk random allowed tokens until EOS: the bytes accepted always fullmatch the pattern."""
    pattern = r"[a-z]{1,5}( [a-z]{1,5}){0,2}\."
    grammar, rng = Grammar.from_regex(pattern, vocab), np.random.default_rng(3)
    for _ in range(20):
        matcher = grammar.matcher()
        while not matcher.is_finished:
            token = int(rng.choice(np.flatnonzero(matcher.mask().numpy())))
            assert matcher.accept(token)
        text = b"".join(vocab.token_bytes[t] for t in matcher.token_ids[:-1])
        assert grammar.dfa.matches(text), f"the matcher finished on {text!r}, no match of {pattern!r}"


def test_forced_bytes_jump_over_a_fixed_key(vocab, tokenizer):
    grammar = Grammar.from_regex(r'\{"name": "[a-z]+", "ok": (true|false)\}', vocab)
    assert grammar.forced_bytes(grammar.start) == b'{"name": "'
    matcher = grammar.matcher()
    forced = matcher.forced_tokens(tokenizer)
    assert b"".join(vocab.token_bytes[t] for t in forced) == b'{"name": "'
    assert all(matcher.accept(t) for t in forced), "forced tokens are allowed tokens"
    assert matcher.forced_tokens(tokenizer) == [], "inside the name the model chooses"
    for token in tokenizer.encode('bob"'):
        assert matcher.accept(token)
    assert grammar.forced_bytes(matcher.state) == b', "ok": '
    assert grammar.forced_bytes(grammar.dfa.walk(0, b'{"name": "b", "ok": t')) == b"rue}"
    assert grammar.forced_bytes(grammar.dfa.walk(0, b'{"name": "b", "ok": true}')) == b"", "accepting: EOS may come"


def test_forced_bytes_end_on_a_whole_character(vocab, tokenizer):
    assert Grammar.from_regex("é|è", vocab).forced_bytes(0) == b"", "only the shared first byte 0xC3 is forced"
    assert Grammar.from_regex("éa|éb", vocab).forced_bytes(0) == "é".encode()
    grammar = Grammar.from_regex("😀!", vocab)
    matcher = grammar.matcher()
    first_byte = tokenizer.hf.convert_tokens_to_ids("ð")  # byte-level BPE spells the byte 0xF0 as "ð"
    assert vocab.token_bytes[first_byte] == b"\xf0" and matcher.accept(first_byte)
    assert grammar.forced_bytes(matcher.state) == b"\x9f\x98\x80!", "the rest of a begun character stays"
    assert matcher.forced_tokens(tokenizer) == [], "no text encodes to a character's tail"
    assert complete_utf8_prefix(b"ab\xe6\x97") == b"ab" and complete_utf8_prefix(b"\xe6\x97\xa5") == "日".encode()


# ---- kinds, backends, the cache -------------------------------------------------------


def test_choice_allows_exactly_the_choices(vocab):
    choices = ["red", "green", "blue (dark)", "a|b"]
    grammar = compile_grammar("choice", choices, vocab)
    dfa = grammar.dfa
    assert all(dfa.matches(c.encode()) for c in choices)
    assert not any(dfa.matches(c.encode()) for c in ["", "re", "redgreen", "a", "blue (dark", "b"])


def test_the_cache_compiles_each_spec_once(vocab):
    cache = GrammarCache(MinicbCompiler(vocab))
    assert cache.get("regex", "[ab]+") is cache.get("regex", "[ab]+") and len(cache) == 1
    cache.get("choice", ["x", "y"])
    assert cache.get("choice", ("x", "y")) is cache.get("choice", ["x", "y"])
    assert (cache.hits, cache.misses, len(cache)) == (3, 2, 2)


def test_bad_kinds_specs_and_backends_are_named(vocab):
    for kind, spec, words in [("grammar", "x", "kind='grammar'"), ("choice", [], "non-empty list"),
                              ("regex", 3, "str pattern"), ("json_object", {"type": "x"}, "takes no spec")]:
        with pytest.raises(ValueError, match=words):
            compile_grammar(kind, spec, vocab)
    with pytest.raises(ValueError, match="backend='outlines'; allowed backends are minicb, xgrammar"):
        make_compiler(vocab, "outlines")


def test_json_kinds_go_through_json_schema(vocab):
    json_schema = pytest.importorskip("minicb.structured.json_schema")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    assert to_regex("json_schema", schema) == json_schema.schema_to_regex(schema)
    assert to_regex("json_schema", json.dumps(schema)) == to_regex("json_schema", schema)
    grammar = compile_grammar("json_schema", schema, vocab)
    assert grammar.dfa.matches(json.dumps({"ok": True}).encode()) and not grammar.dfa.matches(b'{"ok": 1}')
    assert to_regex("json_object", None) == json_schema.json_object_regex()
    two = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["a", "b"]}
    assert compile_grammar("json_schema", two, vocab).dfa.matches(b'{"b": 1, "a": 2}'), "properties in the schema's order"
    cache = GrammarCache(MinicbCompiler(vocab))
    swapped = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    assert cache.get("json_schema", two) is not cache.get("json_schema", swapped), "another order is another grammar"
    assert cache.get("json_schema", json.dumps(two)) is cache.get("json_schema", two)


# ---- the oracle: xgrammar -------------------------------------------------------------


def compare_with_xgrammar(vocab, xgrammar_compiler, pattern, seed, differs=lambda data: False, walks: int = 3):
    """Walk random allowed tokens; at every state the masks must be equal on the tokens both read as
    text, except tokens whose bytes `differs` (a documented difference) picks out.

    EOS is held to xgrammar's is_completed(), not to its bitmask's EOS bit: xgrammar 0.2.9's
    bitmask allows EOS before the first character of a negated class repeated with + or {1,}
    ("[^a]+" at the start, "x[^a]+" after "x"), and accepts it, though is_completed() says the
    text is no match yet, and it is none ("" does not fullmatch "[^a]+"). minicb allows EOS
    exactly where is_completed() is true.
    """
    grammar = Grammar.from_regex(pattern, vocab)
    xgr_grammar = xgrammar_compiler.compile("regex", pattern)
    compared = vocab.text_token & ~np.array([differs(b) for b in vocab.token_bytes])
    rng = np.random.default_rng(seed)
    for walk in range(walks):
        xgr_matcher = xgr_grammar.matcher()
        for state, tokens in walk_states(grammar, rng, 12, choose_from=compared):
            if tokens:
                assert xgr_matcher.accept(tokens[-1]), (
                    f"{pattern!r}: xgrammar refused token {tokens[-1]} {vocab.token_bytes[tokens[-1]]!r} "
                    f"after {[vocab.token_bytes[t] for t in tokens[:-1]]}, which minicb allows")
            ours, theirs = grammar.mask(state).numpy(), xgr_matcher.mask().numpy()
            where = f"{pattern!r}, walk {walk}, state {state} after {b''.join(vocab.token_bytes[t] for t in tokens)!r}"
            assert (ours[compared] == theirs[compared]).all(), f"{where}: " + first_differences(
                vocab, np.where(compared, ours, False), np.where(compared, theirs, False))
            assert xgr_matcher.can_end == grammar.is_accepting(state) == bool(ours[vocab.eos_token_ids[0]]), (
                f"{where}: xgrammar is_completed() {xgr_matcher.can_end}, minicb accepting "
                f"{grammar.is_accepting(state)}, EOS in minicb's mask {bool(ours[vocab.eos_token_ids[0]])}")


@pytest.mark.parametrize("pattern", ORACLE_PATTERNS)
def test_masks_equal_xgrammars(vocab, xgrammar_compiler, pattern):
    compare_with_xgrammar(vocab, xgrammar_compiler, pattern, seed=len(pattern))


@pytest.mark.parametrize("backend", ["minicb", "xgrammar"])
def test_both_backends_take_json_in_json_dumps_layout(vocab, tokenizer, backend):
    pytest.importorskip("minicb.structured.json_schema")
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["city", "n"]}
    for kind, spec, text in [("json_schema", schema, json.dumps({"city": "Zürich", "n": 3})),
                             ("json_object", None, json.dumps({"a": [1, {"b": None}], "c": "x"}))]:
        matcher = compile_grammar(kind, spec, vocab, backend=backend).matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(text)), f"{backend} {kind} refused {text!r}"
        assert matcher.can_end and matcher.accept(vocab.eos_token_ids[0]) and matcher.is_finished
    matcher = compile_grammar("json_schema", schema, vocab, backend=backend).matcher()
    assert not matcher.accept(tokenizer.encode("[")[0]), f"{backend}: an object schema refused '['"


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_json_schemas_regexes_give_xgrammars_masks(vocab, xgrammar_compiler, kind):
    """The big regexes json_schema.py writes (a schema's, any JSON object's), through both automata."""
    pytest.importorskip("minicb.structured.json_schema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "age"]}
    compare_with_xgrammar(vocab, xgrammar_compiler, to_regex(kind, schema if kind == "json_schema" else None), seed=5)


# Random patterns from pieces the two engines read alike (no `.`, \s or \S): combinations nobody listed.
ATOMS = ["a", "b", "é", "日", "😀", " ", "\\.", "[a-c]", "[^a]", "[é-ü]", "[^\\d]", "\\d", "\\w", "[ab😀]", "\"", "\\{"]
random_patterns = st.recursive(
    st.sampled_from(ATOMS),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda options: "(?:" + "|".join(options) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{1,}"])).map(
            lambda pair: f"(?:{pair[0]}){pair[1]}")),
    max_leaves=6)


@given(pattern=random_patterns, seed=st.integers(0, 2 ** 16))
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
def test_random_patterns_give_xgrammars_masks(vocab, xgrammar_compiler, pattern, seed):
    compare_with_xgrammar(vocab, xgrammar_compiler, pattern, seed, walks=1)


# ECMAScript's \s (JSON Schema's regex dialect, which xgrammar follows), past ASCII's [ \t\n\r\f\v].
ECMASCRIPT_ONLY_SPACES = [chr(c).encode() for c in (0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                                                    0x205F, 0x3000, 0xFEFF)]


@pytest.mark.parametrize("pattern, differs", [
    # xgrammar's `.` also matches a newline; Python's does not.
    (r"[a-z]{1,3}.{1,3}", lambda data: b"\n" in data),
    # xgrammar's \s is ECMAScript's: it also matches no-break and other Unicode spaces (a
    # token ending in a first byte of one, 0xC2 / 0xE1 / 0xE2 / 0xE3 / 0xEF, may differ too).
    (r"\S+ \S+", lambda data: any(s in data for s in ECMASCRIPT_ONLY_SPACES) or data[-1:] in
     (b"\xc2", b"\xe1", b"\xe2", b"\xe3", b"\xef") or data[-2:] in (b"\xe2\x80", b"\xe3\x80", b"\xef\xbb")),
])
def test_xgrammar_differs_only_where_it_reads_the_pattern_differently(vocab, xgrammar_compiler, pattern, differs):
    compare_with_xgrammar(vocab, xgrammar_compiler, pattern, seed=7, differs=differs)


def test_xgrammar_reads_smollm2s_special_tokens_as_text(vocab, xgrammar_compiler, tokenizer):
    """xgrammar finds no special tokens in SmolLM2's tokenizer, so "<|im_start|>" is text to it; the oracle
    compares text tokens only. minicb never allows a special token (test_special_tokens_and_eos), and
    the wrapper's mask(), which the engine uses, holds xgrammar's answer to that rule too."""
    matcher = xgrammar_compiler.compile("regex", r"[^\n]*").matcher()
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert xgrammar_compiler.info.special_token_ids == []
    from minicb.structured.xgrammar_backend import unpack_bitmask
    assert unpack_bitmask(matcher.fill_bitmask(), vocab.vocab_size)[im_start], "xgrammar's own bitmask"
    assert not matcher.mask()[im_start], "the wrapper's mask allows a special token"


def test_both_backends_answer_the_same_interface(vocab, xgrammar_compiler, tokenizer):
    """One script of calls (accept, refuse, fork, rollback, jump-forward, EOS) and the same answers."""
    pattern = r'\{"id": [0-9]{1,3}, "tag": "(a|b)"\}'
    answers = []
    for grammar in (compile_grammar("regex", pattern, vocab), xgrammar_compiler.compile("regex", pattern)):
        matcher, seen = grammar.matcher(), []
        forced = matcher.forced_tokens(tokenizer)
        seen.append(b"".join(vocab.token_bytes[t] for t in forced))
        seen.append([matcher.accept(t) for t in forced])
        seen.append(matcher.accept(tokenizer.encode("x")[0]))  # a letter where a digit must come: refused
        seen.append([matcher.accept(t) for t in tokenizer.encode('42, "tag": "')])
        twin = matcher.fork()
        tail = tokenizer.encode('b"}')
        seen.append([twin.accept(t) for t in tail] + [twin.can_end, matcher.can_end])
        seen.append([twin.accept(vocab.eos_token_ids[0]), twin.is_finished, matcher.is_finished])
        twin.rollback(len(tail) + 1)  # back to where it forked
        seen.append([twin.is_finished, twin.num_accepted, matcher.num_accepted, torch.equal(twin.mask(), matcher.mask())])
        answers.append(seen)
    assert answers[0] == answers[1], f"minicb {answers[0]}\nxgrammar {answers[1]}"
