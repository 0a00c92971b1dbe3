"""The benchmark's command line: `python -m minicb bench [options]`.

In this file you will learn the order a fair benchmark runs in, per workload:
build the requests (workloads.py), check that minicb's engines agree with
naive greedy decoding, warm every engine up off the clock, time each one on
the same requests (runners.py), then write the report (report.py).

    python -m minicb bench                        # the chat workload, 100 prompts
    python -m minicb bench --quick                # every engine, 8 prompts, 16 tokens
    python -m minicb bench --workload all --out build/bench/bench.json
    python -m minicb bench --help                 # every option

minicb and HF load the very same checkpoint files, so the engines differ in how
they serve, not in the weights they serve.
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys

import torch

from minicb.bench.report import machine_info, markdown_table, write_report
from minicb.bench.runners import (DEFAULT_ENGINES, ENGINES, check_minicb_agrees, hf_batch_runner, kv_blocks_for,
                                  minicb_batch_runner, run_hf_continuous, run_minicb_continuous,
                                  run_workload, serve_in_batches)
from minicb.bench.workloads import WORKLOADS, Request, build_requests
from minicb.cli_args import add_engine_args, add_model_args, check_engine_args, engine_config
from minicb.cpu_attention import set_num_threads
from minicb.engine import EngineConfig
from minicb.llm import LLM

# The bench's own defaults for the engine flags. (The table's utilisation, busy slots and KV waste
# come from LLM.traces, every step of a run.) Both are one variant's setting:
# 256 tokens is minicb-chunked's budget, and 2 minicb-spec's n-gram (minicb_engine_configs).
ENGINE_DEFAULTS = {"max_num_batched_tokens": 256, "speculative_ngram": 2}


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags, then one for each of the engine's settings (minicb/cli_args.py)."""
    ap = argparse.ArgumentParser(prog="python -m minicb bench",
                                 description="The benchmark: minicb's three engines against HF transformers, "
                                             "on the same weights. The engine settings set every minicb engine, "
                                             "and each variant turns on its own feature; --max-num-seqs (--slots) "
                                             "is also the static batch size and HF's continuous max batch, "
                                             "--block-size HF's page size, and the KV pool HF's too.")
    add_model_args(ap)
    ap.add_argument("--workload", default="chat", choices=[*WORKLOADS, "all"])
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help="comma-separated subset of " + ", ".join(ENGINES) + " (default: all but minicb-prefix-cache, "
                         "minicb-chunked, minicb-eager and minicb-spec)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens at most per request")
    ap.add_argument("--hf-batch", type=int, default=16, help="batch size of hf-generate")
    ap.add_argument("--unpacked", action="store_true",
                    help="minicb engines: keep nn.Linear (torch's default BLAS) instead of oneDNN-packed weights "
                         "on a CPU (minicb/packed_linear.py); for before/after comparisons")
    ap.add_argument("--rate", type=float, default=1.0,
                    help="poisson, shared-prefix and long-prompt workloads: requests per second (0: all at once)")
    ap.add_argument("--random-max-prompt", type=int, default=256, help="random workload: longest prompt")
    ap.add_argument("--lengths-json", default=None,
                    help="chat workload: a JSON whose output_lengths[i] request i then generates exactly, EOS "
                         "ignored, capped at --max-tokens (tools/gpu_bundle.py makes it from the real model; for "
                         "random weights, whose answers have no natural end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines this many times, in turns (A, B, A, B, ...), and report each engine's "
                         "median round and the median of the per-round ratios: on a shared machine, a slow "
                         "stretch then falls on every engine alike")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch and the compiled decode (default: every core). On a CPU shared with other jobs, 1 can be "
                         "many times faster: a parallel op waits for its slowest thread")
    ap.add_argument("--out", default="build/bench/bench.json", help="JSON path; bench.md and bench.png go beside it")
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 prompts, 16 tokens")
    add_engine_args(ap, defaults=ENGINE_DEFAULTS, aliases={"max_num_seqs": ["--slots"]})
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 8, 16
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if args.rate < 0:
        ap.error(f"--rate={args.rate}; it must be > 0 requests/s, or 0 for all at once")
    check_engine_args(ap, args)  # EngineConfig's own rules, before anything loads
    for name in ("num_prompts", "max_tokens", "hf_batch", "threads", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    return args


def minicb_engine_configs(args: argparse.Namespace, num_blocks: int) -> dict[str, dict]:
    """Each paged minicb engine's EngineConfig fields: the engine flags, then the variant's own switch.

    minicb-continuous is the engine the variants are measured against, so the two
    settings that belong to one feature stay out of it: the token budget is
    chunking's (an engine that admits prompts whole keeps EngineConfig's 4096, unless
    --enable-chunked-prefill turns chunking on for every engine), and the n-gram is
    speculation's (only minicb-spec speculates). `num_blocks`: the pool every paged
    engine gets, HF's included (--num-blocks, or enough for the workload: kv_blocks_for).
    """
    flags = {**engine_config(args), "num_blocks": num_blocks}
    budget, whole_prompts = flags["max_num_batched_tokens"], EngineConfig.max_num_batched_tokens  # the field's default
    plain = {**flags, "speculative_ngram": None,
             "max_num_batched_tokens": budget if flags["enable_chunked_prefill"] else whole_prompts}
    return {
        "minicb-continuous": plain,
        "minicb-eager": {**plain, "cuda_graphs": False},
        "minicb-prefix-cache": {**plain, "enable_prefix_caching": True},
        "minicb-chunked": {**plain, "enable_chunked_prefill": True, "max_num_batched_tokens": budget},
        "minicb-spec": {**plain, "speculative_ngram": flags["speculative_ngram"]},
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        set_num_threads(args.threads)
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model, resolve_checkpoint

    # minicb and HF load the very same checkpoint files (a GGUF is converted once and cached).
    model = load_model(args.model, device=args.device, dtype=args.dtype, packed=not args.unpacked)
    try:
        tokenizer = load_tokenizer(args.model)
    except (OSError, ValueError):
        tokenizer = None  # a bare checkpoint: only random prompts can be made for it
    eos_id = tokenizer.eos_token_id if tokenizer else model.config.eos_token_ids[0]
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    if tokenizer is None and "chat" in workloads:
        if args.workload == "chat":
            print("error: the chat workload needs a tokenizer and this model has none; use --workload random",
                  file=sys.stderr)
            return 2
        workloads.remove("chat")
        print("this model has no tokenizer: skipping the chat workload; poisson uses random prompts")

    hf_models = {}

    def hf(name: str):
        # One copy per HF engine: continuous batching switches the model's attention to a paged one.
        if name not in hf_models:
            from transformers import AutoModelForCausalLM
            hf_models[name] = AutoModelForCausalLM.from_pretrained(
                str(resolve_checkpoint(args.model)), dtype=model.dtype, attn_implementation="sdpa",
            ).to(model.device).eval()
        return hf_models[name]

    report = {"meta": machine_info(args, argv, model.device), "workloads": {}}
    for workload in workloads:
        requests, arrivals, description = build_requests(workload, args, tokenizer, model.config.vocab_size)
        print(f"\n== {workload}: {description}")
        # In 16-bit floats two correct engines round differently, and a near tie can pick
        # another greedy token; the check runs on an fp32 copy, where exact agreement is the rule.
        checked = model if model.dtype == torch.float32 else copy.deepcopy(model).float()
        mismatches = check_minicb_agrees(checked, requests, args.max_num_seqs, args.block_size, args.attention)
        del checked
        if mismatches:
            print("minicb engines disagree with naive greedy decoding; not timing them:\n  " + "\n  ".join(mismatches),
                  file=sys.stderr)
            return 1

        # Each engine closes over this workload's settings; run(requests, arrivals, progress)
        # lets the same closure serve the warm-up and the timed run.
        num_blocks = (kv_blocks_for(requests, args.max_num_seqs, args.block_size) if args.num_blocks is None
                      else args.num_blocks)
        configs = minicb_engine_configs(args, num_blocks)
        llm = LLM.from_model(model, tokenizer, **configs["minicb-continuous"])
        report["meta"]["linear_layers"] = llm.engine.linear_choice.describe()  # every minicb engine shares them
        report["meta"]["cpu_ops"] = llm.engine.cpu_ops  # the norms, rotary and SwiGLU that run: compiled or torch
        print(f"{report['meta']['device']}; linear layers: {report['meta']['linear_layers']}; "
              f"norms, rotary and SwiGLU: {report['meta']['cpu_ops']}")
        # minicb-continuous without CUDA graphs (on a CPU the same engine): one, reused like llm's.
        eager_llm = (LLM.from_model(model, tokenizer, **configs["minicb-eager"])
                     if "minicb-eager" in args.engines.split(",") else None)

        def fresh_llm(name: str) -> LLM:
            # A new engine for every run: a prefix cache the warm-up filled would serve the
            # timed run prompts it never computed.
            return LLM.from_model(model, tokenizer, **configs[name])

        engines = {
            "minicb-naive": lambda reqs, arr, progress: serve_in_batches(
                minicb_batch_runner(model, static=False), reqs, arr, 1, "minicb-naive", progress),
            "minicb-static": lambda reqs, arr, progress: serve_in_batches(
                minicb_batch_runner(model, static=True), reqs, arr, args.max_num_seqs, "minicb-static", progress),
            "minicb-continuous": lambda reqs, arr, progress: run_minicb_continuous(llm, reqs, arr, progress),
            "minicb-prefix-cache": lambda reqs, arr, progress: run_minicb_continuous(
                fresh_llm("minicb-prefix-cache"), reqs, arr, progress),
            "minicb-chunked": lambda reqs, arr, progress: run_minicb_continuous(
                fresh_llm("minicb-chunked"), reqs, arr, progress),
            "minicb-eager": lambda reqs, arr, progress: run_minicb_continuous(eager_llm, reqs, arr, progress),
            "minicb-spec": lambda reqs, arr, progress: run_minicb_continuous(
                fresh_llm("minicb-spec"), reqs, arr, progress),
            "hf-generate": lambda reqs, arr, progress: serve_in_batches(
                hf_batch_runner(hf("hf-generate"), eos_id), reqs, arr, args.hf_batch, "hf-generate", progress),
            "hf-generate-batch": lambda reqs, arr, progress: run_hf_continuous(
                hf("hf-generate-batch"), reqs, arr, eos_id, args.max_num_seqs, num_blocks, args.block_size, progress),
        }
        engines = {name: run for name, run in engines.items() if name in args.engines.split(",")}
        # Warm up every engine off the clock: first-call allocations, lazy imports, kernel compiles.
        warm = [Request(r.prompt_ids, min(r.max_tokens, 4), r.ignore_eos) for r in requests[:2]]
        for run in engines.values():
            try:
                run(warm, None, False)
            except Exception:
                pass  # the timed run meets the same error and reports it in its row
        rows = run_workload(engines, requests, arrivals, args.rounds)
        report["workloads"][workload] = {"description": description, "requests": len(requests), "engines": rows}
        print("\n" + markdown_table(rows, len(requests)))

    write_report(report, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())