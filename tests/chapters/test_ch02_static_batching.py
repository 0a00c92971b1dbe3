"""Chapter 02: static batching -- left padding, the padding mask, and its waste.

The oracle is chapter 01: the *reference* `minicb.naive.generate_with_cache`,
run on one prompt at a time. A padded batch must give every prompt exactly the
tokens it gets alone. Below that, the padded cache (task 2) is checked on
logits against chapter 00's full recompute, with a batch built by hand so it
does not depend on your `left_pad` (task 1). The waste counters are checked on
a batch small enough to count on paper.

Run against your own code with `python -m minicb check 2`.
"""
import pytest
import torch

from minicb import impl
from minicb import naive as chapter01  # the previous chapter is the oracle
from minicb.naive import first_difference
from minicb.model import DenseAttention, random_model, tiny_config
from minicb.sampling import SamplingParams

static = impl.load("static_batching")

# Lengths from 1 to 60 tokens, so short prompts sit behind a lot of padding.
LENGTHS = (1, 2, 40, 5, 17, 3, 60, 9, 25, 4, 33)
PROMPTS = [[(11 * i + 7 * n) % 250 + 3 for i in range(n)] for n in LENGTHS]
MAX_TOKENS = (16, 4, 16, 9, 16, 16, 2, 16, 12, 16, 7)
# With EOS = 84 the tiny model ends three of these prompts early (after 2, 5 and
# 6 tokens) and the rest run to max_tokens: both ways of finishing, mid-batch.
EOS = 84


def tiny_model(device):
    return random_model(tiny_config(eos_token_ids=[EOS])).to(device)


def compare_with_chapter01(generations, expected, prompts, label):
    assert len(generations) == len(expected), f"{label}: {len(generations)} generations for {len(expected)} prompts"
    for i, (got, want) in enumerate(zip(generations, expected)):
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (
            f"{label}, prompt {i} ({len(prompts[i])} tokens), finish {got.finish_reason!r} vs chapter 01's "
            f"{want.finish_reason!r}: {first_difference(got.token_ids, want.token_ids)}")


def logits_no_cache(model, ids):
    x = torch.tensor([ids], device=model.device)
    return model(x, torch.arange(len(ids), device=model.device)[None], DenseAttention())[0]  # [T, V]


# ---- task 1: left_pad ----------------------------------------------------------


@pytest.mark.task(1)
def test_left_pad_lines_up_the_last_prompt_tokens(device):
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24], [30]]
    ids, mask, positions = static.left_pad(prompts, pad_id=99, device=device)
    for name, t in [("input_ids", ids), ("padding_mask", mask), ("positions", positions)]:
        assert tuple(t.shape) == (3, 5), f"{name} has shape {tuple(t.shape)}; want (3, 5) = (prompts, longest)"
        assert t.device.type == torch.device(device).type, f"{name} is on {t.device}, want {device}"
    assert mask.dtype == torch.bool, f"padding_mask should be bool, got {mask.dtype}"
    want_ids = [[99, 99, 10, 11, 12], [20, 21, 22, 23, 24], [99, 99, 99, 99, 30]]
    assert ids.tolist() == want_ids, (f"input_ids should be right-aligned with pad_id 99 in front: "
                                      f"got {ids.tolist()}, want {want_ids}")
    want_mask = [[False, False, True, True, True], [True] * 5, [False] * 4 + [True]]
    assert mask.tolist() == want_mask, (f"padding_mask should be True on real tokens only: "
                                        f"got {mask.tolist()}, want {want_mask}")
    # Each real token keeps the position it has alone; what pads get does not matter.
    for row, prompt in enumerate(prompts):
        real = positions[row, 5 - len(prompt):].tolist()
        assert real == list(range(len(prompt))), f"row {row}: real-token positions {real}, want 0..{len(prompt) - 1}"


@pytest.mark.task(1)
def test_left_pad_of_equal_lengths_adds_nothing(device):
    ids, mask, positions = static.left_pad([[4, 5], [6, 7]], pad_id=0, device=device)
    got = (ids.tolist(), mask.tolist(), positions.tolist())
    want = ([[4, 5], [6, 7]], [[True, True], [True, True]], [[0, 1], [0, 1]])
    assert got == want, f"prompts of equal length need no padding: (ids, mask, positions) = {got}, want {want}"


# ---- task 2: the padded cache --------------------------------------------------


def hand_padded_batch(prompts, device):
    """What left_pad returns, written out without it: ids, mask, positions [B, P]."""
    P = max(map(len, prompts))
    ids = [[0] * (P - len(p)) + p for p in prompts]
    mask = [[False] * (P - len(p)) + [True] * len(p) for p in prompts]
    positions = [[0] * (P - len(p)) + list(range(len(p))) for p in prompts]
    return (torch.tensor(ids, device=device), torch.tensor(mask, device=device),
            torch.tensor(positions, device=device))


@pytest.mark.task(2)
def test_key_mask_marks_padding_and_keeps_generated_columns(device):
    model = tiny_model(device)
    _, mask, _ = hand_padded_batch([PROMPTS[1], PROMPTS[3]], device)  # 2 and 5 tokens
    cache = static.PaddedKVCache(model, mask, max_len=8)
    got = cache.key_mask(7)
    want = torch.cat([mask, torch.ones(2, 2, dtype=torch.bool, device=device)], dim=1)
    assert got is not None and tuple(got.shape) == (2, 7), f"key_mask(7) gave {got}; want a [2, 7] bool mask"
    assert got.tolist() == want.tolist(), f"key_mask(7) = {got.tolist()}, want {want.tolist()}"


@pytest.mark.task(2)
def test_padded_cache_gives_each_row_its_own_logits(device):
    # Prefill a left-padded batch, then decode two steps; every row must see the
    # logits its own sequence gets alone (padding invisible, positions its own).
    model = tiny_model(device)
    prompts = [PROMPTS[5], PROMPTS[4], PROMPTS[0]]  # 3, 17 and 1 tokens
    ids, mask, positions = hand_padded_batch(prompts, device)
    P = ids.shape[1]
    cache = static.PaddedKVCache(model, mask, max_len=P + 2)
    logits = model(ids, positions, cache)[:, -1]  # [B, V]
    cache.advance(P)
    sequences = [list(p) for p in prompts]
    next_pos = positions[:, -1] + 1
    for step in range(3):
        for row, seq in enumerate(sequences):
            diff = (logits[row] - logits_no_cache(model, seq)[-1]).abs().max().item()
            assert diff <= 1e-5, (f"step {step}, row {row} ({len(prompts[row])}-token prompt behind "
                                  f"{P - len(prompts[row])} pads): logits differ from the row alone by {diff:.2e}")
        if step == 2:
            break
        new = [seq[-1] for seq in sequences]  # any next token will do
        for seq, token in zip(sequences, new):
            seq.append(token)
        logits = model(torch.tensor(new, device=device)[:, None], next_pos[:, None], cache)[:, -1]
        cache.advance(1)
        next_pos = next_pos + 1


# ---- task 3: run_batch, through run_static --------------------------------------


@pytest.fixture(scope="module")
def chapter01_greedy(device):
    model = tiny_model(device)
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    expected = [chapter01.generate_with_cache(model, p, sp) for p, sp in zip(PROMPTS, params)]
    reasons = {g.finish_reason for g in expected}
    assert reasons == {"stop", "length"}, f"test setup: want both finish reasons from chapter 01, got {reasons}"
    return params, expected


@pytest.mark.task(3)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_every_prompt_gets_chapter01s_tokens(device, chapter01_greedy, batch_size):
    params, expected = chapter01_greedy
    result = static.run_static(tiny_model(device), PROMPTS, params, batch_size=batch_size)
    compare_with_chapter01(result.generations, expected, PROMPTS, f"batch size {batch_size}")


@pytest.mark.task(3)
def test_seeded_sampling_does_not_depend_on_the_batch(device):
    # Each request samples from its own seeded generator, so sharing a batch
    # changes nothing: the tokens are the ones chapter 01 samples alone.
    model = tiny_model(device)
    prompts = PROMPTS[:6]
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [chapter01.generate_with_cache(model, p, sp) for p, sp in zip(prompts, params)]
    result = static.run_static(model, prompts, params, batch_size=4)
    compare_with_chapter01(result.generations, expected, prompts, "seeded sampling, batch size 4")


def count_waste_case(device):
    """One batch of 3 small enough to count by hand: prompts of 2, 5 and 3 tokens."""
    model = random_model(tiny_config(eos_token_ids=[])).to(device)  # no EOS: max_tokens alone ends each
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[5]]
    params = [SamplingParams(max_tokens=n) for n in (1, 4, 2)]
    return static.run_static(model, prompts, params, batch_size=3)


@pytest.mark.task(3)
def test_waste_counted_by_hand(device):
    # Prefill: 3 rows x 5 columns = 15 computed, 2 + 5 + 3 = 10 real, 5 padding.
    # Each row gets its first token. Row 0 (max_tokens 1) is done.
    # Decode 1: rows 1, 2 live, row 0 idle.        Row 2 now has 2 tokens: done.
    # Decode 2: row 1 live, rows 0, 2 idle.
    # Decode 3: row 1 live, rows 0, 2 idle.        Row 1 now has 4 tokens: done.
    # Computed 15 + 3 x 3 = 24; useful 10 + 2 + 1 + 1 = 14; idle slot-steps 1 + 2 + 2 = 5.
    stats = count_waste_case(device).stats
    want = dict(prompt_tokens=10, padding_tokens=5, generated_tokens=7, idle_slot_steps=5,
                computed_tokens=24, useful_tokens=14, steps=4)
    got = {name: getattr(stats, name) for name in want}
    assert got == want, "stats differ from the hand count:\n" + "\n".join(
        f"  {name}: got {got[name]}, want {want[name]}" for name in want if got[name] != want[name])
    assert stats.utilisation == pytest.approx(14 / 24), \
        f"utilisation is useful / computed tokens, 14 / 24 = {14 / 24:.3f}; got {stats.utilisation}"


@pytest.mark.task(3)
def test_padding_is_counted_per_batch(device, chapter01_greedy):
    params, _ = chapter01_greedy
    for batch_size in (3, 8):
        stats = static.run_static(tiny_model(device), PROMPTS, params, batch_size=batch_size).stats
        batches = [LENGTHS[i:i + batch_size] for i in range(0, len(LENGTHS), batch_size)]
        want = sum(max(b) * len(b) - sum(b) for b in batches)
        assert stats.padding_tokens == want, (f"batch size {batch_size}: padding_tokens {stats.padding_tokens}, "
                                              f"want sum(longest - length) over batches {batches} = {want}")
        assert stats.prompt_tokens == sum(LENGTHS), (f"batch size {batch_size}: prompt_tokens {stats.prompt_tokens}, "
                                                     f"want the real prompt tokens, {sum(LENGTHS)}")


@pytest.mark.task(3)
def test_traces_show_one_slot_per_row_and_the_wasted_rows(device):
    traces = count_waste_case(device).traces
    phases = [[slot.phase for slot in t.slots] for t in traces]
    want = [["prefill"] * 3, ["wasted", "decode", "decode"], ["wasted", "decode", "wasted"],
            ["wasted", "decode", "wasted"]]
    assert phases == want, f"slot phases per step:\n  got  {phases}\n  want {want}"
    ids = [[slot.seq_id for slot in t.slots] for t in traces]
    assert ids == [[0, 1, 2]] * 4, f"slot k holds request k at every step, finished or not; got {ids}"
    tokens = [slot.num_tokens for slot in traces[0].slots]
    assert tokens == [2, 5, 3], f"a prefill slot computes its prompt (2, 5 and 3 tokens); got num_tokens {tokens}"
    finished = [sorted(t.finished) for t in traces]
    assert finished == [[(0, "length")], [(2, "length")], [], [(1, "length")]], f"finished per step: {finished}"


@pytest.mark.task(3)
def test_a_short_last_batch_leaves_empty_slots(device):
    model = random_model(tiny_config(eos_token_ids=[])).to(device)
    result = static.run_static(model, PROMPTS[:5], SamplingParams(max_tokens=2), batch_size=3)
    slots = [[(s.seq_id, s.phase) for s in t.slots] for t in result.traces]
    assert len(slots) == 4, f"two batches of 2 steps each; got {len(slots)} traces"
    for step, phase in ((2, "prefill"), (3, "decode")):
        want = [(3, phase), (4, phase), (None, "empty")]
        assert slots[step] == want, (f"step {step}: the last batch of 2 in 3 slots leaves slot 2 empty; "
                                     f"(request, phase) per slot got {slots[step]}, want {want}")


@pytest.mark.task(3)
def test_a_full_context_ends_the_batch_at_its_last_column(device):
    # A 16-token context, prompts of 2 and 10 tokens, max_tokens 100. The 10-token row ends as it
    # does alone, after 6 tokens (10 + 6 = 16). Left padding put the 2-token row in the same 16
    # columns, so it ends too, with "length", when the padded cache's last column is filled:
    # after 16 - 10 + 1 = 7 tokens, the first 7 that chapter 01 gives it alone.
    model = random_model(tiny_config(eos_token_ids=[], max_position_embeddings=16)).to(device)
    prompts = [PROMPTS[1], PROMPTS[8][:10]]
    params = SamplingParams(max_tokens=100)
    alone = [chapter01.generate_with_cache(model, p, params) for p in prompts]
    got = static.run_static(model, prompts, params, batch_size=2).generations
    for row, (n, want) in enumerate([(7, alone[0]), (6, alone[1])]):
        assert (got[row].token_ids, got[row].finish_reason) == (want.token_ids[:n], "length"), (
            f"row {row} ({len(prompts[row])}-token prompt) in a batch padded to 10 columns of a 16-token context: "
            f"want chapter 01's first {n} tokens and 'length', got {len(got[row].token_ids)} tokens and "
            f"{got[row].finish_reason!r}; {first_difference(got[row].token_ids, want.token_ids[:n])}")


# ---- the real model ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.task(3)
@pytest.mark.parametrize("batch_size", [4, 16])
def test_smollm2_chat_prompts_match_chapter01(smollm2, chapter01_answers, batch_size):
    # 16 bundled chat prompts of different lengths, so every batch is really padded.
    model, _, prompts = smollm2
    prompts, params = prompts[:16], SamplingParams(max_tokens=24)
    result = static.run_static(model, prompts, params, batch_size=batch_size)
    assert len(result.generations) == len(prompts), f"{len(result.generations)} generations for {len(prompts)} prompts"
    expected = chapter01_answers(16, params.max_tokens)  # after the code under test: stubs fail fast
    for i, (got, want) in enumerate(zip(result.generations, expected)):
        assert got.token_ids == want.token_ids, (f"batch size {batch_size}, prompt {i} ({len(prompts[i])} tokens): "
                                                 f"{first_difference(got.token_ids, want.token_ids)}")
        assert got.finish_reason == want.finish_reason, (f"batch size {batch_size}, prompt {i}: finish_reason "
                                                         f"{got.finish_reason!r}, chapter 01 gives {want.finish_reason!r}")
