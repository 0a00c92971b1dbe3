"""The compiled norms, rotary and SwiGLU (minicb/cpu_ops.py) against chapter 00's PyTorch, and in the engine.

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
from minicb.model import MLP, RMSNorm, Rotary, random_model, rope_cos_sin

from engine_support import tokens_with_each_setting

pytestmark = pytest.mark.skipif(cpu_ops._kernels() is None, reason="needs Numba")


def mlps() -> tuple[MLP, MLP]:
    """The tiny model's first MLP, and its compiled twin."""
    plain, compiled = (random_model(seed=1).model.layers[0].mlp for _ in range(2))
    compiled.__class__ = cpu_ops.CompiledMLP
    return plain, compiled


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


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("width", [64, 1536])
def test_compiled_swiglu_matches_chapter00s(rows, width):
    # The kernel's own exp (a polynomial and the float's exponent bits) against PyTorch's SiLU,
    # over the range a model's gates reach and past where float32's exp overflows (|g| > 88).
    gen = torch.Generator().manual_seed(rows + width)
    gate, up = 6 * torch.randn(1, rows, width, generator=gen), torch.randn(1, rows, width, generator=gen)
    gate[0, 0, :8] = torch.tensor([-200.0, -88.5, -30.0, -1e-4, 0.0, 1e-4, 88.5, 200.0])[:width]
    with torch.inference_mode():
        plain, compiled = mlps()
        want, got = plain.swiglu(gate, up), compiled.swiglu(gate, up)
    assert got.shape == want.shape
    diff = (got - want).abs() - 1e-5 * want.abs()
    worst = divmod(int(diff.argmax()), width)
    assert diff.max() < 1e-6, (f"compiled SwiGLU differs by {(got - want).abs().max():.2e} at (row, column) {worst}: "
                               f"gate {gate.flatten()[diff.argmax()]:.4g}")


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
        gate, up = x, x.flip(0)
        plain, compiled = mlps()
        assert torch.equal(compiled.swiglu(gate, up), plain.swiglu(gate, up)), \
            "bfloat16 SwiGLU should take the plain path"
    norm = RMSNorm(16, 1e-5)
    x = torch.randn(2, 16, generator=gen, requires_grad=True)
    out = compiled_twin(norm)(x)
    assert out.requires_grad, "a tensor that wants gradients should take the plain path, which keeps them"


def test_use_cpu_ops_switches_the_modules_and_back():
    model = random_model(seed=1)
    keys = list(model.state_dict())
    assert cpu_ops.use_cpu_ops(model, "compiled") == "compiled"
    kinds = {type(m) for m in model.modules()}
    assert {cpu_ops.CompiledRMSNorm, cpu_ops.CompiledRotary, cpu_ops.CompiledMLP} <= kinds
    assert not {RMSNorm, Rotary, MLP} & kinds
    assert list(model.state_dict()) == keys, "switching must not change the model's weights or their names"
    assert cpu_ops.use_cpu_ops(model, "torch") == "torch"
    kinds = {type(m) for m in model.modules()}
    assert {RMSNorm, Rotary, MLP} <= kinds
    assert not {cpu_ops.CompiledRMSNorm, cpu_ops.CompiledRotary, cpu_ops.CompiledMLP} & kinds
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
