"""The server's tokenizer over HTTP (/tokenize, /detokenize, /tokenizer_info) and GET /v1/models/{id}.

The oracle is minicb's own tokenizer, called in this process: what /tokenize
answers must be `Tokenizer.encode` (or the chat template's ids), and /detokenize
must give the text back. On SmolLM2's real tokenizer (loaded in about two
seconds; no model weights) behind the tiny random model: these routes never
reach the engine, so the model behind them only sets max_model_len. Then the
byte tokenizer of the other server tests, and a model served by token ids alone,
which has no tokenizer to lend.
"""
from __future__ import annotations

import httpx
import pytest

from minicb.llm import LLM
from minicb.serve.app import create_app
from minicb.serve.server import serve_in_thread
from minicb.tokenizer import load_tokenizer

from serve_support import TINY, ByteTokenizer, tiny_model, tiny_server

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a name with a "/", as a hub id has
ERROR_KEYS = {"message", "type", "param", "code"}
TEXTS = ["Hello world", "  two spaces, tabs\tand\nnew lines", "Ça va? 😀 日本語", "",
         "<|im_start|>user\nhi<|im_end|>"]  # the last is special tokens as text: tokenized as special tokens


@pytest.fixture(scope="module")
def smol():
    """(client, tokenizer, max_model_len) of a server with SmolLM2's tokenizer, served as SMOL."""
    tokenizer = load_tokenizer()
    llm = LLM.from_model(tiny_model(), tokenizer, max_num_seqs=4)
    with serve_in_thread(create_app(llm, SMOL), shutdown_timeout=2.0) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        yield client, tokenizer, llm.engine.limits.max_model_len


def refused(response, param: str, status: int = 400) -> dict:
    """The error of a refused request, checked for OpenAI's shape and the field it names."""
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"], error
    assert error["param"] == param, f"param {error['param']!r}, expected {param!r}: {error}"
    return error


# ---- SmolLM2's tokenizer ------------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip_on_smollm2(smol):
    client, tokenizer, max_model_len = smol
    for text in TEXTS:
        answer = client.post("/tokenize", json={"model": SMOL, "prompt": text}).json()
        ids = tokenizer.encode(text)
        assert answer == {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}, text
        back = client.post("/detokenize", json={"model": SMOL, "tokens": answer["tokens"]}).json()
        assert back == {"prompt": text}, f"the round trip changed {text!r} into {back['prompt']!r}"
    assert tokenizer.encode("<|im_start|>")[0] == tokenizer.hf.bos_token_id, "a special token's text is the token"
    # The vocabulary's own spelling of each token, as vLLM returns it ("Ġ" is byte-level BPE's space).
    answer = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert answer["token_strs"] == ["Hello", "Ġworld"] == tokenizer.hf.convert_ids_to_tokens(answer["tokens"])
    # add_special_tokens asks the tokenizer for what it puts around a text; SmolLM2's puts nothing.
    answer = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": True}).json()
    assert answer["tokens"] == tokenizer.hf.encode("Hello world", add_special_tokens=True)


def test_tokenize_a_chat_is_what_the_chat_template_makes(smol):
    client, tokenizer, _ = smol
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    answer = client.post("/tokenize", json={"messages": chat}).json()
    assert answer["tokens"] == tokenizer.apply_chat_template(chat) and answer["count"] == len(answer["tokens"])
    # Without the assistant's header: the chat as it stands.
    bare = client.post("/tokenize", json={"messages": chat, "add_generation_prompt": False}).json()["tokens"]
    assert bare == tokenizer.apply_chat_template(chat, add_generation_prompt=False)
    header = tokenizer.encode("<|im_start|>assistant\n")
    assert answer["tokens"] == bare + header, "the generation prompt is the assistant turn's header"
    # Text parts are joined, as the chat route joins them.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert client.post("/tokenize", json={"messages": parts}).json()["tokens"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}])


def test_tokenizer_info_on_smollm2(smol):
    client, tokenizer, max_model_len = smol
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == tokenizer.eos_token_id == 2
    assert info["bos_token"] == "<|im_start|>" and info["bos_token_id"] == 1
    assert info["vocab_size"] == len(tokenizer.hf) == 49152
    assert info["chat_template"] == tokenizer.hf.chat_template and "<|im_start|>" in info["chat_template"]
    assert info["tokenizer_class"] == type(tokenizer.hf).__name__
    assert info["max_model_len"] == max_model_len
    assert info["model_max_length"] is None, "SmolLM2's tokenizer sets no limit (HF's 1e30 sentinel)"


def test_model_by_id_even_with_a_slash(smol):
    client, _, max_model_len = smol
    card = client.get(f"/v1/models/{SMOL}")
    assert card.status_code == 200, card.text
    listed = client.get("/v1/models").json()["data"][0]
    drop_time = (lambda c: {k: v for k, v in c.items() if k != "created"})
    assert drop_time(card.json()) == drop_time(listed) == {"id": SMOL, "object": "model", "owned_by": "minicb",
                                                            "max_model_len": max_model_len}
    for other in ("SmolLM2-135M-Instruct", "HuggingFaceTB/other", "gpt-4", f"{SMOL}/extra"):
        error = refused(client.get(f"/v1/models/{other}"), "model", 404)
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error", error
        assert repr(other) in error["message"] and SMOL in error["message"], error


# ---- what is refused, by name ---------------------------------------------------------------------------

REFUSED = {
    # vLLM fields minicb does not honour: a 400 naming each, never accepted and ignored.
    "a chat template of the client's": ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{x}}"},
                                        "chat_template"),
    "continue_final_message": ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
                               "continue_final_message"),
    "tools": ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
    "a misspelt field": ({"prompt": "hi", "return_token_str": True}, "return_token_str"),
    # Fields that mean nothing for what was sent.
    "both a prompt and messages": ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    "neither": ({"model": SMOL}, "prompt"),
    "add_generation_prompt with a prompt": ({"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
    "add_special_tokens with a chat": ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
                                       "add_special_tokens"),
    # The shapes.
    "an empty chat": ({"messages": []}, "messages"),
    "a prompt of token ids": ({"prompt": [1, 2]}, "prompt"),
    "a lone surrogate": ({"prompt": "a\ud800"}, "prompt"),
    "another model": ({"prompt": "hi", "model": "gpt-4"}, "model"),
}


def test_what_tokenize_and_detokenize_refuse(smol):
    client, _, _ = smol
    for name, (body, param) in REFUSED.items():
        if name == "a lone surrogate":  # Python's JSON encoder would escape it as \ud800: send that
            response = client.post("/tokenize", content=b'{"prompt": "a\\ud800"}',
                                   headers={"Content-Type": "application/json"})
        else:
            response = client.post("/tokenize", json=body)
        error = refused(response, param)
        assert name != "another model" or error["code"] == "model_not_found", error
    for tokens in ([5, 49152], [-1], [2**70]):
        error = refused(client.post("/detokenize", json={"tokens": tokens}), "tokens")
        assert error["code"] == "token_id_out_of_range" and "0 to 49151" in error["message"], error
    refused(client.post("/detokenize", json={"tokens": ["hello"]}), "tokens")
    refused(client.post("/detokenize", json={"tokens": [1], "skip_special_tokens": True}), "skip_special_tokens")
    refused(client.post("/detokenize", json={"tokens": [1], "prompt": "hi"}), "prompt")
    assert refused(client.post("/detokenize", json={}), "tokens")["code"] == "missing"
    # 2.0 is a JSON integer: it is the id 2.
    assert client.post("/detokenize", json={"tokens": [2.0]}).json() == {"prompt": "<|im_end|>"}
    assert client.get("/health").json()["status"] == "ok"


# ---- the byte tokenizer, and a model with no tokenizer at all ------------------------------------------


def test_the_byte_tokenizer_answers_the_same_routes():
    tokenizer = ByteTokenizer()
    with tiny_server() as (url, app), httpx.Client(base_url=url, timeout=30) as client:
        answer = client.post("/tokenize", json={"model": TINY, "prompt": "Ça", "return_token_strs": True}).json()
        assert answer["tokens"] == list("Ça".encode()) == tokenizer.encode("Ça")
        assert answer["token_strs"] == ["\\xc3", "\\x87", "a"], "half a character reads as its byte"
        assert client.post("/detokenize", json={"tokens": answer["tokens"]}).json() == {"prompt": "Ça"}
        chat = [{"role": "user", "content": "hi"}]
        assert client.post("/tokenize", json={"messages": chat}).json()["tokens"] == tokenizer.apply_chat_template(
            chat)
        info = client.get("/tokenizer_info").json()
        assert (info["tokenizer_class"], info["vocab_size"], info["eos_token_id"]) == ("ByteTokenizer", 256, 2)
        assert info["max_model_len"] == app.state.loop.engine.limits.max_model_len
        refused(client.post("/detokenize", json={"tokens": [256]}), "tokens")


def test_a_model_without_a_tokenizer_says_so():
    app = create_app(LLM.from_model(tiny_model(), None, max_num_seqs=4), TINY)
    with serve_in_thread(app, shutdown_timeout=2.0) as url, httpx.Client(base_url=url, timeout=30) as client:
        for path, body, param in (("/tokenize", {"prompt": "hi"}, "prompt"),
                                  ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                                  ("/detokenize", {"tokens": [1, 2]}, "tokens")):
            error = refused(client.post(path, json=body), param)
            assert error["code"] == "no_tokenizer" and "without a tokenizer" in error["message"], error
        error = refused(client.get("/tokenizer_info"), None)
        assert error["code"] == "no_tokenizer", error
        # Token ids still work where they always did.
        answer = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True,
                                                      "return_token_ids": True})
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 3, answer.text
        assert client.get(f"/v1/models/{TINY}").status_code == 200
