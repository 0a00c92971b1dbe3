"""Chunked prefill's token budget, swept: inter-token latency and time to first token per budget.

    .venv/bin/python tools/chunked_budget_sweep.py --out docs/chunked-budget-cpu.png
    .venv/bin/python tools/chunked_budget_sweep.py --num-prompts 6 --max-tokens 8 --budgets 64,256
    .venv/bin/python tools/chunked_budget_sweep.py --quick       # the tiny random model: seconds

The bench's long-prompt workload (minicb/bench/workloads.py: chat requests,
every 4th a document of 1,000+ tokens, arriving as a Poisson process at
--rate) runs through minicb's continuous engine on SmolLM2: first admitting
each prompt whole (chapter 06), then with chunked prefill at each budget of
--budgets (chapter 08). The runs go one after the other in this one process,
on the same requests and arrival times, after one warm-up off the clock. The
script prints a markdown table and saves a plot of ITL p99 and TTFT mean
against the budget, whole admission as horizontal lines; the table goes
beside the plot, as a .md file of the same name.

What to expect: a small budget cuts a long prompt into many chunks, so a
running request never waits long for its next token (ITL p99 falls), but the
long prompt's first token comes later and each step reads all the weights for
fewer tokens (TTFT and throughput suffer). A budget above the longest prompt
behaves like whole admission. Greedy tokens are the same for every budget; the
last column counts that.

Timings on a shared CPU are noisy, and a parallel op waits for its slowest
thread: --threads 1 is often steadier there. Compare rows of one run.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

import torch

from minicb.bench.metrics import summarize_timings
from minicb.bench.runners import kv_blocks_for, run_minicb_continuous
from minicb.bench.workloads import Request, long_prompt_requests, poisson_arrivals, random_requests
from minicb.cli_args import add_model_args
from minicb.cpu_attention import set_num_threads
from minicb.llm import LLM

DEFAULTS = {"num_prompts": 24, "max_tokens": 64, "rate": 1.0, "slots": 8, "budgets": "32,64,128,256,512"}
# --quick: the tiny random model (no tokenizer, so random prompts), small enough for a test.
QUICK = {"num_prompts": 8, "max_tokens": 8, "rate": 50.0, "slots": 4, "budgets": "16,64,256"}
QUICK_LONG_PROMPT = 300  # tokens; the tiny model's context is 512


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/chunked_budget_sweep.py", description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, help=f"requests (default {DEFAULTS['num_prompts']})")
    ap.add_argument("--max-tokens", type=int, help=f"new tokens at most per chat request (default "
                                                   f"{DEFAULTS['max_tokens']}; long prompts get 16)")
    ap.add_argument("--rate", type=float, help=f"arrivals per second (default {DEFAULTS['rate']:g})")
    ap.add_argument("--slots", type=int, help=f"max_num_seqs (default {DEFAULTS['slots']})")
    ap.add_argument("--budgets", help=f"comma-separated max_num_batched_tokens values (default {DEFAULTS['budgets']})")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="seeds the arrival times (and --quick's prompts)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch and the compiled decode (default: every core)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every setting this many times, in turns, and report medians (default 1)")
    ap.add_argument("--out", default="build/chunked-budget/chunked-budget.png",
                    help="the plot; the markdown table goes beside it with the suffix .md")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test on the tiny random model: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    args = ap.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",")})
    except ValueError:
        ap.error(f"--budgets {args.budgets!r}: give whole numbers separated by commas, e.g. 64,256")
    for name in ("num_prompts", "max_tokens", "slots", "block_size", "threads", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    if args.max_tokens < 2:
        ap.error(f"--max-tokens={args.max_tokens}; inter-token latency needs at least 2 tokens a request")
    if args.rate <= 0 or min(args.budgets) < 1:
        ap.error("--rate and every budget must be > 0")
    return args


def quick_requests(vocab_size: int, num_prompts: int, max_tokens: int, seed: int) -> list[Request]:
    """Random prompts of 8-24 tokens; every 4th is a long one of QUICK_LONG_PROMPT tokens, as in
    the long-prompt workload (which needs a tokenizer for its chat prompts)."""
    requests = random_requests(vocab_size, num_prompts, max_tokens, 24, seed)
    rng = random.Random(seed + 1)
    for i in range(3, num_prompts, 4):
        prompt = [rng.randrange(min(100, vocab_size // 2), vocab_size) for _ in range(QUICK_LONG_PROMPT)]
        requests[i] = Request(prompt, min(max_tokens, 16), ignore_eos=True)
    return requests


def sweep(model, tokenizer, requests: list[Request], arrivals: list[float], budgets: list[int], slots: int,
          block_size: int, repeats: int = 1) -> list[dict]:
    """One row per setting: whole-prompt admission (budget None), then each budget.

    With repeats > 1 the settings run in turns (whole, 32, 64, ..., whole, 32, ...),
    so a burst of load from another job on a shared machine hits every setting
    alike, and each figure in a row is the median over its runs (the lower middle one of an even count).
    """
    num_blocks = kv_blocks_for(requests, slots, block_size)

    def engine(budget: int | None) -> LLM:
        chunking = {} if budget is None else {"enable_chunked_prefill": True, "max_num_batched_tokens": budget}
        return LLM.from_model(model, tokenizer, max_num_seqs=slots, block_size=block_size, num_blocks=num_blocks,
                              **chunking)

    # Off the clock: first-call allocations and the compiled CPU decode, for both admission paths.
    warm = [Request(r.prompt_ids, min(r.max_tokens, 2), r.ignore_eos) for r in requests[:2]]
    for budget in (None, budgets[0]):
        run_minicb_continuous(engine(budget), warm, None, progress=False)

    settings = [None, *budgets]
    runs: dict[int | None, list[dict]] = {budget: [] for budget in settings}
    whole_tokens = None
    for turn in range(repeats):
        for budget in settings:
            llm = engine(budget)
            start = time.perf_counter()
            result = run_minicb_continuous(llm, requests, arrivals, progress=False)
            whole_tokens = whole_tokens or result.token_ids
            runs[budget].append({**summarize_timings(result.timings),
                                 "largest_step": max(t.num_tokens for t in llm.traces), "steps": len(llm.traces),
                                 "same_as_whole": sum(a == b for a, b in zip(result.token_ids, whole_tokens)),
                                 "run_s": time.perf_counter() - start})
            print(f"  round {turn + 1}/{repeats}, {'whole' if budget is None else f'budget {budget}'}: "
                  f"{runs[budget][-1]['run_s']:.1f} s", flush=True)
    # Token agreement must hold in every run, so it is the worst run's, not the median's.
    return [{"budget": budget, **{key: statistics.median_low(run[key] for run in runs[budget]) for key in runs[budget][0]},
             "same_as_whole": min(run["same_as_whole"] for run in runs[budget])} for budget in settings]


def markdown_table(rows: list[dict], num_requests: int) -> str:
    lines = ["| budget | ITL mean | ITL p99 | TTFT mean | out tok/s | largest step | steps | same tokens as whole |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'whole' if r['budget'] is None else r['budget']} | {r['itl_mean_s'] * 1e3:.1f} ms | "
                     f"{r['itl_p99_s'] * 1e3:.1f} ms | {r['ttft_mean_s']:.2f} s | {r['output_tok_s']:.1f} | "
                     f"{r['largest_step']} | {r['steps']} | {r['same_as_whole']}/{num_requests} |")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: pathlib.Path) -> None:
    """ITL p99, TTFT mean and throughput against the budget, whole admission as a dashed line."""
    from matplotlib.figure import Figure  # a bare Figure: no pyplot, no backend to choose

    whole, chunked = rows[0], rows[1:]
    budgets = [r["budget"] for r in chunked]
    fig = Figure(figsize=(14, 4), layout="constrained")
    panels = (("itl_p99_s", 1e3, "ITL p99, ms (a streaming reader's worst waits)"),
              ("ttft_mean_s", 1.0, "TTFT mean, s"),
              ("output_tok_s", 1.0, "output tokens/s"))
    for ax, (key, scale, label) in zip(fig.subplots(1, 3), panels):
        ax.plot(budgets, [r[key] * scale for r in chunked], marker="o", label="chunked prefill")
        ax.axhline(whole[key] * scale, color="black", linestyle="--", label="whole-prompt admission")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("token budget a step (max_num_batched_tokens)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        set_num_threads(args.threads)
    if args.quick:
        from minicb.model import random_model

        model, tokenizer = random_model(), None
        requests = quick_requests(model.config.vocab_size, args.num_prompts, args.max_tokens, args.seed)
        what = "tiny random model, random prompts"
    else:
        from minicb.tokenizer import load_tokenizer
        from minicb.weights import load_model

        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype), load_tokenizer(args.model)
        requests = long_prompt_requests(tokenizer, args.num_prompts, args.max_tokens)
        what = args.model or "SmolLM2-135M-Instruct"
    arrivals = poisson_arrivals(len(requests), args.rate, args.seed)
    longest = max(len(r.prompt_ids) for r in requests)
    title = (f"{what}, {args.dtype}, {model.device}, {torch.get_num_threads()} threads: {len(requests)} requests "
             f"(longest prompt {longest} tokens) at {args.rate:g}/s, {args.slots} slots, EOS or {args.max_tokens} tokens"
             + (f"; medians of {args.repeats} runs in turns" if args.repeats > 1 else ""))
    print(title, flush=True)
    rows = sweep(model, tokenizer, requests, arrivals, args.budgets, args.slots, args.block_size, args.repeats)

    table = markdown_table(rows, len(requests))
    print("\n" + table)
    out = pathlib.Path(args.out)
    plot(rows, title, out)
    command = "tools/chunked_budget_sweep.py " + " ".join(argv)
    out.with_suffix(".md").write_text(f"`{command.strip()}`\n\n{title}\n\n{table}\n")
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
