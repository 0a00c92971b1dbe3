"""Chapter 00: a Llama-family transformer, written out in ~200 lines.

In this file you will learn what a decoder-only LLM computes for each token:
embed -> N x (RMSNorm -> attention with RoPE and grouped-query heads -> RMSNorm
-> SwiGLU MLP) -> RMSNorm -> logits. The same code runs SmolLM2-135M, any local
Llama / Qwen2 / Mistral checkpoint, and the tiny random model of the tests.

The one unusual thing: the model does not own a KV cache and does not decide how
attention over past tokens is done. Every forward takes an `attention` object
with one method,

    attention(layer, q, k, v) -> out     # q [B, T, n_heads, hd], k/v [B, T, n_kv_heads, hd]

and each chapter passes its own: dense causal attention with no cache
(`DenseAttention`, below), a contiguous cache (chapter 01), a left-padded batch
(chapter 02), a paged KV pool (chapters 04-06). The model stays the same from
chapter to chapter; only the object describing "where do K and V live" changes.

Run `python -m minicb generate "Hi"` to see it talk; chapters/00-the-model/README.md
walks through it, and tests/chapters/test_ch00_model.py checks it against HF transformers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelConfig:
    """Everything the forward pass needs to know about a checkpoint. Defaults are SmolLM2-135M."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v projections
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"minicb runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")


# ----------------------------------------------------------------------------
# The building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Computed in fp32 so bf16/fp16 models stay stable."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for rotary embeddings at arbitrary positions.

    positions [B, T] int -> cos, sin [B, T, 1, head_dim]. Positions are explicit
    (not 0..T-1) because a left-padded row or a decode step starts mid-sequence.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, hd]: the "half split" layout HF checkpoints use
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+hd/2}) by the position's angle. x [B, T, H, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Rotary(nn.Module):
    """Rotary embeddings of q and k: a module with no weights, so that minicb/cpu_ops.py can
    swap in a compiled one that does both in one pass (the same for RMSNorm)."""

    def forward(self, q, k, cos, sin):
        # q [B, T, n_heads, hd], k [B, T, n_kv_heads, hd], cos/sin [B, T, 1, hd] -> q, k rotated
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rotary = Rotary()

    def forward(self, x, cos, sin, attention):
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, cos, sin)
        # Here is the seam every chapter plugs into: store k/v wherever the cache
        # lives and attend over everything this token may see.
        out = attention(self.layer, q, k, v)  # [B, T, n_heads, hd]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))

    def project_qkv(self, x):
        # x [B, T, hidden] -> q [B, T, n_heads * hd], k and v [B, T, n_kv_heads * hd]. Three
        # matmuls of one input: minicb/packed_linear.py makes them one on a CPU.
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self.swiglu(*self.project_gate_up(x)))

    def project_gate_up(self, x):
        # x [..., hidden] -> gate, up [..., intermediate]; one matmul on a CPU, as project_qkv
        return self.gate_proj(x), self.up_proj(x)

    def swiglu(self, gate, up):
        # gate, up [..., intermediate] -> silu(gate) * up; minicb/cpu_ops.py compiles this part
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    # Named like HF's `model.` prefix so checkpoint keys load without renaming.
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """The causal LM. `forward(input_ids, positions, attention)` returns logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] -> logits [B, T, vocab] (fp32).

        `logits_at` [B, K] (optional) picks which token positions get logits. A
        generation step only needs the last token of each sequence, and the
        576 x 49152 lm_head is the largest matmul in the model, so skipping it
        for prompt tokens saves real time. Then the result is [B, K, vocab].
        """
        return self.logits(self.hidden_states(input_ids, positions, attention), logits_at)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """input_ids, positions [B, T] -> the last layer's output [B, T, hidden], before the final norm."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return x

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states' output [B, T, hidden] -> logits [B, T, vocab] fp32 (or [B, K, vocab] at `logits_at`)."""
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, hidden]
        return self.lm_head(self.model.norm(x)).float()


# ----------------------------------------------------------------------------
# The simplest `attention` object: no cache at all.


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads, in [B, T, H, hd] layout.

    q [B, Tq, n_heads, hd], k/v [B, Tk, n_kv_heads, hd], mask broadcastable to
    [B, 1, Tq, Tk] (True = may attend). Each KV head serves n_heads / n_kv_heads
    query heads; `enable_gqa` lets SDPA do that without copying K and V.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)  # [B, Tq, n_heads, hd]


class DenseAttention:
    """Recompute attention over the whole sequence given in this forward (no cache).

    `padding_mask` [B, T] (True = real token) supports left-padded batches; it is
    combined with the causal mask.
    """

    def __init__(self, padding_mask: torch.Tensor | None = None):
        self.padding_mask = padding_mask

    def __call__(self, layer, q, k, v):
        if self.padding_mask is None:
            return attend(q, k, v, None, is_causal=True)
        T = q.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal[None, None] & self.padding_mask[:, None, None, :]  # [B, 1, T, T]
        # A padding query row would have nothing to attend to (NaN); let it see itself.
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)[None, None]
        return attend(q, k, v, mask)


def random_model(cfg: ModelConfig | None = None, seed: int = 0) -> Model:
    """A small model with random weights, for tests and shape-only notebooks.

    The same `seed` gives the same weights, and the global torch RNG is left
    alone: the weights come from a private generator, so calling this does not
    change what the caller's own torch.randn draws next.
    """
    cfg = cfg or tiny_config()
    # nn.Linear's own initialisation draws from the global RNG; fork_rng puts the
    # global state back afterwards. Every parameter is overwritten below anyway.
    with torch.random.fork_rng(devices=[]):
        model = Model(cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm gains near 1, as in a trained model
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.normal_(0.0, 0.5 / math.sqrt(p.shape[-1]), generator=generator)
    return model.eval()


def tiny_config(**overrides) -> ModelConfig:
    """2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), a 256-token vocab."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2])
    base.update(overrides)
    return ModelConfig(**base)
