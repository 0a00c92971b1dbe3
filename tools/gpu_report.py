"""Write build/gpu-report.md from what tools/gpu_check.sh left in its output folder.

    python tools/gpu_report.py --out build/gpu-check --report build/gpu-report.md [--dry 1]

The folder holds one log per part (tests.log, kernel.log, ...), parts.txt (name,
exit code, seconds, limit per line) and the JSON the parts wrote (kernel.json,
graphs.json, bench.json with bench.md beside it). A part that failed or ran out
of time leaves its file missing: its section then shows the end of its log.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import subprocess


def read(path: pathlib.Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def tail(path: pathlib.Path, lines: int) -> str:
    text = read(path)
    return "(no log)" if text is None else "\n".join(text.rstrip().splitlines()[-lines:])


def versions() -> list[str]:
    import torch
    out = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.append(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip() or "n/a"
        except (OSError, subprocess.TimeoutExpired):
            driver = "n/a (no nvidia-smi)"
        out.append(f"driver: {driver}")
    else:
        out.append(f"GPU: none (CPU: {platform.processor() or platform.machine()})")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = "not installed"
    out.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}), Triton {triton_version}, transformers "
               f"{transformers_version}, Python {platform.python_version()}")
    return out


def parts_table(out: pathlib.Path) -> list[str]:
    rows = ["| part | exit | seconds | limit |", "|---|---|---|---|"]
    for line in (read(out / "parts.txt") or "").splitlines():
        name, rc, seconds, limit = line.split()
        verdict = "ok" if rc == "0" else ("**time limit**" if rc == "124" else f"**{rc}**")
        rows.append(f"| {name} | {verdict} | {seconds} | {limit} |")
    return rows


def test_lines(out: pathlib.Path) -> list[str]:
    text = read(out / "tests.log") or ""
    lines = text.rstrip().splitlines()
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln),
                   "(no pytest summary line: see the log)")
    notes = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    return [f"`{summary.strip('= ')}`", ""] + (["```", *notes[:40], "```"] if notes else [])


def kernel_lines(out: pathlib.Path) -> list[str]:
    text = read(out / "kernel.json")
    if text is None:
        return ["```", tail(out / "kernel.log", 15), "```"]
    k = json.loads(text)
    diffs = ", ".join(f"{name} {value:.1e}" for name, value in k.get("max_abs_diff", {}).items())
    if k.get("interpreted"):
        return [f"Triton interpreter, batch {k['batch']} x ctx {k['ctx']}: max abs diff vs chapter 04: {diffs}. "
                f"No bandwidth: an interpreted kernel is no speed figure."]
    copy = k["copy_bytes_per_s"]
    rows = [f"{k['device']}, batch {k['batch']} x ctx {k['ctx']}, {k['dtype']}, SmolLM2's heads "
            f"({k['n_q_heads']} q / {k['n_kv_heads']} kv / {k['head_dim']}), block {k['block_size']}; max abs diff "
            f"vs chapter 04: {diffs}. A device-to-device copy moved {copy / 1e12:.2f} TB/s (reads and writes "
            f"counted); the kernels' bytes are K and V read once, q read and out written.", "",
            "| kernel | time | GB/s | % of the copy rate | % of the data sheet's peak |", "|---|---|---|---|---|"]
    for name in ("decode", "split_k"):
        r = k[name]
        peak = "n/a" if r.get("fraction_of_peak") is None else f"{100 * r['fraction_of_peak']:.0f}%"
        label = f"{name} ({k['num_splits']} splits)" if name == "split_k" else name
        rows.append(f"| {label} | {1000 * r['ms']:.1f} us | {r['GB_per_s']:.0f} | "
                    f"**{100 * r['fraction_of_copy']:.0f}%** | {peak} |")
    return rows


def graph_lines(out: pathlib.Path) -> list[str]:
    text = read(out / "graphs.json")
    if text is None:
        return ["```", tail(out / "graphs.log", 15), "```"]
    g = json.loads(text)
    step, fwd = g["step_ms"], g["forward_ms"]
    rows = [f"{g['device']}: {g['seqs']} sequences (bucket {g['bucket']}) at {g['context']}+ tokens of context, "
            f"{g['dtype']}, attention={g['attention']}, medians of {g['steps']}.", "",
            "| | eager | CUDA graphs | eager / graphs |", "|---|---|---|---|",
            f"| whole engine step | {step['eager']:.3f} ms | {step['graphs']:.3f} ms | "
            f"{step['eager'] / step['graphs']:.2f}x |"]
    if fwd["graphs"] is not None:
        rows.append(f"| forward only | {fwd['eager']:.3f} ms | {fwd['graphs']:.3f} ms | "
                    f"{fwd['eager'] / fwd['graphs']:.2f}x |")
    else:
        rows += ["", "(no graphs on this device: the 'CUDA graphs' column is the runner run eagerly)"]
    return rows


def engine_lines(out: pathlib.Path) -> list[str]:
    md = read(out / "bench.md")
    if md is None:
        return ["```", tail(out / "engine.log", 20), "```"]
    return md.rstrip().splitlines()[2:]  # without its own title


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--report", type=pathlib.Path, required=True)
    ap.add_argument("--dry", default="0")
    ap.add_argument("--seconds", type=int, default=None)
    args = ap.parse_args(argv)
    out, dry = args.out, args.dry == "1"
    mode = ("**dry run on a CPU** (Triton interpreter, tiny shapes): it shows that every step runs; no figure "
            "here is a GPU figure" if dry else "on the GPU")
    lines = ["# gpu-check report", "",
             f"- {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, {mode}",
             *[f"- {v}" for v in versions()],
             f"- the whole check took {args.seconds} s" if args.seconds is not None else "",
             "", "## Parts", "", *parts_table(out),
             "", "## Tests", "", *test_lines(out),
             "", "## Kernel bandwidth (`python -m minicb.triton_attention`)", "", *kernel_lines(out),
             "", "## Decode steps: eager vs CUDA graphs (`python tools/cuda_graph_bench.py`)", "", *graph_lines(out),
             "", "## Query-tile kernel vs chapter 05's prefill (`python -m minicb.tile_attention`)", "",
             "```", tail(out / "tile.log", 12), "```",
             "", "## Engine benchmark (`python -m minicb bench`)", "",
             "SmolLM2's shape with random weights, bf16; each request generates as many tokens as the real model "
             "answered on a CPU (EOS ignored), so the work matches a real chat load.", "", *engine_lines(out), ""]
    args.report.write_text("\n".join(lines))
    print(f"wrote {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
