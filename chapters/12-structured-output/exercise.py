"""Chapter 12 exercise: a grammar's token masks -- which tokens may come next, and how a request moves.

Fill in the stubs below, task by task. The text is
chapters/12-structured-output/README.md; the tests are tests/chapters/test_ch12_*.py.
Run them against this file with

    python -m minicb check 12
    MINICB_IMPL=student MINICB_IMPL_ONLY=structured.token_mask python -m minicb.structured.bench \
        --rounds 1             # guided requests on SmolLM2 through your code: TPOT and jump-forward

This file stands in for minicb/structured/token_mask.py: an engine takes its
`Grammar` (what minicb's backend compiles a pattern to) and its `mask_logits`
(what puts a mask on a guided request's logits rows) from here, so a guided
request runs all four tasks.

Given, and imported below: the regex -> DFA compiler (minicb/structured/regex.py:
`compile_regex`, the `DFA` with `rows`, `accepting`, `walk`, `step`) and
`TokenVocabulary`, the tokenizer's tokens as byte strings, with its trie built
(the layout is in the docstring of allowed_tokens_trie below). Given, written out
below so that they call *your* functions: `Grammar` (a compiled pattern and its
per-state mask cache: its `mask` calls your allowed_tokens_trie) and `Matcher`
(one request's list of states), without your methods.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from minicb.structured.regex import DFA, compile_regex, complete_utf8_prefix  # noqa: F401  # given
from minicb.structured.token_mask import TokenVocabulary, check_token_id  # noqa: F401  # given


def allowed_tokens_trie(dfa: DFA, vocab: TokenVocabulary, state: int) -> np.ndarray:
    """Task 1: the tokens allowed in `state`, by a depth-first walk of the vocabulary's trie. -> bool [V]

    A text token is allowed when walking all its bytes from `state` never reaches the
    dead state (-1); EOS (every id in vocab.eos_token_ids) exactly when
    dfa.accepting[state]; every other token (special, empty) never.

    dfa.rows[s][b]: the state after byte b in state s (-1: dead). The trie, in preorder:
    node 0 is the root (the empty prefix); node i (1 <= i < vocab.num_trie_nodes) adds
    the byte vocab.node_byte[i] to its parent's prefix, at depth vocab.node_depth[i]
    (its parent is the nearest node before it with depth node_depth[i] - 1); its
    descendants are nodes i + 1 .. vocab.subtree_end[i] - 1; vocab.node_tokens[i] are the
    ids of the tokens whose bytes end there. vocab.max_len: the longest token, in bytes.
    When a node's byte dies, skip its whole subtree: no token below it can live.
        "a", "ab", "b" (ids 0, 1, 2), pattern "a": allowed [True, False, False]"""
    raise NotImplementedError(
        "Chapter 12, task 1: allowed_tokens_trie() — see chapters/12-structured-output/README.md#task-1")


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """Task 2: logits [R, V] float, allowed [R, V] bool -> a copy of logits, every forbidden token at -inf.

    Allowed tokens keep their logits exactly, so the softmax of a row is the model's
    distribution renormalised over what that row allows. A row that allows nothing
    allows every EOS id instead. Leave `logits` and `allowed` as they were."""
    raise NotImplementedError(
        "Chapter 12, task 2: mask_logits() — see chapters/12-structured-output/README.md#task-2")


class Grammar:
    """Given: one compiled pattern for one vocabulary, shared by every request that asks for it.

    mask(state) computes a state's mask once (with your allowed_tokens_trie) and keeps it:
    every request in that state reads the same tensor. next_state is task 3.
    """

    def __init__(self, dfa: DFA, vocab: TokenVocabulary, pattern: str = "", compile_time_s: float = 0.0):
        self.dfa, self.vocab, self.pattern = dfa, vocab, pattern
        self.compile_time_s = compile_time_s  # regex -> DFA, for the benchmarks
        self.start = dfa.start
        self._masks: dict[int, torch.Tensor] = {}  # state -> bool [V]
        self._next: dict[tuple[int, int], int] = {}  # free for next_state to remember its answers in
        self.mask_hits = self.mask_misses = 0

    @classmethod
    def from_regex(cls, pattern: str, vocab: TokenVocabulary) -> Grammar:
        began = time.perf_counter()
        dfa = compile_regex(pattern)
        return cls(dfa, vocab, pattern, time.perf_counter() - began)

    def matcher(self) -> Matcher:
        return Matcher(self)

    def is_accepting(self, state: int) -> bool:
        return state >= 0 and bool(self.dfa.accepting[state])

    def mask(self, state: int) -> torch.Tensor:
        """The tokens allowed in `state`, computed once per state. -> torch.bool [V] (the cached tensor)"""
        if not 0 <= state < self.dfa.num_states:
            raise ValueError(f"state={state!r}; it must be a DFA state in [0, {self.dfa.num_states})")
        cached = self._masks.get(state)
        if cached is not None:
            self.mask_hits += 1
            return cached
        self.mask_misses += 1
        mask = torch.from_numpy(np.asarray(allowed_tokens_trie(self.dfa, self.vocab, state), dtype=bool))
        self._masks[state] = mask
        return mask

    def next_state(self, state: int, token_id: int) -> int:
        """Task 3: the state after `token_id` in `state`; -1 if the token is not allowed there.

        Check the id first with the given check_token_id(token_id, self.vocab.vocab_size),
        which returns it as an int or raises ValueError naming it. An EOS id (in
        self.vocab.eos_token_ids) leaves the state as it is where the state is accepting, and
        is -1 elsewhere; a token that is not text (self.vocab.text_token[token_id] False) is
        -1; a text token walks its bytes (self.vocab.token_bytes[token_id]) from `state`,
        -1 as soon as the walk dies. The answer depends on the state and the token alone."""
        raise NotImplementedError(
            "Chapter 12, task 3: Grammar.next_state() — see chapters/12-structured-output/README.md#task-3")

    def forced_bytes(self, state: int) -> bytes:
        """The longest text every match must continue with from `state` (jump-forward); b"" if none."""
        forced = bytearray()
        while state >= 0 and not self.dfa.accepting[state]:
            live = np.flatnonzero(self.dfa.transitions[state] >= 0)
            if len(live) != 1:
                break
            forced.append(int(live[0]))
            state = self.dfa.step(state, int(live[0]))
        return complete_utf8_prefix(bytes(forced))

    def cache_info(self) -> dict:
        return {"num_states": self.dfa.num_states, "masks_cached": len(self._masks),
                "mask_bytes": sum(m.numel() for m in self._masks.values()), "hits": self.mask_hits,
                "misses": self.mask_misses, "next_states_cached": len(self._next)}


class Matcher:
    """Given, but for tasks 3 and 4: one request's position in a Grammar.

    states[0] is the grammar's start; each accepted token appends the state it led to,
    and token_ids[i] took states[i] to states[i + 1], so len(states) == len(token_ids) + 1
    always. The matcher is finished once it accepted an EOS.
    """

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.states = [grammar.start]
        self.token_ids: list[int] = []

    @property
    def state(self) -> int:
        return self.states[-1]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] in self.grammar.vocab.eos_token_ids

    @property
    def can_end(self) -> bool:
        """Whether the text so far is a whole match (so EOS is allowed now)."""
        return not self.is_finished and self.grammar.is_accepting(self.state)

    def accept(self, token_id: int) -> bool:
        """Task 3: take `token_id` if the grammar allows it here (self.grammar.next_state) and return
        True; return False, changing nothing, if it does not, or if the matcher is finished."""
        raise NotImplementedError(
            "Chapter 12, task 3: Matcher.accept() — see chapters/12-structured-output/README.md#task-3")

    def mask(self) -> torch.Tensor:
        """The tokens allowed next. -> torch.bool [V] (none once finished)."""
        if self.is_finished:
            return torch.zeros(self.grammar.vocab.vocab_size, dtype=torch.bool)
        return self.grammar.mask(self.state)

    def rollback(self, num_tokens: int) -> None:
        """Task 4: forget the last `num_tokens` accepted tokens (rejected speculative drafts), so the
        matcher is where it was before them; 0 changes nothing. ValueError, changing nothing, unless
        num_tokens is an int in [0, self.num_accepted]."""
        raise NotImplementedError(
            "Chapter 12, task 4: Matcher.rollback() — see chapters/12-structured-output/README.md#task-4")

    def fork(self) -> Matcher:
        """Task 4: an independent copy at the same position, on the same grammar (parallel sampling):
        what one of the two accepts or rolls back, the other does not see."""
        raise NotImplementedError(
            "Chapter 12, task 4: Matcher.fork() — see chapters/12-structured-output/README.md#task-4")

    def forced_tokens(self, tokenizer) -> list[int]:
        """The forced text (Grammar.forced_bytes) as token ids; [] when nothing is forced (jump-forward)."""
        if self.is_finished:
            return []
        forced = self.grammar.forced_bytes(self.state)
        if not forced or forced[0] & 0xC0 == 0x80:
            return []
        token_ids = tokenizer.encode(forced.decode("utf-8"))
        # A tokenizer that normalises text could give back other bytes: then jump nowhere.
        if b"".join(self.grammar.vocab.token_bytes[t] for t in token_ids) != forced:
            return []
        return token_ids
