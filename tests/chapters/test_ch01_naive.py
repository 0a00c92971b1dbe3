"""Chapter 01: naive generation, with and without a KV cache.

The oracle is chapter 00's model and nothing else: `oracle_tokens` below runs
the full sequence through `DenseAttention` at every step and takes the argmax
(or samples, with one seeded generator per request). Both loops must produce
its tokens exactly, so they also agree with each other.
The cache itself (task 2) is checked one level lower, on logits: a prefill, a
prefill in two chunks, and a decode step through `ContiguousKVCache` must give
the logits of the same tokens run with no cache.

Stopping rules (EOS, stop tokens, max_tokens, a full context) and sampling run
against both loops, so each is graded under task 1 and task 3.

Run against your own code with `python -m minicb check 1`.
"""
import pytest
import torch

from minicb import impl
from minicb.model import DenseAttention, random_model, tiny_config
from minicb.naive import first_difference
from minicb.sampling import SamplingParams, make_generator, sample

naive = impl.load("naive")

# Task 1 grades generate_no_cache, task 3 generate_with_cache; most behaviour is
# shared, so those tests run once per loop.
LOOPS = [pytest.param("generate_no_cache", marks=pytest.mark.task(1), id="no_cache"),
         pytest.param("generate_with_cache", marks=pytest.mark.task(3), id="with_cache")]

# Very different lengths on purpose: one token (no prompt to attend over), a
# few, and two longer ones where a mask or position offset by one shows.
PROMPTS = [[1], [1, 5, 9], list(range(3, 40)), [(7 * i) % 250 + 3 for i in range(70)]]


def loop(name):
    return getattr(naive, name)


def logits_no_cache(model, ids):
    """Chapter 00's forward over the whole sequence: ids [T] -> logits [T, V]."""
    x = torch.tensor([ids], device=model.device)
    return model(x, torch.arange(len(ids), device=model.device)[None], DenseAttention())[0]


def oracle_tokens(model, prompt, n, params=None):
    """The oracle: n tokens by full recompute, ignoring every stopping rule.

    Greedy by default. With sampling params it draws the way the chapter asks:
    one generator per request (make_generator), one `sample` call per step.
    """
    params = params or SamplingParams(max_tokens=n)
    generator = make_generator(params, model.device)
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(sample(logits_no_cache(model, ids)[-1:], [params], [generator])[0])
        ids.append(out[-1])
    return out


def first_new_token_index(stream, start=2):
    """An index k >= start whose token does not occur earlier, so 'stop at stream[k]' stops exactly at k."""
    for k in range(start, len(stream)):
        if stream[k] not in stream[:k]:
            return k
    raise AssertionError(f"test setup: no fresh token in {stream}; pick another prompt")


@pytest.fixture
def model(device):
    # A fresh model per test: some tests change config.eos_token_ids. No EOS by
    # default, so that only the rule under test can stop a sequence.
    return random_model(tiny_config(eos_token_ids=[])).to(device)


# ---- greedy tokens equal the oracle --------------------------------------------


@pytest.mark.parametrize("name", LOOPS)
@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"prompt_len{len(p)}" for p in PROMPTS])
def test_greedy_tokens_equal_full_recompute(model, name, prompt):
    want = oracle_tokens(model, prompt, 16)
    got = loop(name)(model, prompt, SamplingParams(max_tokens=16))
    assert got.token_ids == want, f"{name}, prompt of {len(prompt)} tokens: {first_difference(got.token_ids, want)}"
    assert got.finish_reason == "length", f"{name}: 16 tokens of 16 should end with 'length', got {got.finish_reason!r}"


# ---- task 2: the cache gives the logits of a full recompute ---------------------


def cached_logits(model, ids, chunks):
    """Run `ids` through one ContiguousKVCache in chunks of the given sizes -> logits [T, V]."""
    cache = naive.ContiguousKVCache(model, batch_size=1, max_len=len(ids) + 4)
    out, start = [], 0
    for size in chunks:
        piece = torch.tensor([ids[start:start + size]], device=model.device)
        positions = torch.arange(start, start + size, device=model.device)[None]
        out.append(model(piece, positions, cache)[0])
        cache.advance(size)
        start += size
    return torch.cat(out)


@pytest.mark.task(2)
@pytest.mark.parametrize("chunks", [[23], [22, 1], [9, 14], [12, 1, 1, 1, 8]],
                         ids=["prefill", "prefill+decode", "two_chunks", "chunks_and_decodes"])
def test_cache_logits_equal_no_cache_logits(model, chunks):
    # A chunk after the first must see every cached key plus the causal part of
    # its own: the mask is a lower triangle shifted right by the cached length.
    ids = PROMPTS[2][:23]
    want = logits_no_cache(model, ids)
    got = cached_logits(model, ids, chunks)
    diff = (got - want).abs().max(dim=-1).values  # [T]
    worst = int(diff.argmax())
    assert diff.max() <= 1e-5, (f"chunks {chunks}: logits differ from a full recompute by {diff.max():.2e} "
                                f"(worst at position {worst}; per-position max {[f'{d:.0e}' for d in diff.tolist()]})")


@pytest.mark.task(2)
def test_cache_rows_of_a_batch_are_independent(model):
    # batch_size > 1: row b of the cache holds sequence b and nothing else.
    a, b = PROMPTS[2][:10], PROMPTS[3][:10]
    cache = naive.ContiguousKVCache(model, batch_size=2, max_len=12)
    ids = torch.tensor([a, b], device=model.device)
    positions = torch.arange(10, device=model.device)[None].expand(2, -1)
    model(ids, positions, cache)
    cache.advance(10)
    step = torch.tensor([[a[-1]], [b[-1]]], device=model.device)  # any next tokens will do
    got = model(step, torch.full((2, 1), 10, device=model.device), cache)[:, 0]  # [2, V]
    for row, ids_row in enumerate([a + [a[-1]], b + [b[-1]]]):
        diff = (got[row] - logits_no_cache(model, ids_row)[-1]).abs().max().item()
        assert diff <= 1e-5, f"batch row {row}: decode logits differ from a full recompute by {diff:.2e}"


@pytest.mark.task(2)
def test_cache_refuses_to_overflow(model):
    cache = naive.ContiguousKVCache(model, batch_size=1, max_len=4)
    model(torch.tensor([[5, 6, 7]], device=model.device), torch.arange(3, device=model.device)[None], cache)
    cache.advance(3)
    with pytest.raises(RuntimeError, match="4"):  # 3 stored + 2 new > 4
        model(torch.tensor([[8, 9]], device=model.device), torch.tensor([[3, 4]], device=model.device), cache)


@pytest.mark.task(2)
def test_cache_takes_a_forward_that_fills_it_exactly(model):
    # max_len is a capacity, not a bound to stay under: 3 stored + 1 new = 4 fits a cache of 4.
    ids = PROMPTS[2][:4]
    cache = naive.ContiguousKVCache(model, batch_size=1, max_len=4)
    model(torch.tensor([ids[:3]], device=model.device), torch.arange(3, device=model.device)[None], cache)
    cache.advance(3)
    try:
        got = model(torch.tensor([ids[3:]], device=model.device), torch.tensor([[3]], device=model.device), cache)[0, -1]
    except RuntimeError as error:
        raise AssertionError(f"a cache of max_len=4 holding 3 tokens refused a 4th: {error}") from error
    diff = (got - logits_no_cache(model, ids)[-1]).abs().max().item()
    assert diff <= 1e-5, f"the token that fills the cache exactly: logits differ from a full recompute by {diff:.2e}"


# ---- stopping rules ------------------------------------------------------------


@pytest.mark.parametrize("name", LOOPS)
def test_eos_stops_and_is_kept(model, name):
    prompt = PROMPTS[1]
    stream = oracle_tokens(model, prompt, 12)
    k = first_new_token_index(stream)
    model.config.eos_token_ids = [255, stream[k]]  # any of several EOS ids ends a sequence
    got = loop(name)(model, prompt, SamplingParams(max_tokens=12))
    assert got.token_ids == stream[:k + 1], f"{name}, EOS {stream[k]}: {first_difference(got.token_ids, stream[:k + 1])}"
    assert got.finish_reason == "stop", f"{name}: ended by EOS, finish_reason should be 'stop', got {got.finish_reason!r}"

    ignored = loop(name)(model, prompt, SamplingParams(max_tokens=k + 3, ignore_eos=True))
    assert ignored.token_ids == stream[:k + 3], f"{name}, ignore_eos: {first_difference(ignored.token_ids, stream[:k + 3])}"
    assert ignored.finish_reason == "length", \
        f"{name}: ignore_eos runs to max_tokens, so finish_reason should be 'length', got {ignored.finish_reason!r}"


@pytest.mark.parametrize("name", LOOPS)
def test_stop_token_ids(model, name):
    prompt = PROMPTS[2]
    stream = oracle_tokens(model, prompt, 12)
    k = first_new_token_index(stream, start=3)
    got = loop(name)(model, prompt, SamplingParams(max_tokens=12, stop_token_ids=[stream[k]]))
    assert got.token_ids == stream[:k + 1], f"{name}, stop token {stream[k]}: {first_difference(got.token_ids, stream[:k + 1])}"
    assert got.finish_reason == "stop", \
        f"{name}: ended by a stop token, finish_reason should be 'stop', got {got.finish_reason!r}"
    # When the stop token is also the last allowed token, "stop" wins: the model chose to end.
    got = loop(name)(model, prompt, SamplingParams(max_tokens=k + 1, stop_token_ids=[stream[k]]))
    assert (got.token_ids, got.finish_reason) == (stream[:k + 1], "stop"), \
        f"{name}: stop token at the max_tokens-th position gave {got.finish_reason!r}, want 'stop'"


@pytest.mark.parametrize("name", LOOPS)
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens(model, name, max_tokens):
    prompt = PROMPTS[1]
    want = oracle_tokens(model, prompt, max_tokens)
    got = loop(name)(model, prompt, SamplingParams(max_tokens=max_tokens))
    assert got.token_ids == want, f"{name}, max_tokens={max_tokens}: {first_difference(got.token_ids, want)}"
    assert got.finish_reason == "length", \
        f"{name}: {max_tokens} tokens of max_tokens={max_tokens} should end with 'length', got {got.finish_reason!r}"


@pytest.mark.parametrize("name", LOOPS)
def test_stops_when_the_context_is_full(device, name):
    # Prompt and generated tokens together never exceed the context: a 10-token
    # prompt in a 16-token context leaves room for 6 new tokens, max_tokens or not.
    model = random_model(tiny_config(eos_token_ids=[], max_position_embeddings=16)).to(device)
    prompt = PROMPTS[2][:10]
    want = oracle_tokens(model, prompt, 6)
    got = loop(name)(model, prompt, SamplingParams(max_tokens=100))
    assert got.token_ids == want, (f"{name}: a 10-token prompt in a 16-token context should get 6 tokens; "
                                   f"{first_difference(got.token_ids, want)}")
    assert got.finish_reason == "length", \
        f"{name}: a full context should end with 'length', got {got.finish_reason!r}"


# ---- sampling ------------------------------------------------------------------


@pytest.mark.parametrize("name", LOOPS)
def test_sampling_that_keeps_one_token_is_greedy(model, name):
    prompt = PROMPTS[2]
    want = oracle_tokens(model, prompt, 10)
    for params in [SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=0),
                   SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=0)]:
        got = loop(name)(model, prompt, params)
        assert got.token_ids == want, f"{name}, {params}: {first_difference(got.token_ids, want)}"


@pytest.mark.parametrize("name", LOOPS)
def test_seeded_sampling_is_reproducible(model, name):
    prompt = PROMPTS[1]
    params = [SamplingParams(max_tokens=12, temperature=1.5, seed=seed) for seed in range(4)]
    first = [loop(name)(model, prompt, p).token_ids for p in params]
    torch.manual_seed(1234)  # the global random state must not matter: each request has its own stream
    again = [loop(name)(model, prompt, p).token_ids for p in params]
    for seed, (a, b) in enumerate(zip(first, again)):
        assert a == b, f"{name}, seed {seed}, run twice: {first_difference(b, a)}"
    greedy = oracle_tokens(model, prompt, 12)
    assert any(tokens != greedy for tokens in first), f"{name}: temperature 1.5 gave the greedy tokens for 4 seeds"
    assert len({tuple(t) for t in first}) > 1, f"{name}: seeds 0-3 all gave the same tokens {first[0]}"


@pytest.mark.parametrize("name", LOOPS)
def test_seeded_sampling_equals_the_oracle(model, name):
    # Same seed, same random numbers; the logits agree to ~1e-6; so the loop
    # must sample exactly the oracle's tokens.
    for seed in range(3):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=seed)
        want = oracle_tokens(model, PROMPTS[2], 12, params)
        got = loop(name)(model, PROMPTS[2], params).token_ids
        assert got == want, f"{name}, seed {seed}: {first_difference(got, want)}"


# ---- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("name", LOOPS)
def test_bad_prompts_raise_value_error_naming_the_length(model, name):
    context = model.config.max_position_embeddings  # 512
    with pytest.raises(ValueError, match="empty"):
        loop(name)(model, [], SamplingParams(max_tokens=4))
    for length in [context, context + 1]:
        with pytest.raises(ValueError, match=str(length)):
            loop(name)(model, [5] * length, SamplingParams(max_tokens=4))


# ---- the real model ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.task(3)
def test_smollm2_cache_equals_no_cache_on_chat_prompts(device):
    from minicb.data import load_chat_prompts
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    model, tokenizer = load_model(device=device), load_tokenizer()
    params = SamplingParams(max_tokens=24)
    for text in load_chat_prompts(2):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        want = naive.generate_no_cache(model, prompt, params)
        got = naive.generate_with_cache(model, prompt, params)
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), \
            f"prompt {text!r}: {first_difference(got.token_ids, want.token_ids)}"
