"""Chapter 12: what a request asks for -> a compiled grammar, once per distinct pattern.

In this file you will learn the one interface both grammar backends answer to,
so that the engine never asks which one it holds:
- a request names a *kind* and a spec: "regex" (a pattern), "choice" (a list of
  strings: the text must be one of them), "json_schema" (a schema: a dict or its
  JSON text) or "json_object" (any JSON object; no spec). minicb turns every kind
  into one regex (`to_regex`) and compiles it to a DFA; xgrammar compiles each
  kind its own way (a JSON schema to its own grammar, so its whitespace rules are
  xgrammar's, not minicb's json_schema.py's);
- a grammar is compiled once and shared; a request gets its own matcher from it
  (`StructuredGrammar.matcher()`). `GrammarCache` keeps one grammar per
  (kind, spec), so a thousand requests for one schema compile it once.

    from minicb.structured import TokenVocabulary, compile_grammar
    grammar = compile_grammar("choice", ["yes", "no"], vocab)       # minicb's DFA
    grammar = compile_grammar("choice", ["yes", "no"], vocab, backend="xgrammar")
    matcher = grammar.matcher(); matcher.mask()                     # torch.bool [V]

Chapter text: chapters/12-structured-output/README.md.
"""
from __future__ import annotations

import json
import time
from typing import Protocol

import torch

from minicb.structured.token_mask import Grammar, TokenVocabulary

KINDS = ("regex", "choice", "json_schema", "json_object")
BACKENDS = ("minicb", "xgrammar")


class StructuredMatcher(Protocol):
    """One request's position in a grammar (minicb's Matcher, xgrammar_backend's XGrammarMatcher)."""

    def accept(self, token_id: int) -> bool: ...  # False, and nothing changes, if not allowed here

    def mask(self) -> torch.Tensor: ...  # torch.bool [V]: the tokens allowed next

    def rollback(self, num_tokens: int) -> None: ...

    def fork(self) -> StructuredMatcher: ...

    def forced_tokens(self, tokenizer) -> list[int]: ...  # jump-forward; [] when nothing is forced

    @property
    def is_finished(self) -> bool: ...  # an EOS was accepted

    @property
    def can_end(self) -> bool: ...  # the text so far is a whole match: EOS is allowed

    @property
    def num_accepted(self) -> int: ...


class StructuredGrammar(Protocol):
    """A compiled grammar, shared by all its requests."""
    compile_time_s: float

    def matcher(self) -> StructuredMatcher: ...


class GrammarCompiler(Protocol):
    def compile(self, kind: str, spec) -> StructuredGrammar: ...


def canonical_spec(kind: str, spec) -> str:
    """The spec as one string, the same for equal specs: the cache's key, and what errors quote.

    A schema keeps its key order: properties come out in the order the schema lists
    them, so two orders are two grammars.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed kinds are {', '.join(KINDS)}")
    if kind == "regex":
        if not isinstance(spec, str):
            raise ValueError(f"a regex grammar needs a str pattern, got {type(spec).__name__} {spec!r}")
        return spec
    if kind == "choice":
        if (not isinstance(spec, (list, tuple)) or not spec
                or not all(isinstance(s, str) for s in spec)):
            raise ValueError(f"a choice grammar needs a non-empty list of strings, got {spec!r}")
        return json.dumps(list(spec), ensure_ascii=False)
    if kind == "json_schema":
        return json.dumps(parse_schema(spec), ensure_ascii=False)
    if spec not in (None, "", {}):
        raise ValueError(f"a json_object grammar takes no spec (any JSON object is allowed), got {spec!r}")
    return ""


def parse_schema(spec) -> dict | bool:
    """A JSON schema given as a dict (or bool) or as its JSON text."""
    try:
        schema = json.loads(spec) if isinstance(spec, str) else spec
    except json.JSONDecodeError as e:
        raise ValueError(f"a json_schema grammar's text is not JSON ({e}): {spec[:80]!r}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a json_schema grammar needs a schema (a dict or its JSON text), got {spec!r}")
    return schema


def to_regex(kind: str, spec) -> str:
    """The one regex minicb compiles for a request's grammar."""
    key = canonical_spec(kind, spec)
    if kind == "regex":
        return key
    # The choice and JSON kinds' regexes are built in their own file; import it only when asked for.
    from minicb.structured import json_schema
    if kind == "choice":
        return json_schema.choice_regex(list(spec))
    if kind == "json_schema":
        return json_schema.schema_to_regex(parse_schema(spec))
    return json_schema.json_object_regex()


class MinicbCompiler:
    """Every kind through to_regex, then minicb's DFA (minicb/structured/token_mask.py's Grammar).

    grammar_type: the Grammar class to build, token_mask.py's or a student's chapter 12 one."""

    def __init__(self, vocab: TokenVocabulary, grammar_type: type = Grammar):
        self.vocab, self.grammar_type = vocab, grammar_type

    def compile(self, kind: str, spec) -> Grammar:
        began = time.perf_counter()
        pattern = to_regex(kind, spec)
        grammar = self.grammar_type.from_regex(pattern, self.vocab)
        grammar.compile_time_s = time.perf_counter() - began  # the schema -> regex step counts too
        return grammar


def make_compiler(vocab: TokenVocabulary, backend: str = "minicb", grammar_type: type = Grammar) -> GrammarCompiler:
    """grammar_type: what minicb's backend builds (MinicbCompiler); xgrammar builds its own."""
    if backend == "minicb":
        return MinicbCompiler(vocab, grammar_type)
    if backend == "xgrammar":
        from minicb.structured.xgrammar_backend import XGrammarCompiler
        return XGrammarCompiler(vocab)
    raise ValueError(f"backend={backend!r}; allowed backends are {', '.join(BACKENDS)}")


def compile_grammar(kind: str, spec, vocab: TokenVocabulary, backend: str = "minicb") -> StructuredGrammar:
    """One grammar, compiled now. A server keeps a GrammarCache instead, so a spec compiles once."""
    return make_compiler(vocab, backend).compile(kind, spec)


class GrammarCache:
    """One compiled grammar per distinct (kind, spec), from one compiler (so one vocabulary and backend).

    Grammars are never evicted: each costs its masks' bytes (minicb: 1 byte per
    token per state met), which a server with a few schemas can afford.
    """

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._grammars: dict[tuple[str, str], StructuredGrammar] = {}
        self.hits = self.misses = 0

    def get(self, kind: str, spec) -> StructuredGrammar:
        key = (kind, canonical_spec(kind, spec))
        grammar = self._grammars.get(key)
        if grammar is not None:
            self.hits += 1
            return grammar
        self.misses += 1
        grammar = self._grammars[key] = self.compiler.compile(kind, spec)
        return grammar

    def __len__(self) -> int:
        return len(self._grammars)
