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


def test_each_column_times_its_call_after_what_it_names(tool, monkeypatch):
    """Column 1 runs no product before the call, column 2 the 576 x 64 one, column 3 a layer's four."""
    products, befores = [], {}
    forward = packed_linear.PackedLinear.forward

    def spy(self, x):
        products.append((self.in_features, self.out_features))
        return forward(self, x)

    def one_call(call, before, calls):
        products.clear()
        before()
        befores.setdefault(call, []).append(list(products))
        call()
        return 1.0
    monkeypatch.setattr(packed_linear.PackedLinear, "forward", spy)
    monkeypatch.setattr(tool, "median_us", one_call)
    results = tool.measure(rows=2, calls=3)
    assert len(results) == 3 and all(figures == [1.0, 1.0, 1.0] for figures in results.values()), results
    layer = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    for call, seen in befores.items():
        assert seen == [[], [(576, 64)], layer], f"the products before each column's calls: {seen}"
