"""Chapter 12: JSON schemas as regexes (minicb/structured/json_schema.py), held to jsonschema.

The oracle is jsonschema itself, with its format checker on: hypothesis draws texts
that fullmatch the regex, and every one must parse and be valid under the schema.
Beside it, hand-written instances from tests/structured/schemas.py must match (json.dumps
writes them in the fixed layout) and invalid ones must not, and every schema there that
must be refused is refused by the keyword and path it names. The regexes are in the
dialect of minicb/structured/regex.py, which means what Python's re means, so no DFA is
needed here (the one check against that DFA is marked slow).

    .venv/bin/python -m pytest tests/structured/test_json_schema.py -q
"""
from __future__ import annotations

import doctest
import functools
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minicb.structured import json_schema
from minicb.structured.json_schema import UnsupportedSchema, choice_regex, json_object_regex, schema_to_regex
from schemas import ACCEPTED, REFUSED

VALIDATOR = jsonschema.Draft202012Validator
# A few draws per schema: 70 schemas x 40 draws take seconds (each run draws anew).
DRAWS = settings(max_examples=40, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def regex_of(name: str) -> str:
    return schema_to_regex(next(case.schema for case in ACCEPTED if case.name == name))


@functools.lru_cache(maxsize=None)
def texts_of(regex: str):
    """The strings hypothesis draws that fullmatch `regex` (built once: building walks the whole regex)."""
    return st.from_regex(re.compile(regex, re.ASCII), fullmatch=True)


def matches(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text, re.ASCII) is not None


def errors(schema, instance) -> list[str]:
    return [e.message for e in VALIDATOR(schema, format_checker=VALIDATOR.FORMAT_CHECKER).iter_errors(instance)]


def shown(case, regex: str, text: str) -> str:
    return f"\nschema: {json.dumps(case.schema)}\nregex:  {regex}\ntext:   {text!r}"


def test_the_test_set_is_large_enough():
    assert len(ACCEPTED) >= 50 and len(REFUSED) >= 10
    assert len({c.name for c in ACCEPTED}) == len(ACCEPTED) and len({r.name for r in REFUSED}) == len(REFUSED)
    for case in ACCEPTED:  # the schemas are well-formed, and the instances say what the test claims
        if not isinstance(case.schema, bool):
            VALIDATOR.check_schema(case.schema)
        for instance in case.valid + case.raw_only:
            assert not errors(case.schema, instance), (case.name, instance, errors(case.schema, instance))
        for instance in case.invalid:
            assert errors(case.schema, instance), f"{case.name}: {instance!r} is valid, yet listed as invalid"


@pytest.mark.parametrize("case", ACCEPTED, ids=lambda c: c.name)
def test_valid_instances_match(case):
    regex = regex_of(case.name)
    for instance in case.valid:
        for ensure_ascii in (True, False):  # non-ASCII escaped as \uXXXX (json.dumps's default) and raw
            text = json.dumps(instance, ensure_ascii=ensure_ascii)
            assert matches(regex, text), "a valid instance does not match" + shown(case, regex, text)
    for instance in case.raw_only:
        text = json.dumps(instance, ensure_ascii=False)
        assert matches(regex, text), "a valid instance does not match" + shown(case, regex, text)


@pytest.mark.parametrize("case", [c for c in ACCEPTED if c.invalid], ids=lambda c: c.name)
def test_invalid_instances_do_not_match(case):
    regex = regex_of(case.name)
    for instance in case.invalid:
        for ensure_ascii in (True, False):
            text = json.dumps(instance, ensure_ascii=ensure_ascii)
            assert not matches(regex, text), "an invalid instance matches" + shown(case, regex, text)


@pytest.mark.parametrize("case", ACCEPTED, ids=lambda c: c.name)
@DRAWS
@given(data=st.data())
def test_every_drawn_text_is_valid(case, data):
    regex = regex_of(case.name)
    text = data.draw(texts_of(regex), label="text")
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        pytest.fail(f"the text is not JSON ({e})" + shown(case, regex, text))
    problems = errors(case.schema, instance)
    assert not problems, f"the text is JSON but invalid: {problems}" + shown(case, regex, text)
    text.encode("utf-8")  # the DFA runs over UTF-8 bytes: a lone surrogate would have none


@pytest.mark.parametrize("refused", REFUSED, ids=lambda r: r.name)
def test_refused_schemas_name_the_keyword_and_its_path(refused):
    with pytest.raises(UnsupportedSchema) as caught:
        regex = schema_to_regex(refused.schema)
        pytest.fail(f"{json.dumps(refused.schema)} was accepted as {regex}")
    assert (caught.value.path, caught.value.keyword) == (refused.path, refused.keyword), str(caught.value)
    assert str(caught.value).startswith(refused.path) and refused.keyword in str(caught.value)


def test_the_worked_example_in_the_docstring():
    assert doctest.testmod(json_schema).failed == 0


def test_one_layout_only():
    regex = regex_of("person")
    assert matches(regex, '{"name": "Ada", "age": 36}')
    for text in ['{"name":"Ada","age":36}', '{ "name": "Ada" }', '{"name": "Ada",}', '{\n  "name": "Ada"\n}',
                 '{"name": "Ada" , "age": 36}', '{"age": 36, "name": "Ada"}', ' {"name": "Ada"}']:
        assert not matches(regex, text), text


def test_extra_properties_are_never_written():
    # additionalProperties allows them (it is not false), but leaving them out is valid too.
    regex = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert matches(regex, '{"a": 1}') and not matches(regex, '{"a": 1, "b": 2}')


def test_optional_properties_grow_linearly():
    def regex(n):
        return schema_to_regex({"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(n)}})
    assert len(regex(40)) < 2.2 * len(regex(20)), "n optional properties must be a chain, not 2^n choices"
    every_other = {f"p{i}": True for i in range(0, 40, 2)}
    assert matches(regex(40), json.dumps(every_other))


@pytest.mark.parametrize("max_depth", [2, 3, 5, 7])
def test_recursion_is_cut_at_max_depth(max_depth):
    tree = next(c.schema for c in ACCEPTED if c.name == "tree_by_ref")
    regex = schema_to_regex(tree, max_depth=max_depth)

    def chain(levels):  # `levels` nodes, each the only child of the one before
        node = {"value": levels, "children": []}
        for level in range(levels - 1, 0, -1):
            node = {"value": level, "children": [node]}
        return node
    # Each node is an object holding an array (the last one's is []): 2 * levels containers deep.
    for levels in range(1, 6):
        fits = 2 * levels <= max_depth
        assert matches(regex, json.dumps(chain(levels))) == fits, (max_depth, levels)


def test_a_schema_deeper_than_max_depth_is_refused():
    tree = next(c.schema for c in ACCEPTED if c.name == "tree_by_ref")
    with pytest.raises(UnsupportedSchema, match="max_depth=1"):  # a node is an object holding an array
        schema_to_regex(tree, max_depth=1)


def test_max_depth_must_be_a_positive_integer():
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ValueError, match="max_depth"):
            schema_to_regex({"type": "integer"}, max_depth=bad)
        with pytest.raises(ValueError, match="max_depth"):
            json_object_regex(bad)


def nesting(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (a scalar is 0)."""
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


@pytest.mark.parametrize("max_depth", [1, 2, 3])
def test_json_object_regex_is_any_object_to_a_depth(max_depth):
    regex = json_object_regex(max_depth)
    objects = [{}, {"a": 1}, {"s": "x\"y\\z\n", "n": -1.5e-3, "t": True, "f": False, "z": None, "é": "ü"},
               {"a": [1, 2]}, {"a": {"b": [None]}}, {"a": {"b": {"c": {}}}}]
    for obj in objects:
        text = json.dumps(obj)
        assert matches(regex, text) == (nesting(obj) <= max_depth), (max_depth, text)
    for text in ["[]", "1", '"s"', "null", '{"a": 1,}', '{"a":1}', "{'a': 1}", '{"a": NaN}', '{"a": 01}']:
        assert not matches(regex, text), text


@pytest.mark.parametrize("max_depth", [1, 3])
@DRAWS
@given(data=st.data())
def test_json_object_regex_draws_objects(max_depth, data):
    regex = json_object_regex(max_depth)
    text = data.draw(texts_of(regex), label="text")
    value = json.loads(text)
    assert isinstance(value, dict) and nesting(value) <= max_depth, text


CHOICES = ["yes", "no", "a.b*c", "(x|y)", "[1-2]", "{3}", "^$", "back\\slash", 'say "hi"', "naïve 😀", "two\nlines",
           "tab\tchar", ""]


def test_choice_regex_matches_each_choice_and_nothing_else():
    regex = choice_regex(CHOICES)
    for choice in CHOICES:
        assert matches(regex, choice), (choice, regex)
    for text in ["ye", "yess", "a.bbc", "x", "1", "3", "say hi", "two lines", " yes"]:
        assert not matches(regex, text), (text, regex)
    assert not matches(choice_regex(["yes"]), "")


@DRAWS
@given(data=st.data())
def test_choice_regex_draws_only_choices(data):
    text = data.draw(texts_of(choice_regex(CHOICES)))
    assert text in CHOICES, text


def test_choice_regex_refuses_what_has_no_choice():
    for bad in ([], "yes", [1], [""], None):
        with pytest.raises(ValueError, match="choices"):
            choice_regex(bad)


# ---- the dialect ---------------------------------------------------------------------
# The DFA compiler takes a subset of Python's re. Every regex emitted must stay in it: a
# scanner that rejects anything else (anchors, lazy quantifiers, (?=, \b, stray {).

ESCAPABLE = set("\\.*+?()[]{}|^$-/\"") | set("ntrfvdwsDWS")


def outside_dialect(regex: str) -> str | None:
    """What in `regex` is outside the dialect, or None."""
    pos, in_class = 0, False
    while pos < len(regex):
        ch = regex[pos]
        if ord(ch) < 0x20:
            return f"a raw control character at {pos}"
        if ch == "\\":
            kind = regex[pos + 1]
            width = {"x": 2, "u": 4}.get(kind, 0)
            if width and not re.fullmatch(f"[0-9a-fA-F]{{{width}}}", regex[pos + 2:pos + 2 + width]):
                return f"a bad \\{kind} escape at {pos}"
            if not width and kind not in ESCAPABLE:
                return f"\\{kind} at {pos}"
            pos += 2 + width
        elif in_class:
            in_class = ch != "]"
            pos += 1
        elif ch == "[":
            in_class, pos = True, pos + 1 + regex.startswith("^", pos + 1)
        elif ch == "(" and regex.startswith("(?", pos) and not regex.startswith("(?:", pos):
            return f"(? at {pos}"
        elif ch in "^$":
            return f"an anchor at {pos}"
        elif ch == "{" and not re.compile(r"\{\d+(,\d*)?\}").match(regex, pos):
            return f"a {{ that is not a count at {pos}"
        elif ch in "*+?}" and regex[pos + 1:pos + 2] in ("?", "+"):
            return f"a lazy or possessive quantifier at {pos}"
        else:
            pos += 1
    return None


def test_every_regex_is_in_the_dialect():
    regexes = {case.name: regex_of(case.name) for case in ACCEPTED}
    regexes.update({f"json_object_{d}": json_object_regex(d) for d in (1, 3)})
    regexes["choices"] = choice_regex(CHOICES)
    for name, regex in regexes.items():
        assert outside_dialect(regex) is None, f"{name}: {outside_dialect(regex)} in {regex}"
    assert outside_dialect("a(?=b)") and outside_dialect("a+?") and outside_dialect("^a") and outside_dialect("\\b")


@pytest.mark.slow
def test_the_dfa_agrees_on_the_instances():
    """The other half: minicb/structured/regex.py builds each regex's DFA over UTF-8 bytes, and it
    accepts the valid instances and refuses the invalid ones, as Python's re did."""
    compile_regex = pytest.importorskip("minicb.structured.regex").compile_regex
    for case in ACCEPTED:
        dfa = compile_regex(regex_of(case.name))
        for instance in case.valid + case.raw_only:
            text = json.dumps(instance, ensure_ascii=False)
            assert dfa.matches(text.encode()), (case.name, text)
        for instance in case.invalid:
            assert not dfa.matches(json.dumps(instance).encode()), (case.name, instance)


# ---- the ranges and patterns, from the other side -------------------------------------
# The draws above show that every text allowed is valid. These show that the valid texts
# a model is most likely to want are allowed: every integer in a window, the decimals next
# to each bound, every value a pattern finds.

INTEGER_BOUNDS = [{"minimum": 0}, {"maximum": 0}, {"minimum": -40, "maximum": 125}, {"minimum": 7, "maximum": 7},
                  {"minimum": 99, "maximum": 1001}, {"exclusiveMinimum": -10.5, "exclusiveMaximum": 0},
                  {"minimum": -1000, "exclusiveMaximum": -99}, {"minimum": 5, "exclusiveMinimum": 5}]


@pytest.mark.parametrize("bounds", INTEGER_BOUNDS, ids=json.dumps)
def test_integer_ranges_are_exact(bounds):
    schema = {"type": "integer", **bounds}
    regex = schema_to_regex(schema)
    wrong = [n for n in range(-1500, 1500) if matches(regex, str(n)) != (not errors(schema, n))]
    assert not wrong, f"{len(wrong)} integers disagree, the first {wrong[:5]}" + shown_schema(schema, regex)


NUMBER_BOUNDS = [{"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0}, {"exclusiveMinimum": -1, "exclusiveMaximum": 1},
                 {"minimum": -100, "maximum": -5}, {"exclusiveMinimum": 3, "exclusiveMaximum": 4},
                 {"minimum": -2, "exclusiveMaximum": 0}, {"exclusiveMinimum": 999, "maximum": 1000}]


@pytest.mark.parametrize("bounds", NUMBER_BOUNDS, ids=json.dumps)
def test_number_ranges_near_their_bounds(bounds):
    schema = {"type": "number", **bounds}
    regex = schema_to_regex(schema)
    texts = set()
    for bound in bounds.values():
        for whole in (bound - 1, bound, bound + 1):
            for fraction in ("", ".0", ".5", ".25", ".000001", ".999999", ".99999999999999999", ".00000000000000001"):
                for sign in ("", "-"):
                    texts.add(f"{sign}{abs(whole)}{fraction}")
    for text in sorted(texts):
        valid = not errors(schema, json.loads(text))
        if matches(regex, text):
            assert valid, "an invalid number matches" + shown_schema(schema, regex, text)
        elif valid and len(text.partition(".")[2]) <= 6 and text not in ("-0", "-0.0"):
            pytest.fail("a valid number with few digits does not match" + shown_schema(schema, regex, text))


def shown_schema(schema, regex: str, text: str = "") -> str:
    return f"\nschema: {json.dumps(schema)}\nregex:  {regex}" + (f"\ntext:   {text!r}" if text else "")


PATTERN_CASES = [c for c in ACCEPTED if isinstance(c.schema, dict) and "pattern" in c.schema]


@pytest.mark.parametrize("case", PATTERN_CASES, ids=lambda c: c.name)
@DRAWS
@given(data=st.data())
def test_every_value_a_pattern_finds_is_allowed(case, data):
    pattern = case.schema["pattern"]
    value = data.draw(texts_of_pattern(pattern), label="value")
    # Two values are left out by design: Python's $ also matches before a final newline, and
    # \D \W \S stand for their ASCII characters only (under Unicode rules they hold fewer).
    assume(not (pattern.endswith("$") and value.endswith("\n")))
    assume(value.isascii() or not re.search(r"\\[DWS]", pattern))
    regex = regex_of(case.name)
    text = json.dumps(value, ensure_ascii=False)
    assert matches(regex, text), "a value the pattern finds is not allowed" + shown(case, regex, text)


@functools.lru_cache(maxsize=None)
def texts_of_pattern(pattern: str):
    # ASCII rules, the ones the regex gives \d \w \s; what re.search finds, as jsonschema uses it.
    return st.from_regex(re.compile(pattern, re.ASCII), fullmatch=False)
