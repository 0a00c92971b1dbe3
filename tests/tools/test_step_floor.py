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
