"""Chapter 12: a JSON schema as a regular expression, so an automaton can hold a model to it.

In this file you will learn:
- how a JSON schema becomes a regex of the texts that parse to a valid
  instance (`schema_to_regex`), one keyword at a time: a string is quotes
  around counted characters, an integer range is a few digit classes, an
  object is its properties in order with the commas always right;
- why the text has one fixed layout: that of `json.dumps(obj)` with its
  default separators (", " and ": "), no other whitespace and no newlines.
  The automaton then stays finite and small; a small model cannot loop on
  whitespace (JSON allows any amount between tokens, and a weak model will take
  it); and every text the automaton allows is valid, so a finished output
  always parses. The cost: valid JSON in other layouts is never generated.
  xgrammar by default allows any whitespace, so the two backends are compared
  where they agree (on texts in this layout). Inside a string, a character
  may be raw or a JSON escape (json.dumps writes é as \\u00e9, a model writes é);
- why "any JSON" has no finite automaton (brackets nest without bound, and a
  DFA cannot count them), so `json_object_regex` and the schema `{}` stand for
  JSON to a bounded depth. The alternative is a pushdown automaton (a grammar
  with a stack), which is what xgrammar runs;
- why a keyword that is not honoured is refused (`UnsupportedSchema`, naming
  the keyword and where it sits, e.g. $.properties.age.multipleOf) rather
  than dropped: a constraint a client asked for and silently did not get is a
  bug they find in production.

Every regex emitted here is in the dialect of minicb/structured/regex.py, which
means what `re.fullmatch(regex, text, re.ASCII)` means, so the tests check this
file with Python's `re` and hypothesis alone. `vLLM`'s `guided_choice` is
`choice_regex`. Chapter text: chapters/12-structured-output/README.md. Try it:

    .venv/bin/python -m minicb.structured.json_schema
"""
from __future__ import annotations

import functools
import json
import math
import re

# Keywords that describe and never constrain: read past by design.
ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$schema", "$id", "$comment",
                         "readOnly", "writeOnly", "deprecated"})
DEFINITIONS = frozenset({"$defs", "definitions"})  # reached through $ref from the root, never read in place
# The keywords of one instance type: they constrain instances of that type and let the others through.
KIND_KEYWORDS = {
    "object": frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"}),
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
}
SUPPORTED_KEYWORDS = (ANNOTATIONS | DEFINITIONS | frozenset({"type", "enum", "const", "anyOf", "allOf", "$ref"})
                      | frozenset().union(*KIND_KEYWORDS.values()))
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
WHY_REFUSED = {
    "oneOf": "an alternation lets several branches match, and oneOf allows exactly one (write anyOf if the "
             "branches cannot overlap)",
    "not": "the complement of a schema is not built",
    "if": "conditional schemas are not built", "then": "conditional schemas are not built",
    "else": "conditional schemas are not built",
    "multipleOf": "the multiples of a number have no small regex",
    "patternProperties": "property names drawn from a pattern are not built",
}

DEFAULT_MAX_DEPTH = 5  # objects and arrays inside one another, the outermost being depth 1
ANY_VALUE_DEPTH = 2  # a value a schema leaves open ({}, true) nests at most this deep: any_value says why
INTEGER_DIGITS = 16  # an integer (or a number's integer part) has at most this many digits
FRACTION_DIGITS = 17  # enough for any float json.dumps writes without an exponent at >= 0.1
EXPONENT_DIGITS = 2  # 1e99 at most: three digits could reach 1e999, which parses to inf
MAX_COUNT = 1000  # a counted repeat (maxLength, maxItems, {m,n}) becomes that many automaton states
MAX_REGEX_CHARS = 200_000  # past this the DFA would be too big to build per request
_LARGEST = 10 ** INTEGER_DIGITS - 1
_EXACT_BOUND = 10 ** 15  # a number's bound past this is not held exactly by a float (2^53 ~ 9e15)


class UnsupportedSchema(ValueError):
    """A schema, or a part of one, this compiler does not honour. `path` is where (e.g.
    $.properties.age.multipleOf) and `keyword` the keyword refused (the path's last part)."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.keyword = re.split(r"[.\[]", path)[-1].strip('"]') if path != "$" else ""
        super().__init__(f"{path}: {message}")


# ---- pieces of regex ----------------------------------------------------------------
# Every builder below returns a regex string, or None for "no text at all" (an array whose
# items are `false`, an object nested past max_depth). None propagates: an optional property
# whose value is None is left out, a required one makes its object None too. A regex returned
# never has a | outside a group, so it can be put after another as it is.

_META = frozenset("\\.*+?()[]{}|^$")


def literal(text: str) -> str:
    """A regex matching exactly `text`: the dialect's metacharacters escaped, control characters as \\xHH."""
    return "".join("\\" + ch if ch in _META else f"\\x{ord(ch):02x}" if ord(ch) < 0x20 or ord(ch) == 0x7F
                   else ch for ch in text)


def json_literal(value) -> str:
    """A regex matching `value` as json.dumps writes it, with its characters outside ASCII escaped
    (json.dumps's default) or raw (as a model writes them, ensure_ascii=False)."""
    forms = {json.dumps(value, allow_nan=False), json.dumps(value, allow_nan=False, ensure_ascii=False)}
    return _either(literal(form) for form in sorted(forms))


def _repeat(atom: str, lo: int, hi: int | None) -> str:
    """atom (one regex atom: a character, a class or a group) repeated lo..hi times (hi None: no limit)."""
    if hi == 0:
        return ""
    short = {(0, None): "*", (1, None): "+", (0, 1): "?", (1, 1): ""}.get((lo, hi))
    if short is not None:
        return atom + short
    return atom + (f"{{{lo}}}" if lo == hi else f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}")


def _either(parts) -> str | None:
    """The alternation of the parts that are not None: one part as it is, None when none is left."""
    parts = list(dict.fromkeys(p for p in parts if p is not None))  # drop the Nones, keep the order
    return None if not parts else parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _list(item: str, lo: int, hi: int | None) -> str:
    """lo..hi copies of item separated by ", " (item written twice: once first, once after each comma)."""
    if hi == 0:
        return ""
    rest = _repeat(f"(?:, {item})", max(lo - 1, 0), None if hi is None else hi - 1)
    return f"{item}{rest}" if lo > 0 else f"(?:{item}{rest})?"


# One character inside a JSON string: any character but ", \ and the controls (which JSON
# forbids raw), or an escape. \uXXXX is a BMP character that is not a surrogate, or a high
# surrogate followed by a low one (json.dumps writes an emoji that way): a lone surrogate
# would be one character to minLength but is no character at all in UTF-8, and a pair must
# count as one, as json.loads and jsonschema count it.
JSON_CHAR = (r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}'
             r'|[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}))')
JSON_STRING = f'"{JSON_CHAR}*"'
JSON_INTEGER = f"-?(?:0|[1-9][0-9]{{0,{INTEGER_DIGITS - 1}}})"
JSON_NUMBER = (JSON_INTEGER + f"(?:\\.[0-9]{{1,{FRACTION_DIGITS}}})?"
               + f"(?:[eE][+\\-]?[0-9]{{1,{EXPONENT_DIGITS}}})?")


@functools.lru_cache(maxsize=None)
def any_value(depth: int) -> str:
    """Any JSON value whose objects and arrays nest at most `depth` deep (0: scalars only).

    Each level holds the level below four times (an object's first and later values,
    an array's first and later items), so the regex grows about 4x per level; the
    minimal DFA grows 2x (it must remember which bracket each level opened).
    """
    scalar = f"{JSON_STRING}|{JSON_NUMBER}|true|false|null"
    if depth == 0:
        return f"(?:{scalar})"
    inner = any_value(depth - 1)
    return f"(?:{scalar}|\\{{{_list(f'{JSON_STRING}: {inner}', 0, None)}\\}}|\\[{_list(inner, 0, None)}\\])"


# ---- integers and numbers in a range ------------------------------------------------
# [0, 255] is 0-9 | 10-99 | 100-199 | 200-249 | 250-255: split the range where the digit count
# changes, then where a leading digit changes, until each piece is a prefix and free digits.

def _same_length(lo: str, hi: str) -> list[str]:
    """Regexes whose union is the digit strings lo..hi, both of one length."""
    if lo == hi:
        return [lo]
    width = len(lo) - 1
    first, last = int(lo[0]), int(hi[0])
    if lo[1:] == "0" * width and hi[1:] == "9" * width:
        head = lo[0] if first == last else f"[{first}-{last}]"
        return [head + _repeat("[0-9]", width, width)]
    if first == last:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    parts = _same_length(lo, lo[0] + "9" * width)
    if first + 1 <= last - 1:
        parts += _same_length(f"{first + 1}" + "0" * width, f"{last - 1}" + "9" * width)
    return parts + _same_length(hi[0] + "0" * width, hi)


def _uint_range(lo: int, hi: int) -> str:
    """The decimal integers lo..hi (0 <= lo <= hi), without leading zeros, as an alternation."""
    parts, full = [], []  # full: the digit counts every number of which is in range
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        first, last = max(lo, 10 ** (digits - 1) if digits > 1 else 0), min(hi, 10 ** digits - 1)
        if digits > 1 and first == 10 ** (digits - 1) and last == 10 ** digits - 1:
            full.append(digits)  # only the shortest and longest counts can be partial: these run on
        else:
            parts += _same_length(str(first), str(last))
    if full:
        parts.append("[1-9]" + _repeat("[0-9]", full[0] - 1, full[-1] - 1))
    return "|".join(parts)


def _integer_range(lo: int, hi: int) -> str | None:
    """Integers lo..hi, both within +-_LARGEST. A negative one is "-" and its size, so never "-0"."""
    if lo > hi:
        return None
    if (lo, hi) == (-_LARGEST, _LARGEST):
        return JSON_INTEGER
    parts = [_uint_range(max(lo, 0), hi)] if hi >= 0 else []
    if lo < 0:
        parts.append(f"-(?:{_uint_range(max(-hi, 1), -lo)})")
    return "(?:" + "|".join(parts) + ")"


def _fraction(digits: int) -> str:
    return f"(?:\\.[0-9]{{1,{digits}}})?"


def _safe_digits(whole: int) -> int:
    # A decimal of at most 15 significant digits parses to a float closer to it than to any
    # other decimal that short: whole.fff then never rounds onto a neighbouring bound.
    return max(1, 15 - len(str(whole)))


def _decimal_range(lo: int, lo_open: bool, hi: int, hi_open: bool) -> str | None:
    """Decimals I or I.F (no exponent) from lo to hi, 0 <= lo <= hi whole numbers; an open end excluded."""
    parts = []
    first, last = (lo + 1 if lo_open else lo), hi - 1  # whole parts whose every fraction lies inside
    if first <= last:
        if hi_open:  # last.999... must not round up onto hi: its fraction stays short
            if first <= last - 1:
                parts.append(f"(?:{_uint_range(first, last - 1)}){_fraction(FRACTION_DIGITS)}")
            parts.append(f"{last}{_fraction(_safe_digits(last))}")
        else:
            parts.append(f"(?:{_uint_range(first, last)}){_fraction(FRACTION_DIGITS)}")
    if lo_open and lo < hi:  # lo itself with a fraction that is not zero (its last digit is not 0)
        parts.append(f"{lo}\\.[0-9]{{0,{_safe_digits(lo) - 1}}}[1-9]")
    if not hi_open and (lo < hi or not lo_open):
        parts.append(f"{hi}(?:\\.0{{1,{FRACTION_DIGITS}}})?")
    return "|".join(parts) or None


def _number_range(lo: int, lo_open: bool, hi: int, hi_open: bool) -> str | None:
    """Numbers from lo to hi (whole numbers, each end open or closed), as sign and size."""
    parts = []
    if hi > 0 or (hi == 0 and not hi_open):
        parts.append(_decimal_range(max(lo, 0), lo_open and lo >= 0, hi, hi_open))
    if lo < 0:  # "-" and a size above 0 (so never "-0", whose value the other side writes)
        size_lo, size_lo_open = (-hi, hi_open) if hi < 0 else (0, True)
        size = _decimal_range(size_lo, size_lo_open, -lo, lo_open)
        parts.append(None if size is None else f"-(?:{size})")
    parts = [p for p in parts if p is not None]
    return "(?:" + "|".join(parts) + ")" if parts else None


# ---- formats ------------------------------------------------------------------------
# Each a subset of what the format allows, chosen so that every text drawn passes jsonschema's
# format checker: no year before 1000, no 29 February, no leap second.
_DAY = r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)" \
       r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
_DATE = rf"[1-9][0-9]{{3}}-{_DAY}"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?"  # unbounded: a loop is one DFA state, {0,61} is 61
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12)),
    "email": rf"[A-Za-z0-9](?:[A-Za-z0-9._%+\-]*[A-Za-z0-9])?@(?:{_LABEL}\.)+[A-Za-z]{{2,24}}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
}


# ---- a string's pattern -------------------------------------------------------------
# A pattern constrains the string's *value*, but the model writes its JSON text, where " is \"
# and a newline is \n. So the pattern is parsed, and each character it allows is written as
# JSON writes it. jsonschema searches with Python's Unicode rules, so \d here is [0-9], a
# subset of its Unicode meaning; \D \W \S are the ASCII characters outside them, which are
# outside in both meanings.
_ASCII_SETS = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
               "s": [(0x09, 0x0D), (0x20, 0x20)]}
_UNICODE_SPACE_IN_ASCII = [(0x09, 0x0D), (0x1C, 0x20)]
_ESCAPED_IN_JSON = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # controls, " and \
_SURROGATES = [(0xD800, 0xDFFF)]  # no UTF-8 form: never in a set, and never named in a class


def _normalise(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges, top: int = 0x10FFFF):
    out, start = [], 0
    for lo, hi in _normalise(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    return out + ([(start, top)] if start <= top else [])


def _intersect(a, b):
    return [(max(x, y), min(u, v)) for x, u in a for y, v in b if max(x, y) <= min(u, v)]


def _class(ranges) -> str:
    """A class of the ranges, negated when that is shorter to write (a set from [^...] or `.`)."""
    def char(cp):
        ch = chr(cp)
        if ch in "\\]^-[":
            return "\\" + ch
        return ch if 0x20 < cp < 0x7F or cp > 0xFFFF else f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}"
    negate = ranges[-1][1] == 0x10FFFF
    written = _intersect(_complement(ranges), _complement(_SURROGATES)) if negate else ranges
    body = "".join(char(lo) if lo == hi else f"{char(lo)}-{char(hi)}" for lo, hi in written)
    return f"[^{body}]" if negate else f"[{body}]"


def _set_regex(ranges) -> str | None:
    """One character of the set, as a JSON string's text: raw where JSON allows it, escaped where not."""
    ranges = _intersect(_normalise(ranges), _complement(_SURROGATES))
    plain = _intersect(ranges, _complement(_ESCAPED_IN_JSON))
    parts = [_class(plain)] if plain else []
    escaped = _intersect(ranges, _ESCAPED_IN_JSON)
    if _intersect(ranges, [(0x00, 0x1F)]) == [(0x00, 0x1F)]:  # all 32 controls (from [^...] or .): two atoms
        parts += [r"\\u00[01][0-9a-fA-F]", r"\\[bfnrt]"]
        escaped = _intersect(escaped, [(0x20, 0x7F)])  # leaving " and \
    # Each other one as json.dumps writes it: \" \\ \n \u0001.
    parts += [literal(json.dumps(chr(cp))[1:-1]) for lo, hi in escaped for cp in range(lo, hi + 1)]
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1] > 0x7F:  # one character outside ASCII: raw or \u
        parts.append(literal(json.dumps(chr(ranges[0][0]))[1:-1]))
    return _either(parts)


def _escape_atom(pattern: str, pos: int, path: str, negated_class: bool):
    """The escape at pattern[pos] ("\\"): (a code point or a list of ranges, the position after it)."""
    ch = pattern[pos + 1]
    if ch in "dwsDWS" and negated_class:  # [^\d] holds Arabic digits in ASCII rules, not in Unicode's
        raise UnsupportedSchema(path, f"{pattern!r}: \\{ch} inside [^...] means different things under "
                                      f"ASCII and Unicode rules; list the characters instead")
    if ch in "dws":
        return _ASCII_SETS[ch], pos + 2
    if ch in "DWS":
        inside = _UNICODE_SPACE_IN_ASCII if ch == "S" else _ASCII_SETS[ch.lower()]
        return _complement(inside, top=0x7F), pos + 2
    simple = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
    if ch in simple:
        return ord(simple[ch]), pos + 2
    if ch in "xu":
        width = 2 if ch == "x" else 4
        return int(pattern[pos + 2:pos + 2 + width], 16), pos + 2 + width
    if not ch.isalnum():
        return ord(ch), pos + 2
    raise UnsupportedSchema(path, f"{pattern!r} uses \\{ch} at {pos}, which is outside the regex dialect "
                                  f"(no anchors inside, backreferences or \\b)")


def _parse_class(pattern: str, pos: int, path: str):
    """The class starting at pattern[pos] ("["): (its ranges, the position after "]")."""
    pos += 1
    negate = pattern.startswith("^", pos)
    pos += negate
    ranges, first = [], True
    while first or pattern[pos] != "]":  # a "]" first is a literal, as in Python
        first = False
        if pattern[pos] == "\\":
            item, pos = _escape_atom(pattern, pos, path, negated_class=negate)
        else:
            item, pos = ord(pattern[pos]), pos + 1
        if isinstance(item, int) and pattern[pos] == "-" and pattern[pos + 1] != "]":
            if pattern[pos + 1] == "\\":
                end, pos = _escape_atom(pattern, pos + 1, path, negated_class=negate)
            else:
                end, pos = ord(pattern[pos + 1]), pos + 2
            ranges.append((item, end))
        else:
            ranges += [(item, item)] if isinstance(item, int) else item
    return (_complement(ranges) if negate else _normalise(ranges)), pos + 1


def _pattern_regex(pattern, path: str) -> str:
    """The JSON string text (between the quotes) of the values `pattern` finds, as jsonschema's
    re.search does: a pattern without ^ may start anywhere, without $ end anywhere."""
    if not isinstance(pattern, str):
        raise UnsupportedSchema(path, f"pattern={pattern!r}; it must be a string")
    try:
        re.compile(pattern)
    except re.error as e:
        raise UnsupportedSchema(path, f"pattern={pattern!r} is not a regex: {e}") from None
    out, depth, top_alternation, anchored_end = [], 0, False, False
    anchored_start = pattern.startswith("^")
    pos = int(anchored_start)
    while pos < len(pattern):
        ch = pattern[pos]
        if ch in "\\[.":
            if ch == "\\":
                item, pos = _escape_atom(pattern, pos, path, negated_class=False)
            elif ch == "[":
                item, pos = _parse_class(pattern, pos, path)
            else:
                item, pos = _complement([(0x0A, 0x0A)]), pos + 1
            one = _set_regex([(item, item)] if isinstance(item, int) else item)
            if one is None:
                raise UnsupportedSchema(path, f"{pattern!r} has a set at {pos} of surrogates only, which UTF-8 "
                                              f"cannot write")
            out.append(one)
        elif ch == "(":
            if pattern.startswith("(?", pos) and not pattern.startswith("(?:", pos):
                raise UnsupportedSchema(path, f"{pattern!r} has (? at {pos}: lookaround, named groups and "
                                              f"flags are outside the regex dialect; (...) and (?:...) are in")
            pos += 3 if pattern.startswith("(?:", pos) else 1
            out.append("(?:")
            depth += 1
        elif ch == ")" or ch == "|":
            depth -= ch == ")"
            top_alternation |= ch == "|" and depth == 0
            out.append(ch)
            pos += 1
        elif ch in "*+?{":
            count = re.compile(r"\{(\d*)(,?)(\d*)\}").match(pattern, pos)
            count = count if count and (count[1] or count[2]) else None  # Python reads {} as text
            if ch == "{" and count is None:
                raise UnsupportedSchema(path, f"{pattern!r} has a {{ at {pos} that is not a count; write \\{{")
            if count is None:
                out.append(ch)
                pos += 1
            else:
                lo = int(count[1] or 0)
                hi = None if count[2] and not count[3] else int(count[3] or count[1] or 0)
                if max(lo, hi or 0) > MAX_COUNT:
                    raise UnsupportedSchema(path, f"{pattern!r} counts to {max(lo, hi or 0)}; at most "
                                                  f"{MAX_COUNT} (each count is that many automaton states)")
                out.append("{0}" if hi == 0 else _repeat("", lo, hi))
                pos = count.end()
            if pos < len(pattern) and pattern[pos] in "?+":
                raise UnsupportedSchema(path, f"{pattern!r} has a lazy or possessive quantifier at {pos}: "
                                              f"a whole-string match has no use for them; drop the {pattern[pos]}")
        elif ch == "$" and pos == len(pattern) - 1 and depth == 0:
            anchored_end, pos = True, pos + 1
        elif ch in "^$":
            raise UnsupportedSchema(path, f"{pattern!r} has {ch} at {pos}; only a leading ^ and a trailing "
                                          f"$ are honoured")
        else:
            out.append(_set_regex([(ord(ch), ord(ch))]))  # a surrogate here is a re.error already
            pos += 1
    if top_alternation and (anchored_start or anchored_end):
        raise UnsupportedSchema(path, f"{pattern!r}: an anchor there binds to one branch only; write "
                                      f"^(?:a|b)$ to anchor them all")
    body = "".join(out)
    return ("" if anchored_start else JSON_CHAR + "*") + (f"(?:{body})" if body else "") \
        + ("" if anchored_end else JSON_CHAR + "*")


# ---- the compiler -------------------------------------------------------------------

def _key(name: str) -> str:
    """A property name as a part of a JSON path: .name, or ["odd name"]."""
    return f".{name}" if re.fullmatch(r"[$\w-]+", name) else f"[{json.dumps(name)}]"


def _count(schema: dict, keyword: str, path: str, default):
    value = schema.get(keyword, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise UnsupportedSchema(f"{path}.{keyword}", f"{keyword}={value!r}; it must be a whole number >= 0")
    if value > MAX_COUNT:
        raise UnsupportedSchema(f"{path}.{keyword}", f"{keyword}={value!r}; at most {MAX_COUNT} is honoured "
                                                     f"(each counted repeat is that many automaton states)")
    return int(value)


def _bound(schema: dict, keyword: str, path: str):
    value = schema.get(keyword)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UnsupportedSchema(f"{path}.{keyword}", f"{keyword}={value!r}; it must be a finite number "
                                                     f"(the boolean form is draft 4's)")
    return value


class _Compiler:
    """One schema's compilation; it holds the root, where every $ref points."""

    def __init__(self, root):
        self.root = root

    def value(self, schema, path: str, depth: int, refs: frozenset = frozenset()) -> str | None:
        """The regex of the texts valid under `schema`, with containers nested at most `depth` deep.

        refs: the $refs followed since the last object or array. Following one of them
        again would go round a loop that never nests, so never ends.
        """
        if schema is True or schema == {}:
            return any_value(min(depth, ANY_VALUE_DEPTH))
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise UnsupportedSchema(path, f"a schema is an object or a boolean, not {schema!r}")
        self.check_keywords(schema, path)
        if "$ref" in schema:
            return self.ref(schema, path, depth, refs)
        if "allOf" in schema:
            return self.value(self.merge_all(schema, path), path, depth, refs)
        if "anyOf" in schema:
            branches = schema["anyOf"]
            if not isinstance(branches, list) or not branches:
                raise UnsupportedSchema(f"{path}.anyOf", f"anyOf={branches!r}; it must be a non-empty list")
            siblings = {k: v for k, v in schema.items() if k != "anyOf" and k not in ANNOTATIONS | DEFINITIONS}
            # S and (A or B) is (S and A) or (S and B): the siblings go into each branch.
            return _either(self.value(self.merge([(siblings, path), (b, f"{path}.anyOf[{i}]")]) if siblings else b,
                                      f"{path}.anyOf[{i}]", depth, refs) for i, b in enumerate(branches))
        if "enum" in schema or "const" in schema:
            return self.literals(schema, path)
        if "type" in schema:
            kinds = _kinds(schema, path)
        else:  # no type: the kinds its keywords speak of (a subset of what is valid), else anything
            kinds = [kind for kind, words in KIND_KEYWORDS.items() if words & schema.keys()]
            if not kinds:
                return any_value(min(depth, ANY_VALUE_DEPTH))
        return _either(self.typed(kind, schema, path, depth) for kind in kinds)

    def check_keywords(self, schema: dict, path: str) -> None:
        for key in schema:
            if key not in SUPPORTED_KEYWORDS:
                why = WHY_REFUSED.get(key, "this compiler does not honour it")
                raise UnsupportedSchema(f"{path}.{key}", f"{key!r} is not supported: {why}. Supported: "
                                                         f"{', '.join(sorted(SUPPORTED_KEYWORDS - ANNOTATIONS))}")

    def typed(self, kind: str, schema: dict, path: str, depth: int) -> str | None:
        if kind == "object":
            return self.object(schema, path, depth)
        if kind == "array":
            return self.array(schema, path, depth)
        if kind == "string":
            return self.string(schema, path)
        if kind in ("integer", "number"):
            return self.number(schema, path, whole=kind == "integer")
        return "(?:true|false)" if kind == "boolean" else "null"

    # -- references and combinations --

    def ref(self, schema: dict, path: str, depth: int, refs: frozenset) -> str | None:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchema(f"{path}.$ref", f"$ref={ref!r}; only references inside this schema "
                                                    f"(#, #/$defs/name, #/definitions/name) are followed")
        if ref in refs:
            raise UnsupportedSchema(f"{path}.$ref", f"$ref={ref!r} comes back to itself with no object or "
                                                    f"array between, so its text would never end")
        target, target_path = self.root, "$"
        for token in ref[1:].split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target, target_path = target[token], target_path + _key(token)
            else:
                raise UnsupportedSchema(f"{path}.$ref", f"$ref={ref!r} points at nothing in this schema")
        siblings = {k: v for k, v in schema.items() if k != "$ref" and k not in ANNOTATIONS | DEFINITIONS}
        if siblings:
            return self.value(self.merge([(siblings, path), (target, target_path)]), path, depth, refs | {ref})
        return self.value(target, target_path, depth, refs | {ref})

    def merge_all(self, schema: dict, path: str):
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise UnsupportedSchema(f"{path}.allOf", f"allOf={parts!r}; it must be a non-empty list")
        rest = {k: v for k, v in schema.items() if k != "allOf"}
        return self.merge([(rest, path)] + [(p, f"{path}.allOf[{i}]") for i, p in enumerate(parts)])

    def merge(self, parts: list[tuple[object, str]]):
        """One schema meaning all of `parts` at once, when that is their keywords side by side.

        It is, when no keyword is set twice to different values, and when keywords that
        read each other (additionalProperties reads properties; items reads prefixItems)
        come from one part. Anything else is refused, never approximated.
        """
        merged, origin = {}, {}
        for schema, where in parts:
            if schema is True:
                continue
            if schema is False:
                return False
            if not isinstance(schema, dict):
                raise UnsupportedSchema(where, f"a schema is an object or a boolean, not {schema!r}")
            self.check_keywords(schema, where)
            for key, val in schema.items():
                if key in ANNOTATIONS or key in DEFINITIONS:
                    continue
                if key in merged and merged[key] != val:
                    raise UnsupportedSchema(f"{where}.{key}", f"{key!r} is also set, differently, at "
                                                              f"{origin[key]}; only schemas whose keywords "
                                                              f"differ are combined")
                merged[key], origin[key] = val, where
        for group in (("properties", "additionalProperties"), ("prefixItems", "items")):
            places = {origin[key] for key in group if key in merged}
            if len(places) > 1:
                raise UnsupportedSchema(f"{origin[group[1]]}.{group[1]}", f"{group[1]!r} reads {group[0]!r}, "
                                        f"which is set at {origin[group[0]]}; they are combined only side by side")
        return merged

    def literals(self, schema: dict, path: str) -> str | None:
        others = sorted(set(schema) - ANNOTATIONS - DEFINITIONS - {"enum", "const", "type"})
        if others or ("enum" in schema and "const" in schema):
            word = others[0] if others else "const"
            raise UnsupportedSchema(f"{path}.{word}", f"{word!r} beside enum/const is not intersected with "
                                                      f"the values; list only values that satisfy it")
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise UnsupportedSchema(f"{path}.enum", f"enum={values!r}; it must be a non-empty list")
        kinds = _kinds(schema, path) if "type" in schema else TYPES
        texts = []
        for value in values:
            if any(_is_type(value, kind) for kind in kinds):
                try:
                    texts.append(json_literal(value))  # json.dumps's separators are the layout's
                except ValueError:
                    raise UnsupportedSchema(f"{path}.enum", f"{value!r} is not a JSON value") from None
        return _either(texts)

    # -- one kind of value --

    def string(self, schema: dict, path: str) -> str | None:
        given = sorted(KIND_KEYWORDS["string"] & schema.keys())
        if len(given) > 1 and ("format" in given or "pattern" in given):
            # A format or a pattern beside a length is the intersection of two automata: not built here.
            raise UnsupportedSchema(f"{path}.{given[1]}", f"{given[1]!r} beside {given[0]!r} is not honoured; "
                                                          f"put the length into the pattern")
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise UnsupportedSchema(f"{path}.format", f"format={schema['format']!r} is not supported; "
                                                          f"supported: {', '.join(FORMATS)}")
            return f'"{FORMATS[schema["format"]]}"'
        if "pattern" in schema:
            return f'"{_pattern_regex(schema["pattern"], f"{path}.pattern")}"'
        lo, hi = _count(schema, "minLength", path, 0), _count(schema, "maxLength", path, None)
        if hi is not None and hi < lo:
            return None
        return f'"{_repeat(JSON_CHAR, lo, hi)}"'  # minLength counts characters: an escape is one

    def number(self, schema: dict, path: str, whole: bool) -> str | None:
        bounds = {k: _bound(schema, k, path) for k in KIND_KEYWORDS["number"]}
        # The tighter of each pair: (value, open?, keyword) for the lower and the upper end.
        lower = max([(bounds["minimum"], False, "minimum"), (bounds["exclusiveMinimum"], True,
                     "exclusiveMinimum")], key=lambda b: (-math.inf if b[0] is None else b[0], b[1]))
        upper = min([(bounds["maximum"], False, "maximum"), (bounds["exclusiveMaximum"], True,
                     "exclusiveMaximum")], key=lambda b: (math.inf if b[0] is None else b[0], not b[1]))
        if whole:  # an integer range is exact for any bound: round it inward
            lo = -_LARGEST if lower[0] is None else math.floor(lower[0]) + 1 if lower[1] else math.ceil(lower[0])
            hi = _LARGEST if upper[0] is None else math.ceil(upper[0]) - 1 if upper[1] else math.floor(upper[0])
            return _integer_range(max(lo, -_LARGEST), min(hi, _LARGEST))
        if lower[0] is None and upper[0] is None:
            return JSON_NUMBER
        for value, _, keyword in (lower, upper):
            if value is not None and (value != int(value) or abs(value) >= _EXACT_BOUND):
                raise UnsupportedSchema(f"{path}.{keyword}", f"{keyword}={value!r}; a number's bounds are "
                                        f"honoured when whole and below {_EXACT_BOUND:.0e} in size")
        lo, lo_open = (-_LARGEST, False) if lower[0] is None else (int(lower[0]), lower[1])
        hi, hi_open = (_LARGEST, False) if upper[0] is None else (int(upper[0]), upper[1])
        return None if lo > hi else _number_range(lo, lo_open, hi, hi_open)

    def object(self, schema: dict, path: str, depth: int) -> str | None:
        if depth == 0:
            return None
        properties, required = schema.get("properties"), schema.get("required", [])
        additional = schema.get("additionalProperties", True)
        lo, hi = _count(schema, "minProperties", path, 0), _count(schema, "maxProperties", path, None)
        if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
            raise UnsupportedSchema(f"{path}.required", f"required={required!r}; it must be a list of names")
        if properties is None and not required:
            # No properties named: a map, any string keys. Keys may repeat (the automaton cannot
            # remember them all), so minProperties above 1 could be met by text that parses to fewer.
            if lo > 1:
                raise UnsupportedSchema(f"{path}.minProperties", f"minProperties={lo} needs distinct keys, "
                                                                 f"which a regex cannot promise; at most 1")
            value = self.value(additional, f"{path}.additionalProperties", depth - 1)
            if value is None:
                return None if lo > 0 else r"\{\}"
            return r"\{" + _list(f"{JSON_STRING}: {value}", lo, hi) + r"\}"
        properties = properties or {}
        if not isinstance(properties, dict):
            raise UnsupportedSchema(f"{path}.properties", f"properties={properties!r}; it must be an object")
        missing = [name for name in required if name not in properties]
        if missing:
            raise UnsupportedSchema(f"{path}.required", f"requires {missing[0]!r}, which properties does not "
                                                        f"define; define it there")
        if lo > len(set(required)) or (hi is not None and hi < len(properties)):
            word = "minProperties" if lo > len(set(required)) else "maxProperties"
            raise UnsupportedSchema(f"{path}.{word}", f"{word} is honoured only when required "
                                                      f"({len(set(required))}) or properties "
                                                      f"({len(properties)}) already settle it")
        # Only the named properties are written, whatever additionalProperties allows: leaving
        # the others out is valid under any additionalProperties.
        members = []
        for name, sub in properties.items():
            value = self.value(sub, f"{path}.properties{_key(name)}", depth - 1)
            if value is None and name in required:
                return None  # a required property that has no text: no object either
            if value is not None:
                members.append((f"{json_literal(name)}: {value}", name in required))
        return r"\{" + _members(members) + r"\}"

    def array(self, schema: dict, path: str, depth: int) -> str | None:
        if depth == 0:
            return None
        lo, hi = _count(schema, "minItems", path, 0), _count(schema, "maxItems", path, None)
        if schema.get("uniqueItems") is True and (hi is None or hi > 1):
            raise UnsupportedSchema(f"{path}.uniqueItems", "uniqueItems needs the automaton to remember every "
                                                           "item so far; it is honoured only with maxItems <= 1")
        prefix, items = schema.get("prefixItems", []), schema.get("items", True)
        if isinstance(items, list):
            raise UnsupportedSchema(f"{path}.items", "items as a list is draft 4's tuple form; use prefixItems")
        if not isinstance(prefix, list):
            raise UnsupportedSchema(f"{path}.prefixItems", f"prefixItems={prefix!r}; it must be a list")
        item = self.value(items, f"{path}.items", depth - 1)
        prefix = [self.value(p, f"{path}.prefixItems[{i}]", depth - 1) for i, p in enumerate(prefix)]
        if hi is not None:
            prefix = prefix[:hi]
        # Positions past the prefix take `item`: at least lo - k of them, at most hi - k.
        tail = "" if item is None else _repeat(f"(?:, {item})", max(lo - len(prefix), 0),
                                               None if hi is None else hi - len(prefix))
        if not prefix:
            return None if item is None and lo > 0 else r"\[" + ("" if item is None else _list(item, lo, hi)) + r"\]"
        if item is None and lo > len(prefix):
            return None
        # From the last prefix position back: each holds its own, then (optionally, past minItems) the rest.
        seq = None
        for i in range(len(prefix) - 1, -1, -1):
            if prefix[i] is None:
                if i < lo:
                    return None
                seq = None
                continue
            rest = tail if i == len(prefix) - 1 else "" if seq is None else \
                f", {seq}" if i + 1 < lo else f"(?:, {seq})?"
            seq = prefix[i] + rest
        return r"\[" + ("" if seq is None else seq if lo > 0 else f"(?:{seq})?") + r"\]"


def _members(members: list[tuple[str, bool]]) -> str:
    """An object's members in order, each optional one present or not, the commas always right.

    Listing every subset would be 2^n alternatives; instead, with S(k) "a non-empty choice
    among the first k optional members", S(k) = S(k-1)(, P_k)? | P_k names each member
    once. Once a required member is written, each later member is just (, P)? or , P.
    """
    first_required = next((i for i, (_, req) in enumerate(members) if req), len(members))
    chain = None
    for regex, _ in members[:first_required]:
        chain = regex if chain is None else f"(?:{chain}(?:, {regex})?|{regex})"
    if first_required == len(members):
        return "" if chain is None else f"(?:{chain})?"
    out = ("" if chain is None else f"(?:{chain}, )?") + members[first_required][0]
    return out + "".join(f", {regex}" if req else f"(?:, {regex})?" for regex, req in members[first_required + 1:])


def _is_type(value, kind: str) -> bool:
    """Whether a JSON value (as json.loads gives it) is of the schema type `kind`."""
    if isinstance(value, bool):  # True is an int to Python, never a number to JSON Schema
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float))
    return isinstance(value, {"object": dict, "array": list, "string": str, "null": type(None),
                              "boolean": bool}[kind])


def _kinds(schema: dict, path: str) -> list[str]:
    """The schema's `type`, as a list of names, each checked."""
    kinds = schema["type"]
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not kinds or not all(kind in TYPES for kind in kinds):
        raise UnsupportedSchema(f"{path}.type", f"type={schema['type']!r}; it must be one of {', '.join(TYPES)} "
                                                f"or a non-empty list of them")
    return kinds


def _check_depth(max_depth) -> None:
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth={max_depth!r}; it must be an integer >= 1 (how deep objects and arrays nest)")


# ---- the public functions -----------------------------------------------------------

def schema_to_regex(schema: dict | bool, *, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    r"""The regex of the texts, in json.dumps's layout, that parse to an instance valid under `schema`.

    Every text it matches is valid. Some valid texts it does not match, each by a choice
    made here to keep the automaton small:
      objects     the named properties in the schema's order, optional ones left out or
                  not; never an extra property, whatever additionalProperties allows
                  (no properties named: a map, any keys, values per additionalProperties);
      integers    at most INTEGER_DIGITS digits; minimum/maximum and the exclusive ones
                  exactly, for any bound (digit-class ranges, see _uint_range);
      numbers     at most INTEGER_DIGITS.FRACTION_DIGITS digits, an exponent of at most
                  EXPONENT_DIGITS; a bounded one has whole bounds under 1e15 and no exponent;
      strings     minLength/maxLength in characters (an escape is one), or a pattern
                  (\d \w \s their ASCII members), or a format (a subset of each);
      {}, true    any JSON nested at most ANY_VALUE_DEPTH deep (and within max_depth);
      no type     the kinds its keywords speak of (minLength: a string), else any JSON.
    Objects and arrays nest at most max_depth deep: a recursive $ref is cut there (a
    tree's last children are an empty list). Raises UnsupportedSchema, naming the keyword
    and its path, for anything not honoured, and when no text fits.

    >>> print(schema_to_regex({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    \{(?:"ok": (?:true|false))?\}
    """
    _check_depth(max_depth)
    regex = _Compiler(schema).value(schema, "$", max_depth)
    if regex is None:
        raise UnsupportedSchema("$", f"no instance of this schema has objects and arrays nested at most "
                                     f"max_depth={max_depth} deep (or the schema allows none at all)")
    if len(regex) > MAX_REGEX_CHARS:
        raise UnsupportedSchema("$", f"the regex is {len(regex):,} characters, over {MAX_REGEX_CHARS:,}; lower "
                                     f"max_depth (now {max_depth}) or the counts in the schema")
    return regex


def json_object_regex(max_depth: int = ANY_VALUE_DEPTH + 1) -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"}), to a bounded depth.

    No finite automaton accepts all of JSON: it would have to count unmatched brackets
    without limit. This is every object whose objects and arrays nest at most max_depth
    deep (the outer object is depth 1), in the fixed layout. A pushdown automaton, a
    grammar with a stack as xgrammar runs, has no such limit. The default is smaller than
    schema_to_regex's: any JSON grows 4x in regex text per level (any_value), where a
    schema's properties do not.
    """
    _check_depth(max_depth)
    return r"\{" + _list(f"{JSON_STRING}: {any_value(max_depth - 1)}", 0, None) + r"\}"


def choice_regex(choices: list[str]) -> str:
    """Exactly one of the strings, as written (vLLM's guided_choice): no quotes, no JSON."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"choices={choices!r}; it must be a non-empty list of strings")
    nonempty = [literal(c) for c in dict.fromkeys(choices) if c]
    if not nonempty:
        raise ValueError("choices=['']: the only choice is the empty text, so there is nothing to generate")
    # An empty choice makes the whole alternation optional (the dialect has no empty branch).
    return "(?:" + "|".join(nonempty) + (")?" if "" in choices else ")")


if __name__ == "__main__":
    person = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"}}, "required": ["name"]}
    regex = schema_to_regex(person)
    print(f"{json.dumps(person)}\n-> {len(regex)} characters:\n{regex}\n")
    for text in ['{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 200}', '{"age": 36}', '{"name":"Ada"}']:
        print(f"{text:32} {'matches' if re.fullmatch(regex, text, re.ASCII) else 'does not match'}")
    print("\njson_object_regex by depth:", {d: len(json_object_regex(d)) for d in range(1, 5)}, "characters")
