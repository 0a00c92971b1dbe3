"""Chapter 12: which tokens may come next -- a token mask from a DFA.

In this file you will learn how a grammar steers a language model without
touching the model:
- a grammar is a DFA over bytes (minicb/structured/regex.py). A token is a
  byte string, so a token is *allowed* in a state if walking all its bytes
  from there never dies. The DFA is trimmed, so "never dies" means "the text
  can still be finished". Before sampling, every other token's logit gets
  -inf: the model can only say what the grammar lets it;
- walking 49,152 tokens one by one costs 330,000 byte steps per state. Tokens
  share prefixes ("Ġthe", "Ġthen", "Ġthere"), so hold them in a *trie* and walk
  it depth-first: when a prefix dies, its whole subtree goes at once
  (`allowed_tokens_trie`, the version to read). The same answer also falls out
  of one numpy gather per byte position over a padded [V, max_len] byte
  matrix (`allowed_tokens_vectorized`, the fast path). A test holds the two,
  and a plain per-token walk, equal. On SmolLM2 the trie takes 0.02 ms where
  few tokens get past their first byte and 4 ms inside a JSON string, where
  nearly all do; the gather takes 1.3 ms in every state, so Grammar uses it;
- EOS has no bytes: it is allowed exactly when the state is accepting. Special
  tokens (<|im_start|>, ...) are control, not text: a grammar never allows them;
- a mask goes on the logits (`mask_logits`): every forbidden token at -inf, so
  the softmax renormalises the model's distribution over the allowed tokens;
- a mask depends only on the DFA state, and a DFA has few states, so a
  `Grammar` computes each state's mask once and every request shares it. A
  request's own position is a `Matcher`: a list of states, one per accepted
  token, so rolling back rejected speculative drafts is truncating a list and
  forking a completion is copying one;
- when a state allows exactly one byte, the grammar has chosen the text:
  `forced_bytes` reads it off without running the model (jump-forward).

Run the benchmark (compile time, mask time per state, cache size, against
xgrammar's `fill_next_token_bitmask`):

    .venv/bin/python -m minicb.structured.token_mask

Chapter text: chapters/12-structured-output/README.md; the exercise
(chapters/12-structured-output/exercise.py) stands in for this file.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from minicb.structured.regex import DFA, compile_regex, complete_utf8_prefix


class TokenVocabulary:
    """A tokenizer's tokens as byte strings, in the two layouts the mask walks read.

    token_bytes[i]: token i's bytes. A token that is an EOS id, a special token or
    empty is never walked as text (`text_token`[i] False): EOS is decided by the
    state alone, the others are never allowed.

    The trie, in preorder (node 0 is the root, the empty prefix): node i adds the
    byte node_byte[i] at depth node_depth[i]; its descendants are nodes
    i+1 .. subtree_end[i]-1, so skipping a subtree is one jump; node_tokens[i] are
    the token ids whose bytes end there. For "a", "ab", "b":

        node  byte  depth  subtree_end  tokens
          0    -      0        4         ()
          1    a      1        3         (id of "a",)
          2    b      2        3         (id of "ab",)
          3    b      1        4         (id of "b",)
    """

    def __init__(self, token_bytes: list[bytes], eos_token_ids: list[int], special_token_ids: list[int] = (),
                 tokenizer=None):
        self.vocab_size = len(token_bytes)  # V
        for name, ids in (("eos_token_ids", eos_token_ids), ("special_token_ids", special_token_ids)):
            bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < self.vocab_size)]
            if bad:
                raise ValueError(f"{name} has {bad[:5]}; each must be a token id in [0, {self.vocab_size})")
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty; a grammar needs at least one token that ends the text")
        self.token_bytes = list(token_bytes)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.special_token_ids = sorted(set(special_token_ids) - set(self.eos_token_ids))
        self.tokenizer = tokenizer  # the minicb Tokenizer it came from, if any (xgrammar's backend reads it)
        text = np.array([len(b) > 0 for b in self.token_bytes])
        text[self.eos_token_ids + self.special_token_ids] = False
        self.text_token = text  # bool [V]
        self._build_trie()
        self._build_matrix()

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_token_ids: list[int], vocab_size: int | None = None) -> TokenVocabulary:
        """From a minicb Tokenizer: its bytes per token, and its added special tokens. vocab_size: the
        model's logits width when it pads past the tokenizer's tokens; the padding ids are never allowed."""
        hf, size = tokenizer.hf, vocab_size or tokenizer.vocab_size
        if size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size={size}; it must be at least the tokenizer's {tokenizer.vocab_size} tokens")
        special = {i for i, added in hf.added_tokens_decoder.items() if added.special} | set(hf.all_special_ids)
        token_bytes = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        return cls(token_bytes + [b""] * (size - len(token_bytes)), eos_token_ids,
                   sorted(i for i in special if i < tokenizer.vocab_size), tokenizer)

    def _build_trie(self) -> None:
        # Sorted byte strings list every prefix before its extensions: that is preorder. Each
        # token shares its first `common` bytes with the one before it and opens nodes for the rest.
        order = sorted(np.flatnonzero(self.text_token).tolist(), key=lambda i: self.token_bytes[i])
        node_byte, node_depth, node_tokens, subtree_end = [-1], [0], [[]], [0]
        path = [0]  # the node of each prefix of the previous token: path[d] is at depth d
        previous = b""
        for token_id in order:
            data = self.token_bytes[token_id]
            common = 0
            while common < min(len(data), len(previous)) and data[common] == previous[common]:
                common += 1
            for closed in path[common + 1:]:  # the previous token's nodes below the shared prefix are done
                subtree_end[closed] = len(node_byte)
            del path[common + 1:]
            for depth in range(common + 1, len(data) + 1):
                path.append(len(node_byte))
                node_byte.append(data[depth - 1])
                node_depth.append(depth)
                node_tokens.append([])
                subtree_end.append(0)
            node_tokens[path[-1]].append(token_id)
            previous = data
        for closed in path:
            subtree_end[closed] = len(node_byte)
        self.node_byte, self.node_depth, self.subtree_end = node_byte, node_depth, subtree_end
        self.node_tokens = [tuple(t) for t in node_tokens]
        self.num_trie_nodes = len(node_byte)

    def _build_matrix(self) -> None:
        lengths = np.array([len(b) if t else 0 for b, t in zip(self.token_bytes, self.text_token)])
        self.max_len = int(lengths.max())
        matrix = np.zeros((self.vocab_size, self.max_len), dtype=np.uint8)  # [V, max_len], 0-padded
        for i in np.flatnonzero(lengths):
            matrix[i, :lengths[i]] = np.frombuffer(self.token_bytes[i], dtype=np.uint8)
        self.byte_matrix, self.lengths = matrix, lengths  # [V, max_len] uint8, [V] int (0 for non-text tokens)
        # The fast walk reads the rows longest first: at byte position p only the first
        # num_longer[p] rows are still walking, so it touches each byte once, not V * max_len cells.
        self.longest_first = np.argsort(-lengths, kind="stable")  # [V]: token ids
        self.matrix_longest_first = np.ascontiguousarray(matrix[self.longest_first].T)  # [max_len, V]
        self.num_longer = [int((lengths > p).sum()) for p in range(self.max_len)]


def allowed_tokens_brute_force(dfa: DFA, vocab: TokenVocabulary, state: int) -> np.ndarray:
    """The definition, one token at a time (for the tests: a Python loop over all V tokens). -> bool [V]"""
    allowed = np.array([bool(t) and dfa.walk(state, b) >= 0 for b, t in zip(vocab.token_bytes, vocab.text_token)])
    allowed[vocab.eos_token_ids] = bool(dfa.accepting[state])
    return allowed


def allowed_tokens_trie(dfa: DFA, vocab: TokenVocabulary, state: int) -> np.ndarray:
    """The tokens allowed in `state`: a depth-first walk of the vocabulary's trie. -> bool [V]

    state_at[d] is the DFA state after the first d bytes of the current node's
    prefix. Node i steps from its parent's state (state_at[depth - 1]) by its byte;
    if that dies, no token below it can live, and the walk jumps past the subtree.
    """
    allowed = np.zeros(vocab.vocab_size, dtype=bool)
    rows, node_byte, node_depth = dfa.rows, vocab.node_byte, vocab.node_depth
    subtree_end, node_tokens = vocab.subtree_end, vocab.node_tokens
    state_at = [state] + [-1] * vocab.max_len
    i = 1
    while i < vocab.num_trie_nodes:
        depth = node_depth[i]
        nxt = rows[state_at[depth - 1]][node_byte[i]]
        if nxt < 0:
            i = subtree_end[i]  # prune: every token with this prefix dies here too
            continue
        state_at[depth] = nxt
        for token_id in node_tokens[i]:
            allowed[token_id] = True
        i += 1
    allowed[vocab.eos_token_ids] = bool(dfa.accepting[state])
    return allowed


def token_end_states(dfa: DFA, vocab: TokenVocabulary, state: int) -> np.ndarray:
    """Every token walked from `state` at once: the state each token ends in (-1: died). -> int32 [V]

    One gather per byte position: at position p the rows still walking (the
    num_longer[p] longest tokens) step by their p-th byte. A row that died holds -1,
    and row -1 of `with_dead_row` is all -1, so it stays dead with no test at all.
    Non-text tokens have length 0 and end where they start: callers mask them.
    """
    table = dfa.with_dead_row  # [S + 1, 256] int32
    states = np.full(vocab.vocab_size, state, dtype=np.int32)  # [V], in longest-first order
    for p, n in enumerate(vocab.num_longer):
        states[:n] = table[states[:n], vocab.matrix_longest_first[p, :n]]  # [n]
    out = np.empty_like(states)
    out[vocab.longest_first] = states  # back to token id order
    return out


def allowed_tokens_vectorized(dfa: DFA, vocab: TokenVocabulary, state: int) -> np.ndarray:
    """The same mask as allowed_tokens_trie, from token_end_states. -> bool [V]"""
    allowed = (token_end_states(dfa, vocab, state) >= 0) & vocab.text_token
    allowed[vocab.eos_token_ids] = bool(dfa.accepting[state])
    return allowed


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """logits [R, V], allowed [R, V] bool -> logits with every forbidden token at -inf (a copy).

    The softmax of the result is the model's distribution renormalised over the
    allowed tokens: p(t) / sum of p over allowed, for allowed t; 0 for the rest. A
    row that allows nothing at all (a grammar needing a byte no token spells)
    allows EOS instead, so its text ends rather than the softmax dividing by zero.
    """
    stuck = ~allowed.any(-1)  # [R]
    if bool(stuck.any()):
        allowed = allowed.clone()
        allowed[stuck.nonzero()[:, 0][:, None], torch.tensor(eos_token_ids, device=allowed.device)] = True
    return logits.masked_fill(~allowed, float("-inf"))


def check_token_id(token_id, vocab_size: int) -> int:
    """token_id as a Python int (numpy's and torch's integers too), or a ValueError naming it."""
    if isinstance(token_id, torch.Tensor) and token_id.numel() == 1:
        token_id = token_id.item()
    if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or not 0 <= token_id < vocab_size:
        raise ValueError(f"token_id={token_id!r}; it must be an integer in [0, {vocab_size})")
    return int(token_id)


class Grammar:
    """One compiled pattern for one vocabulary. Immutable and shared by every request that asks for it.

    The caches below only remember answers of pure functions of (state, token), so
    sharing them is safe; they grow to at most num_states masks.
    mask(state) -> torch.bool [V] is the cached tensor itself: clone it before writing.
    """

    def __init__(self, dfa: DFA, vocab: TokenVocabulary, pattern: str = "", compile_time_s: float = 0.0):
        self.dfa, self.vocab, self.pattern = dfa, vocab, pattern
        self.compile_time_s = compile_time_s  # regex -> DFA, for the benchmarks
        self.start = dfa.start
        self._masks: dict[int, torch.Tensor] = {}  # state -> bool [V]
        self._next: dict[tuple[int, int], int] = {}  # (state, token id) -> state
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
        """The tokens allowed in `state`. -> torch.bool [V]"""
        if not 0 <= state < self.dfa.num_states:
            raise ValueError(f"state={state!r}; it must be a DFA state in [0, {self.dfa.num_states})")
        cached = self._masks.get(state)
        if cached is not None:
            self.mask_hits += 1
            return cached
        self.mask_misses += 1
        mask = torch.from_numpy(allowed_tokens_vectorized(self.dfa, self.vocab, state))
        self._masks[state] = mask
        return mask

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id` in `state`; -1 if the token is not allowed there.

        EOS leaves the state as it is (the matcher marks itself finished), where it is allowed.
        """
        token_id = check_token_id(token_id, self.vocab.vocab_size)
        if token_id in self.vocab.eos_token_ids:
            return state if self.is_accepting(state) else -1
        if not self.vocab.text_token[token_id]:
            return -1
        key = (state, token_id)
        if key not in self._next:
            self._next[key] = self.dfa.walk(state, self.vocab.token_bytes[token_id])
        return self._next[key]

    def forced_bytes(self, state: int) -> bytes:
        """The longest text every match must continue with from `state` (jump-forward); b"" if none.

        Follow states that allow exactly one byte and are not accepting (an accepting
        state could also end). A trimmed DFA has no cycle of such states, since a state
        on it could never finish. The end is cut back to a whole UTF-8 character.
        """
        forced = bytearray()
        while state >= 0 and not self.dfa.accepting[state]:
            live = np.flatnonzero(self.dfa.transitions[state] >= 0)
            if len(live) != 1:
                break
            forced.append(int(live[0]))
            state = self.dfa.step(state, int(live[0]))
        return complete_utf8_prefix(bytes(forced))

    def cache_info(self) -> dict:
        """What the benchmarks print: masks cached, their bytes, hits and misses."""
        return {"num_states": self.dfa.num_states, "masks_cached": len(self._masks),
                "mask_bytes": sum(m.numel() for m in self._masks.values()), "hits": self.mask_hits,
                "misses": self.mask_misses, "next_states_cached": len(self._next)}


class Matcher:
    """One request's position in a Grammar. states[0] is the start; each accepted token appends one.

    token_ids[i] took states[i] to states[i + 1], so len(states) == len(token_ids) + 1 always.
    The matcher is finished once it accepted an EOS; rolling that back un-finishes it.
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
        """Take `token_id` if the grammar allows it here; False (and nothing changes) if not."""
        if self.is_finished:
            return False
        nxt = self.grammar.next_state(self.state, token_id)
        if nxt < 0:
            return False
        self.states.append(nxt)
        self.token_ids.append(token_id)
        return True

    def mask(self) -> torch.Tensor:
        """The tokens allowed next. -> torch.bool [V] (none once finished)."""
        if self.is_finished:
            return torch.zeros(self.grammar.vocab.vocab_size, dtype=torch.bool)
        return self.grammar.mask(self.state)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if not (isinstance(num_tokens, int) and 0 <= num_tokens <= self.num_accepted):
            raise ValueError(f"rollback({num_tokens!r}); it must be an int in [0, {self.num_accepted}], the tokens "
                             f"accepted so far")
        del self.states[len(self.states) - num_tokens:]
        del self.token_ids[len(self.token_ids) - num_tokens:]

    def fork(self) -> Matcher:
        """An independent copy at the same position (parallel sampling: n completions of one prompt)."""
        twin = Matcher(self.grammar)
        twin.states, twin.token_ids = list(self.states), list(self.token_ids)
        return twin

    def forced_tokens(self, tokenizer) -> list[int]:
        """The forced text (Grammar.forced_bytes) as token ids; [] when nothing is forced.

        The text is encoded on its own, which may split it differently from how the
        model would have: fine for the grammar (every split of forced text is allowed),
        a known cost to quality that engines accept for the speed. [] as well when the
        forced bytes begin inside a character: no text encodes to those.
        """
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


# ---- benchmark: python -m minicb.structured.token_mask -----------------------------------

BENCH_PATTERNS = {
    "integer": r"-?(0|[1-9][0-9]*)",
    "choice": r"positive|negative|neutral",
    "quoted string": r'"([^"\\]|\\["\\/bfnrt])*"',
    "person object": r'\{"name": "[^"]{1,32}", "age": (0|[1-9][0-9]{0,2}), "email": "[a-z.]+@[a-z]+\.[a-z]{2,3}"\}',
    "date time": r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
}


def _walk(grammar: Grammar, xgr_grammar, rng: np.random.Generator) -> tuple[list[int], list[float]]:
    """The states a decoder meets (four walks of random allowed tokens), and the seconds xgrammar's
    fill_next_token_bitmask took at each step of a matcher walking the same tokens (none without xgrammar)."""
    states, fills = {grammar.start}, []
    for _ in range(4):
        matcher, xgr_matcher = grammar.matcher(), xgr_grammar.matcher() if xgr_grammar else None
        for _ in range(30):
            if xgr_matcher:
                tick = time.perf_counter()
                xgr_matcher.fill_bitmask()
                fills.append(time.perf_counter() - tick)
            allowed = np.flatnonzero(matcher.mask().numpy() & grammar.vocab.text_token)
            if not len(allowed):
                break
            token = int(rng.choice(allowed))
            matcher.accept(token)
            states.add(matcher.state)
            if xgr_matcher:
                xgr_matcher.accept(token)
    return sorted(states), fills


def _mean_seconds(fn, states: list[int], repeats: int = 3) -> float:
    began = time.perf_counter()
    for _ in range(repeats):
        for s in states:
            fn(s)
    return (time.perf_counter() - began) / (repeats * len(states))


def main() -> None:
    from minicb.bench.machine import cpu_model
    from minicb.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    began = time.perf_counter()
    vocab = TokenVocabulary.from_tokenizer(tokenizer, [tokenizer.hf.convert_tokens_to_ids("<|im_end|>")])
    print(f"CPU: {cpu_model()}\nvocabulary: {vocab.vocab_size} tokens, {vocab.num_trie_nodes:,} trie nodes, "
          f"max_len {vocab.max_len}, built in {time.perf_counter() - began:.2f} s")
    try:
        from minicb.structured.xgrammar_backend import XGrammarCompiler
        xgr_compiler = XGrammarCompiler(vocab)
    except ImportError as e:
        print(f"{e}: no xgrammar columns")
        xgr_compiler = None
    rng = np.random.default_rng(0)
    print(f"{'pattern':14} {'states':>6} {'met':>4} {'compile ms':>10} {'xgr ms':>7} {'trie ms':>8} {'vector ms':>9} "
          f"{'hit us':>7} {'xgr fill us':>11} {'cache KiB':>9}")
    for name, pattern in BENCH_PATTERNS.items():
        grammar = Grammar.from_regex(pattern, vocab)
        xgr_grammar = xgr_compiler.compile("regex", pattern) if xgr_compiler else None
        states, fills = _walk(grammar, xgr_grammar, rng)
        trie_s = _mean_seconds(lambda s: allowed_tokens_trie(grammar.dfa, vocab, s), states)
        vector_s = _mean_seconds(lambda s: allowed_tokens_vectorized(grammar.dfa, vocab, s), states)
        hit_s = _mean_seconds(grammar.mask, states)  # every state met is cached by now
        xgr_ms = xgr_grammar.compile_time_s * 1e3 if xgr_grammar else float("nan")
        print(f"{name:14} {grammar.dfa.num_states:6d} {len(states):4d} {grammar.compile_time_s * 1e3:10.2f} "
              f"{xgr_ms:7.2f} {trie_s * 1e3:8.2f} {vector_s * 1e3:9.2f} {hit_s * 1e6:7.2f} "
              f"{np.mean(fills) * 1e6 if fills else float('nan'):11.1f} "
              f"{grammar.cache_info()['mask_bytes'] / 1024:9.0f}")
    print("met: states the walks reached; trie / vector: one mask computed, mean over those states; hit: "
          "Grammar.mask from its cache; xgr fill: xgrammar's fill_next_token_bitmask (packed int32, its masks "
          "precomputed at compile time); cache: minicb's masks held, 1 byte per token per state met")


if __name__ == "__main__":
    main()
