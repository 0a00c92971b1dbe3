"""Tests for minicb/viz.py, on traces built here rather than by the engines.

Two small simulators below produce StepTraces the way the chapter 02 and chapter 06
engines do (same fields, same meaning), so these tests need no model and run in
about a second. The continuous one is sized so its run has evictions, refills and
a preemption.
"""
import dataclasses
import os
import subprocess
import sys

os.environ.setdefault("MPLBACKEND", "Agg")  # before anything imports pyplot

import numpy as np
import pytest

from minicb import LLM, SamplingParams, viz
from minicb.model import random_model
from minicb.trace import SlotState, StepTrace, load_traces, save_traces

# (prompt_len, output_len, ends_with_stop_token) per request; request id = index.
REQUESTS = [(3, 4, True), (2, 7, False), (4, 2, True), (1, 3, False), (2, 5, True)]


def simulate_continuous(requests, num_slots=2, num_blocks=5, block_size=2) -> list[StepTrace]:
    """A toy continuous batcher: FCFS admission into free slots, one prefill step per
    request (it also yields the first token), one token per decode step, KV blocks from a
    free list, and preemption by recompute of the newest running request when a decode
    needs a block and none is free."""
    waiting = list(range(len(requests)))
    slot_of: dict[int, int] = {}  # running request -> slot
    admitted_at: dict[int, int] = {}  # request -> admission number (newest = largest)
    kv_len = {rid: 0 for rid in waiting}  # tokens whose KV is cached
    generated = {rid: 0 for rid in waiting}
    owners: list[int | None] = [None] * num_blocks
    traces = []

    def blocks_of(rid):
        return [b for b, owner in enumerate(owners) if owner == rid]

    def grab(rid, count):
        free = [b for b, owner in enumerate(owners) if owner is None]
        for b in free[:count]:
            owners[b] = rid

    def release(rid):
        for b in blocks_of(rid):
            owners[b] = None

    step = 0
    while waiting or slot_of:
        slots = [SlotState(None, "empty") for _ in range(num_slots)]
        admitted, finished, preempted = [], [], []
        # Decodes first; a decode that needs a block it cannot get preempts the newest request.
        for rid in sorted(slot_of, key=lambda r: admitted_at[r]):
            if rid not in slot_of:
                continue
            while len(blocks_of(rid)) * block_size < kv_len[rid] + 1 and None not in owners:
                victim = max(slot_of, key=lambda r: admitted_at[r])
                release(victim)
                del slot_of[victim]
                kv_len[victim] = generated[victim] = 0
                slots = [SlotState(None, "empty") if s.request_id == victim else s for s in slots]
                waiting.insert(0, victim)
                preempted.append(victim)
                if victim == rid:
                    break
            if rid in slot_of:
                grab(rid, 1 if len(blocks_of(rid)) * block_size < kv_len[rid] + 1 else 0)
                slots[slot_of[rid]] = SlotState(rid, "decode", 1)
        # Admit waiting requests into free slots while their prompt fits (not in a step that preempted).
        while waiting and not preempted and len(slot_of) < num_slots:
            rid = waiting[0]
            need = -(-requests[rid][0] // block_size)
            if owners.count(None) < need:
                break
            waiting.pop(0)
            grab(rid, need)
            slot = min(set(range(num_slots)) - set(slot_of.values()))
            slot_of[rid], admitted_at[rid] = slot, len(admitted_at) + step * num_slots
            admitted.append(rid)
            slots[slot] = SlotState(rid, "prefill", requests[rid][0])
        # "Run" the step, then evict the requests that are done.
        for slot_state in slots:
            if slot_state.request_id is not None:
                kv_len[slot_state.request_id] += slot_state.num_tokens
                generated[slot_state.request_id] += 1
        for rid in list(slot_of):
            if generated[rid] == requests[rid][1]:
                finished.append((rid, "stop" if requests[rid][2] else "length"))
                release(rid)
                del slot_of[rid]
        computed = sum(s.num_tokens for s in slots)
        traces.append(StepTrace(step=step, slots=slots, admitted=admitted, finished=finished,
                                preempted=preempted, waiting=list(waiting), running=sorted(slot_of),
                                num_free_blocks=owners.count(None), num_blocks=num_blocks,
                                block_owners=list(owners), num_tokens=computed,
                                num_useful_tokens=computed, time_s=0.01))
        step += 1
    return traces


def simulate_static(requests, batch_size=2) -> list[StepTrace]:
    """A toy static batcher: batches of `batch_size` in arrival order, prompts left-padded
    to the longest, and every batch runs until its longest request is done."""
    traces = []
    for start in range(0, len(requests), batch_size):
        batch = list(range(start, min(start + batch_size, len(requests))))
        longest_prompt = max(requests[rid][0] for rid in batch)
        for i in range(max(requests[rid][1] for rid in batch)):
            slots = [SlotState(None, "empty") for _ in range(batch_size)]
            finished = []
            for row, rid in enumerate(batch):
                prompt_len, output_len, stops = requests[rid]
                if i >= output_len:
                    slots[row] = SlotState(rid, "wasted", 1)
                else:
                    slots[row] = SlotState(rid, "prefill", prompt_len) if i == 0 else SlotState(rid, "decode", 1)
                    if i == output_len - 1:
                        finished.append((rid, "stop" if stops else "length"))
            traces.append(StepTrace(
                step=len(traces), slots=slots, admitted=batch if i == 0 else [], finished=finished,
                waiting=list(range(batch[-1] + 1, len(requests))),
                running=[rid for rid in batch if i < requests[rid][1] - 1],
                num_tokens=len(batch) * (longest_prompt if i == 0 else 1),
                num_useful_tokens=sum(s.num_tokens for s in slots if s.phase in ("prefill", "decode")),
                time_s=0.01))
    return traces


@pytest.fixture(scope="module")
def continuous():
    return simulate_continuous(REQUESTS)


@pytest.fixture(scope="module")
def static():
    return simulate_static(REQUESTS)


def test_simulator_covers_every_event(continuous, static):
    # The rest of this file relies on the toy run having each kind of event.
    kinds = {kind for _, _, kind, _ in viz.step_events(continuous)}
    assert kinds == {"stop", "length", "refill", "preempt"}, kinds
    assert any(s.phase == "wasted" for t in static for s in t.slots)


# ---------------------------------------------------------------- summarize

def hand_trace() -> list[StepTrace]:
    """Two slots, four steps, every count checkable by eye:
    step 0: r0 prefill (3 tokens) | r1 prefill (2)
    step 1: r0 decode, finishes "stop" | r1 decode
    step 2: r2 prefill (2) into slot 0 -> refill | r1 preempted, slot 1 empty
    step 3: r2 decode, finishes "length" | r1 prefill (2) again into slot 1 -> not a refill
            (slot 1's previous occupant was r1 itself); one padding token, so 4 computed, 3 useful
    """
    S = SlotState
    return [
        StepTrace(0, [S(0, "prefill", 3), S(1, "prefill", 2)], admitted=[0, 1], num_tokens=5, num_useful_tokens=5),
        StepTrace(1, [S(0, "decode", 1), S(1, "decode", 1)], finished=[(0, "stop")], num_tokens=2,
                  num_useful_tokens=2),
        StepTrace(2, [S(2, "prefill", 2), S(None, "empty")], admitted=[2], preempted=[1], num_tokens=2,
                  num_useful_tokens=2),
        StepTrace(3, [S(2, "decode", 1), S(1, "prefill", 2)], admitted=[1], finished=[(2, "length")],
                  num_tokens=4, num_useful_tokens=3),
    ]


def test_summarize_matches_hand_count():
    got = viz.summarize(hand_trace())
    want = {"steps": 4, "tokens_computed": 13, "useful_tokens": 12, "evictions": 2, "refills": 1,
            "preemptions": 1, "slot_steps": 8, "idle_slot_steps": 1}
    differing = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert not differing, f"(got, want) per key: {differing}"
    assert got["utilisation"] == pytest.approx(12 / 13)


def test_step_events_places_each_event_in_its_slot():
    events = sorted(viz.step_events(hand_trace()))
    assert events == [(1, 0, "stop", 0), (2, 0, "refill", 2), (2, 1, "preempt", 1), (3, 0, "length", 2)], events


def test_summarize_static_counts_wasted_rows(static):
    # Batch (r0, r1) runs 7 steps: r0 is wasted for 3; batch (r2, r3) runs 3: r2 wasted for 1;
    # r4 runs 5 steps alone in a 2-row batch: its second row is empty for 5.
    got = viz.summarize(static)
    assert (got["steps"], got["idle_slot_steps"], got["refills"]) == (15, 3 + 1 + 5, 3), got


# ---------------------------------------------------------------- timeline_text

def rows_of(text: str, slot: int) -> tuple[str, str]:
    """The cells of a slot's row and of the event row under it (without the labels)."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(f"slot {slot} "))
    return lines[i][10:], lines[i + 1][10:]


def test_timeline_text_cells_and_markers_at_their_steps():
    text = viz.timeline_text(hand_trace(), color=False, width=80)
    cells0, marks0 = rows_of(text, 0)
    cells1, marks1 = rows_of(text, 1)
    assert cells0 == "AaCc", text
    assert cells1 == "Bb B", text
    # slot 0: finished "stop" at step 1, refill at step 2, finished "length" at step 3
    assert marks0 == " x+#", text
    # slot 1: the preemption at step 2, where r1 last ran
    assert marks1 == "  !", text
    assert "A=r0" in text and "B=r1" in text and "C=r2" in text


def test_timeline_text_markers_match_events(continuous):
    text = viz.timeline_text(continuous, color=False, width=500)
    events = viz.step_events(continuous)
    assert len({(i, slot) for i, slot, _, _ in events}) == len(events), "this run has one event per cell"
    for i, slot, kind, rid in events:
        cells, marks = rows_of(text, slot)
        assert marks[i] == viz.MARKERS[kind], f"step {i} slot {slot}: want {kind!r}, row {marks!r}"
        state = continuous[i].slots[slot]
        if state.phase != "empty":
            assert cells[i] == viz.request_symbol(state.request_id, state.phase == "prefill")
    for rid in range(len(REQUESTS)):
        assert viz.request_symbol(rid, prefill=True) in text and viz.request_symbol(rid) in text


def test_timeline_text_color_is_only_decoration(continuous):
    import re

    plain = viz.timeline_text(continuous, color=False, width=500)
    colored = viz.timeline_text(continuous, color=True, width=500)
    assert "\x1b[" in colored
    assert re.sub(r"\x1b\[[0-9;]*m", "", colored) == plain


def test_timeline_text_static_shows_wasted_rows(static):
    text = viz.timeline_text(static, color=False, width=500)
    cells0, marks0 = rows_of(text, 0)
    # r0 (A) computes 4 tokens and then wastes 3 steps waiting for r1; r2 (C) refills the row.
    assert cells0.startswith("Aaaa···Cc·E"), text
    assert marks0.startswith("   x   +x +"), text


def test_timeline_text_compresses_long_runs(static):
    # 15 steps in 5 columns: column c covers steps 3c..3c+2 and shows its prefill, else its last step.
    text = viz.timeline_text(static, color=False, width=5)
    assert "1 column = 3 steps" in text
    cells0, marks0 = rows_of(text, 0)
    assert cells0 == "A·CEe", text
    # r0 stops at step 3; r2 refills at 7 and stops at 8 (one column: the stop wins); r4 refills at 10, stops at 14
    assert marks0 == " xx+x", text


# ---------------------------------------------------------------- figures

def render(fig) -> np.ndarray:
    """The figure as pixels, [height, width, 3] uint8."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def pixel(image, ax, x, y) -> np.ndarray:
    """RGB of the rendered figure at data coordinates (x, y) of ax, as floats 0-255."""
    px, py = ax.transData.transform((x, y))  # display coordinates, origin bottom left
    return image[image.shape[0] - int(round(py)), int(round(px))].astype(float)


def test_plot_timeline_cells_take_request_colors(continuous):
    fig = viz.plot_timeline(continuous, title="toy")
    ax = fig.axes[0]
    assert len(fig.axes) == 2 and ax.get_title() == "toy", "the timeline, then the token strip under it"
    assert len(viz.plot_timeline(continuous, strip=False).axes) == 1
    image = render(fig)
    # step 0, slot 0: r0's prefill, in the darker shade; a later decode of the same slot is lighter
    want = np.round(np.array(viz.request_color(continuous[0].slots[0].request_id, prefill=True)) * 255)
    assert np.abs(pixel(image, ax, 0, 0.3) - want).max() <= 3, (pixel(image, ax, 0, 0.3), want)
    decode = next(i for i, t in enumerate(continuous) if t.slots[0].phase == "decode")
    assert np.abs(pixel(image, ax, decode, 0.3) - pixel(image, ax, 0, 0.3)).max() > 20
    empty = next(i for i, t in enumerate(continuous) if t.slots[1].phase == "empty")
    assert pixel(image, ax, empty, 1.3).min() >= 250, "an empty slot should be white"


def test_plot_block_map_free_and_owned_cells_differ(continuous):
    trace = next(t for t in continuous if 0 < t.num_free_blocks < t.num_blocks)
    fig = viz.plot_block_map(trace)
    ax = fig.axes[0]
    assert f"{trace.num_free_blocks} of {trace.num_blocks} free" in ax.get_title()
    image = render(fig)
    cols = int(round(ax.get_xlim()[1] + 0.5))
    for block, owner in enumerate(trace.block_owners):
        # sample a corner of the cell, away from the letter drawn in its middle
        rgb = pixel(image, ax, block % cols - 0.3, block // cols - 0.3)
        want = (255, 255, 255) if owner is None else np.round(np.array(viz.request_color(owner)) * 255)
        assert np.abs(rgb - want).max() <= 3, f"block {block} (owner {owner}): pixel {rgb}, want {want}"


def test_plot_block_map_without_a_pool(static):
    fig = viz.plot_block_map(static[0])
    assert "none" in fig.axes[0].get_title()


def test_plot_side_by_side_titles_and_png(static, continuous, tmp_path):
    path = tmp_path / "compare.png"
    fig = viz.plot_side_by_side(static, continuous, path=str(path))
    assert len(fig.axes) == 2
    top, bottom = (ax.get_title() for ax in fig.axes)
    for title, traces in ((top, static), (bottom, continuous)):
        numbers = viz.summarize(traces)
        assert f"{numbers['steps']} steps" in title and f"{numbers['utilisation']:.0%}" in title, title
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_traces_survive_a_json_round_trip(continuous, tmp_path):
    path = tmp_path / "run.json"
    save_traces(continuous, str(path))
    loaded = load_traces(str(path))
    assert loaded == continuous
    text = viz.timeline_text(continuous, color=False, width=500)
    assert viz.timeline_text(loaded, color=False, width=500) == text
    assert len(viz.plot_timeline(loaded).axes) == 2


# ---------------------------------------------------------------- the widget

def test_step_player_follows_the_slider(continuous):
    player = viz.StepPlayer(continuous)
    assert player.slider.max == len(continuous) - 1
    for k in (0, 3, len(continuous) - 1, 2):
        player.slider.value = k
        state, trace = player.state(), continuous[k]
        assert state["step"] == k and player.step == k
        assert state["slots"] == [s.request_id if s.phase != "empty" else None for s in trace.slots]
        assert state["phases"] == [s.phase for s in trace.slots]
        assert (state["waiting"], state["running"]) == (trace.waiting, trace.running)
        assert state["finished"] == [rid for t in continuous[:k + 1] for rid, _ in t.finished]
        assert (state["num_free_blocks"], state["block_owners"]) == (trace.num_free_blocks, trace.block_owners)
        assert f"<b>step {k}</b>" in player.queues.value
        for rid in trace.running:  # named as the block map names them: letter, then id
            assert f">{viz.request_symbol(rid, prefill=True)}&nbsp;r{rid}<" in player.queues.value
    # Two steps with different slot contents give different pictures.
    a = next(i for i in range(1, len(continuous)) if continuous[i].block_owners != continuous[0].block_owners)
    player.step = 0
    timeline0, blocks0 = player.timeline_image.value, player.block_image.value
    player.step = a
    assert player.timeline_image.value != timeline0 and player.block_image.value != blocks0
    assert player.timeline_image.value[:4] == b"\x89PNG"


def test_step_player_with_static_run(static, continuous):
    player = viz.StepPlayer(continuous, static_traces=static)
    assert player.slider.max == max(len(static), len(continuous)) - 1
    classes = {c for w in (player.static_image, player.timeline_image, player.block_image, player.queues)
               for c in w._dom_classes}
    assert {"minicb-slot-timeline", "minicb-block-map", "minicb-queues", "minicb-static-timeline"} <= classes
    before = player.static_image.value
    player.step = player.slider.max  # past the continuous run's end: it stays on its last step
    assert player.state()["step"] == continuous[-1].step
    assert player.static_image.value != before
    assert "application/vnd.jupyter.widget-view+json" in player._repr_mimebundle_()


def test_importing_viz_does_not_import_matplotlib_or_ipywidgets():
    code = ("import sys, minicb; before = set(sys.modules); import minicb.viz; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new & {'matplotlib', 'ipywidgets', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_figures_leave_matplotlib_global_state_alone(static, continuous, tmp_path):
    # A notebook user's backend must survive drawing; a figure saved to a file must
    # not pile up in pyplot's list, while an on-screen one must be there for plt.show().
    import matplotlib
    import matplotlib.pyplot as plt

    backend, before = matplotlib.get_backend(), plt.get_fignums()
    viz.plot_side_by_side(static, continuous, path=str(tmp_path / "compare.png"))
    assert plt.get_fignums() == before, f"saving to a file registered pyplot figures {plt.get_fignums()}"
    fig = viz.plot_timeline(continuous)
    assert fig.number in plt.get_fignums(), "an on-screen figure must be one plt.show() can find"
    plt.close(fig)
    assert matplotlib.get_backend() == backend, f"the backend changed from {backend} to {matplotlib.get_backend()}"


# ---------------------------------------------------------------- the token strip

def test_token_split_by_hand():
    # hand_trace: whole prompts only (each admitted, then decoding or done); step 3 computed
    # 4 tokens for 3 useful ones, so 1 is padding.
    got = [(s["decode"], s["prefill"], s["chunk"], s["padding"]) for s in viz.token_split(hand_trace())]
    assert got == [(0, 5, 0, 0), (2, 0, 0, 0), (0, 2, 0, 0), (1, 2, 0, 1)], got


def test_token_split_static_counts_padding_and_wasted_rows(static):
    for trace, split in zip(static, viz.token_split(static)):
        assert split["chunk"] == 0, f"step {trace.step}: static batching never cuts a prompt"
        assert split["decode"] + split["prefill"] + split["padding"] == trace.num_tokens, (trace, split)
    # Batch (r0, r1): prompts of 3 and 2 padded to 3, so 1 padding token; then r0's wasted rows.
    assert viz.token_split(static)[0]["padding"] == 1 and viz.token_split(static)[4]["padding"] == 1


def run_long_prompt(chunked: bool) -> tuple[list[StepTrace], int]:
    """chapter 08's picture on the tiny model: three requests decode while a 60-token prompt
    arrives. With chunking and a budget of 8 the prompt is cut into 12 chunks of 5."""
    llm = LLM.from_model(random_model(seed=5), block_size=4, max_num_seqs=4, enable_chunked_prefill=chunked,
                         max_num_batched_tokens=8 if chunked else 4096)
    decoding = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(3):
        llm.engine.add_request([5 + i, 6, 7], decoding)
    for _ in range(3):
        llm.engine.step()
    long_id = llm.engine.add_request(list(range(10, 70)), SamplingParams(max_tokens=4, ignore_eos=True))
    while llm.engine.has_unfinished():
        llm.engine.step()
    return list(llm.engine.traces), long_id


@pytest.fixture(scope="module")
def long_prompt_runs():
    return {chunked: run_long_prompt(chunked) for chunked in (True, False)}


def strip_layers(strip_ax) -> dict[str, np.ndarray]:
    """label -> the height each step's column gives that layer of the strip."""
    from matplotlib.patches import StepPatch

    layers = {}
    for patch in strip_ax.patches:
        if isinstance(patch, StepPatch):
            values, _, baseline = patch.get_data()
            layers[patch.get_label()] = np.asarray(values) - np.asarray(baseline)
    return layers


def slot_sums(traces, phase) -> list[int]:
    return [sum(s.num_tokens for s in t.slots if s.phase == phase) for t in traces]


def test_strip_heights_are_each_steps_decode_and_prefill_tokens(long_prompt_runs):
    traces, long_id = long_prompt_runs[True]
    fig = viz.plot_timeline(traces, budget=8)
    layers = strip_layers(fig.axes[1])
    assert set(layers) == {"decode (1 token a request)", "whole prompt", "prompt chunk"}, set(layers)
    decode, prompts = layers["decode (1 token a request)"], layers["whole prompt"] + layers["prompt chunk"]
    assert decode.tolist() == slot_sums(traces, "decode")
    assert prompts.tolist() == slot_sums(traces, "prefill")
    # While the long prompt is cut, every column is 3 decodes + a chunk of 5: the budget, full.
    cut = [i for i, t in enumerate(traces) if any(s.request_id == long_id and s.phase == "prefill" for s in t.slots)]
    assert len(cut) == 12, f"the 60-token prompt should take 12 steps, took {len(cut)}"
    assert [(decode[i], layers["prompt chunk"][i], layers["whole prompt"][i]) for i in cut] == [(3, 5, 0)] * 12
    assert (decode + prompts).max() <= 8
    budget_lines = [line for line in fig.axes[1].get_lines() if line.get_label() == "budget: 8 tokens"]
    assert len(budget_lines) == 1 and list(budget_lines[0].get_ydata()) == [8, 8]
    # And it is what the eye sees: decode blue at the bottom of a cut step, chunk orange above.
    image, ax, step = render(fig), fig.axes[1], traces[cut[5]].step
    for y, (key, _, color) in ((1.5, viz._STRIP_LAYERS[0]), (6, viz._STRIP_LAYERS[2])):
        want = np.round(np.array(color) * 255)
        assert np.abs(pixel(image, ax, step, y) - want).max() <= 3, (key, pixel(image, ax, step, y), want)


def test_strip_of_whole_admission_has_one_tall_column(long_prompt_runs):
    traces, long_id = long_prompt_runs[False]
    layers = strip_layers(viz.plot_timeline(traces).axes[1])
    assert "prompt chunk" not in layers, "whole-prompt admission cuts nothing"
    whole = layers["whole prompt"]
    admitted = next(i for i, t in enumerate(traces) if long_id in t.admitted)
    assert whole[admitted] == 60 and layers["decode (1 token a request)"][admitted] == 3
    assert whole.tolist() == slot_sums(traces, "prefill")
    # A budget far above every column is named, not drawn (a line would flatten the columns).
    fig = viz.plot_timeline(traces, budget=4096)
    assert not [line for line in fig.axes[1].get_lines() if "budget" in line.get_label()]
    assert any("4096" in text.get_text() for text in fig.axes[1].texts)


def test_strip_reads_the_budget_the_traces_recorded(long_prompt_runs):
    traces, _ = long_prompt_runs[True]
    recorded = [dataclasses.replace(t, token_budget=8) for t in traces]
    labels = [line.get_label() for line in viz.plot_timeline(recorded).axes[1].get_lines()]
    assert "budget: 8 tokens" in labels, labels
    assert not [l for l in viz.plot_timeline(traces).axes[1].get_lines() if "budget" in l.get_label()], \
        "no budget given and none recorded: no line"
    with pytest.raises(ValueError, match="budget"):
        viz.plot_timeline(traces, budget=0)


def test_step_player_state_has_the_steps_token_split(long_prompt_runs):
    traces, long_id = long_prompt_runs[True]
    player = viz.StepPlayer(traces, budget=8)
    decode, prefill = slot_sums(traces, "decode"), slot_sums(traces, "prefill")
    cut = next(i for i, t in enumerate(traces) if any(s.request_id == long_id for s in t.slots))
    for k in (0, cut, cut + 4, len(traces) - 1):
        player.step = k
        state = player.state()
        assert (state["decode_tokens"], state["prefill_tokens"]) == (decode[k], prefill[k]), (k, state)
        assert state["token_budget"] == 8
    player.step = cut + 4
    assert (player.state()["decode_tokens"], player.state()["prefill_tokens"], player.state()["chunk_tokens"]) == (3, 5, 5)
    assert "3 decode + 5 prompt (5 in chunks) of 8" in player.queues.value
    # Without a budget, as before: the keys are there, the budget is None.
    assert viz.StepPlayer(long_prompt_runs[False][0]).state()["token_budget"] is None
