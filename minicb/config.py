"""The engine's settings: one dataclass, each field with its default and what it does.

`EngineConfig` is what `Engine` (minicb/engine.py) is built from, and the one
place its settings are written down. Everything else reads them from here:

- `LLM(max_num_seqs=8, enable_prefix_caching=True)` takes the fields by name
  (minicb/llm.py);
- `minicb.cli_args.add_engine_args` makes a flag of each field (`--max-num-seqs`,
  `--enable-prefix-caching`, `--no-cuda-graphs`, ...) for `python -m minicb
  generate`, `demo`, `bench` and `serve`, with the help text written here.

So a field added here is a setting of the API and of every command, with no
other edit. Only dataclasses is imported: `--help` reads this module, and must
not wait for torch to load.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    # Each field's metadata["help"] is its explanation: `python -m minicb serve --help`
    # prints it, and LLM's docstring points here. The annotations are strings (see the
    # __future__ import); minicb/cli_args.py turns each into a flag's type.

    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV blocks in the pool; none: as many as the memory budget holds (gpu_memory_fraction, "
                "cpu_kv_gib), but never more than every slot at full context could use"})
    max_num_seqs: int = field(default=32, metadata={"help": "slots: sequences decoding together"})
    max_num_batched_tokens: int = field(default=4096, metadata={
        "help": "new tokens a step computes at most; caps how much prefill joins a step"})
    attention: str = field(default="torch", metadata={
        "help": "attention kernels: torch (chapter 04) or triton (chapter 05)", "choices": ["torch", "triton"]})
    watermark: float = field(default=0.01, metadata={
        "help": "fraction of the KV blocks kept free at admission, so running requests can grow "
                "without being preempted at once"})
    gpu_memory_fraction: float = field(default=0.5, metadata={
        "help": "KV budget on CUDA when num_blocks is none: this fraction of the free GPU memory"})
    cpu_kv_gib: float = field(default=1.0, metadata={
        "help": "KV budget on a CPU when num_blocks is none, in GiB"})
    keep_traces: int | None = field(default=0, metadata={
        "help": "StepTraces to keep in Engine.traces: 0 records none (a long-running server needs none), "
                "N keeps the last N steps, none keeps every step"})
    enable_prefix_caching: bool = field(default=False, metadata={
        "help": "keep computed full blocks under a key of their prefix and share them with later requests "
                "that start the same way (minicb/prefix_cache.py); greedy outputs are the same either way, "
                "and chapter 07's text says why it is off by default"})
    enable_chunked_prefill: bool = field(default=False, metadata={
        "help": "cut prompts into chunks that fill what the running requests' decodes leave of "
                "max_num_batched_tokens, so no step computes more than that (minicb/chunked_prefill.py, "
                "chapter 08); off, chapter 06's scheduler admits each prompt whole"})
    cuda_graphs: bool | None = field(default=None, metadata={
        "help": "replay decode-only steps from CUDA graphs, one per batch-size bucket (minicb/cuda_graphs.py, "
                "chapter 10); none (neither flag): on for CUDA with attention triton, off otherwise. On a CPU, "
                "which has no graphs, on runs the same runner eagerly, through its static buffers and bucket "
                "padding"})
    speculative_ngram: int | None = field(default=None, metadata={
        "help": "speculative decoding by prompt lookup (minicb/speculative.py, chapter 11): a decoding request "
                "whose last N tokens appeared earlier in its context proposes the (up to) "
                "num_speculative_tokens tokens that followed, and one forward verifies them; none: off. Greedy "
                "outputs are the same either way; sampled ones keep their distribution"})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "speculative decoding: draft tokens proposed and verified per step at most"})
