"""oneDNN-packed linear layers (minicb/packed_linear.py) against nn.Linear, the oracle."""
import pytest
import torch
import torch.nn as nn

from minicb import packed_linear
from minicb.model import DenseAttention, random_model, tiny_config

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (3, 7), (1, 64)])
def test_packed_linear_matches_nn_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = packed_linear.PackedLinear(linear)
    x = torch.randn(*shape, 48)
    with torch.inference_mode():
        want, got = linear(x), packed(x)
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, nn.Linear gives {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"max |packed - nn.Linear| = {err:.2e} at input shape {shape}, bias={bias}"


def test_weight_written_after_packing_is_used():
    """load_state_dict and copy_ write weights in place; the stale packed copy must not be used then."""
    linear = nn.Linear(16, 8, bias=False)
    packed = packed_linear.PackedLinear(linear)
    with torch.no_grad():
        linear.weight.copy_(torch.ones(8, 16))
    x = torch.randn(2, 16)
    with torch.inference_mode():
        got = packed(x)
    torch.testing.assert_close(got, x.sum(-1, keepdim=True).expand(2, 8),
                               msg="after an in-place write the packed layer still used its old weights")


def test_pack_linears_keeps_the_model_and_its_outputs():
    cfg = tiny_config()
    model = random_model(cfg)
    keys = sorted(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).expand(2, 9)
    want = model(ids, positions, DenseAttention())
    packed_linear.pack_linears(model)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.project_qkv, packed_linear.FusedLinears), "q, k and v were not fused"
        assert attn.project_qkv.linears == [attn.q_proj, attn.k_proj, attn.v_proj]
        assert isinstance(mlp.project_gate_up, packed_linear.FusedLinears), "gate and up were not fused"
        assert mlp.project_gate_up.linears == [mlp.gate_proj, mlp.up_proj]
        assert isinstance(attn.o_proj, packed_linear.PackedLinear) and isinstance(mlp.down_proj,
                                                                                  packed_linear.PackedLinear)
    assert isinstance(model.lm_head, packed_linear.PackedLinear)
    assert sorted(model.state_dict()) == keys, "packing changed the state dict's keys"
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "packing untied lm_head from the embedding"
    got = model(ids, positions, DenseAttention())
    err = (got - want).abs().max().item()
    assert err < 1e-3, f"logits moved by {err:.2e} when the linear layers were packed"


def fused_layers(biases):
    torch.manual_seed(0)
    return [nn.Linear(48, out, bias=bias) for out, bias in zip((80, 16, 16), biases)]


@pytest.mark.parametrize("biases", [(False, False, False), (True, False, True)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (3, 7), (1, 64)])
def test_fused_linears_match_each_layer_alone(biases, shape):
    linears = fused_layers(biases)
    fused = packed_linear.FusedLinears(linears)
    x = torch.randn(*shape, 48)
    with torch.inference_mode():
        got = fused(x)
        for i, (linear, out) in enumerate(zip(linears, got)):
            want = linear(x)
            assert out.shape == want.shape, f"output {i}: shape {tuple(out.shape)}, nn.Linear gives {tuple(want.shape)}"
            err = (out - want).abs().max().item()
            assert err < 1e-4, f"output {i}: max |fused - nn.Linear| = {err:.2e} at input {shape}, biases {biases}"


@pytest.mark.parametrize("written", ["weight", "bias"])
def test_fused_linears_use_a_weight_written_after_packing(written):
    linears = fused_layers((False, True, False))
    fused = packed_linear.FusedLinears(linears)
    with torch.no_grad():
        getattr(linears[1], written).add_(1.0)  # in place, as load_state_dict writes
    x = torch.randn(2, 48)
    with torch.inference_mode():
        torch.testing.assert_close(
            fused(x)[1], linears[1](x),
            msg=f"after an in-place write of a {written} the fused product still used the old one")


def test_fused_linears_refuse_layers_of_different_inputs():
    with pytest.raises(ValueError, match=r"one input width; got \[48, 32\]"):
        packed_linear.FusedLinears([nn.Linear(48, 8), nn.Linear(32, 8)])


def test_pack_linears_leaves_other_dtypes_alone():
    model = random_model(tiny_config()).to(torch.bfloat16)
    packed_linear.pack_linears(model)
    assert not any(isinstance(m, packed_linear.PackedLinear) for m in model.modules()), \
        "a bfloat16 model was packed; only CPU float32 models should be"
