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
from minicb.cli_args import add_model_args, add_speculative_args
from minicb.cpu_attention import set_num_threads
from minicb.llm import LLM


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m minicb bench",
                                 description="The benchmark: minicb's three engines against HF transformers, "
                                             "on the same weights.")
    add_model_args(ap)
    ap.add_argument("--workload", default="chat", choices=[*WORKLOADS, "all"])
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                    help="comma-separated subset of " + ", ".join(ENGINES) + " (default: all but minicb-prefix-cache, "
                         "minicb-chunked, minicb-eager and minicb-spec)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens at most per request")
    ap.add_argument("--slots", type=int, default=32, help="minicb static batch size and continuous max_num_seqs")
    ap.add_argument("--hf-batch", type=int, default=16, help="batch size of hf-generate")
    ap.add_argument("--block-size", type=int, default=16, help="KV block size (minicb) and page size (HF)")
    ap.add_argument("--attention", default="torch", choices=["torch", "triton"])
    ap.add_argument("--unpacked", action="store_true",
                    help="minicb engines: keep nn.Linear (torch's default BLAS) instead of oneDNN-packed weights "
                         "on a CPU (minicb/packed_linear.py); for before/after comparisons")
    ap.add_argument("--rate", type=float, default=1.0,
                    help="poisson, shared-prefix and long-prompt workloads: requests per second (0: all at once)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="minicb-chunked: tokens a step computes at most (the token budget)")
    add_speculative_args(ap)
    ap.add_argument("--random-max-prompt", type=int, default=256, help="random workload: longest prompt")
    ap.add_argument("--lengths-json", default=None,
                    help="chat workload: a JSON whose output_lengths[i] request i then generates exactly, EOS "
                         "ignored, capped at --max-tokens (tools/gpu_bundle.py makes it from the real model; for "
                         "random weights, whose answers have no natural end)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch and the compiled decode (default: every core). On a CPU shared with other jobs, 1 can be "
                         "many times faster: a parallel op waits for its slowest thread")
    ap.add_argument("--out", default="build/bench/bench.json", help="JSON path; bench.md and bench.png go beside it")
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 prompts, 16 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 8, 16
    unknown = sorted(set(args.engines.split(",")) - set(ENGINES))
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    if args.rate < 0:
        ap.error(f"--rate={args.rate}; it must be > 0 requests/s, or 0 for all at once")
    for name in ("num_prompts", "max_tokens", "slots", "hf_batch", "block_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}; it must be >= 1")
    return args


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
        mismatches = check_minicb_agrees(checked, requests, args.slots, args.block_size, args.attention)
        del checked
        if mismatches:
            print("minicb engines disagree with naive greedy decoding; not timing them:\n  " + "\n  ".join(mismatches),
                  file=sys.stderr)
            return 1

        # Each engine closes over this workload's settings; run(requests, arrivals, progress)
        # lets the same closure serve the warm-up and the timed run.
        num_blocks = kv_blocks_for(requests, args.slots, args.block_size)
        llm = LLM.from_model(model, tokenizer, max_num_seqs=args.slots, attention=args.attention,
                             block_size=args.block_size, num_blocks=num_blocks)

        # minicb-continuous without CUDA graphs (on a CPU the same engine): one, reused like llm's.
        eager_llm = (LLM.from_model(model, tokenizer, max_num_seqs=args.slots, attention=args.attention,
                                    block_size=args.block_size, num_blocks=num_blocks, cuda_graphs=False)
                     if "minicb-eager" in args.engines.split(",") else None)

        def cached_llm():
            # The same engine with prefix caching, new for every run: a cache the warm-up
            # filled would serve the timed run prompts it never computed.
            return LLM.from_model(model, tokenizer, max_num_seqs=args.slots, attention=args.attention,
                                  block_size=args.block_size, num_blocks=num_blocks, enable_prefix_caching=True)

        def chunked_llm():
            return LLM.from_model(model, tokenizer, max_num_seqs=args.slots, attention=args.attention,
                                  block_size=args.block_size, num_blocks=num_blocks, enable_chunked_prefill=True,
                                  max_num_batched_tokens=args.max_num_batched_tokens)

        def spec_llm():
            return LLM.from_model(model, tokenizer, max_num_seqs=args.slots, attention=args.attention,
                                  block_size=args.block_size, num_blocks=num_blocks,
                                  speculative_ngram=args.speculative_ngram or 2,
                                  num_speculative_tokens=args.num_speculative_tokens)

        engines = {
            "minicb-naive": lambda reqs, arr, progress: serve_in_batches(
                minicb_batch_runner(model, static=False), reqs, arr, 1, "minicb-naive", progress),
            "minicb-static": lambda reqs, arr, progress: serve_in_batches(
                minicb_batch_runner(model, static=True), reqs, arr, args.slots, "minicb-static", progress),
            "minicb-continuous": lambda reqs, arr, progress: run_minicb_continuous(llm, reqs, arr, progress),
            "minicb-prefix-cache": lambda reqs, arr, progress: run_minicb_continuous(cached_llm(), reqs, arr, progress),
            "minicb-chunked": lambda reqs, arr, progress: run_minicb_continuous(chunked_llm(), reqs, arr, progress),
            "minicb-eager": lambda reqs, arr, progress: run_minicb_continuous(eager_llm, reqs, arr, progress),
            "minicb-spec": lambda reqs, arr, progress: run_minicb_continuous(spec_llm(), reqs, arr, progress),
            "hf-generate": lambda reqs, arr, progress: serve_in_batches(
                hf_batch_runner(hf("hf-generate"), eos_id), reqs, arr, args.hf_batch, "hf-generate", progress),
            "hf-generate-batch": lambda reqs, arr, progress: run_hf_continuous(
                hf("hf-generate-batch"), reqs, arr, eos_id, args.slots, num_blocks, args.block_size, progress),
        }
        engines = {name: run for name, run in engines.items() if name in args.engines.split(",")}
        # Warm up every engine off the clock: first-call allocations, lazy imports, kernel compiles.
        warm = [Request(r.prompt_ids, min(r.max_tokens, 4), r.ignore_eos) for r in requests[:2]]
        for run in engines.values():
            try:
                run(warm, None, False)
            except Exception:
                pass  # the timed run meets the same error and reports it in its row
        rows = run_workload(engines, requests, arrivals)
        report["workloads"][workload] = {"description": description, "requests": len(requests), "engines": rows}
        print("\n" + markdown_table(rows, len(requests)))

    write_report(report, pathlib.Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())