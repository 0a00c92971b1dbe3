"""tools/step_floor.py's pieces on the tiny model: the floor runs the step's own linear layers, the step is decode-only.

The tool times SmolLM2 for minutes; what it times must be the right thing,
which does not depend on timing: every product of every layer (on a packed
model q, k and v as one, gate and up as one) plus lm_head, on as many rows as
slots, against an engine step in which every slot decodes.
"""

import pytest
import torch

from minicb import packed_linear
from minicb.model import random_model, tiny_config
from minicb.model_runner import prepare

from tool_support import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("step_floor")


@pytest.mark.parametrize("packed", [False, True])
def test_floor_runs_every_projection_and_lm_head_on_slot_rows(tool, packed, monkeypatch):
    cfg = tiny_config()
    model = random_model(cfg)
    if packed:
        packed_linear.pack_linears(model)
    layers = tool.linear_layers(model)
    # Plain: q, k, v, o, gate, up, down. Packed: [q k v], o, [gate up], down.
    per_layer = 4 if packed else 7
    assert len(layers) == per_layer * cfg.num_layers + 1, \
        f"{len(layers)} products; a step runs {per_layer} per layer and lm_head"
    assert layers[-1] is model.lm_head, "lm_head must come last, as in the forward"
    if packed:
        kinds = [type(m).__name__ for m in layers[:4]]
        assert kinds == ["FusedLinears", "PackedLinear", "FusedLinears", "PackedLinear"], f"a layer's products: {kinds}"
    rows_seen = []
    for kind in (torch.nn.Linear, packed_linear.PackedLinear, packed_linear.FusedLinears):
        call = kind.__call__ if kind is packed_linear.FusedLinears else kind.forward

        def spy(self, x, call=call):
            rows_seen.append((id(self), x.shape[1]))
            return call(self, x)
        monkeypatch.setattr(kind, "__call__" if kind is packed_linear.FusedLinears else "forward", spy)
    tool.floor_fn(model, rows=5)()
    assert rows_seen == [(id(m), 5) for m in layers], f"floor ran {rows_seen}"


def test_decoding_engine_steps_decode_every_slot(tool):
    engine = tool.decoding_engine(random_model(tiny_config()), slots=3, context=20, steps=4)
    batch = prepare(engine.scheduler.schedule(), engine.allocator)
    assert batch.is_decode_only and batch.num_seqs == 3, \
        f"the timed step should decode 3 slots; it has {batch.num_seqs} sequences, {batch.num_decodes} decode rows"
    assert not engine.scheduler.waiting, "a request is still waiting: its prefill would land in the timed steps"


def test_knockout_takes_each_piece_out_of_the_step_and_puts_it_back(tool):
    engine = tool.decoding_engine(random_model(tiny_config()), slots=2, context=20, steps=2 * len(tool.PIECES) + 4)
    assert isinstance(engine.attention, tool.CpuDecodeAttention), \
        f"the engine runs {type(engine.attention).__name__}, not the CPU decode the knockout takes apart"
    for name, (cls, method, nothing) in tool.PIECES.items():
        original = cls.__dict__[method]
        calls = []

        def counted(*args, original=original):
            calls.append(1)
            return original(*args)
        setattr(cls, method, counted)
        try:
            with tool.without(name):
                engine.step()
            assert not calls, f"the step ran {name} {len(calls)} times while it was taken out"
            engine.step()
            assert calls, f"the step never ran {name} once it was put back"
        finally:
            setattr(cls, method, original)
    assert all(cls.__dict__[method] is not nothing for cls, method, nothing in tool.PIECES.values()), \
        "a piece was left replaced by nothing"


def test_attention_bounds_read_the_steps_own_k_and_v(tool):
    cfg = tiny_config()
    engine = tool.decoding_engine(random_model(cfg), slots=2, context=20, steps=4)
    bounds = tool.attention_bounds(engine, rounds=2)
    # Prompts of 20 and 25 tokens, then a prefill and two decodes: the measured step attends over
    # 20 + 3 and 25 + 3 tokens, each a K row and a V row of n_kv_heads * head_dim floats in every layer.
    expected = 2 * cfg.num_layers * (23 + 28) * cfg.num_kv_heads * cfg.head_dim * 4 / 1e6
    assert bounds["kv_mb"] == pytest.approx(expected), f"{bounds['kv_mb']} MB of K and V; the step holds {expected}"
    assert bounds["read_ms"] > 0 and bounds["in_cache_ms"] > 0, f"a bound was not timed: {bounds}"
    flops = 4 * cfg.num_layers * (23 + 28) * cfg.num_heads * cfg.head_dim  # a score and a weighted value per K/V row read
    assert bounds["gflops_in_cache"] == pytest.approx(flops / bounds["in_cache_ms"] / 1e6), bounds


def test_floor_gflops_counts_a_multiply_add_per_weight_and_row(tool):
    cfg = tiny_config()
    model = random_model(cfg)
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim   # q, k, v
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size                        # o
                 + 3 * cfg.hidden_size * cfg.intermediate_size)                          # gate, up, down
    weights = cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size              # and lm_head
    assert tool.floor_gflops(model, rows=4, floor_ms=2.0) == pytest.approx(2 * 4 * weights / 2.0 / 1e6)
