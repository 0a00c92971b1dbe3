"""Pictures of speculative decoding (chapter 11), drawn from step traces and measured numbers.

What you will learn from each picture:

- `speculation_html` / `SpeculationText`: one request's answer as it was written, step
  by step. Each step is a box; inside it, the drafts the model accepted (green), the
  drafts it rejected (red, struck through), and the one token the step always adds
  (blue: the *correction* where the first draft failed, or, outlined, the *bonus*
  token after a run of drafts that were all accepted). Plain tokens (grey box) come
  from steps that had no drafts to verify. Reading it you see *where* prompt lookup
  pays: long green runs where the answer copies its prompt, and steps with one plain
  token where the answer says something new. A box never holds fewer tokens than a
  step without speculation would have made: a rejection costs compute, never tokens.
- `SpeculationPlayer`: the same text revealed step by step with a slider (Jupyter,
  ipywidgets), with the step's drafts and verdict spelled out under it. Without a
  live kernel (a saved notebook, nbviewer) it shows the static picture instead.
- `plot_acceptance`: acceptance against k, the number of drafts proposed at most.
  Mean accepted drafts per decode step grows with k, but slower and slower: a run of
  copied text ends somewhere, and drafts past its end are rejected. The acceptance
  rate tends to fall as k grows, for the same reason. Since every draft costs a row
  of the forward, the k worth choosing is where the accepted tokens stop growing.

`acceptance_numbers` adds up the RequestOutputs' metrics into the numbers the plot takes.
`replay_greedy` gives the same numbers for any (n, k) without the model: with greedy
decoding, which drafts are accepted follows from the greedy answer alone, so one plain
run answers every k (the notebook checks it against the engine's own counts).

Only the standard library is imported at module level (like minicb/viz.py):
matplotlib and ipywidgets are imported by the functions that need them.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from minicb.trace import StepTrace

# One colour per kind of token: (css class, label in the legend, inline style).
# Inline styles, not a <style> block: Jupyter front ends and GitHub may strip <style>,
# never style attributes, so the picture keeps its colours wherever the HTML is shown.
ACCEPTED, REJECTED, CORRECTION, BONUS, PLAIN, DROPPED = (
    "minicb-spec-accepted", "minicb-spec-rejected", "minicb-spec-correction", "minicb-spec-bonus",
    "minicb-spec-plain", "minicb-spec-dropped")
ADDED = "minicb-spec-added"  # the extra class that both correction and bonus carry
STYLES = {
    ACCEPTED: "background:#c9efc9;color:#114411",
    REJECTED: "color:#c0392b;text-decoration:line-through;opacity:0.75",
    CORRECTION: "background:#cfe0ff;color:#0b3a8c",
    BONUS: "background:#cfe0ff;color:#0b3a8c;outline:2px solid #2f62c9;outline-offset:-2px",
    PLAIN: "background:#ececec;color:#222",
    DROPPED: "color:#999;text-decoration:underline dotted",
}
LEGEND = (
    (ACCEPTED, "accepted draft"),
    (REJECTED, "rejected draft"),
    (CORRECTION, "correction: the model's token where a draft failed"),
    (BONUS, "bonus: the model's token after all drafts were accepted"),
    (PLAIN, "plain token: a step with no drafts"),
)


@dataclass
class StepSegment:
    """What one step did for one request. Token lists hold token ids.

    kind "speculative": the step verified `drafts`; the first `num_accepted` were
    accepted, the rest rejected, and `added` is the correction (num_accepted < len(drafts))
    or the bonus token. kind "plain": the step sampled `tokens` without drafts (the
    first token after the prompt, or a decode with nothing to propose).
    `kept`: how many of the step's yielded tokens (accepted + [added], or `tokens`) were
    appended to the answer; fewer when a stop token ended it inside the step.
    """

    step: int
    kind: str  # "speculative" | "plain"
    drafts: list[int] = field(default_factory=list)  # [k] proposed this step
    num_accepted: int = 0
    added: int | None = None  # correction or bonus token
    tokens: list[int] = field(default_factory=list)  # plain steps: the sampled tokens
    kept: int = 0

    @property
    def accepted(self) -> list[int]:
        return self.drafts[:self.num_accepted]

    @property
    def rejected(self) -> list[int]:
        return self.drafts[self.num_accepted:]

    @property
    def bonus(self) -> bool:
        """True when every draft was accepted, so `added` is a bonus, not a correction."""
        return self.kind == "speculative" and self.num_accepted == len(self.drafts)

    @property
    def yielded(self) -> list[int]:
        """The tokens this step produced, in order: accepted drafts then the added token, or the plain ones."""
        if self.kind != "speculative":
            return list(self.tokens)
        return self.accepted + ([] if self.added is None else [self.added])


def request_steps(traces: list[StepTrace], seq_id: int) -> list[StepSegment]:
    """One StepSegment per step in which `seq_id` got tokens or verified drafts, in step order."""
    segments = []
    for trace in traces:
        appended = [token for rid, token in trace.new_tokens if rid == seq_id]
        spec = [entry for entry in trace.speculation if entry[0] == seq_id]
        if spec:
            _, drafts, num_accepted, added = spec[0]
            if not 0 <= num_accepted <= len(drafts):
                raise ValueError(f"step {trace.step}: sequence {seq_id} accepted {num_accepted} "
                                 f"of {len(drafts)} drafts")
            segment = StepSegment(trace.step, "speculative", list(drafts), num_accepted, added)
            segment.kept = len(appended)
            if appended != segment.yielded[:len(appended)]:
                raise ValueError(f"step {trace.step}: sequence {seq_id} appended {appended}, which does not "
                                 f"start the verified tokens {segment.yielded}")
            segments.append(segment)
        elif appended:
            segments.append(StepSegment(trace.step, "plain", tokens=appended, kept=len(appended)))
    return segments


def _token_text(tokenizer, token: int) -> str:
    """One token as readable text: its decoded string, newlines shown as ↵, spaces kept."""
    text = tokenizer.decode([token]) if tokenizer is not None else f"[{token}]"
    if text == "":
        text = f"[{token}]"  # a special token, or a byte that is not a character on its own
    return html.escape(text).replace("\n", "↵\n")


def _span(css: str, text: str, title: str = "") -> str:
    classes = f"{css} {ADDED}" if css in (CORRECTION, BONUS) else css
    tip = f" title='{html.escape(title, quote=True)}'" if title else ""
    return f"<span class='{classes}' style='{STYLES[css]}'{tip}>{text}</span>"


def _step_html(segment: StepSegment, tokenizer, current: bool) -> str:
    """One step's box: [accepted][rejected, struck][added], or [plain tokens]."""
    parts = []
    if segment.kind == "speculative":
        kept = segment.kept
        for i, token in enumerate(segment.accepted):
            parts.append(_span(ACCEPTED if i < kept else DROPPED, _token_text(tokenizer, token),
                               "accepted draft" if i < kept else "accepted, but after the stop token"))
        for token in segment.rejected:
            parts.append(_span(REJECTED, _token_text(tokenizer, token), "rejected draft"))
        if segment.added is not None:
            css = (BONUS if segment.bonus else CORRECTION) if kept > segment.num_accepted else DROPPED
            parts.append(_span(css, _token_text(tokenizer, segment.added),
                               "bonus token" if segment.bonus else "correction token"))
        title = (f"step {segment.step}: {len(segment.drafts)} drafts, {segment.num_accepted} accepted, "
                 f"{'bonus' if segment.bonus else 'correction'} added")
    else:
        for i, token in enumerate(segment.tokens):
            parts.append(_span(PLAIN if i < segment.kept else DROPPED, _token_text(tokenizer, token)))
        title = f"step {segment.step}: no drafts"
    frame = "2px solid #222" if current else "1px solid #bbb"
    return (f"<span class='minicb-spec-step' data-step='{segment.step}' title='{title}' "
            f"style='border:{frame};border-radius:3px;padding:1px 1px;margin:0 1px'>{''.join(parts)}</span>")


def legend_html() -> str:
    chips = " ".join(_span(css, html.escape(label)) for css, label in LEGEND)
    return (f"<div class='minicb-spec-legend' style='font-family:sans-serif;font-size:0.85em;margin:4px 0'>"
            f"{chips} <span style='border:1px solid #bbb;border-radius:3px;padding:0 3px'>box = one step</span>"
            f"</div>")


def speculation_summary(segments: list[StepSegment]) -> dict:
    """The request's numbers over these segments: steps, drafts, accepted, tokens appended."""
    spec = [s for s in segments if s.kind == "speculative"]
    drafts = sum(len(s.drafts) for s in spec)
    accepted = sum(s.num_accepted for s in spec)
    return {"steps": len(segments), "verify_steps": len(spec), "drafts": drafts, "accepted": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "tokens": sum(s.kept for s in segments)}


def speculation_html(traces: list[StepTrace], tokenizer, seq_id: int, *, upto: int | None = None,
                     current: int | None = None, legend: bool = True) -> str:
    """One request's answer as HTML, one box per step (see the module docstring for the colours).

    traces: the run's StepTraces (llm.traces); tokenizer: has decode(list[int]) -> str
    (None shows token ids). upto: show only steps <= upto (the trace's step number);
    current: frame that step in black. Returns a self-contained HTML string (inline styles).
    """
    segments = request_steps(traces, seq_id)
    if not segments:
        raise ValueError(f"sequence {seq_id} got no tokens in these {len(traces)} traces")
    shown = [s for s in segments if upto is None or s.step <= upto]
    numbers = speculation_summary(shown)
    rate = "" if numbers["acceptance_rate"] is None else f" ({numbers['acceptance_rate']:.0%})"
    header = (f"<div style='font-family:sans-serif;font-size:0.9em'><b>sequence {seq_id}</b>: "
              f"{numbers['tokens']} tokens in {numbers['steps']} steps; {numbers['drafts']} drafts proposed in "
              f"{numbers['verify_steps']} steps, {numbers['accepted']} accepted{rate}</div>")
    body = "".join(_step_html(s, tokenizer, s.step == current) for s in shown)
    text = (f"<div class='minicb-spec-text' style='font-family:monospace;white-space:pre-wrap;"
            f"line-height:1.9;max-width:60em'>{body}</div>")
    return (f"<div class='minicb-speculation'>{header}{legend_html() if legend else ''}{text}</div>")


class SpeculationText:
    """The static picture as a notebook object: the last expression of a cell shows it,
    with or without a kernel (it is plain HTML in the saved output). `.html` is the string."""

    def __init__(self, traces: list[StepTrace], tokenizer, seq_id: int, **options):
        self.html = speculation_html(traces, tokenizer, seq_id, **options)

    def _repr_html_(self) -> str:
        return self.html


def describe_step(segment: StepSegment, tokenizer) -> str:
    """One line of plain text about a step: what was proposed and what the model did with it."""
    def words(tokens):
        return repr(tokenizer.decode(tokens)) if tokenizer is not None else str(tokens)

    if segment.kind == "plain":
        return f"step {segment.step}: no drafts; sampled {words(segment.tokens)}"
    added = "bonus" if segment.bonus else "correction"
    return (f"step {segment.step}: proposed {len(segment.drafts)} drafts {words(segment.drafts)}; "
            f"accepted {segment.num_accepted} {words(segment.accepted)}; "
            f"{added} {words([segment.added])}: {segment.num_accepted + 1} tokens from one forward")


class SpeculationPlayer:
    """Step through one request's speculation in Jupyter: a Play button and a slider over
    the steps that gave it tokens; the answer so far, the current step framed, and a line
    saying what that step proposed and kept.

        player = SpeculationPlayer(llm.traces, llm.tokenizer, seq_id=0)
        player          # shows the widget; player.step = 5 moves it; player.state() reads it

    Saved without widget state, a notebook shows the whole answer as static HTML instead.
    """

    def __init__(self, traces: list[StepTrace], tokenizer, seq_id: int):
        import ipywidgets as widgets

        self.traces, self.tokenizer, self.seq_id = list(traces), tokenizer, seq_id
        self.segments = request_steps(self.traces, seq_id)  # [steps the request took part in]
        if not self.segments:
            raise ValueError(f"sequence {seq_id} got no tokens in these {len(self.traces)} traces")
        last = len(self.segments) - 1
        self.play = widgets.Play(min=0, max=last, step=1, interval=500, description="play")
        self.slider = widgets.IntSlider(min=0, max=last, value=last, description="step #")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.text = widgets.HTML()
        self.text.add_class("minicb-spec-player-text")
        self.caption = widgets.HTML()
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]), self.caption, self.text])
        self.widget.add_class("minicb-spec-player")
        self.slider.observe(lambda change: self._show(change["new"]), names="value")
        self._show(last)

    @property
    def step(self) -> int:
        """Index into self.segments (0 = the request's first step with tokens)."""
        return self.slider.value

    @step.setter
    def step(self, value: int) -> None:
        self.slider.value = value

    def state(self) -> dict:
        segment = self.segments[self.slider.value]
        return {"index": self.slider.value, "step": segment.step, "kind": segment.kind,
                "drafts": list(segment.drafts), "accepted": segment.accepted, "rejected": segment.rejected,
                "added": segment.added, "tokens": segment.yielded[:segment.kept],
                "caption": describe_step(segment, self.tokenizer)}

    def _show(self, index: int) -> None:
        segment = self.segments[index]
        self.caption.value = f"<code>{html.escape(describe_step(segment, self.tokenizer))}</code>"
        self.text.value = speculation_html(self.traces, self.tokenizer, self.seq_id,
                                           upto=segment.step, current=segment.step)

    def _repr_mimebundle_(self, **kwargs):
        # The widget for a live kernel, plus the whole answer as HTML for every place without one.
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data["text/html"] = speculation_html(self.traces, self.tokenizer, self.seq_id)
        return bundle


# ----------------------------------------------------------------------------
# Acceptance against k.

def replay_greedy(prompt_ids: list[int], output_ids: list[int], n: int, k: int,
                  max_tokens: int | None = None) -> list[StepSegment]:
    """What prompt lookup with (n, k) does on a greedy answer that is already known, without the model.

    Greedy verification keeps a draft exactly when it equals the token greedy decoding
    writes there, so the whole run follows from the answer: each step proposes
    propose_ngram(prompt + answer so far, n, k), accepts the drafts that match the
    answer's next tokens, and adds the answer's next token after them. Returns
    StepSegments as request_steps would build them from the engine's traces (step 0:
    the prompt's step, with the first token), numbered 0, 1, 2, ...
    max_tokens: the request's limit (None: the answer's length); like the engine,
    no step proposes drafts past it.

    Exact for an answer that stopped at max_tokens (the engine proposes no draft past
    it); when a run of drafts reaches past a stop token, the engine compares the rest
    with argmaxes this replay cannot know, and counts them as the model decides, so
    there the replay's accepted count is a lower bound.
    """
    from minicb.speculative import propose_ngram  # imports torch: not at module level

    answer = list(output_ids)  # [T]
    if not answer:
        return []
    limit = len(answer) if max_tokens is None else max_tokens
    if limit < len(answer):
        raise ValueError(f"the answer has {len(answer)} tokens, more than max_tokens={max_tokens}")
    segments = [StepSegment(0, "plain", tokens=answer[:1], kept=1)]
    written = 1
    while written < len(answer):
        # At most the tokens still allowed after this step's own one, as the scheduler proposes.
        drafts = propose_ngram(list(prompt_ids) + answer[:written], n, min(k, limit - written - 1))
        step = len(segments)
        if not drafts:
            segments.append(StepSegment(step, "plain", tokens=[answer[written]], kept=1))
            written += 1
            continue
        accepted = 0
        while accepted < len(drafts) and written + accepted < len(answer) \
                and drafts[accepted] == answer[written + accepted]:
            accepted += 1
        if written + accepted == len(answer):  # the drafts ran to the answer's last token (a stop token)
            segments.append(StepSegment(step, "speculative", drafts, accepted, None, kept=accepted))
            break
        segments.append(StepSegment(step, "speculative", drafts, accepted, answer[written + accepted],
                                    kept=accepted + 1))
        written += accepted + 1
    return segments


def replay_numbers(segments: list[StepSegment]) -> dict:
    """The engine's metrics for a replayed answer: num_draft_tokens, num_accepted_tokens, num_decode_steps."""
    return {"num_draft_tokens": sum(len(s.drafts) for s in segments),
            "num_accepted_tokens": sum(s.num_accepted for s in segments),
            "num_decode_steps": max(0, len(segments) - 1)}  # every step after the prompt's

def acceptance_numbers(outputs) -> dict:
    """Sum the speculation metrics over requests: RequestOutputs (llm.generate's result), their
    .metrics, or replay_numbers' dicts; each has num_draft_tokens, num_accepted_tokens, num_decode_steps.

    accepted_per_step: accepted drafts per decode step (steps without drafts count too);
    tokens_per_step = 1 + accepted_per_step, since every decode step adds one token of its own.
    """
    def field(item, name):
        metrics = getattr(item, "metrics", item)
        return metrics[name] if isinstance(metrics, dict) else getattr(metrics, name)

    drafts = sum(field(o, "num_draft_tokens") for o in outputs)
    accepted = sum(field(o, "num_accepted_tokens") for o in outputs)
    steps = sum(field(o, "num_decode_steps") for o in outputs)
    return {"drafts": drafts, "accepted": accepted, "decode_steps": steps,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "accepted_per_step": accepted / steps if steps else 0.0,
            "tokens_per_step": 1 + accepted / steps if steps else 1.0}


def plot_acceptance(ks, accepted_per_step, acceptance_rate=None, *, ax=None, title: str | None = None):
    """Measured acceptance against k. ks: [K] ints; accepted_per_step: [K] mean accepted
    drafts per decode step; acceptance_rate: [K] in 0..1, drawn on a second y axis (optional).

    The dashed line y = k is the ceiling: every draft accepted, every step. Returns the figure.
    """
    ks, accepted_per_step = list(ks), list(accepted_per_step)
    if not ks or len(ks) != len(accepted_per_step):
        raise ValueError(f"need one accepted_per_step value per k; got {len(ks)} ks, "
                         f"{len(accepted_per_step)} values")
    if acceptance_rate is not None and len(list(acceptance_rate)) != len(ks):
        raise ValueError(f"need one acceptance_rate per k; got {len(list(acceptance_rate))} for {len(ks)} ks")
    if ax is None:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(7.5, 4.0), layout="constrained")
        ax = fig.add_subplot()
    ax.plot(ks, ks, linestyle="--", color="0.6", label="ceiling: all k accepted")
    ax.plot(ks, accepted_per_step, "o-", color="tab:green", label="accepted drafts per decode step")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("k: drafts proposed at most")
    ax.set_ylabel("accepted drafts per step")
    ax.set_ylim(0, max(ks) * 1.05)
    handles, labels = ax.get_legend_handles_labels()
    if acceptance_rate is not None:
        rate_ax = ax.twinx()
        rate_ax.plot(ks, list(acceptance_rate), "s:", color="tab:red", label="acceptance rate")
        rate_ax.set_ylim(0, 1.05)
        rate_ax.set_ylabel("accepted / proposed")
        more_handles, more_labels = rate_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    # Under the axes: inside, it would cover the points at small k.
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(handles), fontsize=8,
              frameon=False)
    ax.set_title(title or "speculation: acceptance against k")
    return ax.figure
