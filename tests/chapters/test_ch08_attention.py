"""Chapter 08: the causal mask of a chunk, in PyTorch and in Triton.

The oracle is ordinary causal attention over the whole sequence (PyTorch's
scaled_dot_product_attention with is_causal=True): a chunk's q_len new tokens
are its last q_len rows, so attending from them to the whole context with the
offset mask must give exactly those rows. The Triton version runs under the
interpreter on a CPU, on small shapes.

Run against your own code with `python -m minicb check 8`.
"""
import pytest
import torch

from minicb import impl

GRADED_MODULE = "chunked_prefill"  # the one_task fixture (conftest.py) grades one task at a time
pytestmark = pytest.mark.usefixtures("one_task")

# (context_len, q_len, n_heads, n_kv_heads, head_dim): a chunk mid-sequence, GQA, a whole
# prompt (q_len = context_len), a decode (q_len = 1), odd sizes; and chunks of 16 and 33 new
# tokens, which fill a kernel's query tile of 16 (or 32) rows exactly, then spill one row over.
CASES = [(13, 5, 6, 2, 16), (9, 9, 4, 4, 8), (17, 1, 6, 3, 16), (7, 3, 2, 1, 24), (20, 11, 3, 3, 4),
         (16, 16, 2, 1, 8), (40, 33, 2, 2, 16)]


def cp():
    """The graded module (your exercise under `check 8`), read when the test runs."""
    return impl.load("chunked_prefill")


def oracle(q_full, k, v, scale=None):
    """Causal attention over every position; [context_len, n_heads, head_dim]."""
    group = q_full.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q_full.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


def inputs(context_len, n_heads, n_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(context_len, n_heads, head_dim, generator=g),
            torch.randn(context_len, n_kv_heads, head_dim, generator=g),
            torch.randn(context_len, n_kv_heads, head_dim, generator=g))


@pytest.mark.task(2)
@pytest.mark.parametrize("q_len,context_len", [(3, 7), (1, 5), (4, 4), (0, 3), (2, 2)])
def test_offset_causal_mask_by_hand(q_len, context_len):
    got = cp().offset_causal_mask(q_len, context_len)
    want = torch.tensor([[j <= context_len - q_len + r for j in range(context_len)] for r in range(q_len)],
                        dtype=torch.bool).reshape(q_len, context_len)
    assert got.dtype == torch.bool and got.shape == want.shape, f"want bool {tuple(want.shape)}, got {got.dtype} " \
                                                                f"{tuple(got.shape)}"
    assert torch.equal(got, want), f"q_len {q_len}, context_len {context_len}:\n got\n{got.int()}\n want\n{want.int()}"


@pytest.mark.task(2)
@pytest.mark.parametrize("context_len,q_len,n_heads,n_kv_heads,head_dim", CASES)
def test_chunk_attention_equals_the_chunks_rows_of_causal_attention(context_len, q_len, n_heads, n_kv_heads,
                                                                     head_dim):
    q_full, k, v = inputs(context_len, n_heads, n_kv_heads, head_dim)
    got = cp().chunk_attention(q_full[context_len - q_len:], k, v)
    want = oracle(q_full, k, v)[context_len - q_len:]
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err < 1e-5, f"max abs error {err:.2e} against causal attention's last {q_len} rows"


@pytest.mark.task(2)
def test_chunk_attention_scale_and_errors():
    q_full, k, v = inputs(6, 4, 2, 8)
    got = cp().chunk_attention(q_full[4:], k, v, scale=0.5)
    err = (got - oracle(q_full, k, v, scale=0.5)[4:]).abs().max().item()
    assert err < 1e-5, f"scale=0.5: max abs error {err:.2e}"
    for bad, match in [((q_full, k[:5], v[:5]), "q_len"),  # 6 new tokens after a context of 5
                       ((q_full[:, :3], k, v), "multiple"),  # 3 query heads over 2 KV heads
                       ((q_full, k, v[:, :, :4]), "shape")]:
        with pytest.raises(ValueError, match=match):
            cp().chunk_attention(*bad)
    with pytest.raises(ValueError, match="-1"):
        cp().offset_causal_mask(-1, 4)


@pytest.mark.task(3)
@pytest.mark.parametrize("context_len,q_len,n_heads,n_kv_heads,head_dim", CASES)
def test_chunk_attention_triton_equals_the_chunks_rows_of_causal_attention(context_len, q_len, n_heads,
                                                                            n_kv_heads, head_dim, device):
    q_full, k, v = (t.to(device) for t in inputs(context_len, n_heads, n_kv_heads, head_dim, seed=1))
    got = cp().chunk_attention_triton(q_full[context_len - q_len:], k, v)
    want = oracle(q_full, k, v)[context_len - q_len:]
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"max abs error {err:.2e} against causal attention's last {q_len} rows"


@pytest.mark.task(3)
def test_chunk_attention_triton_uses_the_scale_it_is_given(device):
    q_full, k, v = (t.to(device) for t in inputs(6, 4, 2, 8, seed=2))
    got = cp().chunk_attention_triton(q_full[4:], k, v, scale=0.5)
    err = (got - oracle(q_full, k, v, scale=0.5)[4:]).abs().max().item()
    assert err < 1e-4, (f"chunk_attention_triton(..., scale=0.5): max abs error {err:.2e} against causal "
                        f"attention with scale 0.5 (1/sqrt(head_dim) would be {8 ** -0.5:.3f}); use the scale given")


@pytest.mark.task(3)
def test_chunk_attention_triton_errors(device):
    q_full, k, v = (t.to(device) for t in inputs(6, 4, 2, 8))
    with pytest.raises(ValueError, match="q_len"):
        cp().chunk_attention_triton(q_full, k[:5], v[:5])
    with pytest.raises(ValueError, match="multiple"):
        cp().chunk_attention_triton(q_full[:, :3], k, v)
