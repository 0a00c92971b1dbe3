"""Chapter 11, all tasks together: your propose, verify and rollback inside the engine.

The other chapter 11 tests grade each task on its own, with the reference
standing in for the others. This file runs the engine (minicb/engine.py) with
speculation on, on the tiny random model, whose greedy answers repeat
themselves, so prompt lookup finds drafts and the model accepts some and
rejects others. Blocks of 4 tokens and up to 4 drafts make rollbacks cross
block boundaries.

- Greedy: every request's tokens and finish reason must equal the plain
  engine's (speculation off), drafts must have been proposed and accepted (and
  some rejected), after every step each decoding request must hold exactly as
  many token slots as it has computed tokens (no rejected draft's slot is
  kept), and at the end every block is free. On a roomy pool, and on a pool
  with prefix caching small enough to preempt.
- Seeded sampling: with speculation a seeded request draws its random numbers
  in another order than without, so its text differs from the plain engine's
  (chapter 11's text says why). What holds: each request ends properly, the
  same seeds give the same texts twice, and the same bookkeeping as above.

`check 11` shows it as the row "all".
"""
import pytest

from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [20, 21, 22, 23, 24] * 3, [30, 31] * 6, [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def tiny():
    return random_model(seed=3)  # vocab 256


def serve(model, params: list[SamplingParams], **config) -> dict:
    """Serve PROMPTS (one SamplingParams each); -> {index: finished Sequence}, checking the bookkeeping."""
    engine = Engine(model, EngineConfig(block_size=4, max_num_seqs=4, **config))
    index_of = {engine.add_request(prompt, p): i for i, (prompt, p) in enumerate(zip(PROMPTS, params))}
    finished = {}
    while engine.has_unfinished():
        for seq in engine.step().finished:
            assert index_of[seq.request_id] not in finished, f"request {index_of[seq.request_id]} finished twice"
            finished[index_of[seq.request_id]] = seq
        for seq in engine.scheduler.running:
            if seq.is_decoding:
                slots = engine.allocator.num_tokens(seq.seq_id)
                assert slots == seq.num_computed_tokens, (
                    f"after step {engine.num_steps - 1}, request {index_of[seq.request_id]} has "
                    f"{seq.num_computed_tokens} computed tokens but holds {slots} token slots: the slots of "
                    f"rejected drafts must go (rollback)")
        assert engine.num_steps < 500, f"the engine stopped making progress: {len(finished)} finished"
    assert sorted(finished) == list(range(len(PROMPTS))), f"requests that never finished: " \
        f"{sorted(set(range(len(PROMPTS))) - set(finished))}"
    free, total = engine.allocator.num_free_blocks, engine.allocator.num_blocks
    assert free == total, f"every block must be free after the run, but only {free} of {total} are"
    return finished


def check_drafts(finished: dict) -> None:
    drafted = sum(seq.num_draft_tokens for seq in finished.values())
    accepted = sum(seq.num_accepted_tokens for seq in finished.values())
    assert drafted > 0, "no draft was proposed, though every prompt repeats itself: propose_ngram found nothing"
    assert 0 < accepted < drafted, (f"{accepted} of {drafted} drafts were accepted; on these prompts the model "
                                    f"accepts some and rejects some")


@pytest.mark.task("all")
@pytest.mark.parametrize("pool", ["roomy", "small, caching"])
def test_greedy_speculation_gives_the_plain_engines_tokens(tiny, pool):
    config = dict(num_blocks=64) if pool == "roomy" else dict(num_blocks=14, enable_prefix_caching=True)
    params = [SamplingParams(max_tokens=m) for m in (24, 24, 20, 24, 16)]
    got = serve(tiny, params, speculative_ngram=2, num_speculative_tokens=4, **config)  # yours first: fail fast
    want = serve(tiny, params, **config)
    for i in sorted(want):
        a, b = got[i], want[i]
        assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason), (
            f"request {i} (prompt {PROMPTS[i]}): with speculation {a.output_token_ids} ({a.finish_reason}), "
            f"without {b.output_token_ids} ({b.finish_reason}); greedy verification must change no token")
    check_drafts(got)
    if pool != "roomy":
        preempted = sum(seq.num_preemptions for seq in got.values())
        assert preempted > 0, "the small pool was meant to force a preemption, but none happened"


@pytest.mark.task("all")
def test_seeded_sampling_with_speculation_repeats_itself(tiny):
    params = [SamplingParams(max_tokens=20, temperature=0.1, seed=40 + i) for i in range(len(PROMPTS))]
    first = serve(tiny, params, num_blocks=64, speculative_ngram=2, num_speculative_tokens=3)
    again = serve(tiny, params, num_blocks=64, speculative_ngram=2, num_speculative_tokens=3)
    for i, seq in sorted(first.items()):
        assert seq.finish_reason in ("stop", "length") and 1 <= len(seq.output_token_ids) <= 20, (
            f"request {i} ended {seq.finish_reason!r} with {len(seq.output_token_ids)} tokens of max_tokens 20")
        assert seq.output_token_ids == again[i].output_token_ids, (
            f"request {i}, seed {params[i].seed}: {seq.output_token_ids} then {again[i].output_token_ids}; the "
            f"same seed must give the same text (every draw from the request's generator)")
    check_drafts(first)
