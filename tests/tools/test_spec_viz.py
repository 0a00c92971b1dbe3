"""Tests for minicb/spec_viz.py, on StepTraces built by hand (no model, well under a second).

The traces below follow chapter 11's engine: a step that verified drafts lists
(seq_id, drafts, num_accepted, added token) in `speculation`, and `new_tokens`
holds what was appended, the accepted drafts then the added token.
"""
import ast
import html
import os
import pathlib
from html.parser import HTMLParser
from types import SimpleNamespace

os.environ.setdefault("MPLBACKEND", "Agg")  # before anything imports pyplot

import pytest

from minicb import spec_viz
from minicb.trace import SlotState, StepTrace

WORDS = {1: " the", 2: " cat", 3: " sat", 4: " on", 5: " mat", 6: " dog", 7: ".", 8: " a", 9: "\n", 10: " <b>"}


class WordTokenizer:
    """decode(ids) joins fixed words: enough of a tokenizer for the pictures."""

    def decode(self, token_ids):
        return "".join(WORDS[t] for t in token_ids)


def trace(step, new_tokens=(), speculation=()):
    return StepTrace(step=step, slots=[SlotState(0, "decode", 1)], new_tokens=list(new_tokens),
                     speculation=[tuple(s) for s in speculation])


# Request 0: step 0 samples its first token (prefill, no drafts); step 1 verifies 3 drafts and
# accepts 1 ("cat" kept; "on", "mat" rejected; correction "sat"); step 2 has no drafts ("."); step 3
# accepts both drafts and adds the bonus "dog". Request 1 shares the steps and must not leak in.
TRACES = [
    trace(0, new_tokens=[(0, 1), (1, 8)]),
    trace(1, new_tokens=[(0, 2), (0, 3), (1, 6)], speculation=[(0, [2, 4, 5], 1, 3)]),
    trace(2, new_tokens=[(0, 7)], speculation=[(1, [5, 5], 0, 7)]),
    trace(3, new_tokens=[(0, 1), (0, 5), (0, 6)], speculation=[(0, [1, 5], 2, 6)]),
]


class SpanCollector(HTMLParser):
    """(css class, text) of every token span, in document order; and the steps' data-step values."""

    def __init__(self):
        super().__init__()
        self.spans, self.steps, self._open = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and attrs.get("class", "").startswith("minicb-spec-step"):
            self.steps.append(int(attrs["data-step"]))
        elif tag == "span" and "minicb-spec-" in attrs.get("class", "") and self.steps:
            self._open = [attrs["class"], "", attrs.get("style", "")]

    def handle_data(self, data):
        if self._open is not None:
            self._open[1] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.spans.append(tuple(self._open))
            self._open = None


def token_spans(html_text):
    """Parse only the text part (after the legend)."""
    text = html_text[html_text.index("minicb-spec-text"):]
    parser = SpanCollector()
    parser.feed("<div class='" + text)
    return parser


def test_request_steps_splits_accepted_rejected_and_added():
    segments = spec_viz.request_steps(TRACES, 0)
    assert [s.step for s in segments] == [0, 1, 2, 3]
    assert [s.kind for s in segments] == ["plain", "speculative", "plain", "speculative"]
    one, three = segments[1], segments[3]
    assert (one.accepted, one.rejected, one.added, one.bonus) == ([2], [4, 5], 3, False)
    assert (three.accepted, three.rejected, three.added, three.bonus) == ([1, 5], [], 6, True)
    assert [s.kept for s in segments] == [1, 2, 1, 3]
    # Request 1's speculation at step 2 belongs to request 1 only.
    other = spec_viz.request_steps(TRACES, 1)
    assert [(s.step, s.kind) for s in other] == [(0, "plain"), (1, "plain"), (2, "speculative")]
    assert other[2].rejected == [5, 5] and other[2].added == 7


def test_html_colours_each_token_by_its_fate_in_order():
    html_text = spec_viz.speculation_html(TRACES, WordTokenizer(), 0)
    parsed = token_spans(html_text)
    assert parsed.steps == [0, 1, 2, 3]
    got = [(cls, text) for cls, text, _ in parsed.spans]
    assert got == [
        ("minicb-spec-plain", " the"),
        ("minicb-spec-accepted", " cat"),
        ("minicb-spec-rejected", " on"),
        ("minicb-spec-rejected", " mat"),
        ("minicb-spec-correction minicb-spec-added", " sat"),
        ("minicb-spec-plain", "."),
        ("minicb-spec-accepted", " the"),
        ("minicb-spec-accepted", " mat"),
        ("minicb-spec-bonus minicb-spec-added", " dog"),
    ]
    styles = {cls.split()[0]: style for cls, _, style in parsed.spans}
    assert "line-through" in styles["minicb-spec-rejected"]
    assert "line-through" not in styles["minicb-spec-accepted"]
    # Three different colours for accepted, rejected and added tokens.
    assert len({styles[c] for c in ("minicb-spec-accepted", "minicb-spec-rejected",
                                    "minicb-spec-correction")}) == 3
    # The legend names every kind, and the header counts: 5 drafts proposed, 3 accepted.
    for _, label in spec_viz.LEGEND:
        assert html.escape(label) in html_text
    assert "5 drafts proposed in 2 steps, 3 accepted (60%)" in html_text
    assert "7 tokens in 4 steps" in html_text


def test_steps_without_speculation_show_plain_tokens():
    traces = [trace(0, new_tokens=[(0, 1)]), trace(1, new_tokens=[(0, 2)]), trace(2, new_tokens=[(0, 9), (0, 10)])]
    parsed = token_spans(spec_viz.speculation_html(traces, WordTokenizer(), 0))
    assert [(cls, text) for cls, text, _ in parsed.spans] == [
        ("minicb-spec-plain", " the"), ("minicb-spec-plain", " cat"),
        ("minicb-spec-plain", "↵\n"), ("minicb-spec-plain", " <b>")]  # newline shown, markup escaped
    html_text = spec_viz.speculation_html(traces, WordTokenizer(), 0)
    assert "&lt;b&gt;" in html_text and " <b>" not in html_text[html_text.index("minicb-spec-text"):]
    assert "0 drafts proposed in 0 steps" in html_text


def test_upto_and_current_show_the_run_so_far():
    html_text = spec_viz.speculation_html(TRACES, WordTokenizer(), 0, upto=1, current=1, legend=False)
    parsed = token_spans(html_text)
    assert parsed.steps == [0, 1]
    assert [text for _, text, _ in parsed.spans] == [" the", " cat", " on", " mat", " sat"]
    assert "2px solid #222" in html_text[html_text.index("data-step='1'"):]
    assert "2px solid #222" not in html_text[:html_text.index("data-step='1'")]
    assert "minicb-spec-legend" not in html_text


def test_tokens_after_a_stop_are_marked_dropped():
    # Step 1 accepted 2 drafts, but the first was the stop token: only it was appended.
    traces = [trace(0, new_tokens=[(0, 1)]), trace(1, new_tokens=[(0, 7)], speculation=[(0, [7, 8], 2, 6)])]
    parsed = token_spans(spec_viz.speculation_html(traces, WordTokenizer(), 0))
    assert [(cls, text) for cls, text, _ in parsed.spans] == [
        ("minicb-spec-plain", " the"), ("minicb-spec-accepted", "."),
        ("minicb-spec-dropped", " a"), ("minicb-spec-dropped", " dog")]


def test_inconsistent_traces_and_unknown_requests_raise():
    bad = [trace(0, new_tokens=[(0, 4)], speculation=[(0, [2], 1, 3)])]  # appended is not what was verified
    with pytest.raises(ValueError, match="appended"):
        spec_viz.request_steps(bad, 0)
    with pytest.raises(ValueError, match="sequence 7"):
        spec_viz.speculation_html(TRACES, WordTokenizer(), 7)


def test_static_object_renders_html_without_a_kernel():
    view = spec_viz.SpeculationText(TRACES, WordTokenizer(), 0)
    assert view._repr_html_() == view.html == spec_viz.speculation_html(TRACES, WordTokenizer(), 0)


def test_player_steps_and_falls_back_to_html():
    pytest.importorskip("ipywidgets")
    player = spec_viz.SpeculationPlayer(TRACES, WordTokenizer(), 0)
    assert player.step == 3  # it opens on the whole answer
    player.step = 1
    state = player.state()
    assert (state["step"], state["accepted"], state["rejected"], state["added"]) == (1, [2], [4, 5], 3)
    assert state["caption"] == ("step 1: proposed 3 drafts ' cat on mat'; accepted 1 ' cat'; "
                                "correction ' sat': 2 tokens from one forward")
    assert [text for _, text, _ in token_spans(player.text.value).spans] == [" the", " cat", " on", " mat", " sat"]
    player.step = 3
    assert player.state()["tokens"] == [1, 5, 6] and "bonus" in player.state()["caption"]
    bundle = player._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/html"] == spec_viz.speculation_html(TRACES, WordTokenizer(), 0)


def test_replay_greedy_follows_the_known_answer():
    # Prompt 5 6 7 8 9; answer 5 6 7 8 1 2. After "5 6" the lookup of [5, 6] proposes 7 8 9:
    # 7 and 8 match the answer, 9 does not, and the answer's 1 is the correction.
    segments = spec_viz.replay_greedy([5, 6, 7, 8, 9], [5, 6, 7, 8, 1, 2], n=2, k=3)
    assert [(s.kind, s.drafts, s.num_accepted, s.added, s.yielded) for s in segments] == [
        ("plain", [], 0, None, [5]), ("plain", [], 0, None, [6]),
        ("speculative", [7, 8, 9], 2, 1, [7, 8, 1]), ("plain", [], 0, None, [2])]
    assert [t for s in segments for t in s.yielded[:s.kept]] == [5, 6, 7, 8, 1, 2]
    assert spec_viz.replay_numbers(segments) == {"num_draft_tokens": 3, "num_accepted_tokens": 2,
                                                 "num_decode_steps": 3}
    # k = 1: draft 7 accepted with the bonus 8; then [7, 8] proposes 9, rejected for the correction 1.
    one = spec_viz.replay_greedy([5, 6, 7, 8, 9], [5, 6, 7, 8, 1, 2], n=2, k=1)
    assert [(s.drafts, s.num_accepted, s.added, s.bonus) for s in one if s.kind == "speculative"] == [
        ([7], 1, 8, True), ([9], 0, 1, False)]
    capped = spec_viz.replay_greedy([5, 6, 7, 8, 9], [5, 6, 7], n=2, k=3)
    assert [s.drafts for s in capped] == [[], [], []]  # after "5 6" only 0 drafts fit under max_tokens = 3
    # An answer that stopped (max_tokens 10) inside a run of drafts: nothing after the stop is added.
    stopped = spec_viz.replay_greedy([5, 6, 7, 8, 9], [5, 6, 7, 8], n=2, k=3, max_tokens=10)
    last = stopped[-1]
    assert (last.drafts, last.num_accepted, last.added, last.kept) == ([7, 8, 9], 2, None, 2)
    with pytest.raises(ValueError, match="more than max_tokens"):
        spec_viz.replay_greedy([1], [1, 2, 3], n=1, k=1, max_tokens=2)


def test_acceptance_numbers_sum_the_metrics():
    outputs = [SimpleNamespace(metrics=SimpleNamespace(num_draft_tokens=10, num_accepted_tokens=6, num_decode_steps=8)),
               SimpleNamespace(metrics=SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0, num_decode_steps=4))]
    numbers = spec_viz.acceptance_numbers(outputs)
    assert numbers["acceptance_rate"] == pytest.approx(0.6)
    assert numbers["accepted_per_step"] == pytest.approx(0.5)
    assert numbers["tokens_per_step"] == pytest.approx(1.5)
    # The same numbers from replay_numbers' dicts.
    as_dicts = [{"num_draft_tokens": 10, "num_accepted_tokens": 6, "num_decode_steps": 8},
                {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_decode_steps": 4}]
    assert spec_viz.acceptance_numbers(as_dicts) == numbers


def test_plot_acceptance_has_one_point_per_k():
    import matplotlib.pyplot as plt

    ks, accepted, rates = [1, 2, 4, 8], [0.5, 0.9, 1.3, 1.5], [0.8, 0.7, 0.5, 0.3]
    fig = spec_viz.plot_acceptance(ks, accepted, rates)
    try:
        lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
        measured = lines["accepted drafts per decode step"]
        assert list(measured.get_xdata()) == ks and list(measured.get_ydata()) == accepted
        assert list(lines["acceptance rate"].get_ydata()) == rates
        assert list(lines["ceiling: all k accepted"].get_ydata()) == ks
        assert len(fig.axes) == 2
    finally:
        plt.close(fig)
    fig = spec_viz.plot_acceptance(ks, accepted)  # without rates: one axis
    try:
        assert len(fig.axes) == 1 and len(fig.axes[0].get_lines()) == 2
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="one accepted_per_step value per k"):
        spec_viz.plot_acceptance(ks, accepted[:3])


def test_module_level_imports_are_cheap():
    # matplotlib and ipywidgets are imported inside the functions that draw, as in minicb/viz.py.
    tree = ast.parse(pathlib.Path(spec_viz.__file__).read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert top <= {"__future__", "html", "dataclasses", "minicb"}, top
