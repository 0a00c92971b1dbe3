"""The engine is built from the parts it is given (minicb/parts.py), and nothing on its path looks one up again."""
from __future__ import annotations

import pathlib

import pytest

from minicb import impl
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.parts import EngineParts
from minicb.sampling import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_student_switch_is_resolved_in_the_factory_only():
    # The engine's path reaches a student's code through EngineParts alone.
    path = [ROOT / "minicb" / name for name in ("engine.py", "paged_model.py", "cuda_graphs.py", "model_runner.py")]
    path += sorted((ROOT / "minicb" / "serve").glob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{i}" for p in path for i, line in enumerate(p.read_text().splitlines(), 1)
             if "impl.load" in line.split("#")[0] or "import impl" in line]
    assert not found, f"impl.load on the engine's path (the parts factory should resolve it): {found}"


def test_whose_code_the_parts_say_they_ran(monkeypatch):
    monkeypatch.setenv("MINICB_IMPL", "student")
    monkeypatch.setenv("MINICB_IMPL_ONLY", "scheduler")
    model = random_model(seed=0)
    engine = Engine(model, EngineConfig(num_blocks=16))
    assert type(engine.scheduler).__module__ == impl.student_module_name("scheduler"), type(engine.scheduler)
    assert engine.parts.students() == ["scheduler"], engine.parts.students()
    assert "block_allocator" in engine.parts.references() and "scheduler" not in engine.parts.references()
    # The reference's parts, whatever the environment says.
    config = EngineConfig(num_blocks=16)
    reference = Engine(model, parts=EngineParts.reference(config))
    assert type(reference.scheduler).__module__ == "minicb.scheduler" and reference.parts.students() == []
    assert reference.config is config, "the engine's settings are its parts'"
    with pytest.raises(ValueError, match="another EngineConfig"):
        Engine(model, EngineConfig(num_blocks=16), EngineParts.reference(config))


def test_reset_keeps_counting_request_ids_with_new_parts():
    engine = Engine(random_model(seed=0), EngineConfig(num_blocks=16, enable_prefix_caching=True))
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    old_scheduler, old_allocator = engine.scheduler, engine.allocator
    assert engine.reset() == [first]
    assert engine.scheduler is not old_scheduler and engine.allocator is not old_allocator
    assert engine.scheduler.allocator is engine.allocator, "the new scheduler must run on the new allocator"
    second = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, n=2))
    assert second > first, f"ids keep counting across a reset: {first} then {second}"
    named, completions = set(), set()
    while engine.has_unfinished():
        for token in engine.step().new_tokens:
            named.add(token.request_id)
            completions.add(token.completion)
    assert named == {second} and completions == {0, 1}, (named, completions)


def test_the_limits_a_server_reads():
    engine = Engine(random_model(seed=0), EngineConfig(num_blocks=8, block_size=4, max_num_seqs=3))
    limits = engine.limits
    assert (limits.num_blocks, limits.block_size, limits.max_num_seqs) == (8, 4, 3)
    assert limits.max_model_len == engine.model.config.max_position_embeddings
    assert limits.default_max_tokens(10) == 8 * 4 - 10, "the pool (32 tokens) is smaller than the context"
    assert limits.default_max_tokens(40) == 1, "at least 1: a prompt that leaves no room is the check's to refuse"
    with pytest.raises(Exception):
        limits.num_blocks = 9  # frozen: fixed for the engine's life


def test_step_outputs_carry_what_metrics_need():
    engine = Engine(random_model(seed=0), EngineConfig(num_blocks=32, block_size=4, max_num_seqs=2,
                                                       enable_prefix_caching=True, speculative_ngram=1))
    prompt = [5, 6, 7, 8] * 3
    total = {"computed": 0, "drafts": 0, "accepted": 0, "cached": 0, "tokens": 0}
    for _ in range(2):  # the second request finds the first one's full blocks cached
        engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        while engine.has_unfinished():
            out = engine.step()
            assert out.trace is None, "keep_traces=0 and nobody asked: no trace"
            total["computed"] += out.num_computed_tokens
            total["drafts"] += out.num_draft_tokens
            total["accepted"] += out.num_accepted_tokens
            total["cached"] += out.num_cached_tokens
            total["tokens"] += len(out.new_tokens)
            assert out.stats.num_running + out.stats.num_waiting == len(engine.scheduler.running) + len(
                engine.scheduler.waiting) and out.stats.num_free_blocks == engine.allocator.num_free_blocks
    assert total["tokens"] == 24 and total["cached"] == 8, total  # two full blocks of 4 of the 12-token prompt
    assert total["drafts"] > 0 and 0 <= total["accepted"] <= total["drafts"], total
    # Every token computed is a prompt token the cache did not serve, or a decode's newest token, or a
    # draft. Decode steps make 11 tokens a request: one each, plus the drafts they accepted.
    decode_steps = 2 * 11 - total["accepted"]
    want = (2 * 12 - total["cached"]) + decode_steps + total["drafts"]
    assert total["computed"] == want, f"tokens computed {total['computed']}, want {want}: {total}"
