"""Chapter 12: a grammar as a rule of the engine's one loop.

In this file you will learn how structured output joins the engine without a
second path beside the loop. A request's grammar is one more rule on its
logits rows, like chapter 01's penalties, and one more source of drafts, like
chapter 11's n-grams:

- **The mask is a logits rule.** Before a guided row is sampled, every token the
  grammar forbids gets -inf (`Guide.mask_rows`). The softmax then renormalises
  over the allowed tokens by itself: greedy takes the best allowed token,
  sampling draws from p(token) / p(allowed) -- the model's distribution,
  conditioned on the text staying valid.
- **The state advances on accepted tokens.** After postprocess appends a token to
  a completion, its Guide accepts it (`Guide.accept`). A completion forked for
  n > 1 gets a copy of its parent's state (`Guide.fork`), taken before the
  parent's first token. A preempted completion keeps its output tokens, and its
  state is exactly the state after them, so it needs nothing.
- **Drafts stay inside the grammar.** A draft that leaves the grammar would be
  rejected anyway, and the masks of the rows after it would not exist; so
  chapter 11's drafts are cut to their longest valid prefix, and the verify rows
  are masked along them: row j after drafts[:j] (the state walks forward over
  the drafts and rolls back, `mask_rows`).
- **Forced tokens are drafts (jump-forward).** Where the grammar allows a single
  continuation ('"name": ' after '{'), its tokens cost no sampling: they are
  proposed as drafts, and one forward verifies them all. The verifier accepts
  exactly what sampling under the mask would have chosen, so the tokens are the
  same with jump-forward on or off; only the number of forwards changes.
- **Grammars compile once, without stalling the loop.** `Grammars` compiles each
  distinct (kind, spec) once, on a worker thread; a request waits outside the
  scheduler until its grammar is ready, and the others keep running.

The grammars themselves (regex -> DFA -> token masks) are in regex.py and
token_mask.py; xgrammar's, behind the same interface, in xgrammar_backend.py.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

import torch

from minicb.sampling import StructuredOutput
from minicb.structured import token_mask as reference_token_mask
from minicb.structured.backend import GrammarCache, canonical_spec, make_compiler, to_regex
from minicb.structured.token_mask import mask_logits


class Guide:
    """One completion's grammar state, and the rule it puts on that completion's rows.

    matcher: a StructuredMatcher (minicb/structured/backend.py) at the position
    after the completion's output so far. tokenizer: to spell forced bytes as
    tokens (jump-forward). eos_token_ids: the model's. mask_logits: the rule that puts
    a mask on logits (token_mask.py's, or a student's chapter 12). Tokens enter only
    through accept(); drafts are walked and rolled back inside mask_rows() and cut().
    """

    def __init__(self, matcher, tokenizer, jump_forward: bool, eos_token_ids: list[int], mask_logits=mask_logits):
        self.matcher, self.tokenizer, self.jump_forward = matcher, tokenizer, jump_forward
        self.eos_token_ids, self.mask_logits = eos_token_ids, mask_logits

    def fork(self) -> Guide:
        return Guide(self.matcher.fork(), self.tokenizer, self.jump_forward, self.eos_token_ids, self.mask_logits)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept(token_id):
            raise RuntimeError(f"token {token_id} was sampled under a grammar mask that forbids it (after "
                               f"{self.matcher.num_accepted} tokens): the mask and the sampler disagree")

    def cut(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows from here."""
        kept = 0
        for token in drafts:
            if not self.matcher.accept(token):
                break
            kept += 1
        self.matcher.rollback(kept)
        return drafts[:kept]

    def drafts(self, proposed: list[int], max_drafts: int) -> list[int]:
        """What this completion verifies next: the forced tokens when the grammar forces some and
        jump-forward is on, else the proposed (n-gram) drafts' valid prefix; at most max_drafts."""
        if max_drafts < 1:
            return []
        forced = self.matcher.forced_tokens(self.tokenizer) if self.jump_forward else []
        return self.cut(forced[:max_drafts] if forced else proposed[:max_drafts])

    def allowed(self, drafts: list[int]) -> torch.Tensor:
        """The tokens allowed at each of 1 + len(drafts) rows: row j after drafts[:j]. -> bool [1 + len(drafts), V].

        The state walks over the drafts (which cut() made valid) and rolls back, so
        nothing is accepted here."""
        if not drafts:
            return self.matcher.mask()[None]
        masks = []
        for j in range(len(drafts) + 1):
            masks.append(self.matcher.mask())
            if j < len(drafts):
                self.matcher.accept(drafts[j])
        self.matcher.rollback(len(drafts))
        return torch.stack(masks)

    def mask_rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [1 + len(drafts), V] -> the same with every token the grammar forbids there at -inf."""
        return self.mask_logits(logits, self.allowed(drafts).to(logits.device), self.eos_token_ids)


class VerifierOnly:
    """Chapter 11's verifier and rollback without its n-gram drafts: jump-forward with speculation off."""

    def __init__(self, speculator):
        self.speculator = speculator

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        return []

    def verify(self, *args):
        return self.speculator.verify(*args)

    def rollback(self, *args) -> None:
        self.speculator.rollback(*args)


class Grammars:
    """The engine's grammar part: what requests' StructuredOutput compile to, once each, on a worker thread.

    vocab: the TokenVocabulary of the model's tokenizer (token_mask.py), or a
    function that makes it, called when the first guided request arrives (reading
    49,152 tokens' bytes is not free, and most engines never need it). tokenizer:
    anything with encode(text) -> ids, to spell forced text as tokens (jump-forward).
    backend and jump_forward: EngineConfig.structured_backend and .jump_forward.
    token_mask: chapter 12's module, whose Grammar minicb's backend compiles to and
    whose mask_logits masks the rows: token_mask.py, until an engine gives its own
    (`use`, with EngineParts.token_mask(): the reference's, or a student's file).
    """

    def __init__(self, vocab, tokenizer, eos_token_ids: list[int], backend: str = "minicb",
                 jump_forward: bool = False, token_mask: ModuleType = reference_token_mask):
        self._vocab, self.tokenizer, self.eos_token_ids = vocab, tokenizer, list(eos_token_ids)
        self.backend, self.jump_forward, self.token_mask = backend, jump_forward, token_mask
        self._cache: GrammarCache | None = None
        self._compiling: dict[tuple[str, str], Future] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minicb-grammar")

    @classmethod
    def for_tokenizer(cls, tokenizer, eos_token_ids: list[int], vocab_size: int, backend: str = "minicb",
                      jump_forward: bool = False) -> Grammars:
        """An engine's Grammars for a minicb Tokenizer, its vocabulary read when first needed. vocab_size:
        the model's logits' width (a model may have more rows than its tokenizer has tokens)."""
        from minicb.structured.token_mask import TokenVocabulary
        return cls(lambda: TokenVocabulary.from_tokenizer(tokenizer, eos_token_ids, vocab_size), tokenizer,
                   eos_token_ids, backend, jump_forward)

    def use(self, token_mask: ModuleType) -> None:
        """Compile and mask with `token_mask`'s code from now on. Refused once a grammar was compiled
        (its matchers are another module's), so two engines of different code cannot share one."""
        if token_mask is not self.token_mask and self._compiling:
            raise RuntimeError(f"these Grammars compiled with {self.token_mask.__name__} already; give the engine "
                               f"its own Grammars to run {token_mask.__name__}")
        self.token_mask = token_mask

    def mask_logits(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """logits [R, V], allowed [R, V] bool -> every token a row forbids at -inf (token_mask's mask_logits)."""
        return self.token_mask.mask_logits(logits, allowed, self.eos_token_ids)

    def check(self, structured: StructuredOutput) -> None:
        """Raise ValueError naming what is not supported (a schema keyword, a regex construct). Cheap:
        the schema becomes a regex and the regex is parsed; the automaton is built later."""
        canonical_spec(structured.kind, structured.spec)
        if self.backend == "minicb":
            from minicb.structured.regex import parse
            parse(to_regex(structured.kind, structured.spec))

    def compile(self, structured: StructuredOutput) -> Future:
        """A Future of the compiled grammar, started now or earlier for the same (kind, spec)."""
        key = (structured.kind, canonical_spec(structured.kind, structured.spec))
        future = self._compiling.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._compiling[key] = self._worker.submit(self._compile, structured)
        return future

    def _compile(self, structured: StructuredOutput):
        if self._cache is None:
            vocab = self._vocab() if callable(self._vocab) else self._vocab
            self._cache = GrammarCache(make_compiler(vocab, self.backend, self.token_mask.Grammar))
        return self._cache.get(structured.kind, structured.spec)

    def guide(self, grammar) -> Guide:
        """A new completion's Guide, at the grammar's start."""
        return Guide(grammar.matcher(), self.tokenizer, self.jump_forward, self.eos_token_ids,
                     self.token_mask.mask_logits)
