"""tools/cold_calls.py times the right things: each call right after what it says came before it,
and a layer's products at SmolLM2's shapes on the rows asked for.

The tool's figures are timings and are not checked; what they time is.
"""

import pytest
import torch

from minicb import packed_linear

from tool_support import load_tool

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN packed linear")


@pytest.fixture(scope="module")
def tool():
    return load_tool("cold_calls")


def test_a_layer_runs_smollm2s_four_products_on_the_rows_asked(tool, monkeypatch):
    seen = []
    forward = packed_linear.PackedLinear.forward

    def spy(self, x):
        seen.append((self.in_features, self.out_features, tuple(x.shape)))
        return forward(self, x)
    monkeypatch.setattr(packed_linear.PackedLinear, "forward", spy)
    run = tool.layer_products(rows=3)
    with torch.inference_mode():
        run()
    assert seen == [(576, 960, (1, 3, 576)), (576, 576, (1, 3, 576)), (576, 3072, (1, 3, 576)),
                    (1536, 576, (1, 3, 1536))], f"a layer's products ran as {seen}"


def test_each_timed_call_comes_right_after_its_before(tool):
    order = []
    us = tool.median_us(lambda: order.append("call"), lambda: order.append("before"), calls=4)
    assert order == ["before", "call"] * 4, f"the calls ran in the order {order}"
    assert us >= 0


def test_every_probe_is_timed_three_ways(tool):
    results = tool.measure(rows=2, calls=3)
    assert len(results) == 3, f"probes: {list(results)}"
    for name, figures in results.items():
        assert len(figures) == 3 and all(f > 0 for f in figures), f"{name}: {figures}"
