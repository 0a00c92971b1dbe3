"""Logprobs and prompt logprobs (minicb/logprobs.py) against HF transformers on the same weights.

The oracle: HF's LlamaForCausalLM loads the checkpoint the engine loads, runs
the whole text (prompt + what the engine generated) in one forward, and its
log_softmax at position p scores the token at p + 1 (teacher forcing). Every
engine feature that changes how the tokens were computed must leave the scores
alone: chunked prefill (the prompt's logprobs come from several steps),
prefix caching (from blocks another request computed), the engine's cache of
scored prompt blocks (a shared prefix is scored once), speculation (generated
tokens come from verify rows), n > 1 (the completions' first tokens share a
row), preemption (recomputed K/V).
"""
from __future__ import annotations

import pytest
import torch

from minicb import LLM, SamplingParams, weights
from minicb.logprobs import token_logprobs
from minicb.model import random_model, tiny_config

TOLERANCE = 1e-4  # fp32, as the oracle asks
SHARED = list(range(10, 45))  # a prefix the prompts share: 35 tokens, two full blocks of 16 and a bit
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], [7, 8, 9, 10, 11], SHARED + [70] * 12]
CONFIGS = {
    "plain": {},
    "prefix caching": {"enable_prefix_caching": True},
    "chunked prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
    "speculation": {"speculative_ngram": 2, "num_speculative_tokens": 3},
    "all of them": {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 16,
                    "speculative_ngram": 2, "num_speculative_tokens": 3},
    "preemption": {"num_blocks": 24, "block_size": 4, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama saved as an HF checkpoint, and HF's model of it (on the CPU: the oracle)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = tiny_config()
    weights.save_checkpoint(path, cfg, random_model(cfg, seed=11).state_dict())
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """HF's log_softmax at every position of `ids` in one forward: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check_entry(entry, oracle_row: torch.Tensor, token: int, k: int, where: str) -> None:
    """One TokenLogprob against HF's log_softmax row that predicted `token`."""
    assert entry.token_id == token, f"{where}: the entry scores token {entry.token_id}, the text has {token}"
    want = oracle_row[token].item()
    assert abs(entry.logprob - want) <= TOLERANCE, f"{where}: logprob {entry.logprob:.6f}, HF {want:.6f}"
    assert entry.rank == int((oracle_row > oracle_row[token]).sum()) + 1, f"{where}: rank {entry.rank}"
    values, ids = oracle_row.topk(k)
    assert len(entry.top) == k, f"{where}: {len(entry.top)} top entries for k={k}"
    for (got_id, got), want_id, want_lp in zip(entry.top, ids.tolist(), values.tolist()):
        assert abs(got - want_lp) <= TOLERANCE, f"{where}: top {entry.top} against HF {list(zip(ids.tolist(), values.tolist()))}"
        # Two tokens whose logprobs tie within the tolerance may come in either order.
        assert got_id == want_id or abs(oracle_row[got_id].item() - want_lp) <= TOLERANCE, f"{where}: top {entry.top}"


@pytest.mark.parametrize("name", CONFIGS)
def test_scores_equal_hf_teacher_forced(checkpoint, name, device):
    path, hf = checkpoint
    llm = LLM(str(path), device=device, **CONFIGS[name])
    params = SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, out in enumerate(outs):
        ids = out.prompt_token_ids + out.token_ids
        oracle = hf_logprobs(hf, ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
            check_entry(entry, oracle[p - 1], ids[p], 2, f"{name}, prompt {i}, prompt token {p}")
        start = len(out.prompt_token_ids)
        assert len(out.outputs[0].logprobs) == len(out.token_ids)
        for j, entry in enumerate(out.outputs[0].logprobs):
            check_entry(entry, oracle[start + j - 1], ids[start + j], 3, f"{name}, prompt {i}, output token {j}")
    again = llm.generate(PROMPTS, params, use_tqdm=False)  # scored before: from the score cache this time
    assert llm.engine.prompt_scores.hits > 0, "no prompt took its scored blocks: the test saw no score cache"
    for out, before in zip(again, outs):
        assert [e and (e.token_id, e.logprob, e.top) for e in out.prompt_logprobs] == \
            [e and (e.token_id, e.logprob, e.top) for e in before.prompt_logprobs], f"{name}: cached prompt scores"
    if name == "prefix caching":
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0, "no prompt hit the cache: the test saw nothing"
    if name == "preemption":
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "nothing was preempted: the test saw nothing"


def test_prompt_scores_from_cached_blocks_equal_computed_ones(checkpoint, device):
    """The second request takes SHARED's full blocks from the prefix cache: its prompt scores come
    from hidden states another request (which asked for no scores) left in them, and must equal a
    run with caching off."""
    path, _ = checkpoint
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    scores = {}
    for caching in (False, True):
        llm = LLM(str(path), device=device, enable_prefix_caching=caching)
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)
        out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
        assert llm.engine.prompt_scores.hits == 0, "scores came from the score cache, not the blocks"
        assert out.metrics.num_cached_tokens == (32 if caching else 0), out.metrics.num_cached_tokens
        scores[caching] = out.prompt_logprobs
    for p, (off, on) in enumerate(zip(scores[False][1:], scores[True][1:]), start=1):
        assert off.token_id == on.token_id and abs(off.logprob - on.logprob) <= 1e-5, f"prompt token {p}: {off} {on}"
        assert [t for t, _ in off.top] == [t for t, _ in on.top], f"prompt token {p}: top {off.top} against {on.top}"


def test_n_completions_score_their_own_tokens(checkpoint, device):
    path, hf = checkpoint
    llm = LLM(str(path), device=device)
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=4, logprobs=0,
                                                    ignore_eos=True), use_tqdm=False)[0]
    for c in out.outputs:
        ids = out.prompt_token_ids + c.token_ids
        oracle = hf_logprobs(hf, ids)
        start = len(out.prompt_token_ids)
        for j, entry in enumerate(c.logprobs):
            check_entry(entry, oracle[start + j - 1], ids[start + j], 0, f"completion {c.index}, token {j}")


def test_scores_are_the_model_s_before_any_sampling_rule(checkpoint, device):
    """Temperature and penalties change what is sampled, not the scores: the same tokens teacher-forced
    give the same logprobs as HF's raw distribution."""
    path, hf = checkpoint
    llm = LLM(str(path), device=device)
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0.3, seed=1, logprobs=1, ignore_eos=True,
                                                    repetition_penalty=1.5, presence_penalty=1.0, min_tokens=3),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.token_ids
    oracle = hf_logprobs(hf, ids)
    start = len(out.prompt_token_ids)
    for j, entry in enumerate(out.outputs[0].logprobs):
        check_entry(entry, oracle[start + j - 1], ids[start + j], 1, f"token {j}")


def test_a_request_that_does_not_ask_gets_no_scores():
    llm = LLM.from_model(random_model(seed=2))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None
    step_outputs = []
    llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    while llm.engine.has_unfinished():
        step_outputs.append(llm.engine.step())
    assert all(t.logprobs is None for s in step_outputs for t in s.new_tokens)
    assert all(not s.prompt_logprobs for s in step_outputs)


def test_token_logprobs_checks_its_arguments():
    with pytest.raises(ValueError, match="2 logits rows for 3 tokens"):
        token_logprobs(torch.zeros(2, 5), [1, 2, 3], 1)
    for bad in (-1, 21, True, 2.5):
        with pytest.raises(ValueError, match="logprobs="):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs="):
            SamplingParams(prompt_logprobs=bad)


def test_the_score_cache_serves_only_what_it_was_asked_with():
    """A block scored with top 2 serves a request for top 1 (cut) or 2, not one for top 3; a prompt that
    differs in its first token finds nothing; one that differs inside a block gets the tokens before."""
    from minicb.logprobs import PromptScoreCache, TokenLogprob

    cache = PromptScoreCache(block_size=2, max_blocks=3)
    prompt = [5, 6, 7, 8, 9]
    entries = [None] + [TokenLogprob(t, -1.0 * t, 1, [(t, -1.0 * t), (0, -9.0)]) for t in prompt[1:]]
    cache.store(prompt, entries, k=2)
    assert len(cache) == 3  # two full blocks and the partial [9]
    cut = cache.lookup(prompt, k=1)
    assert [e and (e.token_id, e.top) for e in cut] == [None, (6, [(6, -6.0)]), (7, [(7, -7.0)]), (8, [(8, -8.0)]),
                                                         (9, [(9, -9.0)])]
    assert cache.lookup(prompt, k=3) == [None] and cache.lookup([4] + prompt[1:], k=1) == [None]
    assert [e and e.token_id for e in cache.lookup([5, 6, 7, 1, 9], k=2)] == [None, 6, 7]  # 7 shared, 1 not
    assert [e and e.token_id for e in cache.lookup([5, 6, 7], k=2)] == [None, 6, 7]  # a shorter prompt
    cache = PromptScoreCache(block_size=2, max_blocks=2)
    cache.store(prompt[:4], entries[:4], k=2)
    cache.store([1, 2], [None, entries[1]], k=2)  # a third block: the least recently used parent's go
    assert len(cache) == 2 and [e and e.token_id for e in cache.lookup(prompt, k=1)] == [None, 6]  # not 7, 8


def test_prompts_of_one_call_share_their_common_start():
    """Four prompts with one context (a multiple-choice question's choices) scored in one call: the
    context's positions are scored once, and every prompt's entries equal its own scoring alone."""
    from minicb.logprobs import PromptScoreCache, PromptToScore, prompt_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(12, 8)  # positions 0..11 of every prompt: one shared "model output" table

    class Head:  # model.logits: the hidden state, as logits over 8 tokens; counts the rows it scores
        rows = 0

        def logits(self, x):
            Head.rows += x.shape[1]
            return x.float()

    context = [1, 2, 3, 4, 5]
    prompts = [context + [c, 7] for c in (0, 6)] + [context + [6], context[:3]]
    def make(ids):
        return PromptToScore(ids, 2, lambda start, end: hidden[start:end])
    together = prompt_logprobs(Head(), [make(p) for p in prompts], PromptScoreCache(block_size=4))
    assert Head.rows == 6 + 2 + 0 + 0, f"{Head.rows} rows scored; the shared start should be scored once"
    for ids, entries in zip(prompts, together):
        alone = prompt_logprobs(Head(), [make(ids)])[0]
        assert [e and (e.token_id, e.logprob, e.rank, e.top) for e in entries] == \
            [e and (e.token_id, e.logprob, e.rank, e.top) for e in alone], ids
