"""tools/step_floor.py's pieces on the tiny model: the floor runs the step's own linear layers, the step is decode-only.

The tool times SmolLM2 for minutes; what it times must be the right thing,
which does not depend on timing: every projection of every layer plus lm_head,
on as many rows as slots, against an engine step in which every slot decodes.
"""

import pytest

from minicb import packed_linear
from minicb.model import random_model, tiny_config
from minicb.model_runner import prepare

from tool_support import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("step_floor")


@pytest.mark.parametrize("packed", [False, True])
def test_floor_runs_every_projection_and_lm_head_on_slot_rows(tool, packed):
    cfg = tiny_config()
    model = random_model(cfg)
    if packed:
        packed_linear.pack_linears(model)
    layers = tool.linear_layers(model)
    assert len(layers) == 7 * cfg.num_layers + 1, f"{len(layers)} linear layers; a step runs 7 per layer and lm_head"
    assert layers[-1] is model.lm_head, "lm_head must come last, as in the forward"
    rows_seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: rows_seen.append((args[0].shape[1], out.shape[-1])))
             for m in layers]
    tool.floor_fn(model, rows=5)()
    for h in hooks:
        h.remove()
    assert rows_seen == [(5, m.weight.shape[0]) for m in layers], f"floor ran {rows_seen}"


def test_decoding_engine_steps_decode_every_slot(tool):
    engine = tool.decoding_engine(random_model(tiny_config()), slots=3, context=20, steps=4)
    batch = prepare(engine.scheduler.schedule(), engine.allocator)
    assert batch.is_decode_only and batch.num_seqs == 3, \
        f"the timed step should decode 3 slots; it has {batch.num_seqs} sequences, {batch.num_decodes} decode rows"
    assert not engine.scheduler.waiting, "a request is still waiting: its prefill would land in the timed steps"
