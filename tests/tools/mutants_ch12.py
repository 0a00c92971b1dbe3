"""Planted bugs in chapter 12 of kinds tests/tools/test_mutants.py's first list does not have.

Each is a Mutant (tests/tools/mutant_support.py): a plain text edit of the reference's
source (minicb/structured/token_mask.py), graded as `check 12 --file` grades a
submission; the grade must fail on a test of what the code does (test_mutants.py
runs them with MINICB_GRADER_CHECKS=all).
"""
from __future__ import annotations

from mutant_support import GRAMMAR_GIVEN, Mutant

MUTANTS: list[Mutant] = [
    Mutant(12, 1, "each trie node steps from the state at its own depth, not its parent's (one level off)",
           "allowed_tokens_trie", [("rows[state_at[depth - 1]]", "rows[state_at[depth]]")], GRAMMAR_GIVEN),
    Mutant(12, 2, "a row that allows nothing stays all -inf, so its softmax is NaN (EOS is not let through)",
           "mask_logits", [("if bool(stuck.any()):", "if False:")], GRAMMAR_GIVEN),
    Mutant(12, 2, "the mask is written into the logits in place, so the engine scores the masked logits",
           "mask_logits", [("logits.masked_fill(~allowed", "logits.masked_fill_(~allowed")], GRAMMAR_GIVEN),
    Mutant(12, 3, "EOS is accepted in any state, not only where the text is a whole match", "Grammar.next_state",
           [("return state if self.is_accepting(state) else -1", "return state")], GRAMMAR_GIVEN),
    Mutant(12, 4, "rollback keeps one state too many (off by one)", "Matcher.rollback",
           [("del self.states[len(self.states) - num_tokens:]",
             "del self.states[len(self.states) - num_tokens + 1:]")], GRAMMAR_GIVEN),
]
