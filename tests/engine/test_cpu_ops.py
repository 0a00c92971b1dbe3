"""The compiled norms and rotary (minicb/cpu_ops.py) against chapter 00's PyTorch, and inside the engine.

Each compiled module's oracle is the plain one it inherits from, on the same
input: one row, a few, a prompt's worth; SmolLM2's widths and the tiny model's.
What the kernels do not take (bfloat16, cos/sin broadcast over a batch) must go
to the plain forward unchanged. In the engine, greedy tokens must not depend on
which ran, and "compiled" must really run the kernels.
"""
import pytest
import torch

from minicb import cpu_ops
from minicb.config import EngineConfig
from minicb.model import RMSNorm, Rotary, random_model, rope_cos_sin

from engine_support import tokens_with_each_setting

pytestmark = pytest.mark.skipif(cpu_ops._kernels() is None, reason="needs Numba")


def compiled_twin(norm: RMSNorm) -> RMSNorm:
    twin = RMSNorm(norm.weight.shape[0], norm.eps)
    twin.load_state_dict(norm.state_dict())
    twin.__class__ = cpu_ops.CompiledRMSNorm
    return twin


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 576])
def test_compiled_rms_norm_matches_chapter00s(rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    x = 3 * torch.randn(1, rows, hidden, generator=gen)
    with torch.inference_mode():
        want, got = norm(x), compiled_twin(norm)(x)
    assert got.shape == want.shape
    diff = (got - want).abs()
    assert diff.max() < 1e-5, f"compiled RMSNorm differs by {diff.max():.2e}, worst at row {int(diff.amax(-1).argmax())}"


@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 33), (2, 5)])
def test_compiled_rotary_matches_chapter00s(batch, rows):
    gen = torch.Generator().manual_seed(rows)
    q, k = torch.randn(batch, rows, 9, 64, generator=gen), torch.randn(batch, rows, 3, 64, generator=gen)
    positions = torch.randint(0, 4000, (batch, rows), generator=gen)
    cos, sin = rope_cos_sin(positions, 64, 100000.0, torch.float32)
    with torch.inference_mode():
        want, got = Rotary()(q, k, cos, sin), cpu_ops.CompiledRotary()(q, k, cos, sin)
    for name, a, b in zip("qk", got, want):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)}, want {tuple(b.shape)}"
        assert (a - b).abs().max() < 1e-5, f"compiled rotary's {name} differs by {(a - b).abs().max():.2e}"


def test_compiled_rotary_takes_strided_q_and_k():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 64, 9, generator=gen).transpose(2, 3)  # [1, 6, 9, 64], not contiguous
    k = torch.randn(1, 6, 3, 64, generator=gen)
    cos, sin = rope_cos_sin(torch.arange(6)[None], 64, 100000.0, torch.float32)
    with torch.inference_mode():
        for name, a, b in zip("qk", cpu_ops.CompiledRotary()(q, k, cos, sin), Rotary()(q, k, cos, sin)):
            assert (a - b).abs().max() < 1e-5, f"strided input: rotary's {name} differs by {(a - b).abs().max():.2e}"


def test_what_the_kernels_do_not_take_runs_chapter00s_code():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 4, 16, generator=gen), torch.randn(3, 4, 2, 16, generator=gen)
    cos, sin = rope_cos_sin(torch.arange(4)[None], 16, 10000.0, torch.float32)  # one row of angles for 3
    with torch.inference_mode():
        for a, b in zip(cpu_ops.CompiledRotary()(q, k, cos, sin), Rotary()(q, k, cos, sin)):
            assert torch.equal(a, b), "cos/sin broadcast over the batch should take the plain path"
        norm = RMSNorm(16, 1e-5).to(torch.bfloat16)
        x = torch.randn(2, 16, generator=gen).to(torch.bfloat16)
        assert torch.equal(compiled_twin(norm)(x), norm(x)), "bfloat16 should take the plain path"
    norm = RMSNorm(16, 1e-5)
    x = torch.randn(2, 16, generator=gen, requires_grad=True)
    out = compiled_twin(norm)(x)
    assert out.requires_grad, "a tensor that wants gradients should take the plain path, which keeps them"


def test_use_cpu_ops_switches_the_modules_and_back():
    model = random_model(seed=1)
    keys = list(model.state_dict())
    assert cpu_ops.use_cpu_ops(model, "compiled") == "compiled"
    kinds = {type(m) for m in model.modules()}
    assert {cpu_ops.CompiledRMSNorm, cpu_ops.CompiledRotary} <= kinds and not {RMSNorm, Rotary} & kinds
    assert list(model.state_dict()) == keys, "switching must not change the model's weights or their names"
    assert cpu_ops.use_cpu_ops(model, "torch") == "torch"
    kinds = {type(m) for m in model.modules()}
    assert {RMSNorm, Rotary} <= kinds and not {cpu_ops.CompiledRMSNorm, cpu_ops.CompiledRotary} & kinds
    # A model the kernels cannot run stays on PyTorch, and says so.
    assert cpu_ops.use_cpu_ops(random_model(seed=1).to(torch.bfloat16), "compiled") == "torch"
    with pytest.raises(ValueError, match="cpu_ops='fast'"):
        cpu_ops.use_cpu_ops(model, "fast")
    with pytest.raises(ValueError, match="cpu_ops='fast'"):
        EngineConfig(cpu_ops="fast")


def test_the_engine_gives_the_same_tokens_with_either_setting(monkeypatch):
    calls = []
    kernels = cpu_ops._kernels()
    counted = type(kernels)(**{name: (lambda fn: lambda *args: calls.append(1) or fn(*args))(fn)
                               for name, fn in vars(kernels).items()})
    monkeypatch.setattr(cpu_ops, "_kernels", lambda: counted)
    runs = tokens_with_each_setting("cpu_ops", ("compiled", "torch"), calls)
    (compiled, used), (plain, unused) = runs["compiled"], runs["torch"]
    assert used > 0, "on a CPU in fp32 the engine should run the compiled norms; they never ran"
    assert unused == 0, f"cpu_ops='torch' must switch the kernels off; they ran {unused} times"
    assert compiled == plain, f"tokens differ: compiled {compiled}, torch {plain}"
