"""Chapter 12 (given): a regular expression -> a DFA over UTF-8 bytes.

In this file you will learn how a pattern becomes a table a decoder can step
through one byte at a time:
- parse the pattern into a small tree (a recursive-descent parser, one method
  per level of precedence: alternation, concatenation, repetition, atom);
- build an NFA over *bytes*, not characters (Thompson's construction). A
  language model's tokens are byte strings, and a byte-level BPE token may end
  in the middle of a character, so the automaton must be able to stop there
  too. A character range becomes the handful of UTF-8 byte-sequence ranges
  that spell it (`utf8_sequences`);
- turn the NFA into a DFA by subset construction, over *byte classes* (bytes
  the pattern never tells apart share a column, so a pattern about ASCII
  letters has a dozen columns, not 256);
- trim every state from which no accepting state can be reached, so a state
  that is alive always has a way to finish (the token mask relies on this:
  "did not die" then means "can still match");
- minimise with Moore's partition refinement (a few numpy passes), so two
  patterns for the same language give DFAs of the same size.

The dialect is a subset of Python's `re`, with the meaning of
`re.fullmatch(pattern, text, re.ASCII)`: literals, escapes (\\n \\t \\r \\f \\v
\\xHH \\uXXXX \\UXXXXXXXX, an escaped punctuation character), \\d \\w \\s and
\\D \\W \\S (ASCII meanings), `.` (anything but a newline), classes [a-z] [^...],
groups (...) (?:...), `|`, and the quantifiers * + ? {m} {m,} {m,n}. Anything
else (anchors, lazy or possessive quantifiers, backreferences, lookaround,
named groups, flags) is refused with a ValueError that names it and its
position. Surrogates (U+D800..U+DFFF) have no UTF-8 form: a range or a negated
class never covers them, and a pattern that names one is refused.

This file is given; the lesson is minicb/structured/token_mask.py, which walks
this DFA with the vocabulary's tokens. Chapter text:
chapters/12-structured-output/README.md. Try it:

    .venv/bin/python -c "from minicb.structured.regex import compile_regex; \\
        d = compile_regex('[0-9]+(\\\\.[0-9]+)?'); print(d.num_states, d.matches(b'3.14'))"
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

MAX_DFA_STATES = 20_000  # a pattern past this is refused rather than eat the memory of a server
MAX_NFA_STATES = 200_000  # counted repeats of counted repeats grow the NFA first: refuse them early
MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)

# ---- the tree ------------------------------------------------------------------------
# A pattern parses into three kinds of node, plus CharSet for everything that reads one
# character. Concat(()) is the empty string.


@dataclass(frozen=True)
class CharSet:
    ranges: tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges


@dataclass(frozen=True)
class Concat:
    parts: tuple


@dataclass(frozen=True)
class Alternate:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    body: object
    min: int
    max: int | None  # None: no upper bound


def normalise(ranges) -> tuple[tuple[int, int], ...]:
    """Sort and merge code point ranges, and cut the surrogates out of them."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out = []
    for lo, hi in merged:
        if lo < SURROGATES[0] <= hi or lo <= SURROGATES[1] < hi or SURROGATES[0] <= lo <= hi <= SURROGATES[1]:
            out += [(a, b) for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)) if a <= b]
        else:
            out.append((lo, hi))
    return tuple(out)


def complement(ranges) -> tuple[tuple[int, int], ...]:
    """Every Unicode scalar value outside `ranges` (which must be normalised)."""
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return normalise(out)


DIGIT = ((ord("0"), ord("9")),)
WORD = normalise([(ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z"))])
SPACE = normalise([(ord(c), ord(c)) for c in " \t\n\r\f\v"])
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE, "D": complement(DIGIT), "W": complement(WORD),
                 "S": complement(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
ANY_BUT_NEWLINE = complement(((10, 10),))
# Characters that mean something outside a class; escape() puts a backslash before each.
METACHARACTERS = set("\\.*+?()[]{}|^$")
COUNTED_REPEAT = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")  # the lexer's one use of re


def escape(text: str) -> str:
    """A pattern that matches exactly `text` in this dialect (the "choice" grammars use it)."""
    return "".join("\\" + ch if ch in METACHARACTERS else ch for ch in text)


# ---- the parser ------------------------------------------------------------------------


class _Parser:
    """Recursive descent over the grammar
         alternation := concat ('|' concat)*
         concat      := repeat*
         repeat      := atom quantifier?
         atom        := literal | escape | '.' | class | '(' alternation ')'
    """

    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def refuse(self, construct: str, pos: int, hint: str = "") -> ValueError:
        return ValueError(f"{construct} at position {pos} of the pattern {self.pattern!r} is not supported"
                          f"{'; ' + hint if hint else ''} (minicb's dialect: literals, escapes, . \\d \\w \\s, "
                          f"[classes], (groups), (?:groups), |, and the quantifiers * + ? {{m}} {{m,}} {{m,n}})")

    def peek(self, ahead: int = 0) -> str | None:
        i = self.pos + ahead
        return self.pattern[i] if i < len(self.pattern) else None

    def parse(self):
        tree = self.alternation()
        if self.pos < len(self.pattern):  # only a ')' stops alternation() early
            raise self.refuse("an unmatched ')'", self.pos)
        return tree

    def alternation(self):
        options = [self.concat()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    def concat(self):
        parts = []
        while self.peek() is not None and self.peek() not in "|)":
            parts.append(self.repeat())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def repeat(self):
        start = self.pos
        if self.peek() in ("*", "+", "?") or self.quantifier_at(self.pos):
            raise self.refuse(f"a quantifier {self.peek()!r} with nothing to repeat", start)
        node = self.atom()
        quantifier_pos = self.pos
        bounds = self.quantifier()
        if bounds is None:
            return node
        if self.peek() == "?":
            raise self.refuse("a lazy quantifier", self.pos, "drop the '?': a DFA has no preference")
        if self.peek() == "+":
            raise self.refuse("a possessive quantifier", self.pos)
        if self.peek() == "*" or self.quantifier_at(self.pos):
            raise self.refuse("a quantifier after a quantifier", self.pos, "group the first: (?:a{2})*")
        low, high = bounds
        if high is not None and low > high:
            raise ValueError(f"the repeat {self.pattern[quantifier_pos:self.pos]!r} at position {quantifier_pos} of "
                             f"{self.pattern!r} has min {low} > max {high}; it must be {{m,n}} with m <= n")
        return Repeat(node, low, high)

    def quantifier_at(self, pos: int) -> re.Match | None:
        """The counted repeat {m}, {m,}, {m,n} (or the refused {,n}) that starts at `pos`, if one does."""
        found = COUNTED_REPEAT.match(self.pattern, pos)
        return found if found and (found.group(1) or found.group(3)) else None

    def quantifier(self) -> tuple[int, int | None] | None:
        ch = self.peek()
        if ch in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if ch != "{":
            return None
        found = self.quantifier_at(self.pos)
        if found is None:
            raise self.refuse("a '{' that starts no repeat", self.pos, "write \\{ for a literal brace")
        low, comma, high = found.groups()
        if not low:
            raise self.refuse(f"the repeat {found.group(0)}", self.pos, "write {0,n}")
        self.pos = found.end()
        return int(low), (int(high) if high else None) if comma else int(low)

    def atom(self):
        start, ch = self.pos, self.peek()
        self.pos += 1
        if ch == "(":
            if self.peek() == "?":
                if self.peek(1) != ":":
                    rest = self.pattern[start:start + 4]
                    kind = ("a named group" if rest.startswith(("(?P<", "(?<")) and not rest.startswith(("(?<=", "(?<!"))
                            else "a named backreference" if rest.startswith("(?P=")
                            else "a lookahead" if rest.startswith(("(?=", "(?!"))
                            else "a lookbehind" if rest.startswith(("(?<=", "(?<!"))
                            else "a comment group" if rest.startswith("(?#")
                            else "an atomic group" if rest.startswith("(?>")
                            else "an inline flag group")
                    raise self.refuse(f"{kind} {rest!r}", start, "only (...) and (?:...) groups are")
                self.pos += 2
            inner = self.alternation()
            if self.peek() != ")":
                raise ValueError(f"the group opened at position {start} of {self.pattern!r} is never closed; "
                                 f"add a ')'")
            self.pos += 1
            return inner
        if ch in ("^", "$"):
            raise self.refuse(f"the anchor {ch!r}", start, "a grammar always matches the whole text")
        if ch == "{":  # a counted repeat with nothing before it, or a brace meant literally
            raise self.refuse("a '{' that starts no repeat", start, "write \\{ for a literal brace")
        if ch == ".":
            return CharSet(ANY_BUT_NEWLINE)
        if ch == "[":
            return self.char_class(start)
        if ch == "\\":
            ranges = self.escape(start, in_class=False)
            return CharSet(ranges)
        return self.literal(ch, start)

    def literal(self, ch: str, pos: int) -> CharSet:
        if SURROGATES[0] <= ord(ch) <= SURROGATES[1]:
            raise ValueError(f"the surrogate U+{ord(ch):04X} at position {pos} of {self.pattern!r} has no UTF-8 "
                             f"bytes; a grammar can only name Unicode scalar values")
        return CharSet(((ord(ch), ord(ch)),))

    def escape(self, start: int, in_class: bool) -> tuple[tuple[int, int], ...]:
        """The ranges of the escape whose backslash is at `start` (self.pos is just past it)."""
        ch = self.peek()
        if ch is None:
            raise ValueError(f"the pattern {self.pattern!r} ends with a lone backslash; write \\\\ for one")
        self.pos += 1
        if ch in CLASS_ESCAPES:
            return CLASS_ESCAPES[ch]
        if ch in CHAR_ESCAPES:
            return ((ord(CHAR_ESCAPES[ch]),) * 2,)
        if ch in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = self.pattern[self.pos:self.pos + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise ValueError(f"the escape \\{ch} at position {start} of {self.pattern!r} needs exactly {width} "
                                 f"hex digits, got {digits!r}")
            self.pos += width
            code = int(digits, 16)
            if code > MAX_CODE_POINT:
                raise ValueError(f"\\{ch}{digits} at position {start} of {self.pattern!r} is past U+10FFFF")
            return self.literal(chr(code), start).ranges
        if ch in "0123456789":
            raise self.refuse(f"the backreference or octal escape \\{ch}", start)
        if ch in ("b", "B", "A", "Z", "z", "G"):
            raise self.refuse(f"the anchor \\{ch}", start, "(inside a class Python reads \\b as a backspace: "
                              "write \\x08)" if in_class else "a grammar always matches the whole text")
        if ch.isascii() and ch.isalpha():
            raise self.refuse(f"the escape \\{ch}", start)
        return self.literal(ch, start).ranges  # an escaped punctuation or non-ASCII character is itself

    def char_class(self, start: int) -> CharSet:
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        if self.peek() == "]":
            raise self.refuse("a ']' first in a class", self.pos, "write \\] for a literal ]")
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if self.peek() is None:
                raise ValueError(f"the class opened at position {start} of {self.pattern!r} is never closed; "
                                 f"add a ']'")
            lo_pos = self.pos
            lo = self.class_member()
            if self.peek() == "-" and self.peek(1) not in ("]", None):
                self.pos += 1
                hi_pos = self.pos
                hi = self.class_member()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise ValueError(f"the range {self.pattern[lo_pos:self.pos]!r} at position {lo_pos} of "
                                     f"{self.pattern!r} must run between two single characters")
                if lo[0][0] > hi[0][0]:
                    raise ValueError(f"the range {self.pattern[lo_pos:self.pos]!r} at position {lo_pos} of "
                                     f"{self.pattern!r} runs backwards (U+{lo[0][0]:04X} > U+{hi[0][0]:04X}, "
                                     f"from position {hi_pos})")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges += lo
        self.pos += 1
        merged = normalise(ranges)
        return CharSet(complement(merged) if negate else merged)

    def class_member(self) -> tuple[tuple[int, int], ...]:
        ch, pos = self.peek(), self.pos
        self.pos += 1
        if ch == "\\":
            return self.escape(pos, in_class=True)
        return self.literal(ch, pos).ranges


def parse(pattern: str):
    """The pattern's tree (CharSet / Concat / Alternate / Repeat), or a ValueError naming what is refused."""
    if not isinstance(pattern, str):
        raise ValueError(f"a pattern must be a str, got {type(pattern).__name__} {pattern!r}")
    return _Parser(pattern).parse()


# ---- code points -> UTF-8 byte ranges --------------------------------------------------


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi as UTF-8: a list of sequences, each a list of byte ranges, one per byte.

    The idea (Russ Cox's, as in Rust's regex-syntax): split lo..hi until both ends
    encode to the same length and every range below the first byte is full, then
    pair the bytes of the two ends. For example U+0080..U+07FF (every 2-byte
    character) is [[(0xC2, 0xDF), (0x80, 0xBF)]], and é..ü (U+00E9..U+00FC) is
    [[(0xC3, 0xC3), (0xA9, 0xBC)]].
    """
    for boundary in (0x7F, 0x7FF, 0xFFFF):  # where the encoded length changes
        if lo <= boundary < hi:
            return utf8_sequences(lo, boundary) + utf8_sequences(boundary + 1, hi)
    length = len(chr(lo).encode("utf-8"))
    for i in range(1, length):
        # the low 6*i bits are the last i bytes: the range must cover them fully or not split them
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask != 0:
                return utf8_sequences(lo, lo | mask) + utf8_sequences((lo | mask) + 1, hi)
            if hi & mask != mask:
                return utf8_sequences(lo, (hi & ~mask) - 1) + utf8_sequences(hi & ~mask, hi)
    return [list(zip(chr(lo).encode("utf-8"), chr(hi).encode("utf-8")))]


def complete_utf8_prefix(data: bytes) -> bytes:
    """`data` cut back so it does not end inside a UTF-8 character (leading continuation bytes stay:
    they finish a character that began before `data`)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last character's first byte
            need = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if need <= back else data[:-back]
    return data


# ---- tree -> NFA over bytes (Thompson) ---------------------------------------------------


class _NFA:
    """States are ints. edges[s]: (byte_lo, byte_hi, target) moves; epsilon[s]: free moves."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.edges: list[list[tuple[int, int, int]]] = []
        self.epsilon: list[list[int]] = []

    def new_state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise ValueError(f"the pattern ({len(self.pattern)} characters, {self.pattern[:60]!r}...) needs more than "
                             f"{MAX_NFA_STATES:,} NFA states; allowed is a pattern whose repeats are smaller")
        self.edges.append([])
        self.epsilon.append([])
        return len(self.edges) - 1

    def build(self, node) -> tuple[int, int]:
        """A fragment for `node`: its (entry, exit) states, exit with no moves yet."""
        entry, exit_ = self.new_state(), self.new_state()
        if isinstance(node, CharSet):
            for lo, hi in node.ranges:
                for sequence in utf8_sequences(lo, hi):
                    state = entry
                    for i, (byte_lo, byte_hi) in enumerate(sequence):
                        target = exit_ if i == len(sequence) - 1 else self.new_state()
                        self.edges[state].append((byte_lo, byte_hi, target))
                        state = target
        elif isinstance(node, Concat):
            state = entry
            for part in node.parts:
                part_entry, part_exit = self.build(part)
                self.epsilon[state].append(part_entry)
                state = part_exit
            self.epsilon[state].append(exit_)
        elif isinstance(node, Alternate):
            for option in node.options:
                option_entry, option_exit = self.build(option)
                self.epsilon[entry].append(option_entry)
                self.epsilon[option_exit].append(exit_)
        elif isinstance(node, Repeat):
            # {m,n} is m copies in a row, then n - m optional ones; {m,} ends in a loop.
            state = entry
            for _ in range(node.min):
                body_entry, body_exit = self.build(node.body)
                self.epsilon[state].append(body_entry)
                state = body_exit
            if node.max is None:
                body_entry, body_exit = self.build(node.body)
                self.epsilon[state] += [body_entry, exit_]
                self.epsilon[body_exit].append(state)
            else:
                for _ in range(node.max - node.min):
                    body_entry, body_exit = self.build(node.body)
                    self.epsilon[state] += [body_entry, exit_]
                    state = body_exit
                self.epsilon[state].append(exit_)
        return entry, exit_

    def closure(self, states) -> frozenset[int]:
        seen, stack = set(states), list(states)
        while stack:
            for nxt in self.epsilon[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)


# ---- NFA -> DFA -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # eq=False: compare DFAs by identity, not by their arrays
class DFA:
    """A deterministic automaton over bytes: trimmed (every state can still reach an accepting
    one) and minimal (Moore). State 0 is the start; -1 is the dead state, never stored.

    transitions: int32 [num_states, 256], the next state for each byte (-1: dead)
    accepting:   bool  [num_states], the text read so far is a whole match
    """
    transitions: np.ndarray
    accepting: np.ndarray
    start: int = 0

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    @cached_property
    def with_dead_row(self) -> np.ndarray:
        """int32 [num_states + 1, 256]: the table and one more row, all -1, at the end. Index -1 (the
        dead state) is that last row, so a vectorized walk stays dead without a test (token_mask.py)."""
        return np.vstack([self.transitions, np.full((1, 256), -1, dtype=np.int32)])

    @cached_property
    def rows(self) -> list[list[int]]:
        """The table as Python lists: a Python loop (the trie walk) indexes these several times faster."""
        return self.transitions.tolist()

    def step(self, state: int, byte: int) -> int:
        return int(self.transitions[state, byte]) if state >= 0 else -1

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`; -1 as soon as it dies."""
        for byte in data:
            if state < 0:
                return -1
            state = int(self.transitions[state, byte])
        return state

    def matches(self, data: bytes) -> bool:
        state = self.walk(self.start, data)
        return state >= 0 and bool(self.accepting[state])


def _byte_classes(nfa: _NFA) -> np.ndarray:
    """int [256]: the column of each byte. Two bytes share a column when no edge tells them apart."""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.update((lo, hi + 1))
    cuts = sorted(cuts)
    column = np.zeros(256, dtype=np.int64)
    for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        column[lo:hi] = k
    return column


def _subsets(nfa: _NFA, start: int, accept: int, column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction over the byte columns: (table int [S, K], accepting bool [S]), -1 = no state."""
    num_columns = int(column.max()) + 1
    first_column = column.tolist()
    initial = nfa.closure([start])
    ids, order, rows = {initial: 0}, [initial], []
    while len(rows) < len(order):
        current = order[len(rows)]
        targets: list[set[int]] = [set() for _ in range(num_columns)]
        for state in current:
            for lo, hi, target in nfa.edges[state]:
                for k in range(first_column[lo], first_column[hi] + 1):
                    targets[k].add(target)
        row = []
        for moved in targets:
            if not moved:
                row.append(-1)
                continue
            subset = nfa.closure(moved)
            if subset not in ids:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"the pattern ({len(nfa.pattern)} characters: {nfa.pattern[:60]!r}"
                                     f"{'...' if len(nfa.pattern) > 60 else ''}) needs more than {MAX_DFA_STATES:,} "
                                     f"DFA states; allowed are patterns below that (shorten its counted repeats)")
                ids[subset] = len(order)
                order.append(subset)
            row.append(ids[subset])
        rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(len(rows), num_columns), np.array([accept in s for s in order])


def _trim(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop the states that cannot reach an accepting state; moves into them become -1."""
    live = accepting.copy()
    while True:  # a state is live if one of its moves reaches a live state
        reaches = ((table >= 0) & live[np.maximum(table, 0)]).any(axis=1)
        grown = live | reaches
        if (grown == live).all():
            break
        live = grown
    if not live[0]:  # the pattern matches nothing: one dead-ended start state
        return np.full((1, table.shape[1]), -1, dtype=np.int64), np.zeros(1, dtype=bool)
    new_id = np.cumsum(live) - 1
    kept = table[live]
    kept = np.where((kept >= 0) & live[np.maximum(kept, 0)], new_id[np.maximum(kept, 0)], -1)
    return kept, accepting[live]


def _minimise(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hopcroft's algorithm: merge the states no text can tell apart; one state per block.

    Start from the blocks {accepting, not accepting, dead}. A *splitter* block A splits any
    block B whose states disagree on whether their move on column k lands in A.
    Each split queues the smaller half as a new splitter, so every state takes
    part in O(log n) splits: O(K n log n) in all. (Moore's simpler refinement
    needs one pass per character of the longest forced chain: `.{0,1000}` took
    30 s that way.) When no splitter is left, the blocks are the minimal DFA's states.
    """
    num_states, num_columns = table.shape
    # One explicit dead state makes every move defined, so "lands in A" is always a yes or a no.
    dead = num_states
    complete = np.vstack([np.where(table >= 0, table, dead), np.full((1, num_columns), dead)]).tolist()
    predecessors = [[[] for _ in range(num_states + 1)] for _ in range(num_columns)]  # [k][t]: states s with s -k-> t
    for source, row in enumerate(complete):
        for k, target in enumerate(row):
            predecessors[k][target].append(source)
    final = accepting.tolist() + [False]
    # The dead state starts in a block of its own (trimming made every other state live, so it is
    # equal to none) and that block is never a splitter: "lands in dead" is "lands in no other
    # block", which the other splitters decide already. That skips every missing move of the table.
    blocks = [b for b in ({s for s in range(num_states) if final[s]}, {s for s in range(num_states) if not final[s]})
              if b] + [{dead}]
    block_of = [0] * (num_states + 1)
    for b, members in enumerate(blocks):
        for s in members:
            block_of[s] = b
    splitters = set(range(len(blocks) - 1))
    while splitters:
        splitter = set(blocks[splitters.pop()])  # a copy: splits below may change the block
        for k in range(num_columns):
            landing: dict[int, set[int]] = {}  # block -> its states whose move on k lands in the splitter
            for target in splitter:
                for source in predecessors[k][target]:
                    landing.setdefault(block_of[source], set()).add(source)
            for b, inside in landing.items():
                if len(inside) == len(blocks[b]):
                    continue  # the whole block agrees: no split
                outside = blocks[b] - inside
                smaller, larger = (inside, outside) if len(inside) <= len(outside) else (outside, inside)
                blocks[b] = larger
                blocks.append(smaller)
                for s in smaller:
                    block_of[s] = len(blocks) - 1
                # b's pieces must still split others: both if b was waiting, else the smaller is enough.
                splitters.add(len(blocks) - 1)
    # Number the live blocks in the order a breadth-first walk from the start meets them (state 0 =
    # the start); the dead state's block (trimming left it alone in it) becomes -1 again.
    number = {block_of[0]: 0}
    queue = [block_of[0]]
    for b in queue:
        for target in complete[next(iter(blocks[b]))]:
            if block_of[target] != block_of[dead] and block_of[target] not in number:
                number[block_of[target]] = len(queue)
                queue.append(block_of[target])
    rows = np.array([[number.get(block_of[t], -1) for t in complete[next(iter(blocks[b]))]] for b in queue],
                    dtype=np.int64).reshape(len(queue), num_columns)
    return rows, np.array([final[next(iter(blocks[b]))] for b in queue], dtype=bool)


def compile_regex(pattern: str) -> DFA:
    """The trimmed, minimal byte DFA of `pattern` (see the module docstring for the dialect)."""
    tree = parse(pattern)
    nfa = _NFA(pattern)
    start, accept = nfa.build(tree)
    column = _byte_classes(nfa)  # [256]
    table, accepting = _subsets(nfa, start, accept, column)  # [S, K], [S]
    table, accepting = _minimise(*_trim(table, accepting))
    transitions = table[:, column].astype(np.int32)  # every byte takes its column's move: [S, 256]
    transitions.setflags(write=False)
    accepting.setflags(write=False)
    return DFA(transitions=transitions, accepting=accepting, start=0)
