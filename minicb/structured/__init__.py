"""Chapter 12: structured output -- constrained decoding with a grammar.

In this package you will learn how a server makes a model's text take a given
shape (a regex, one of a few strings, JSON of a schema) without touching the
model: before each sampling step, every token that would break the shape gets
masked. One concern per file, in the order a request uses them:

    json_schema.py       a JSON schema -> a regex
    regex.py             a regex -> a byte DFA, trimmed and minimal (given)
    token_mask.py        the DFA + the vocabulary -> the tokens each state allows; Grammar, Matcher (the lesson)
    backend.py           the interface both backends answer to: compile_grammar, GrammarCache
    xgrammar_backend.py  the same interface from xgrammar, the oracle the tests hold minicb to

    from minicb.structured.backend import compile_grammar
    from minicb.structured.token_mask import TokenVocabulary

Nothing is imported here, so `python -m minicb.structured.token_mask` (the
benchmark) runs its file once. Chapter text: chapters/12-structured-output/README.md.
"""
