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
                slots = [SlotState(None, "empty") if s.seq_id == victim else s for s in slots]
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
            if slot_state.seq_id is not None:
                kv_len[slot_state.seq_id] += slot_state.num_tokens
                generated[slot_state.seq_id] += 1
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
            assert cells[i] == viz.request_symbol(state.seq_id, state.phase == "prefill")
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
    want = np.round(np.array(viz.request_color(continuous[0].slots[0].seq_id, prefill=True)) * 255)
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
        assert state["slots"] == [s.seq_id if s.phase != "empty" else None for s in trace.slots]
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


# ---------------------------------------------------------------- prefix caching and shared blocks

def caching_trace() -> StepTrace:
    """8 blocks: r0 holds 0-2, r1 holds 0-1 too (a shared prefix) and 5; 3 and 4 are free but
    cached (4 goes first), 6 and 7 plain free."""
    return StepTrace(7, [SlotState(0, "decode", 1), SlotState(1, "prefill", 3)], running=[0, 1],
                     num_free_blocks=4, num_blocks=8, block_owners=[0, 0, 0, None, None, 1, None, None],
                     shared_blocks=[0, 1], cached_free_blocks=[4, 3], cached_tokens=[(1, 8)])


def corner_pixels(image, ax, block, cols) -> np.ndarray:
    """The pixels of a block's top left quarter, away from its outline and from the letter
    in its middle, as [k, 3] floats."""
    row, col = divmod(block, cols)
    (x0, y0), (x1, y1) = ax.transData.transform([(col - 0.42, row - 0.12), (col - 0.12, row - 0.42)])
    height = image.shape[0]
    return image[height - int(y1):height - int(y0), int(x0):int(x1)].reshape(-1, 3).astype(float)


def block_map_marks(ax) -> dict:
    """The artists plot_block_map adds for prefix caching, by what they mark."""
    return {"shared": [c for c in ax.collections if c.get_gid() == "minicb-shared-blocks"],
            "cached": [t for t in ax.texts if t.get_gid() == "minicb-cached-free-block"],
            "legend": ax.get_legend()}


def test_plot_block_map_marks_shared_and_cached_free_blocks():
    trace = caching_trace()
    fig = viz.plot_block_map(trace)
    ax = fig.axes[0]
    assert "4 of 8 free (2 of them cached), 2 shared" in ax.get_title(), ax.get_title()
    image = render(fig)
    cols = int(round(ax.get_xlim()[1] + 0.5))
    tint = np.round(np.array(viz._CACHED_TINT) * 255)
    for block, owner in enumerate(trace.block_owners):
        corner = pixel(image, ax, block % cols - 0.3, block // cols - 0.3)
        want = (np.round(np.array(viz.request_color(owner)) * 255) if owner is not None
                else tint if block in trace.cached_free_blocks else (255, 255, 255))
        pixels = corner_pixels(image, ax, block, cols)
        assert len(pixels) > 20, "the cells are too small to tell a hatch from a fill"
        # Hatch lines: many pixels far darker than the fill; an unshared cell's corner has none.
        dark = (pixels.sum(axis=1) < sum(want) - 150).mean()
        if block in trace.shared_blocks:
            assert dark > 0.1, f"shared block {block}: only {dark:.1%} of its corner is hatch-dark"
        else:
            assert dark == 0 and np.abs(corner - want).max() <= 3, \
                f"block {block} (owner {owner}): pixel {corner}, want {want}; {dark:.1%} dark"
    marks = block_map_marks(ax)
    # The hatch covers exactly the shared blocks' cells, the "c" exactly the cached free ones.
    (hatched,) = marks["shared"]
    cells = sorted((round(p.get_extents().x0 + 0.5), round(p.get_extents().y0 + 0.5)) for p in hatched.get_paths())
    assert cells == [(b % cols, b // cols) for b in trace.shared_blocks], cells
    assert hatched.get_hatch() == viz._SHARED_HATCH
    assert sorted((round(t.get_position()[0]), t.get_text()) for t in marks["cached"]) == [(3, "c"), (4, "c")]
    labels = [t.get_text() for t in marks["legend"].get_texts()]
    assert len(labels) == 4 and any("shared" in s for s in labels) and any("K/V kept" in s for s in labels), labels


def test_plot_block_map_without_caching_draws_no_cached_or_shared_marks(continuous):
    trace = next(t for t in continuous if 0 < t.num_free_blocks < t.num_blocks)
    assert not trace.shared_blocks and not trace.cached_free_blocks
    fig = viz.plot_block_map(trace)
    ax = fig.axes[0]
    marks = block_map_marks(ax)
    assert not marks["shared"] and not marks["cached"] and marks["legend"] is None, marks
    assert "cached" not in ax.get_title() and "shared" not in ax.get_title(), ax.get_title()
    assert tuple(fig.get_size_inches()) == (7, 3), "the figure of a run without caching keeps its size"
    # Forcing a legend on is allowed (the step player does, for a whole run) but marks nothing.
    forced = block_map_marks(viz.plot_block_map(trace, legend=True).axes[0])
    assert forced["legend"] is not None and not forced["shared"] and not forced["cached"]


def test_plot_block_map_refuses_blocks_outside_the_pool():
    trace = caching_trace()
    trace.cached_free_blocks = [3, 8]
    with pytest.raises(ValueError, match="cached_free_blocks"):
        viz.plot_block_map(trace)


def test_step_player_keeps_the_latest_admissions_cached_tokens():
    # r0 finds 8 cached tokens, is preempted, and finds 12 when it comes back.
    S = SlotState
    traces = [StepTrace(0, [S(0, "prefill", 5)], admitted=[0], running=[0], cached_tokens=[(0, 8)]),
              StepTrace(1, [S(None, "empty")], preempted=[0], waiting=[0]),
              StepTrace(2, [S(0, "prefill", 3)], admitted=[0], running=[0], cached_tokens=[(0, 12)])]
    player = viz.StepPlayer(traces)
    seen = []
    for k in range(3):
        player.step = k
        seen.append(player.state()["cached_tokens"])
    assert seen == [{0: 8}, {0: 8}, {0: 12}], seen
    assert "r0<span class='minicb-cached'>&nbsp;·&nbsp;12&nbsp;cached</span>" in player.queues.value


@pytest.fixture(scope="module")
def caching_run():
    """The tiny model with prefix caching, 10 prompts sharing part of a 45-token system prompt,
    on a pool small enough that some requests are preempted and re-admitted."""
    import random

    from minicb import LLM, SamplingParams
    from minicb.model import random_model

    system = [(13 * i) % 200 + 3 for i in range(45)]
    rng = random.Random(1)
    prompts = [system[:rng.randint(5, 30)] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
               for _ in range(10)]
    llm = LLM.from_model(random_model(seed=11), enable_prefix_caching=True, block_size=4, max_num_seqs=4,
                         num_blocks=22)
    return llm.generate(prompts, SamplingParams(max_tokens=10), use_tqdm=False), llm.traces


def test_step_player_cached_tokens_match_a_real_run(caching_run):
    outputs, traces = caching_run
    player = viz.StepPlayer(traces)
    player.step = player.slider.max
    shown = player.state()["cached_tokens"]
    # Request ids are the prompts' indices (one fresh LLM, n = 1). metrics.num_cached_tokens is the
    # first admission's count; the player shows the latest one, so preempted requests may differ.
    plain = [o for o in outputs if o.metrics.num_preemptions == 0]
    preempted = [o for o in outputs if o.metrics.num_preemptions > 0]
    assert preempted and any(o.metrics.num_cached_tokens for o in plain), "the run should have both kinds"
    assert {o.index: shown[o.index] for o in plain} == {o.index: o.metrics.num_cached_tokens for o in plain}
    for o in preempted:
        admissions = [n for t in traces for rid, n in t.cached_tokens if rid == o.index]
        assert len(admissions) == o.metrics.num_preemptions + 1 and admissions[0] == o.metrics.num_cached_tokens
        assert shown[o.index] == admissions[-1], f"r{o.index}: admissions {admissions}, shown {shown[o.index]}"
    assert any(shown[o.index] != o.metrics.num_cached_tokens for o in preempted), \
        "some re-admission should find a different number of cached tokens (else this test shows nothing)"
    # The finished row names each request with its count, and none with a count of 0.
    html = player.queues.value
    for o in outputs:
        chip = f"r{o.index}<span class='minicb-cached'>&nbsp;·&nbsp;{shown[o.index]}&nbsp;cached</span>"
        assert (chip in html) == (shown[o.index] > 0), f"r{o.index} ({shown[o.index]} cached) in {html}"
    # Before anything is admitted again, the counts are those of the admissions so far.
    first = next(i for i, t in enumerate(traces) if t.cached_tokens)
    player.step = first
    assert player.state()["cached_tokens"] == dict(traces[first].cached_tokens)


def test_step_player_block_map_of_a_caching_run(caching_run):
    _, traces = caching_run
    player = viz.StepPlayer(traces)
    k = next(i for i, t in enumerate(traces) if t.shared_blocks and t.cached_free_blocks)
    player.step = k
    state = player.state()
    assert (state["shared_blocks"], state["cached_free_blocks"]) == (traces[k].shared_blocks,
                                                                     traces[k].cached_free_blocks)
    assert f"({len(traces[k].cached_free_blocks)} of them cached), {len(traces[k].shared_blocks)} shared" \
        in player.queues.value
    # The frame is wider than a plain run's: it carries the legend, on every step.
    widths = set()
    for step in (0, k):
        player.step = step
        image = player.block_image.value
        widths.add(int.from_bytes(image[16:20], "big"))  # PNG header: width
    plain = viz.StepPlayer(simulate_continuous(REQUESTS)).block_image.value
    assert widths == {int(9.2 * 80)} and int.from_bytes(plain[16:20], "big") == 7 * 80, (widths, plain[16:20])
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
                         max_num_batched_tokens=8 if chunked else 4096, keep_traces=None)  # the engine keeps every step
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
    cut = [i for i, t in enumerate(traces) if any(s.seq_id == long_id and s.phase == "prefill" for s in t.slots)]
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
    assert {t.token_budget for t in traces} == {8}, "the engine records its max_num_batched_tokens in every trace"
    labels = [line.get_label() for line in viz.plot_timeline(traces).axes[1].get_lines()]
    assert "budget: 8 tokens" in labels, labels
    unknown = [dataclasses.replace(t, token_budget=0) for t in traces]
    assert not [l for l in viz.plot_timeline(unknown).axes[1].get_lines() if "budget" in l.get_label()], \
        "no budget given and none recorded: no line"
    with pytest.raises(ValueError, match="budget"):
        viz.plot_timeline(traces, budget=0)


def test_step_player_state_has_the_steps_token_split(long_prompt_runs):
    traces, long_id = long_prompt_runs[True]
    player = viz.StepPlayer(traces, budget=8)
    decode, prefill = slot_sums(traces, "decode"), slot_sums(traces, "prefill")
    cut = next(i for i, t in enumerate(traces) if any(s.seq_id == long_id for s in t.slots))
    for k in (0, cut, cut + 4, len(traces) - 1):
        player.step = k
        state = player.state()
        assert (state["decode_tokens"], state["prefill_tokens"]) == (decode[k], prefill[k]), (k, state)
        assert state["token_budget"] == 8
    player.step = cut + 4
    assert (player.state()["decode_tokens"], player.state()["prefill_tokens"], player.state()["chunk_tokens"]) == (3, 5, 5)
    assert "3 decode + 5 prompt (5 in chunks) of 8" in player.queues.value
    # The budget the traces recorded, without being told; none recorded: the key is there, None.
    assert viz.StepPlayer(traces).state()["token_budget"] == 8
    unknown = [dataclasses.replace(t, token_budget=0) for t in long_prompt_runs[False][0]]
    assert viz.StepPlayer(unknown).state()["token_budget"] is None
