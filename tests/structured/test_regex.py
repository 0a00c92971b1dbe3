"""minicb/structured/regex.py against its definition: Python's re.fullmatch(pattern, text, re.ASCII).

For every pattern below, the DFA must say yes to the strings Hypothesis builds
from the pattern itself (st.from_regex), and agree with `re` on random text
drawn from the pattern's own characters, their neighbours and multibyte ones
(a random string of any characters almost never matches, so it would test
little). Bytes that are not UTF-8 must never match. Every refused construct
gets a ValueError naming it and its position. And the DFA is what the module
docstring promises: trimmed (every state can finish) and minimal.
"""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minicb.structured.regex import MAX_DFA_STATES, compile_regex, escape, normalise, utf8_sequences

PATTERNS = [
    "",
    "a",
    "abc",
    "a|b|",
    "()",
    "(?:ab|cd)*e",
    "[0-9]+(\\.[0-9]+)?",
    "-?(0|[1-9][0-9]*)",
    "a{3}",
    "a{2,}",
    "(ab){1,3}c?",
    "x{0,4}y{0}",
    "[a-z]{2,5}@[a-z]+\\.(com|org)",
    ".",
    ".{2,3}",
    "\\d\\D\\w\\W\\s\\S",
    "[\\d\\s]+",
    "[^\\w]+",
    "[^a-c]",
    "[^\"\\\\]*",
    '"([^"\\\\]|\\\\["\\\\/bfnrt])*"',
    "é+|ü",
    "[α-ω]{1,3}",
    "[à-ÿ]*x",
    "[^é]",
    "[\\u007f-\\u0801]",
    "[\\u07ff-\\U00010001]+",
    "[\\U0001F600-\\U0001F64F]",
    "[^\\u0000-\\u00ff]",
    "[\\x00-\\x1f\\x7f]",
    "\\x41\\u00e9\\U0001F600",
    "\\n\\t\\r\\f\\v",
    "\\.\\*\\+\\?\\(\\)\\[\\]\\{\\}\\|\\^\\$\\-\\/\\\"\\\\",
    "a}b]",
    "[-a]|[a-]|[a\\-z]",
    "[\\]-^]",
    "(a|b)*abb",
    "(a*b)*c",
    "((a|b)c){2}|[^abc]{1,2}",
    "日本語?|中文",
]

# Characters random text is drawn from: ASCII edges and specials, multibyte ones of every length,
# and a surrogate-free stretch near the top of the BMP.
SPICE = "aAzZ09_- \t\n\r\f\v\"\\./@éüàÿα\u07ff\u0800\u0801\u00ffĀ日本語中文😀\U0001F64F\U00010000\U00010001\x00\x1f\x7f\ufffd"


@functools.lru_cache(maxsize=None)
def dfa_of(pattern: str):
    return compile_regex(pattern)


def python_says(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


def alphabet_of(pattern: str) -> str:
    chars = set(SPICE) | {ch for ch in pattern if not 0xD800 <= ord(ch) <= 0xDFFF}
    for ch in list(chars):  # neighbours catch an off-by-one at a range's end
        for near in (ord(ch) - 1, ord(ch) + 1):
            if 0 <= near <= 0x10FFFF and not 0xD800 <= near <= 0xDFFF:
                chars.add(chr(near))
    return "".join(sorted(chars))


FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("pattern", PATTERNS)
@FAST
@given(data=st.data())
def test_dfa_accepts_what_the_pattern_generates(pattern, data):
    text = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True,
                                   alphabet=st.characters(codec="utf-8")))
    assert python_says(pattern, text)  # Hypothesis' own promise, so a failure below is minicb's
    assert dfa_of(pattern).matches(text.encode("utf-8")), f"{pattern!r} refused {text!r}, which re.fullmatch takes"


@pytest.mark.parametrize("pattern", PATTERNS)
@FAST
@given(data=st.data())
def test_dfa_agrees_with_re_on_random_text(pattern, data):
    text = data.draw(st.text(alphabet=alphabet_of(pattern), max_size=8))
    want = python_says(pattern, text)
    assert dfa_of(pattern).matches(text.encode("utf-8")) == want, (
        f"{pattern!r} on {text!r}: re.fullmatch says {want}, the DFA says {not want}")


@pytest.mark.parametrize("pattern", PATTERNS)
@FAST
@given(data=st.data())
def test_dfa_agrees_with_re_near_a_match(pattern, data):
    """A generated match with one character dropped, doubled or replaced: the strings that nearly match."""
    text = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True,
                                   alphabet=st.characters(codec="utf-8")))
    if not text:
        return
    i = data.draw(st.integers(0, len(text) - 1))
    other = data.draw(st.sampled_from(alphabet_of(pattern)))
    for near in (text[:i] + text[i + 1:], text[:i] + text[i] + text[i:], text[:i] + other + text[i + 1:]):
        assert dfa_of(pattern).matches(near.encode("utf-8")) == python_says(pattern, near), (
            f"{pattern!r} on {near!r}: re.fullmatch says {python_says(pattern, near)}")


# Random patterns from pieces, so that combinations nobody listed get tried: nested
# quantifiers over multibyte classes, alternations of counted repeats, empty options.
ATOMS = ["a", "b", "é", "😀", "\\.", "[a-c]", "[^a]", "[é-ü]", "[^\\d]", "\\d", "\\S", ".", "[ab😀]"]
random_patterns = st.recursive(
    st.sampled_from(ATOMS),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda options: "(?:" + "|".join(options) + ")"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{0,2}", "{1,}"])).map(
            lambda pair: f"(?:{pair[0]}){pair[1]}")),
    max_leaves=6)


@given(pattern=random_patterns, texts=st.lists(st.text(alphabet="abcé😀ü.0x\n", max_size=6), min_size=5,
                                                max_size=5))
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
def test_random_patterns_agree_with_re(pattern, texts):
    dfa = compile_regex(pattern)
    for text in texts:
        assert dfa.matches(text.encode("utf-8")) == python_says(pattern, text), (
            f"{pattern!r} on {text!r}: re.fullmatch says {python_says(pattern, text)}")


@pytest.mark.parametrize("pattern", [".", "[^a]", "\\W", ".*", "[^\\u0000-\\u00ff]+"])
@FAST
@given(data=st.binary(max_size=6))
def test_only_utf8_matches(pattern, data):
    """Overlong forms, surrogates, stray continuation bytes, 0xF5..0xFF: a byte DFA must refuse them all."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        assert not dfa_of(pattern).matches(data), f"{pattern!r} took {data!r}, which is not UTF-8"
        return
    assert dfa_of(pattern).matches(data) == python_says(pattern, text)


def test_surrogates_and_the_top_of_unicode():
    dfa = dfa_of("[^a]")
    assert not dfa.matches("\ud800".encode("utf-8", "surrogatepass")), "a negated class never covers a surrogate"
    assert dfa.matches(chr(0x10FFFF).encode("utf-8")) and dfa.matches(chr(0xE000).encode("utf-8"))
    assert not dfa_of("[\\u0000-\\uffff]").matches("\udfff".encode("utf-8", "surrogatepass"))


@given(lo=st.integers(0, 0x10FFFF), span=st.integers(0, 70_000), probe=st.integers(0, 0x10FFFF))
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_utf8_sequences_cover_exactly_the_range(lo, span, probe):
    hi = min(lo + span, 0x10FFFF)
    # utf8_sequences is only ever given ranges with the surrogates cut out (no UTF-8 form)
    sequences = [seq for piece_lo, piece_hi in normalise([(lo, hi)]) for seq in utf8_sequences(piece_lo, piece_hi)]
    for code in (lo, hi, probe, (lo + hi) // 2):
        if 0xD800 <= code <= 0xDFFF:
            continue
        encoded = chr(code).encode("utf-8")
        hits = sum(len(seq) == len(encoded) and all(a <= b <= c for (a, c), b in zip(seq, encoded))
                   for seq in sequences)
        assert hits == (1 if lo <= code <= hi else 0), f"U+{code:04X} in U+{lo:04X}..U+{hi:04X}: {hits} hits"


REFUSED = [
    ("^a", "the anchor '^'", 0),
    ("a$", "the anchor '$'", 1),
    ("a*?", "a lazy quantifier", 2),
    ("a+?", "a lazy quantifier", 2),
    ("a??", "a lazy quantifier", 2),
    ("ab{2}?", "a lazy quantifier", 5),
    ("a*+", "a possessive quantifier", 2),
    ("a**", "a quantifier after a quantifier", 2),
    ("a{2}{3}", "a quantifier after a quantifier", 4),
    ("*a", "nothing to repeat", 0),
    ("a|+", "nothing to repeat", 2),
    ("(a)\\1", "backreference", 3),
    ("\\0", "backreference or octal", 0),
    ("a\\b", "the anchor \\b", 1),
    ("[\\b]", "the anchor \\b", 1),
    ("\\Aa", "the anchor \\A", 0),
    ("a\\Z", "the anchor \\Z", 1),
    ("(?P<year>a)", "a named group", 0),
    ("(?P=year)", "a named backreference", 0),
    ("x(?=a)", "a lookahead", 1),
    ("(?!a)", "a lookahead", 0),
    ("(?<=a)b", "a lookbehind", 0),
    ("(?<!a)b", "a lookbehind", 0),
    ("(?i)a", "an inline flag group", 0),
    ("(?#note)", "a comment group", 0),
    ("(?>a)", "an atomic group", 0),
    ("a{,3}", "the repeat {,3}", 1),
    ("a{x}", "a '{' that starts no repeat", 1),
    ("{", "a '{' that starts no repeat", 0),
    ("[]a]", "a ']' first in a class", 1),
    ("\\q", "the escape \\q", 0),
    ("\\N{DASH}", "the escape \\N", 0),
]


@pytest.mark.parametrize("pattern, construct, position", REFUSED)
def test_refused_constructs_are_named_with_their_position(pattern, construct, position):
    with pytest.raises(ValueError) as caught:
        compile_regex(pattern)
    message = str(caught.value)
    assert construct in message and f"at position {position} " in message, message


@pytest.mark.parametrize("pattern, words", [
    ("(a", "never closed"), ("a)", "unmatched ')'"), ("[ab", "never closed"), ("a\\", "lone backslash"),
    ("[z-a]", "runs backwards"), ("[\\d-z]", "two single characters"), ("a{3,2}", "min 3 > max 2"),
    ("\\x4", "2 hex digits"), ("\\u12", "4 hex digits"), ("\\ud800", "surrogate U+D800"),
    ("\\U00110000", "past U+10FFFF"),
])
def test_malformed_patterns_say_what_is_wrong(pattern, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        compile_regex(pattern)


def test_a_pattern_past_the_state_limit_is_refused_with_its_size():
    # (a|b)*a(a|b){n}: "the (n+1)-th letter from the end is a" needs 2^(n+1) states, with no way around it.
    pattern = "(a|b)*a(a|b){14}"
    with pytest.raises(ValueError) as caught:
        compile_regex(pattern)
    assert f"{len(pattern)} characters" in str(caught.value) and f"{MAX_DFA_STATES:,}" in str(caught.value)
    assert compile_regex("(a|b)*a(a|b){9}").num_states == 2 ** 10  # below the limit: compiled, and minimal


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_state_is_reachable_and_can_finish(pattern):
    dfa = dfa_of(pattern)
    table = dfa.transitions
    assert table.dtype == np.int32 and table.shape == (dfa.num_states, 256) and dfa.start == 0
    reached, frontier = {0}, [0]
    while frontier:
        nxt = {int(t) for s in frontier for t in table[s] if t >= 0} - reached
        reached |= nxt
        frontier = list(nxt)
    assert reached == set(range(dfa.num_states)), f"{pattern!r}: states {set(range(dfa.num_states)) - reached} unreachable"
    finishes = set(np.flatnonzero(dfa.accepting).tolist())
    while True:
        more = {s for s in range(dfa.num_states) if any(int(t) in finishes for t in table[s] if t >= 0)} - finishes
        if not more:
            break
        finishes |= more
    if dfa.accepting.any() or dfa.num_states > 1:
        assert finishes == reached, f"{pattern!r}: states {reached - finishes} cannot reach an accepting state"


@pytest.mark.parametrize("first, second", [
    ("a|ab|abc", "a(b(c)?)?"), ("(a|b)*", "[ab]*"), ("a+", "aa*"), ("(ab)*a", "a(ba)*"), ("x{2,4}", "xx(x|xx)?"),
    ("[0-9]+", "\\d\\d*"), ("é|è", "\\u00e9|\\u00e8"),
])
def test_equivalent_patterns_give_dfas_of_one_size(first, second):
    """Minimal DFAs of one language are the same up to names; breadth-first numbering makes them equal."""
    a, b = dfa_of(first), dfa_of(second)
    assert a.num_states == b.num_states, f"{first!r}: {a.num_states} states, {second!r}: {b.num_states}"
    assert (a.transitions == b.transitions).all() and (a.accepting == b.accepting).all()


def test_textbook_sizes():
    assert dfa_of("(a|b)*abb").num_states == 4  # the dragon book's example, without its dead state
    assert dfa_of("[^\\u0000-\\U0010ffff]").num_states == 1 and not dfa_of("[^\\u0000-\\U0010ffff]").matches(b"")
    assert dfa_of("").num_states == 1 and dfa_of("").matches(b"")


def test_step_walk_and_matches():
    dfa = dfa_of("ab+")
    state = dfa.step(dfa.start, ord("a"))
    assert state >= 0 and not dfa.accepting[state]
    assert dfa.walk(state, b"bbb") >= 0 and dfa.accepting[dfa.walk(state, b"bbb")]
    assert dfa.walk(dfa.start, b"ac") == -1 and dfa.walk(dfa.start, b"acb") == -1, "dead stays dead"
    assert dfa.step(-1, ord("a")) == -1


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=12))
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
def test_escape_matches_exactly_its_text(text):
    pattern = escape(text)
    dfa = compile_regex(pattern)
    assert dfa.matches(text.encode("utf-8")) and python_says(pattern, text)
    assert not dfa.matches((text + "x").encode("utf-8"))
