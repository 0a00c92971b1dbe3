"""tools/step_kinds.py on the tiny model: every step lands in one kind, and the kinds add up to the run.

The tool is read to decide which steps a faster run must shorten, so a step
counted twice, left out, or put in the wrong kind would send that work to the
wrong place.
"""

import pytest

from minicb.llm import LLM
from minicb.model import random_model, tiny_config
from minicb.sampling import SamplingParams

from tool_support import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("step_kinds")


def test_decode_steps_fall_in_the_range_of_their_rows(tool):
    kinds = [tool.step_kind({"prefill": 0, "decode": rows}, slots=32) for rows in (1, 8, 9, 16, 17, 25, 32)]
    assert kinds == ["decode 1-8", "decode 1-8", "decode 9-16", "decode 9-16", "decode 17-24", "decode 25-32",
                     "decode 25-32"], kinds
    assert tool.step_kind({"prefill": 40, "decode": 0}, slots=32) == "prefill"
    assert tool.step_kind({"prefill": 40, "decode": 3}, slots=32) == "mixed"
    # Slots that do not divide evenly: the last range stops at the slots.
    assert tool.step_kind({"prefill": 0, "decode": 6}, slots=6, bins=4) == "decode 5-6"
    assert tool.step_kind({"prefill": 0, "decode": 2}, slots=2, bins=4) == "decode 2"


def test_the_kinds_add_up_to_the_run_and_order_prefills_first(tool):
    # Six prompts on two slots: a first prefill, refills beside decodes, then decodes alone.
    llm = LLM.from_model(random_model(tiny_config()), max_num_seqs=2)
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(6)]
    # Lengths that differ, so that a slot frees while the other still decodes.
    params = [SamplingParams(max_tokens=3 + 2 * (i % 3), ignore_eos=True) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    table = tool.tally(llm.traces, slots=2)
    assert list(table)[:2] == ["prefill", "mixed"] and all(k.startswith("decode") for k in list(table)[2:]), \
        f"kinds in order: {list(table)}"
    assert sum(row["steps"] for row in table.values()) == len(llm.traces)
    assert sum(row["seconds"] for row in table.values()) == pytest.approx(sum(t.time_s for t in llm.traces))
    assert sum(row["prompt_tokens"] for row in table.values()) == sum(map(len, prompts))
    # Every token but each request's first comes from a decode row.
    assert sum(row["decode_tokens"] for row in table.values()) == sum(len(o.token_ids) - 1 for o in outs)
    assert all(len(row["times"]) == row["steps"] for row in table.values())
    text = tool.markdown(table, wall_s=sum(t.time_s for t in llm.traces))
    assert text.count("\n") == 1 + len(table) and "| prefill | 1 |" in text, text
