"""Chapter 05, all tasks together: your Triton kernels inside the real engine, and with each other.

The chapter 06 engine runs the tiny model with attention="triton", which is your
module: your `store_kv` (task 1) writes the pool, your `paged_decode_attention`
(task 2) serves the decodes and your `paged_prefill_attention` (task 4) the
prompts, all in mixed steps; every request's greedy tokens must equal chapter
01's. Then, on the pool that run left behind, your split-K kernel (task 3) must
agree with your decode kernel. Without a GPU the kernels run under the Triton
interpreter, so the run is small. `check 5` shows this as the row "all".
"""
import pytest
import torch

from minicb import impl
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.sampling import SamplingParams


@pytest.mark.task("all")
def test_the_engine_on_your_kernels_matches_chapter01(engine_matches_chapter01, random_requests):
    tiny = random_model(seed=8)
    requests = random_requests(tiny.config.vocab_size, 8, seed=5)
    engine_matches_chapter01(tiny, requests, block_size=4, num_blocks=48, max_num_seqs=4, attention="triton")

    # Split-K beside decode, on real K/V a prefill wrote into scattered blocks.
    kernels = impl.load("triton_attention")
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=48, max_num_seqs=4, attention="triton"))
    prompts = [prompt for _, prompt, _ in requests[:3]]
    rids = [engine.add_request(prompt, SamplingParams(max_tokens=4)) for prompt in prompts]
    engine.step()  # prefills all three: their prompts' K/V are in the pool, in scattered blocks
    tables = [engine.allocator.block_table(rid) for rid in rids]
    lens = [len(prompt) for prompt in prompts]  # the K/V written so far
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    cfg = tiny.config
    q = torch.randn(len(rids), cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    k_cache, v_cache = engine.pool.k_caches[1], engine.pool.v_caches[1]
    decode = kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    split = kernels.paged_decode_attention_split_k(q, k_cache, v_cache, block_tables, context_lens, num_splits=2)
    diff = (decode - split).abs().max().item()
    assert diff < 1e-4, f"your split-K kernel differs from your decode kernel by {diff:.2e} on the engine's pool"
