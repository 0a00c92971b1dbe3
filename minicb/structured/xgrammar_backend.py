"""Chapter 12: the same grammar interface, answered by xgrammar (what vLLM and SGLang use).

In this file you will learn how a production grammar engine plugs into the one
interface minicb's own DFA answers to (minicb/structured/backend.py), and so
where the two may be compared:
- xgrammar compiles a grammar against the vocabulary ahead of time (a
  `TokenizerInfo` built from the HF tokenizer) and answers each step with a
  packed bitmask: int32 [ceil(V / 32)], bit j of word i is token 32 * i + j.
  `unpack_bitmask` turns it into minicb's torch.bool [V];
- it is a pushdown automaton (an Earley parser), so it also takes grammars a
  regex cannot say (nested JSON of any depth); minicb's DFA cannot;
- its matcher keeps its own history: `rollback(n)` undoes n tokens. Where the
  installed version has no `fork`, a fork is a new matcher that replays the
  accepted tokens.

Where xgrammar (0.2.9) and minicb differ for the same pattern (the tests compare
the two where they agree, and hold each difference to exactly this):
- xgrammar's `.` also matches a newline; Python's, and so minicb's, does not;
- xgrammar's \\s is ECMAScript's (JSON Schema's regex dialect): it also matches
  U+00A0, U+2000..U+200A, U+3000 and other Unicode spaces; minicb's is ASCII's;
- xgrammar finds no special tokens in SmolLM2's tokenizer, so "<|im_start|>" is
  text to it and `[^\\n]*` allows it; minicb never allows a special token;
- xgrammar's bitmask allows EOS before the first character of a negated class
  repeated with + ("[^a]+" at the start), and accepts it, though its own
  is_completed() says no; minicb allows EOS exactly where the text is a match.

xgrammar is imported only when this backend is asked for. Chapter text:
chapters/12-structured-output/README.md.
"""
from __future__ import annotations

import time

import torch

from minicb.structured.backend import canonical_spec, to_regex
from minicb.structured.token_mask import TokenVocabulary, check_token_id


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("backend='xgrammar' needs the xgrammar package (pip install xgrammar); "
                          "backend='minicb' needs nothing more") from e
    return xgrammar


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed mask -> bools. int32 [W] (W = ceil(V / 32)) -> torch.bool [V]

    Bit j of word i is token 32 * i + j. An arithmetic shift of a negative word
    copies its sign bit upwards, but `& 1` keeps only bit 0 of the shifted word,
    which is bit j of the original for every j < 32.
    """
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.reshape(-1, 1) >> bits) & 1).bool().reshape(-1)[:vocab_size]


class XGrammarCompiler:
    """xgrammar's compiler for one vocabulary: its TokenizerInfo is built once, here."""

    def __init__(self, vocab: TokenVocabulary):
        xgr = import_xgrammar()
        self.vocab = vocab
        if vocab.tokenizer is not None:
            info = xgr.TokenizerInfo.from_huggingface(vocab.tokenizer.hf, vocab_size=vocab.vocab_size,
                                                      stop_token_ids=vocab.eos_token_ids)
        else:  # a vocabulary of raw bytes (the tests' small ones)
            info = xgr.TokenizerInfo(vocab.token_bytes, xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                     stop_token_ids=vocab.eos_token_ids)
        self.info = info
        self.compiler = xgr.GrammarCompiler(info)

    def compile(self, kind: str, spec) -> XGrammarGrammar:
        key = canonical_spec(kind, spec)  # refuses a bad kind or spec the way minicb's compiler does
        began = time.perf_counter()
        if kind in ("regex", "choice"):
            compiled = self.compiler.compile_regex(to_regex(kind, spec))
        else:  # json.dumps' layout, as minicb's json_schema.py writes it, not xgrammar's free whitespace
            schema = key if kind == "json_schema" else '{"type": "object"}'
            compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        return XGrammarGrammar(compiled, self.vocab, time.perf_counter() - began)


class XGrammarGrammar:
    def __init__(self, compiled, vocab: TokenVocabulary, compile_time_s: float):
        self.compiled, self.vocab, self.compile_time_s = compiled, vocab, compile_time_s

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)


class XGrammarMatcher:
    """One request's xgrammar matcher, with minicb's Matcher's interface. token_ids: what it accepted."""

    def __init__(self, grammar: XGrammarGrammar, _matcher=None, _token_ids: list[int] | None = None):
        xgr = import_xgrammar()
        self.grammar = grammar
        self.xgr_matcher = _matcher if _matcher is not None else xgr.GrammarMatcher(grammar.compiled)
        self.token_ids = list(_token_ids or [])
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab.vocab_size)  # int32 [1, W], reused

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.xgr_matcher.is_terminated()

    @property
    def can_end(self) -> bool:
        return not self.is_finished and self.xgr_matcher.is_completed()

    def accept(self, token_id: int) -> bool:
        token_id = check_token_id(token_id, self.grammar.vocab.vocab_size)
        if self.is_finished or not self.xgr_matcher.accept_token(token_id):
            return False
        self.token_ids.append(token_id)
        return True

    def fill_bitmask(self) -> torch.Tensor:
        """xgrammar's own packed answer, int32 [1, W] (the benchmark times this alone)."""
        self.xgr_matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask

    def mask(self) -> torch.Tensor:
        """The tokens allowed next. -> torch.bool [V] (none once finished).

        xgrammar's bitmask, held to the two rules the engine keeps with either backend
        (the differences in this file's docstring): a special token is never text, and
        EOS comes exactly when the text is a whole match (is_completed). fill_bitmask()
        is xgrammar's answer as it gives it.
        """
        vocab = self.grammar.vocab
        if self.is_finished:
            return torch.zeros(vocab.vocab_size, dtype=torch.bool)
        allowed = unpack_bitmask(self.fill_bitmask(), vocab.vocab_size).clone()
        allowed[vocab.special_token_ids] = False
        allowed[vocab.eos_token_ids] = self.can_end
        return allowed

    def rollback(self, num_tokens: int) -> None:
        if not (isinstance(num_tokens, int) and 0 <= num_tokens <= self.num_accepted):
            raise ValueError(f"rollback({num_tokens!r}); it must be an int in [0, {self.num_accepted}], the tokens "
                             f"accepted so far")
        if num_tokens:
            self.xgr_matcher.rollback(num_tokens)
            del self.token_ids[len(self.token_ids) - num_tokens:]

    def fork(self) -> XGrammarMatcher:
        if hasattr(self.xgr_matcher, "fork"):  # xgrammar >= 0.2 copies its own state
            return XGrammarMatcher(self.grammar, self.xgr_matcher.fork(), self.token_ids)
        twin = XGrammarMatcher(self.grammar)  # older ones: replay the history into a new matcher
        for token_id in self.token_ids:
            twin.accept(token_id)
        return twin

    def forced_tokens(self, tokenizer) -> list[int]:
        if self.is_finished:
            return []
        forced = self.xgr_matcher.find_jump_forward_string()
        return tokenizer.encode(forced) if forced else []

