"""Chapters 04-05 inside the model: greedy tokens through the paged pool equal chapter 01's.

The kernels have their own tests against dense attention (test_ch04_*, test_ch05_*);
here the whole model runs through `minicb.paged_model.generate_paged` with each
backend, on the tiny model and on SmolLM2.
"""
import pytest
import torch

from minicb.model import random_model
from minicb.naive import first_difference, generate_with_cache
from minicb.paged_model import generate_paged
from minicb.sampling import SamplingParams


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_tiny_model_paged_equals_chapter01(block_size):
    model = random_model(seed=2)
    params = SamplingParams(max_tokens=10)
    for prompt in ([5], [7, 8, 9, 10, 11], list(range(3, 40))):
        want = generate_with_cache(model, prompt, params).token_ids
        for backend in ("torch", "triton"):
            got = generate_paged(model, prompt, params, attention=backend, block_size=block_size).token_ids
            assert got == want, f"{backend}, block_size {block_size}: {first_difference(got, want, ('paged', 'chapter 01'))}"


@pytest.mark.slow
def test_smollm2_paged_torch_and_triton_equal_chapter01():
    """4 chat prompts (37 to 39 tokens, each in 3 blocks of 16; the next four are as long): chapter 01 vs
    paged-torch vs paged-triton (interpreted on CPU)."""
    from minicb.data import load_chat_prompts
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    model, tok = load_model(None, device="cpu"), load_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in load_chat_prompts(4)]
    # The interpreter runs every kernel program in Python (30 layers x 3 KV heads per
    # token): on CPU each prompt gets 2 tokens, so Triton stores its prompt's K/V and
    # decodes once over them; on CUDA, 32 tokens.
    params = SamplingParams(max_tokens=32 if torch.cuda.is_available() else 2)
    for i, p in enumerate(prompts):
        want = generate_with_cache(model, p, params).token_ids
        for backend in ("torch", "triton"):
            got = generate_paged(model, p, params, attention=backend).token_ids
            assert got == want, f"{backend}, prompt {i}: {first_difference(got, want, ('paged', 'chapter 01'))}"
