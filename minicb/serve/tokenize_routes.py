"""The server's tokenizer over HTTP: POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's shapes.

In this file you will learn why a serving API lends out its tokenizer. A client
that must count tokens (an eval harness fitting a few-shot prompt into the
context, a load tester making prompts of 128 tokens, a chat UI showing what is
left) needs the model's own tokenizer, and usually fetches it from a model hub.
These routes let it ask the server instead, which also answers for the chat
template exactly as a chat request would be rendered:

    POST /tokenize    {"prompt": "Hello world"}                       # or "messages": [...] (a chat)
      -> {"count": 2, "max_model_len": 8192, "tokens": [19556, 905], "token_strs": null}
         with "add_special_tokens": true, what the tokenizer puts around a text by itself (a BOS);
         with "return_token_strs": true, "token_strs": ["Hello", "Ġworld"] (the vocabulary's spelling);
         a chat ends with the assistant turn's header unless "add_generation_prompt": false.
    POST /detokenize  {"tokens": [19556, 905]}  ->  {"prompt": "Hello world"}
    GET  /tokenizer_info  ->  {"tokenizer_class", "vocab_size", "bos_token", "bos_token_id", "eos_token",
                               "eos_token_id", ..., "model_max_length", "max_model_len", "chat_template"}

Every request may name the model ("model"), as vLLM's do. Three choices, each so
that what a client learns here is what the server does:

- A prompt is tokenized as /v1/completions tokenizes it: without special tokens
  unless the client asks (vLLM's default is to add them, because its
  completions add them too; minicb's never do).
- /detokenize keeps special tokens in the text, so that
  tokenize -> detokenize gives back the text, "<|im_start|>" and all. An id
  outside the vocabulary is a 400 naming "tokens", not a crash in the tokenizer.
- Fields minicb does not honour (vLLM's "chat_template", "tools",
  "continue_final_message", ...) are refused with a 400 naming them
  (`extra="forbid"`, turned into OpenAI's error shape by app.py's
  `invalid_request`), and so are fields that mean nothing for what was sent
  ("add_generation_prompt" with a prompt). A model served by token ids alone
  (no tokenizer) answers all three routes with a 400 saying so.

The tokenizer is the server's: minicb.tokenizer.Tokenizer (SmolLM2's, HF's
underneath) or minicb.serve.tiny.ByteTokenizer; beside encode and decode, the
routes read its `vocab_size`, `token_strs` and `info()`. The routes are on
`router`, which create_app (minicb/serve/app.py) includes: it imports this module
when it builds an app, because these routes take its `Server` dependency.
Tests: tests/serve/test_server_tokenizer.py.
"""
from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field, field_validator

from minicb.serve import chat
from minicb.serve import protocol as p
from minicb.serve.app import APIError, Server, ServerState, check_model

# ---- the wire format --------------------------------------------------------------------------------


class TokenizeRequest(p._Strict):
    """POST /tokenize: a text (`prompt`) or a chat (`messages`), one of the two."""

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # a prompt's; None: as /v1/completions (none added)
    add_generation_prompt: bool | None = None  # a chat's; None: True, as /v1/chat/completions
    return_token_strs: bool = False

    _prompt_is_text = field_validator("prompt")(lambda cls, prompt: p._unicode(prompt))


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the most tokens a prompt and its completion may take on this server
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(p._Strict):
    model: str | None = None
    tokens: list[int]

    _ints = field_validator("tokens", mode="before")(lambda cls, tokens: p._integral(tokens))


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info. vLLM's answer is its tokenizer's whole config; these are the parts a
    client uses (lm-eval's remote tokenizer reads the special tokens and the template)."""

    tokenizer_class: str
    vocab_size: int
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None
    model_max_length: int | None  # the tokenizer's own limit; None when it sets none (HF's 1e30)
    max_model_len: int  # this server's: what a request may take
    chat_template: str | dict[str, str] | None  # the Jinja source (named templates: a dict); None if not Jinja


# ---- the routes ---------------------------------------------------------------------------------------

router = APIRouter()


def tokenizer_of(server: ServerState, param: str | None):
    """The served model's tokenizer, or a 400 when it is served by token ids alone."""
    if server.tokenizer is None:
        raise APIError(400, "this model is served without a tokenizer (by token ids alone), so it cannot tokenize, "
                            "detokenize or describe one; send token ids to /v1/completions", param, "no_tokenizer")
    return server.tokenizer


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, server: Server):
    check_model(server, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give the text to tokenize as \"prompt\" (a string) or as \"messages\" (a chat), "
                            f"one of the two; got {'both' if req.prompt is not None else 'neither'}", "prompt")
    if req.prompt is not None:
        if req.add_generation_prompt is not None:
            raise APIError(400, "add_generation_prompt is for \"messages\": a prompt is tokenized as it is",
                           "add_generation_prompt")
        tokenizer = tokenizer_of(server, "prompt")
        ids = tokenizer.encode(req.prompt, add_special_tokens=bool(req.add_special_tokens))
    else:
        if req.add_special_tokens:  # false is what a chat gets anyway
            raise APIError(400, "add_special_tokens=true is for a \"prompt\": a chat's special tokens are the ones "
                                "its template writes", "add_special_tokens")
        tokenizer = tokenizer_of(server, "messages")
        add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        try:
            ids = chat.render(tokenizer, req.messages, add_generation_prompt)
        except Exception as e:  # the template's own complaint, as /v1/chat/completions words it
            raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None
    return TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids,
                            token_strs=tokenizer.token_strs(ids) if req.return_token_strs else None)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, server: Server):
    check_model(server, req.model)
    tokenizer = tokenizer_of(server, "tokens")
    vocab = tokenizer.vocab_size
    outside = [(i, t) for i, t in enumerate(req.tokens) if not 0 <= t < vocab]
    if outside:
        i, t = outside[0]
        raise APIError(400, f"tokens[{i}] is {t}, which is not a token id of this tokenizer: ids are 0 to "
                            f"{vocab - 1} ({len(outside)} of the {len(req.tokens)} ids are outside)", "tokens",
                       "token_id_out_of_range")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))


@router.get("/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info(server: Server):
    return TokenizerInfo(**tokenizer_of(server, None).info(), max_model_len=server.max_model_len)
