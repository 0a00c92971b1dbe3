"""The benchmark's report: a markdown table, a JSON file and a PNG from one run.

In this file you will learn what a benchmark report should carry besides its
numbers: the exact command, the machine, the library versions and the engine
settings (`machine_info`), so that a reader can rerun it and a later run can be
compared with it. The JSON holds everything; the markdown table and the PNG
(throughput beside latency, mean and p99, one row of panels per workload) are
made from the JSON's contents alone.

    python -m minicb bench --out build/bench/bench.json   # also bench.md and bench.png beside it

The figure is a bare matplotlib Figure, never registered with pyplot, so writing
it needs no backend switch and leaves a notebook's inline plotting alone.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib

import torch

from minicb.bench.machine import device_name

from minicb.bench.runners import BASELINES


def _fmt(value, spec: str, suffix: str = "", scale: float = 1.0) -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def markdown_table(rows: dict, num_requests: int) -> str:
    """One row per engine, as run_workload returns them; a number no engine could see reads n/a,
    and an engine that failed gets its error in the second cell (every row keeps the same cells).
    When the engines ran more than one round, a last column lists each round's tok/s."""
    rounds = any(len(r.get("output_tok_s_rounds", ())) > 1 for r in rows.values())
    header = ("| engine | out tok/s | req/s | latency mean | p50 | p99 | TTFT mean | TPOT mean | ITL mean | "
              "ITL p99 | slot util | "
              "busy slots | KV waste | prefill computed | prefix hits | tok/step | vs hf-generate | "
              "vs hf-generate-batch | vs minicb-static | same as continuous |" + (" tok/s per round |" if rounds else ""))
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} |" + " |" * (header.count(" | ") - 1))
            continue
        same = None if r["same_as_continuous"] is None else f"{r['same_as_continuous']}/{num_requests}"
        cells = [
            f"| {name}", _fmt(r["output_tok_s"], ".1f"), _fmt(r["req_s"], ".2f"),
            _fmt(r["latency_mean_s"], ".2f", " s"), _fmt(r["latency_p50_s"], ".2f", " s"),
            _fmt(r["latency_p99_s"], ".2f", " s"), _fmt(r["ttft_mean_s"], ".2f", " s"),
            _fmt(r["tpot_mean_s"], ".1f", " ms", 1000),
            _fmt(r.get("itl_mean_s"), ".1f", " ms", 1000), _fmt(r.get("itl_p99_s"), ".1f", " ms", 1000),
            _fmt(r["utilisation"], ".0f", "%", 100), _fmt(r.get("busy_slots"), ".0f", "%", 100),
            _fmt(r["kv_waste_pct"], ".0f", "%"), _fmt(r.get("prefill_tokens"), ",.0f"),
            _fmt(r.get("cache_hit_pct"), ".0f", "%"), _fmt(r.get("tokens_per_step"), ".2f"),
            *[_fmt(r.get(f"speedup_vs_{baseline}"), ".2f", "x") for baseline in BASELINES],
            same or "n/a"]
        if rounds:
            cells.append(", ".join(f"{x:.1f}" for x in r.get("output_tok_s_rounds", [])))
        lines.append(" | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    """Throughput (left) and latency, mean bar and p99 tick (right), one row per workload, to `path`."""
    # A bare Figure, not pyplot: nothing is registered globally, so neither a
    # backend switch nor plt.close is needed, and savefig renders with Agg itself.
    from matplotlib.figure import Figure

    workloads = report["workloads"]
    fig = Figure(figsize=(12, 3.2 * len(workloads)))
    axes = fig.subplots(len(workloads), 2, squeeze=False, sharey="row")
    for (name, w), (ax_tput, ax_lat) in zip(workloads.items(), axes):
        ok = {e: r for e, r in w["engines"].items() if "error" not in r}
        ax_tput.barh(list(ok), [r["output_tok_s"] for r in ok.values()], color="tab:blue")
        ax_tput.set_xlabel("output tokens / s (higher is better)")
        ax_lat.barh(list(ok), [r["latency_mean_s"] for r in ok.values()], color="tab:orange", label="mean")
        ax_lat.scatter([r["latency_p99_s"] for r in ok.values()], list(ok), color="black", marker="|", s=200,
                       label="p99", zorder=3)
        ax_lat.set_xlabel("request latency, s (lower is better)")
        ax_lat.legend(loc="best")
        ax_tput.set_title(f"{name}: {w['description']}", loc="left", fontsize=9)
        ax_tput.invert_yaxis()  # engines top to bottom, in table order (shared with the latency panel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine_info(args, argv: list[str], device: torch.device) -> dict:
    from importlib.metadata import version
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m minicb bench " + " ".join(argv),
        "device": device_name(device),
        "torch": torch.__version__, "transformers": version("transformers"), "threads": torch.get_num_threads(),
        "model": args.model or "embedded SmolLM2-135M-Instruct", "dtype": args.dtype,
        "slots": args.max_num_seqs, "hf_batch": args.hf_batch, "block_size": args.block_size, "attention": args.attention,
        "packed_linear": not args.unpacked, "linear_backend": args.linear_backend, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
    }


def write_report(report: dict, out: pathlib.Path) -> None:
    """report = {"meta": machine_info(...), "workloads": {name: {description, requests, engines}}}
    -> `out` (JSON), and the markdown and PNG beside it with the same stem."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    meta = report["meta"]
    md = [f"# minicb bench, {meta['date']}", "", f"`{meta['command']}`", "",
          f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['threads']} threads, "
          f"{meta['model']} in {meta['dtype']}, slots {meta['slots']}, hf batch {meta['hf_batch']}, "
          f"block size {meta['block_size']}, attention {meta['attention']}"]
    for workload, w in report["workloads"].items():
        md += ["", f"## {workload}: {w['description']}", "", markdown_table(w["engines"], w["requests"])]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"\nwrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
