"""On the device: a model of SmolLM2's exact shape with random weights, chapter against chapter.

The real weights do not travel to the offline GPU machine (tools/gpu_bundle.py),
and these checks need none: each holds one chapter's code against an earlier
chapter's on the same weights, so whatever the weights are, the answers agree.
- The engine's greedy tokens equal chapter 01's loop, with either attention
  backend (and CUDA graphs, where the engine turns them on by default).
- Chapter 05's Triton kernels give chapter 04's logits for a mixed step, in bf16.
- Decode steps replayed from CUDA graphs give the eager engine's tokens.
- Sampling on the device: `draw` follows its probabilities and its generator, top-p
  keeps the CPU's nucleus, and seeded sampled requests repeat through the engine.

make gpu-check runs this file with MINICB_DEVICE=cuda, at SmolLM2's shape. On a
CPU (here, and in the dry run of tools/gpu_check.sh) the same tests run on the
tiny model, so they cannot rot unseen. The real model's agreement with HF
transformers stays a CPU test (tests/chapters/test_ch00_model.py).
"""
import math
import random

import pytest
import torch

from minicb import paged_attention, triton_attention
from minicb.attention_backends import TorchAttention, TritonAttention
from minicb.cuda_graphs import DecodeGraphs
from minicb.engine import Engine, EngineConfig
from minicb.model import ModelConfig, random_model, tiny_config
from minicb.paged_model import PagedAttention
from minicb.sampling import SamplingParams, draw, filter_logits

from engine_support import paged_step


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def model_for(device, dtype=torch.float32):
    """SmolLM2-135M's shape (ModelConfig's defaults) on CUDA; the tiny model elsewhere. Random weights."""
    config = ModelConfig() if on_cuda(device) else tiny_config()
    return random_model(config, seed=0).to(device, dtype)


def requests_for(device, vocab_size: int, seed: int = 0):
    """(arrival_step, prompt, greedy params): prompts across several blocks on CUDA, short ones on a CPU."""
    rng = random.Random(seed)
    count, longest_prompt, most_tokens = (16, 300, 24) if on_cuda(device) else (5, 30, 8)
    return [(rng.randint(0, 10), [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, longest_prompt))],
             SamplingParams(max_tokens=rng.randint(1, most_tokens))) for _ in range(count)]


def pool_blocks(requests, slots: int, block_size: int) -> int:
    longest = max(len(prompt) + params.max_tokens for _, prompt, params in requests)
    return slots * math.ceil(longest / block_size) + slots


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_engine_equals_chapter01(attention, device, engine_matches_chapter01):
    model = model_for(device)
    requests = requests_for(device, model.config.vocab_size)
    engine_matches_chapter01(model, requests, attention=attention, max_num_seqs=8,
                             num_blocks=pool_blocks(requests, 8, 16))
    runner = engine_matches_chapter01.engine.runner
    if on_cuda(device) and attention == "triton":
        assert isinstance(runner, DecodeGraphs) and runner.graphs, (
            f"on CUDA with Triton the engine should replay CUDA graphs; its runner is a {type(runner).__name__}"
            f"{' with no graph captured' if isinstance(runner, DecodeGraphs) else ''}")


def test_graphs_equal_eager(device):
    model = model_for(device)
    requests = requests_for(device, model.config.vocab_size, seed=1)
    outputs = {}
    # Graphs need the Triton decode; on a CPU the runner runs eagerly, quicker with chapter 04's
    # (tests/engine/test_cuda_graphs.py runs it with both there).
    attention = "triton" if on_cuda(device) else "torch"
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=8, attention=attention, cuda_graphs=graphs,
                                            num_blocks=pool_blocks(requests, 8, 16)))
        index_of, finished, step, pending = {}, {}, 0, sorted(range(len(requests)), key=lambda i: requests[i][0])
        while pending or engine.has_unfinished():
            while pending and requests[pending[0]][0] <= step:
                i = pending.pop(0)
                index_of[engine.add_request(requests[i][1], requests[i][2])] = i
            for seq in engine.step().finished:
                finished[index_of[seq.request_id]] = seq.output_token_ids
            step += 1
        outputs[graphs] = finished
    assert outputs[True] == outputs[False], "greedy tokens differ with the decode runner on and off"


def test_triton_equals_torch_on_a_mixed_step_in_bf16(device):
    """One step of 3 decodes and 2 prompts (one a chunk after cached tokens): the logits of both backends."""
    model = model_for(device, torch.bfloat16)
    block_size = 16
    seqs = [(40, 1), (300, 1), (17, 1), (64, 64), (90, 30)] if on_cuda(device) else [(9, 1), (20, 1), (5, 1),
                                                                                       (12, 12), (21, 6)]
    ids, pos, meta, pool = paged_step(model, seqs, 3, block_size, num_blocks=64, kv_seed=0)
    logits = {}
    backends = {"torch": TorchAttention(paged_attention), "triton": TritonAttention(triton_attention)}
    for name, backend in backends.items():
        attention = PagedAttention(pool.k_caches, pool.v_caches, meta, backend)
        logits[name] = model(ids, pos, attention, logits_at=meta.last_token_index()).float()
    scale = logits["torch"].abs().max().item()
    diff = (logits["triton"] - logits["torch"]).abs().max().item()
    assert diff <= 3e-2 * scale, f"Triton's logits differ from chapter 04's by {diff:.3g} (largest logit {scale:.3g})"


def test_sampling_on_the_device_follows_its_probabilities(device):
    # draw: tokens of probability 0 never come, the rest within 5 sigma of theirs, from the device's generator.
    probs = torch.tensor([0.0, 0.05, 0.0, 0.6, 0.25, 0.1, 0.0], device=device)
    generator, draws = torch.Generator(device=device).manual_seed(3), 4000
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(draws)]), minlength=7).double()
    want = probs.double().cpu()
    assert (counts[want == 0] == 0).all(), f"drew a token of probability 0 on {device}: {counts.tolist()}"
    assert ((counts / draws - want).abs() <= 5 * (want * (1 - want) / draws).sqrt()).all(), (
        f"frequencies on {device} {(counts / draws).tolist()} vs probabilities {want.tolist()}")
    # top-p: the nucleus the CPU finds. The device's softmax may round otherwise, so a token may differ
    # only where the more likely tokens' share is top_p to within float32's rounding.
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 4
    shares = logits.double().softmax(-1)
    for top_p in (0.5, 0.9):
        here = torch.isfinite(filter_logits(logits.to(device), 0, top_p).cpu())
        there = torch.isfinite(filter_logits(logits, 0, top_p))
        for token in (here != there).nonzero()[:, 0].tolist():
            before = shares[shares > shares[token]].sum().item()
            assert abs(before - top_p) < 1e-5, (
                f"top_p {top_p}: token {token} kept {bool(here[token])} on {device}, {bool(there[token])} on the CPU; "
                f"the tokens before it hold {before}")
    # Through the engine: the same seeds give the same tokens twice.
    model = model_for(device)
    prompts = [[5, 9, 14, 3, 22][: i + 1] * 3 for i in range(5)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(5)]
    runs = []
    for _ in range(2):
        engine = Engine(model, EngineConfig(max_num_seqs=4))
        ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        done = {}
        while engine.has_unfinished():
            done.update({seq.request_id: seq.output_token_ids for seq in engine.step().finished})
        runs.append([done[i] for i in ids])
    assert runs[0] == runs[1], f"seeded sampled requests on {device} gave {runs[0]}, then {runs[1]}"
