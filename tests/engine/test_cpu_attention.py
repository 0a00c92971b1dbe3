"""The compiled CPU decode kernel against chapter 04's gather, and inside the engine.

minicb/cpu_attention.py is what the engine's torch backend runs for decodes on
a CPU. Its oracle is chapter 04's version 1 (gather + SDPA) on the same pool:
lengths of 1, of exactly a block, and ragged; GQA and plain multi-head; blocks
scattered at random. In the engine, greedy tokens must not depend on which of
the two decodes ran.
"""
import pytest
import torch

from minicb import cpu_attention
from minicb.paged_attention import paged_decode_attention_gather

from engine_support import tokens_with_each_setting

pytestmark = pytest.mark.skipif(not cpu_attention._has_numba(), reason="needs Numba")


def scattered_pool(context_lens, n_q_heads, n_kv_heads, head_dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(blocks) + 1), -1, dtype=torch.int32)  # -1 past the end
    taken = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[taken:taken + count]
        taken += count
    k_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(context_lens), n_q_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("context_lens,n_q_heads,n_kv_heads,head_dim,block_size", [
    ([1, 16, 17, 5, 40], 9, 3, 64, 16),  # SmolLM2's heads; one token, a full block, one past it
    ([3, 8, 1], 4, 4, 8, 4),  # plain multi-head attention, tiny blocks
    ([33, 2, 64, 7], 8, 2, 16, 8),  # GQA groups of 4
])
def test_matches_chapter04s_gather(context_lens, n_q_heads, n_kv_heads, head_dim, block_size):
    args = scattered_pool(context_lens, n_q_heads, n_kv_heads, head_dim, block_size)
    got = cpu_attention.paged_decode_attention(*args)
    want = paged_decode_attention_gather(*args)
    diff = (got - want).abs()
    worst = int(diff.amax(dim=(1, 2)).argmax())
    assert diff.max() < 1e-5, (f"compiled kernel differs from chapter 04's gather by {diff.max():.2e}, worst at "
                               f"sequence {worst} (context length {context_lens[worst]})")
    scaled = cpu_attention.paged_decode_attention(*args, scale=0.5)
    assert (scaled - paged_decode_attention_gather(*args, scale=0.5)).abs().max() < 1e-5, "a custom scale is ignored"


@pytest.mark.parametrize("order", ["rising", "falling", "random"])
def test_matches_the_gather_where_scores_span_hundreds(order):
    # The kernel takes a block's maximum once and rescales what it summed before, so the
    # order in which large scores arrive matters to it: keys whose scores rise block after
    # block (a rescale at every block), fall (none after the first), or come at random.
    # Scores reach about +-600, past float32's exp range, so only a max taken first survives.
    q, k_cache, v_cache, tables, lens = scattered_pool([40, 33, 16, 1], 9, 3, 64, 16, seed=3)
    q = q * 10
    if order != "random":
        for seq, n in enumerate(lens.tolist()):
            for t in range(n):
                block, offset = int(tables[seq, t // 16]), t % 16
                ramp = (t + 1) / n if order == "rising" else (n - t) / n
                k_cache[block, offset] = k_cache[block, offset].sign() * ramp * 4
    args = (q, k_cache, v_cache, tables, lens)
    got, want = cpu_attention.paged_decode_attention(*args), paged_decode_attention_gather(*args)
    assert torch.isfinite(got).all(), f"{order}: the kernel gave non-finite values"
    err = (got - want).abs().max()  # outputs are about +-4; the key-at-a-time kernel was 4e-6 to 8e-6 off
    assert err < 2e-5, f"{order} scores: compiled kernel differs from chapter 04's gather by {err:.2e}"


def test_asking_for_rows_early_changes_no_value():
    # The prefetch is a hint to the CPU: asking or not must give the same bits. Its addresses
    # follow the block tables, here scattered at random, with contexts that end inside a block,
    # on its last token, one past it, and shorter than one block.
    args = scattered_pool([1, 16, 17, 5, 40, 33, 32], 9, 3, 64, 16, seed=5)
    want = cpu_attention.paged_decode_attention_unchecked(*args, prefetch_rows=False)
    got = cpu_attention.paged_decode_attention_unchecked(*args, prefetch_rows=True)
    assert torch.equal(got, want), f"asking for rows early changed the output by {(got - want).abs().max():.2e}"


def test_compiled_store_matches_chapter04s():
    # The compiled store_kv writes the same slots as chapter 04's, and nothing else.
    from minicb.paged_attention import store_kv_unchecked

    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(7, 3, 16, generator=gen), torch.randn(7, 3, 16, generator=gen)
    slots = torch.tensor([0, 5, 6, 17, 30, 31, 12])  # scattered, across block edges (block_size 4)
    caches = {name: (torch.randn(8, 4, 3, 16, generator=gen), torch.randn(8, 4, 3, 16, generator=gen))
              for name in ("compiled", "chapter 04")}
    caches["chapter 04"] = tuple(c.clone() for c in caches["compiled"])
    cpu_attention.store_kv_unchecked(k, v, *caches["compiled"], slots)
    store_kv_unchecked(k, v, *caches["chapter 04"], slots)
    for got, want, name in zip(caches["compiled"], caches["chapter 04"], ("k_cache", "v_cache")):
        assert torch.equal(got, want), f"{name} differs in {int((got != want).any(-1).any(-1).sum())} slot row(s)"


def test_the_unchecked_kernels_never_touch_memory_outside_the_pool():
    # Numba checks no index. The engine checks each step's slots and tables once, but a
    # student's padding (chapter 10) reaches these kernels too: a slot or block outside
    # the pool must be an error naming it, never a write or read of other memory.
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    for slot in (16, -1):
        with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {slot} lies outside"):
            cpu_attention.store_kv_unchecked(k, v, k_cache, v_cache, torch.tensor([0, slot, 2]))
        assert not k_cache.any() and not v_cache.any(), "a refused store must write nothing"
    q, k_cache, v_cache, tables, lens = scattered_pool([5, 9], 4, 2, 8, 4)
    bad = tables.clone()
    bad[1, 2] = k_cache.shape[0]  # sequence 1's third block: one past the pool
    with pytest.raises(ValueError, match=r"block_tables\[1\]\[2\] = \d+ is not a block of the pool"):
        cpu_attention.paged_decode_attention_unchecked(q, k_cache, v_cache, bad, lens)
    with pytest.raises(ValueError, match="sequence 0 has context length 40"):
        cpu_attention.paged_decode_attention_unchecked(q, k_cache, v_cache, tables, torch.tensor([40, 9],
                                                                                                 dtype=torch.int32))


def test_bad_input_is_refused_with_a_reason():
    q, k_cache, v_cache, tables, lens = scattered_pool([5, 9], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="float32"):
        cpu_attention.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens)
    with pytest.raises(ValueError, match="context_lens"):  # chapter 04's checks run first
        cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens + 100)


def test_the_engine_gives_the_same_tokens_with_either_decode(monkeypatch):
    calls = []
    kernel = cpu_attention.paged_decode_attention_unchecked
    monkeypatch.setattr(cpu_attention, "paged_decode_attention_unchecked",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    runs = tokens_with_each_setting("cpu_decode", ("compiled", "gather"), calls)
    (compiled, used), (gathered, unused) = runs["compiled"], runs["gather"]
    assert used > 0, "on a CPU in fp32 the engine should decode with the compiled kernel; it never did"
    assert unused == 0, f"cpu_decode='gather' must switch the kernel off; it ran {unused} times"
    assert compiled == gathered, f"tokens differ: compiled {compiled}, gather {gathered}"


@pytest.mark.parametrize("threads", [1, 2])
def test_set_num_threads_sets_torch_and_numba_alike(threads):
    # In a fresh process, as the command-line entry points call it: the first call
    # starts Numba's pool, which once reset torch's threads behind its back.
    import subprocess
    import sys

    # Then the engine decodes once on the compiled kernel, whose first run starts Numba's pool.
    code = ("import torch, numba; from minicb.cpu_attention import set_num_threads; "
            f"set_num_threads({threads}); "
            "from minicb import LLM, SamplingParams; from minicb.model import random_model; "
            "LLM.from_model(random_model(seed=1), block_size=4, num_blocks=32, max_num_seqs=2)"
            ".generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3), use_tqdm=False); "
            # A thread started later (the server's engine thread) must run the kernel on the same count.
            "import threading; seen = []; t = threading.Thread(target=lambda: seen.append(("
            "LLM.from_model(random_model(seed=1), block_size=4, num_blocks=32, max_num_seqs=2)"
            ".generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False), numba.get_num_threads())[1])); "
            "t.start(); t.join(); "
            "print(torch.get_num_threads(), numba.get_num_threads(), seen[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_threads, numba_threads, numba_on_a_new_thread = map(int, out.stdout.split()[-3:])
    import numba
    want_numba = min(threads, numba.config.NUMBA_NUM_THREADS)
    assert (torch_threads, numba_threads) == (threads, want_numba), (
        f"set_num_threads({threads}) left torch on {torch_threads} thread(s) and Numba on {numba_threads}; "
        f"want {threads} and {want_numba}")
    assert numba_on_a_new_thread == want_numba, (
        f"on a thread started after set_num_threads({threads}), the kernel ran with Numba on "
        f"{numba_on_a_new_thread} thread(s); want {want_numba}")


def test_the_compiled_kernels_load_from_the_disk_cache_in_a_new_process():
    # Compiling the decode kernel takes seconds; every engine, grader and notebook process
    # would pay them if a kernel missed Numba's disk cache (as one that closes over an
    # intrinsic does: it is a new object in every process). The second process must hit.
    import subprocess
    import sys
    script = """
import numpy as np, torch
from minicb import cpu_attention, cpu_ops
q, k, v = torch.randn(2, 4, 8), torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
tables, lens = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([5, 3], dtype=torch.int32)
cpu_attention.paged_decode_attention_unchecked(q, k, v, tables, lens)
cpu_attention.store_kv_unchecked(k[0], v[0], k, v, torch.tensor([0, 1, 2, 3]))
kernels = cpu_ops._kernels()
x = np.ones((2, 8), np.float32)
kernels.rms_norm(x, x[0], np.float32(1e-5)); kernels.swiglu(x, x)
kernels.rotary(q.numpy(), k[0].numpy(), x, x)
for name, fn in [("decode", cpu_attention._compiled_kernel(8, 2)), ("store", cpu_attention._compiled_store()),
                 *vars(kernels).items()]:
    print(name, sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values()))
"""
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    second = {name: (int(hits), int(misses)) for name, hits, misses in map(str.split, runs[1].stdout.split("\n")[:-1])}
    missed = [name for name, (hits, misses) in second.items() if misses or not hits]
    assert len(second) == 5 and not missed, f"compiled again in a second process: {missed} ({second})"
