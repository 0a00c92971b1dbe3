"""Pictures of the engine at work, drawn from its step traces.

What you will learn: how to *see* a batching policy. Each engine returns one
`StepTrace` per step (minicb/trace.py); this file turns a list of them into

- `timeline_text`: a slot timeline for the terminal (rows = slots, columns = steps);
- `plot_timeline`, `plot_block_map`, `plot_side_by_side`: the same as matplotlib figures,
  plus the map of physical KV blocks and static vs continuous one above the other;
  with prefix caching or n > 1 the block map also tells shared blocks (hatched) and
  free blocks that keep their K/V for reuse (pale blue, "c") from the rest;
- `draw_token_strip`: under a timeline, how each step spent its tokens: decodes,
  whole prompts, prompt chunks, padding, against the step's token budget;
- `StepPlayer`: a Jupyter widget with a play button that steps through a run;
- `summarize`, `token_split`: the numbers behind the pictures (utilisation, evictions,
  refills, ...; each step's decode and prefill tokens).

Static batching shows up as long grey runs of wasted rows that wait for the
slowest request of the batch; continuous batching shows slots that are refilled
the step after they are freed. Chapters 02, 06, 07 and 08 use these pictures. In the
token strip, admitting a long prompt whole is one tall bar: one step that
computes the whole prompt while every running request waits for its next
token. Chunked prefill (chapter 08) cuts it into bars no taller than the budget.

Try it:  python -m minicb demo   (or open notebooks/06-continuous-batching.ipynb;
         notebooks/07-prefix-caching.ipynb shows shared and cached blocks,
         notebooks/08-chunked-prefill.ipynb the token strip)

Only the standard library is imported at module level: matplotlib and ipywidgets
are imported inside the functions that need them, so `import minicb.viz` is
cheap and works where neither is installed.
"""
from __future__ import annotations

import colorsys
import io
import shutil

from minicb.trace import SlotState, StepTrace

# ----------------------------------------------------------------------------
# One identity per request: a letter and a colour, both derived from the request
# id alone, so the same request looks the same in every picture (the static and
# the continuous run of one workload, the timeline and the block map).

# Upper case = prefill, lower case = decode, so each symbol needs both cases.
# Latin first, then Greek and Cyrillic letters that do not look like Latin ones.
_SYMBOLS = ("ABCDEFGHIJKLMNOPQRSTUVWXYZ" "ΓΔΘΛΞΠΣΦΨΩ" "БДЖЗИЛЦЧШЩЭЮЯ")

WASTED_CHAR = "·"
EMPTY_CHAR = " "
# Event markers, drawn under the slot they happened in.
MARKERS = {"stop": "x", "length": "#", "refill": "+", "preempt": "!"}
_MARKER_MEANING = {
    "stop": "finished (stop token)",
    "length": "finished (max_tokens)",
    "refill": "refill (a new request takes a used slot)",
    "preempt": "preempted (back to waiting)",
}
# When two events land in one cell (or one compressed column), the rarer one wins.
_PRIORITY = ("preempt", "stop", "length", "refill")
_GREY = (0.78, 0.78, 0.78)  # wasted rows
_WHITE = (1.0, 1.0, 1.0)  # empty slots, free blocks
# Prefix caching: a free block whose K/V is kept for reuse. Pale, so it reads as free;
# no request colour is this light (theirs have saturation 0.6).
_CACHED_TINT = (0.84, 0.91, 0.98)
_SHARED_HATCH = "////"  # a block held by more than one request
# The token strip's layers, bottom to top: (key in token_split, label, colour). Plain
# colours, not the requests' own: the strip counts tokens, whoever they belong to.
_STRIP_LAYERS = (("decode", "decode (1 token a request)", (0.27, 0.47, 0.78)),
                 ("whole", "whole prompt", (0.80, 0.40, 0.08)),
                 ("chunk", "prompt chunk", (0.98, 0.72, 0.38)),
                 ("padding", "padding, wasted rows", _GREY))


def request_symbol(seq_id: int, prefill: bool = False) -> str:
    letter = _SYMBOLS[seq_id % len(_SYMBOLS)]
    return letter if prefill else letter.lower()


def request_color(seq_id: int, prefill: bool = False) -> tuple[float, float, float]:
    """RGB in [0, 1]. Hues step by the golden angle, so neighbouring ids never look alike;
    the saturation keeps every colour away from the grey used for wasted rows."""
    hue = (0.08 + seq_id * 0.6180339887) % 1.0
    return colorsys.hsv_to_rgb(hue, 0.6, 0.6 if prefill else 0.92)


def _ansi(text: str, rgb: tuple[float, float, float], bold: bool = False) -> str:
    # The 6x6x6 cube of 256-colour terminals: index 16 + 36 r + 6 g + b, with r, g, b in 0..5.
    r, g, b = (round(c * 5) for c in rgb)
    return f"\x1b[{'1;' if bold else ''}38;5;{16 + 36 * r + 6 * g + b}m{text}\x1b[0m"


# ----------------------------------------------------------------------------
# Events. A trace says which requests finished or were preempted in a step, but
# not in which slot, and it does not flag refills at all; all three come from
# comparing who holds each slot step by step.

def _holder(trace: StepTrace, slot: int) -> int | None:
    """Who owns the slot's row in this step. A wasted row still belongs to its finished request."""
    if slot >= len(trace.slots) or trace.slots[slot].phase == "empty":
        return None
    return trace.slots[slot].seq_id


def _find_slot(traces: list[StepTrace], index: int, seq_id: int) -> int | None:
    # The slot the request holds at `index`, else the last slot it held before.
    for i in range(index, -1, -1):
        for slot in range(len(traces[i].slots)):
            if _holder(traces[i], slot) == seq_id:
                return slot
    return None


def step_events(traces: list[StepTrace]) -> list[tuple[int, int | None, str, int]]:
    """Every event as (trace index, slot, kind, seq_id), kind in MARKERS.

    - "stop"/"length": the request finished in this step (marked in its slot);
    - "preempt": the request was sent back to waiting (marked in the slot it last held);
    - "refill": a request entered a slot whose previous occupant was another request.
    The slot is None when the request never appears in any slot.
    """
    events = []
    last_holder: dict[int, int] = {}  # slot -> most recent request that held it
    for i, trace in enumerate(traces):
        for slot in range(len(trace.slots)):
            rid = _holder(trace, slot)
            if rid is None:
                continue
            # A first occupant is an admission, not a refill; neither is a preempted
            # request coming back to the slot it left empty.
            if last_holder.get(slot, rid) != rid:
                events.append((i, slot, "refill", rid))
            last_holder[slot] = rid
        for rid, reason in trace.finished:
            if reason not in ("stop", "length"):
                raise ValueError(f"step {trace.step}: request {rid} finished with reason {reason!r}; "
                                 "expected 'stop' or 'length'")
            events.append((i, _find_slot(traces, i, rid), reason, rid))
        for rid in trace.preempted:
            events.append((i, _find_slot(traces, i, rid), "preempt", rid))
    return events


def summarize(traces: list[StepTrace]) -> dict:
    """The headline numbers of a run. Utilisation = useful tokens / tokens computed:
    padding and wasted rows count as computed but not useful."""
    kinds = [kind for _, _, kind, _ in step_events(traces)]
    computed = sum(t.num_tokens for t in traces)
    useful = sum(t.num_useful_tokens for t in traces)
    phases = [s.phase for t in traces for s in t.slots]
    return {
        "steps": len(traces),
        "tokens_computed": computed,
        "useful_tokens": useful,
        "utilisation": useful / computed if computed else 0.0,
        "evictions": sum(len(t.finished) for t in traces),
        "refills": kinds.count("refill"),
        "preemptions": sum(len(t.preempted) for t in traces),
        "slot_steps": len(phases),
        "idle_slot_steps": phases.count("wasted") + phases.count("empty"),  # slots doing no useful work
        "time_s": sum(t.time_s for t in traces),
    }


def token_split(traces: list[StepTrace]) -> list[dict[str, int]]:
    """How each step spent its tokens: one dict per trace, with

    - "decode":  tokens of requests decoding (one each);
    - "prefill": prompt tokens, chunks included;
    - "chunk":   the part of "prefill" that belongs to prompts cut across steps (chapter 08);
    - "padding": what the forward computed for no live request (static batching's
                 padding and wasted rows): trace.num_tokens minus the rest.

    A prefill is whole when its request was admitted in that step and either got its
    first token there or next appears decoding (the static engines record no tokens);
    any other prefill is a chunk: the start of a prompt that goes on in a later step,
    or a piece after the first.
    """
    split: list[dict[str, int]] = [{} for _ in traces]
    upcoming: dict[int, str] = {}  # request -> phase of its next appearance, read backwards
    for i in range(len(traces) - 1, -1, -1):
        trace = traces[i]
        admitted, sampled = set(trace.admitted), {rid for rid, _ in trace.new_tokens}
        counts = {"decode": 0, "prefill": 0, "chunk": 0}
        for state in trace.slots:
            rid = state.seq_id
            if state.phase == "decode":
                counts["decode"] += state.num_tokens
            elif state.phase == "prefill":
                counts["prefill"] += state.num_tokens
                whole = rid in admitted and (rid in sampled or upcoming.get(rid) != "prefill")
                counts["chunk"] += 0 if whole else state.num_tokens
        counts["padding"] = max(0, trace.num_tokens - counts["decode"] - counts["prefill"])
        split[i] = counts
        for state in trace.slots:
            if state.seq_id is not None and state.phase != "empty":
                upcoming[state.seq_id] = state.phase
    return split


def _token_budget(traces: list[StepTrace], budget: int | None) -> int | None:
    """The budget to draw: the one given, else the one the traces recorded, if they agree."""
    if budget is not None:
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget={budget!r}; it must be a positive number of tokens, or None")
        return budget
    recorded = {t.token_budget for t in traces if t.token_budget}
    return recorded.pop() if len(recorded) == 1 else None


# ----------------------------------------------------------------------------
# The terminal timeline.
#
#             0         10        20
#   slot 0    AAaaaaaaaBbbb
#                     x+   #
#   slot 1    Cccc····
#                x
#
# Upper case = prefill, lower case = decode, · = wasted row, blank = empty slot.
# The line under each slot holds its events.

def _cell_char(slot_state, color: bool) -> str:
    if slot_state.phase == "empty" or slot_state.seq_id is None:
        return EMPTY_CHAR
    rid = slot_state.seq_id
    if slot_state.phase == "wasted":
        return _ansi(WASTED_CHAR, _GREY) if color else WASTED_CHAR
    prefill = slot_state.phase == "prefill"
    char = request_symbol(rid, prefill)
    return _ansi(char, request_color(rid), bold=prefill) if color else char


def timeline_text(traces: list[StepTrace], *, width: int | None = None, color: bool = True) -> str:
    """Slot timeline as text. `width` caps the number of step columns (None: fit the
    terminal). With more steps than that, each column stands for `stride` consecutive
    steps and shows the prefill in that span if there was one, else its last step."""
    if not traces:
        return "(no steps)"
    label_width = 10
    if width is None:
        width = max(20, shutil.get_terminal_size((100, 24)).columns - label_width - 1)
    if width < 1:
        raise ValueError(f"width must be a positive number of columns, got {width!r}")
    num_slots = max(len(t.slots) for t in traces)
    stride = -(-len(traces) // width)  # ceil: steps per column
    columns = [list(range(c, min(c + stride, len(traces)))) for c in range(0, len(traces), stride)]

    # Events per (slot, column); the highest-priority kind wins the cell.
    marks: dict[tuple[int, int], tuple[str, int]] = {}
    for i, slot, kind, rid in step_events(traces):
        if slot is None:
            continue
        key = (slot, i // stride)
        if key not in marks or _PRIORITY.index(kind) < _PRIORITY.index(marks[key][0]):
            marks[key] = (kind, rid)

    def shown(slot: int, steps: list[int]):
        # The slot state a compressed column displays: a prefill beats everything else,
        # since admissions are the moments worth seeing.
        states = [traces[i].slots[slot] for i in steps if slot < len(traces[i].slots)]
        prefills = [s for s in states if s.phase == "prefill"]
        return (prefills or states or [None])[-1]

    # Axis: the step number every 10 columns.
    axis = [" "] * len(columns)
    for c in range(0, len(columns), 10):
        label = str(traces[columns[c][0]].step)
        if c + len(label) <= len(columns):
            axis[c:c + len(label)] = label
    scale = ("1 column = 1 step" if stride == 1
             else f"1 column = {stride} steps (prefill shown if any, else the last)")
    lines = [f"slot timeline: {len(traces)} steps x {num_slots} slots; {scale}",
             " " * label_width + "".join(axis).rstrip()]
    for slot in range(num_slots):
        cells = []
        for steps in columns:
            state = shown(slot, steps)
            cells.append(EMPTY_CHAR if state is None else _cell_char(state, color))
        lines.append(f"slot {slot:<4} " + "".join(cells).rstrip())
        under = []
        for c in range(len(columns)):
            kind, rid = marks.get((slot, c), (None, None))
            char = MARKERS[kind] if kind else " "
            under.append(_ansi(char, request_color(rid)) if kind and color else char)
        lines.append(" " * label_width + "".join(under).rstrip())

    # Legend: what the characters mean, then which symbol is which request.
    lines.append(f"UPPER prefill, lower decode, {WASTED_CHAR} wasted row, blank empty slot; "
                 + ", ".join(f"{MARKERS[k]} {_MARKER_MEANING[k]}" for k in MARKERS))
    seq_ids = sorted({s.seq_id for t in traces for s in t.slots if s.seq_id is not None})
    legend = [f"{_cell_char(SlotState(rid, 'prefill'), color)}=r{rid}" for rid in seq_ids]
    lines.append("requests: " + " ".join(legend))
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# matplotlib figures. Each drawing function draws into an Axes it is given, so
# the same code serves a notebook figure, the saved comparison PNG and the frames
# of the StepPlayer widget (which never touches pyplot, so frames pile up nowhere).

def _new_figure(on_screen: bool, **subplots):
    """(figure, axes) for the plot_* functions; `subplots` go to Figure.subplots.

    On screen: through pyplot, so `plt.show()` and Jupyter's inline display find
    the figure, in whatever backend the user chose (matplotlib itself falls back
    to Agg where there is no display). For a file: a bare Figure that pyplot never
    sees, so saving it needs no backend and nothing piles up in pyplot's list.
    Either way, the global backend is never switched.
    """
    figsize = subplots.pop("figsize")
    if on_screen:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=figsize, layout="constrained")
    else:
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(**subplots)


def _timeline_rgb(traces: list[StepTrace], num_slots: int, upto: int):
    # rgb: [num_slots, num_steps, 3]; steps after `upto` stay white (not happened yet).
    import numpy as np

    rgb = np.ones((num_slots, len(traces), 3))
    for i, trace in enumerate(traces[:upto + 1]):
        for slot, state in enumerate(trace.slots):
            if state.phase == "wasted":
                rgb[slot, i] = _GREY
            elif state.phase in ("prefill", "decode") and state.seq_id is not None:
                rgb[slot, i] = request_color(state.seq_id, prefill=state.phase == "prefill")
    return rgb


def draw_timeline(ax, traces: list[StepTrace], *, title: str | None = None, current: int | None = None,
                  legend: bool = True, strip_ax=None, budget: int | None = None) -> None:
    """Draw the slot timeline into `ax`. With `current`, only steps 0..current are drawn
    and that step's column is framed; the x axis still spans the whole run.
    With `strip_ax`, the token strip (draw_token_strip, with `budget`) goes there, on the same steps."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    if not traces:
        raise ValueError("cannot draw a timeline of an empty trace list")
    upto = len(traces) - 1 if current is None else current
    if not 0 <= upto < len(traces):
        raise ValueError(f"current step index {current!r} is outside 0..{len(traces) - 1}")
    num_slots = max(len(t.slots) for t in traces)
    first = traces[0].step  # x = step number, assuming the traces are consecutive steps
    ax.imshow(_timeline_rgb(traces, num_slots, upto), aspect="auto", interpolation="nearest",
              extent=(first - 0.5, first + len(traces) - 0.5, num_slots - 0.5, -0.5))
    for boundary in range(num_slots - 1):  # thin white lines keep neighbouring slots apart
        ax.axhline(boundary + 0.5, color="white", linewidth=0.8)

    # The terminal timeline's characters (MARKERS), drawn as mathtext markers, so a
    # reader who learnt "# = max_tokens" in the demo reads the figure the same way.
    styles = {kind: dict(marker="$" + char.replace("#", r"\#") + "$", s=40,
                         color="red" if kind == "preempt" else "black")
              for kind, char in MARKERS.items()}
    events = [e for e in step_events(traces) if e[1] is not None and e[0] <= upto]
    for kind, style in styles.items():
        points = [(first + i, slot) for i, slot, k, _ in events if k == kind]
        if points:
            xs, ys = zip(*points)
            ax.scatter(xs, ys, zorder=3, **{"s": 28, **style})
    if current is not None:
        ax.add_patch(Rectangle((first + upto - 0.5, -0.5), 1, num_slots, fill=False,
                               edgecolor="black", linewidth=1.5, zorder=4))

    ax.set_xlabel("step")
    ax.set_ylabel("slot")
    ax.set_yticks(range(num_slots) if num_slots <= 16 else range(0, num_slots, max(1, num_slots // 8)))
    if title:
        ax.set_title(title)
    if legend:
        sample = next((s.seq_id for t in traces for s in t.slots if s.seq_id is not None), 0)
        handles = [Patch(facecolor=request_color(sample, prefill=True), label="prefill (darker)"),
                   Patch(facecolor=request_color(sample), label="decode"),
                   Patch(facecolor=_GREY, label="wasted row"),
                   Patch(facecolor=_WHITE, edgecolor="0.6", label="empty")]
        handles += [Line2D([], [], linestyle="", marker=s["marker"], markersize=8, color=s["color"],
                           label=_MARKER_MEANING[k])
                    for k, s in styles.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if strip_ax is not None:
        ax.set_xlabel("")
        draw_token_strip(strip_ax, traces, budget=budget, current=current, legend=legend)
        strip_ax.set_xlim(ax.get_xlim())


def draw_token_strip(ax, traces: list[StepTrace], *, budget: int | None = None, current: int | None = None,
                     legend: bool = True) -> None:
    """One stacked column per step: its decode tokens, then whole prompts, prompt chunks and
    padding (token_split), with the token budget as a dashed line. `budget` None: the
    traces' token_budget, if they recorded one. With `current`, as in draw_timeline."""
    import numpy as np
    from matplotlib.patches import Rectangle

    if not traces:
        raise ValueError("cannot draw a token strip of an empty trace list")
    upto = len(traces) - 1 if current is None else current
    if not 0 <= upto < len(traces):
        raise ValueError(f"current step index {current!r} is outside 0..{len(traces) - 1}")
    budget = _token_budget(traces, budget)
    split = token_split(traces)
    first = traces[0].step
    edges = first - 0.5 + np.arange(len(traces) + 1)
    shown = np.arange(len(traces)) <= upto  # later steps have not happened yet
    layers = {"decode": [s["decode"] for s in split], "whole": [s["prefill"] - s["chunk"] for s in split],
              "chunk": [s["chunk"] for s in split], "padding": [s["padding"] for s in split]}
    # One StepPatch per layer (not a bar per step), so thousands of steps stay cheap to draw.
    bottom = np.zeros(len(traces))
    for key, label, color in _STRIP_LAYERS:
        values = np.array(layers[key], dtype=float)
        if key != "decode" and not values.any():
            continue  # a layer this run never had stays out of the picture and the legend
        top = bottom + values * shown
        ax.stairs(top, edges, baseline=bottom, fill=True, color=color, label=label, linewidth=0)
        bottom = top

    # The y axis fits the whole run, so it stays still while the player steps.
    highest = max(sum(s.values()) - s["chunk"] for s in split)  # "chunk" is part of "prefill"
    if budget is not None and budget <= 2 * max(highest, 1):
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget: {budget} tokens")
        highest = max(highest, budget)
    elif budget is not None:  # far above every step: a line would flatten the columns
        ax.text(0.99, 0.95, f"budget {budget} tokens: above the scale", transform=ax.transAxes,
                ha="right", va="top", fontsize=8)
    top = 1.12 * max(highest, 1)
    ax.set_ylim(0, top)
    ax.set_xlim(edges[0], edges[-1])
    if current is not None:
        ax.add_patch(Rectangle((first + upto - 0.5, 0), 1, top, fill=False, edgecolor="black",
                               linewidth=1.5, zorder=4))
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def plot_timeline(traces: list[StepTrace], ax=None, title: str | None = None, *, current: int | None = None,
                  budget: int | None = None, strip: bool = True):
    """The slot timeline as a figure: one cell per (slot, step), coloured by request, and
    under it the token strip (draw_token_strip, with `budget`) unless `strip` is False.
    Given an `ax`, the timeline alone goes there (the caller owns the layout)."""
    if ax is None:
        num_slots = max(len(t.slots) for t in traces) if traces else 1
        height = min(8.0, 1.5 + 0.3 * num_slots)
        if not strip:
            _, ax = _new_figure(True, figsize=(11, height))
        else:
            _, (ax, strip_ax) = _new_figure(True, figsize=(11, height + 1.6), nrows=2, ncols=1,
                                            height_ratios=[height, 1.6])
            draw_timeline(ax, traces, title=title, current=current, strip_ax=strip_ax, budget=budget)
            return ax.figure
    draw_timeline(ax, traces, title=title, current=current)
    return ax.figure


def _block_map_legend(ax, trace: StepTrace) -> None:
    from matplotlib.patches import Patch

    sample = next((owner for owner in trace.block_owners if owner is not None), 0)
    handles = [Patch(facecolor=request_color(sample), edgecolor="0.6", label="held by one request"),
               Patch(facecolor=request_color(sample), edgecolor="black", hatch=_SHARED_HATCH,
                     label="shared: held by 2+\n(a common prefix, n > 1)"),
               Patch(facecolor=_CACHED_TINT, edgecolor="0.6", label="free, K/V kept (c):\nevictable, reusable"),
               Patch(facecolor=_WHITE, edgecolor="0.6", label="free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def plot_block_map(trace: StepTrace, ax=None, *, legend: bool | None = None):
    """The physical KV blocks after one step, coloured by owning request; free blocks are white.

    Prefix caching and parallel sampling add two kinds of block, drawn apart:
    - shared (trace.shared_blocks, ref count > 1): hatched, in a black outline,
      coloured by the lowest request id holding it;
    - free but cached (trace.cached_free_blocks): pale blue with a "c", as in
      `python -m minicb.prefix_cache`; it counts as free, yet its K/V wait for
      a request with the same prefix until the block is evicted.
    `legend`: None shows one only when the trace has such blocks, so a trace
    without them draws exactly as before.
    """
    import numpy as np
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.patches import Rectangle

    num_blocks = trace.num_blocks
    cached, shared = set(trace.cached_free_blocks), set(trace.shared_blocks)
    if legend is None:
        legend = bool(cached or shared)
    if ax is None:
        _, ax = _new_figure(True, figsize=(9.5 if legend else 7, 3))
    if num_blocks == 0:  # the contiguous-cache engines (chapters 01-02) have no block pool
        ax.text(0.5, 0.5, "no paged KV pool in this trace\n(contiguous cache: num_blocks = 0)",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        ax.set_title("KV blocks: none")
        return ax.figure
    if len(trace.block_owners) != num_blocks:
        raise ValueError(f"step {trace.step}: block_owners has {len(trace.block_owners)} entries "
                         f"but num_blocks is {num_blocks}; they must match")
    for name, blocks in (("cached_free_blocks", cached), ("shared_blocks", shared)):
        if any(not 0 <= block < num_blocks for block in blocks):
            raise ValueError(f"step {trace.step}: {name} {sorted(blocks)} names blocks outside 0..{num_blocks - 1}")

    # A wide grid (about 4 columns per row) reads better beside a timeline than a square.
    cols = min(num_blocks, max(8, int(np.ceil(np.sqrt(4 * num_blocks)))))
    rows = -(-num_blocks // cols)
    rgba = np.zeros((rows, cols, 4))  # cells past the last block stay transparent
    for block, owner in enumerate(trace.block_owners):
        fill = request_color(owner) if owner is not None else _CACHED_TINT if block in cached else _WHITE
        rgba[block // cols, block % cols] = (*fill, 1.0)
    ax.imshow(rgba, interpolation="nearest", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    # One outline per block (one collection, so thousands of blocks stay cheap to draw).
    corners = [(-0.5, -0.5), (0.5, -0.5), (0.5, 0.5), (-0.5, 0.5), (-0.5, -0.5)]
    outlines = [[(c + dx, r + dy) for dx, dy in corners]
                for r, c in (divmod(block, cols) for block in range(num_blocks))]
    ax.add_collection(LineCollection(outlines, colors="0.6", linewidths=0.6))
    if shared:  # hatch and a dark frame on top of the owner's colour; one collection again
        squares = [Rectangle((block % cols - 0.5, block // cols - 0.5), 1, 1) for block in sorted(shared)]
        hatched = PatchCollection(squares, facecolor="none", edgecolor="0.15", hatch=_SHARED_HATCH,
                                  linewidths=1.2, zorder=2)
        hatched.set_gid("minicb-shared-blocks")
        ax.add_collection(hatched)
    if num_blocks <= 128:  # the request's letter, as in the text timeline; "c" as in prefix_cache's demo
        for block, owner in enumerate(trace.block_owners):
            if owner is not None:
                ax.text(block % cols, block // cols, request_symbol(owner, prefill=True),
                        ha="center", va="center", fontsize=7, zorder=3,
                        bbox=dict(boxstyle="square,pad=0.15", facecolor=request_color(owner), linewidth=0)
                        if block in shared else None)  # the hatch must not cross out the letter
            elif block in cached:
                ax.text(block % cols, block // cols, "c", ha="center", va="center", fontsize=7,
                        color="0.35", gid="minicb-cached-free-block")
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():  # the block outlines are the frame; a box would enclose non-blocks
        spine.set_visible(False)
    ax.set_xlabel(f"block id = row x {cols} + column")
    title = f"KV blocks after step {trace.step}: {trace.num_free_blocks} of {num_blocks} free"
    if cached:
        title += f" ({len(cached)} of them cached)"
    if shared:
        title += f", {len(shared)} shared"
    ax.set_title(title)
    if legend:
        _block_map_legend(ax, trace)
    return ax.figure


def plot_side_by_side(static_traces: list[StepTrace], continuous_traces: list[StepTrace], path: str | None = None):
    """Static above continuous on one step axis, so the shorter run is visibly shorter.

    With `path`, the figure is saved there and not shown (the demo's PNG);
    without, it is an on-screen figure, like plot_timeline's."""
    num_slots = max(len(t.slots) for t in static_traces + continuous_traces)
    fig, (top, bottom) = _new_figure(path is None, nrows=2, ncols=1, sharex=True,
                                     figsize=(11, min(12.0, 2.5 + 0.5 * num_slots)))
    runs = ((top, "static batching", static_traces), (bottom, "continuous batching", continuous_traces))
    for ax, name, traces in runs:
        numbers = summarize(traces)
        draw_timeline(ax, traces, legend=ax is top,
                      title=f"{name}: {numbers['steps']} steps, utilisation {numbers['utilisation']:.0%} "
                            f"({numbers['useful_tokens']} useful of {numbers['tokens_computed']} tokens computed)")
    top.set_xlabel("")
    if path:
        fig.savefig(path, dpi=120)
    return fig


# ----------------------------------------------------------------------------
# The step player: a Play button and a slider that step through a run, showing the
# timeline so far, the block map and the queues at the chosen step. Frames are PNG
# bytes in ipywidgets.Image: that renders in JupyterLab, VS Code and nbviewer-like
# tools without any custom JavaScript.

class StepPlayer:
    """Step through a run in Jupyter.

        player = StepPlayer(continuous_traces, static_traces=static_traces)
        player            # the last expression of a cell displays the widget

    `player.step = k` (or dragging the slider, or Play) shows step k; `player.state()`
    returns what is on screen as plain data, for tests and for reading along.

    With prefix caching, each request's chip in the queues says how many of its
    prompt tokens came from the cache ("E r4 · 160 cached"), and the block map
    marks shared and cached-free blocks (see plot_block_map).
    """

    def __init__(self, traces: list[StepTrace], static_traces: list[StepTrace] | None = None,
                 budget: int | None = None):
        """budget: the token budget the strip under the timeline draws (None: the traces' own)."""
        import ipywidgets as widgets

        if not traces:
            raise ValueError("StepPlayer needs at least one StepTrace; got an empty list")
        self.traces = list(traces)
        self.static_traces = list(static_traces) if static_traces else None
        self.budget = _token_budget(self.traces, budget)
        self._split = token_split(self.traces)
        # The slider spans the longer run; the shorter one stays on its last step.
        last = max(len(self.traces), len(self.static_traces or [])) - 1
        self._frames: dict[tuple[str, int], bytes] = {}  # (picture, trace index) -> PNG
        # One legend for every block map frame of a run that has shared or cached blocks,
        # so the grid does not jump when the first such block appears.
        self._block_legend = any(t.shared_blocks or t.cached_free_blocks for t in self.traces)

        self.play = widgets.Play(min=0, max=last, step=1, interval=400, description="play")
        self.slider = widgets.IntSlider(min=0, max=last, value=0, description="step")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.timeline_image = widgets.Image(format="png")
        self.timeline_image.add_class("minicb-slot-timeline")
        self.block_image = widgets.Image(format="png")
        self.block_image.add_class("minicb-block-map")
        self.queues = widgets.HTML()
        self.queues.add_class("minicb-queues")
        pictures = [self.timeline_image, self.block_image]
        if self.static_traces:
            self.static_image = widgets.Image(format="png")
            self.static_image.add_class("minicb-static-timeline")
            pictures.insert(0, self.static_image)  # stacked above, on the same step axis
        else:
            self.static_image = None
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]),
                                    widgets.HBox([widgets.VBox(pictures), self.queues])])
        self.widget.add_class("minicb-step-player")
        self.slider.observe(lambda change: self._show(change["new"]), names="value")
        self._show(0)

    @property
    def step(self) -> int:
        return self.slider.value

    @step.setter
    def step(self, value: int) -> None:
        self.slider.value = value

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _index(self) -> int:
        return min(self.slider.value, len(self.traces) - 1)

    def _cached_tokens(self, index: int) -> dict[int, int]:
        """request id -> prompt tokens it got from the prefix cache, for each request admitted
        in steps 0..index. A preempted request is admitted again, and may find more (or
        less) cached then: the latest admission's count is the one that holds its blocks."""
        cached: dict[int, int] = {}
        for trace in self.traces[:index + 1]:
            cached.update(trace.cached_tokens)
        return cached

    def state(self) -> dict:
        """What the player shows at the current step, as plain data."""
        index = self._index()
        trace = self.traces[index]
        return {
            "step": trace.step,
            "slots": [s.seq_id if s.phase != "empty" else None for s in trace.slots],
            "phases": [s.phase for s in trace.slots],
            "waiting": list(trace.waiting),
            "running": list(trace.running),
            # Finished so far, in finishing order: a trace lists only this step's finishers.
            "finished": [rid for t in self.traces[:index + 1] for rid, _ in t.finished],
            "num_free_blocks": trace.num_free_blocks,
            "block_owners": list(trace.block_owners),
            "shared_blocks": list(trace.shared_blocks),
            "cached_free_blocks": list(trace.cached_free_blocks),  # the next to be evicted first
            "cached_tokens": self._cached_tokens(index),  # admitted so far: rid -> prompt tokens from the cache
            # The strip's column for this step: prompt tokens include the chunks.
            "decode_tokens": self._split[index]["decode"],
            "prefill_tokens": self._split[index]["prefill"],
            "chunk_tokens": self._split[index]["chunk"],
            "token_budget": self.budget,
        }

    def _frame(self, picture: str, index: int) -> bytes:
        key = (picture, index)
        if key not in self._frames:
            from matplotlib.figure import Figure

            # A bare Figure (no pyplot): nothing is registered globally, nothing shows twice.
            # Fixed margins instead of a layout engine: layout would double the time per frame.
            if picture == "block":
                # A legend needs room on the right: the figure grows, the grid keeps its size.
                fig = Figure(figsize=(9.2 if self._block_legend else 7, 2.6), dpi=80)
                fig.subplots_adjust(left=0.03, right=0.74 if self._block_legend else 0.97, bottom=0.12, top=0.86)
                plot_block_map(self.traces[index], ax=fig.add_subplot(), legend=self._block_legend)
            else:
                traces = self.static_traces if picture == "static" else self.traces
                name = ("static batching" if picture == "static"
                        else "continuous batching" if self.static_traces else "")
                num_slots = max(len(t.slots) for t in traces)
                height = min(6.0, 1.6 + 0.28 * num_slots)
                strip = 1.4  # inches for the token strip under the timeline
                fig = Figure(figsize=(10, height + strip), dpi=80)
                fig.subplots_adjust(left=0.06, right=0.72, bottom=0.55 / (height + strip),
                                    top=1 - 0.4 / (height + strip), hspace=0.35)
                ax, strip_ax = fig.subplots(2, 1, height_ratios=[height - 0.95, strip - 0.3])
                draw_timeline(ax, traces, current=index, strip_ax=strip_ax,
                              budget=self.budget if picture == "timeline" else None,
                              title=f"{name} step {traces[index].step} of {len(traces) - 1}".strip())
                # Both timelines span the slider's range, so the same step sits at the same x.
                for axes in (ax, strip_ax):
                    axes.set_xlim(traces[0].step - 0.5, traces[0].step + self.slider.max + 0.5)
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png")
            self._frames[key] = buffer.getvalue()
        return self._frames[key]

    def _queues_html(self) -> str:
        state = self.state()
        trace = self.traces[self._index()]
        cached = state["cached_tokens"]

        def chips(seq_ids):
            # "A r0": the letter the timeline and the block map draw, beside the request id;
            # "· 160 cached" after it when its (latest) admission found prompt tokens in the cache.
            if not seq_ids:
                return "<i>none</i>"
            return " ".join(
                f"<span style='background:#{''.join(f'{round(c * 255):02x}' for c in request_color(rid))};"
                f"padding:0 3px;border-radius:3px'>{request_symbol(rid, prefill=True)}&nbsp;r{rid}"
                + (f"<span class='minicb-cached'>&nbsp;·&nbsp;{cached[rid]}&nbsp;cached</span>"
                   if cached.get(rid) else "") + "</span>"
                for rid in seq_ids)

        rows = [("waiting", state["waiting"]), ("running", state["running"]),
                ("finished", state["finished"]), ("admitted this step", trace.admitted),
                ("finished this step", [rid for rid, _ in trace.finished]),
                ("preempted this step", trace.preempted)]
        body = "".join(f"<tr><td><b>{name}</b> ({len(ids)})</td><td>{chips(ids)}</td></tr>" for name, ids in rows)
        blocks = (f"{trace.num_free_blocks} of {trace.num_blocks} free" if trace.num_blocks
                  else "no paged pool")
        if trace.cached_free_blocks:
            blocks += f" ({len(trace.cached_free_blocks)} of them cached)"
        if trace.shared_blocks:
            blocks += f", {len(trace.shared_blocks)} shared"
        tokens = (f"{state['decode_tokens']} decode + {state['prefill_tokens']} prompt"
                  + (f" ({state['chunk_tokens']} in chunks)" if state["chunk_tokens"] else "")
                  + (f" of {state['token_budget']}" if state["token_budget"] else ""))
        return (f"<div style='font-family:monospace;min-width:260px'><b>step {trace.step}</b>"
                f"<table>{body}<tr><td><b>KV blocks</b></td><td>{blocks}</td></tr>"
                f"<tr><td><b>tokens</b></td><td>{tokens}</td></tr></table></div>")

    def _show(self, value: int) -> None:
        index = min(value, len(self.traces) - 1)
        self.timeline_image.value = self._frame("timeline", index)
        self.block_image.value = self._frame("block", index)
        if self.static_traces:
            self.static_image.value = self._frame("static", min(value, len(self.static_traces) - 1))
        self.queues.value = self._queues_html()
