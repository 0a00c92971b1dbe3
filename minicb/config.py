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

It also checks itself, in one place: `validate()` holds every bound of every
field and the rules between fields (a speculating request computes 1 + k
tokens, so k must fit the token budget). It runs when a config is made and
again when an engine is built from it; `LLM`, `serve`, `bench` and `demo` ask
nothing else (`minicb.cli_args.check_engine_args` turns its error into a
flag's error before any model loads).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


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
    cpu_decode: str = field(default="compiled", metadata={
        "help": "how attention=torch decodes on a CPU in fp32: compiled (minicb/cpu_attention.py, Numba, reading "
                "the blocks in place; chapter 04's gather when Numba is missing) or gather (chapter 04's code as a "
                "GPU runs it)", "choices": ["compiled", "gather"]})
    cpu_ops: str = field(default="compiled", metadata={
        "help": "a CPU float32 model's RMSNorms, rotary embeddings and SwiGLU: compiled (minicb/cpu_ops.py, "
                "Numba, one pass each instead of two to ten PyTorch operators) or torch (chapter 00's code); a GPU, "
                "another dtype or a machine without Numba runs torch's", "choices": ["compiled", "torch"]})
    linear_backend: str = field(default="auto", metadata={
        "help": "the CPU's matmul library for oneDNN-packed linear layers (minicb/linear_backend.py): auto times "
                "MKL and oneDNN on the model's shapes at 1, 4 and max_num_seqs rows when the engine is built and "
                "keeps, per shape, MKL below the row count where oneDNN gets faster; mkl or onednn forces one. A "
                "model without packed layers (a GPU, load_model(packed=False)) runs MKL's or the GPU's",
        "choices": ["auto", "mkl", "onednn"]})
    cpu_threads: str = field(default="share", metadata={
        "help": "on a CPU: share (the forward runs on the cores other programs leave free, measured once a "
                "second: all of them on an idle machine, where OpenMP's threads spin between operators, fewer "
                "beside busy programs, so no spinning thread takes a core they need; never more than --threads, where "
                "a command has it and it was given; minicb/cpu_threads.py) or fixed (torch's thread count as it is)",
        "choices": ["share", "fixed"]})
    tile_prefill: bool | None = field(default=None, metadata={
        "help": "attention=triton: prefill with the query-tile kernel (minicb/tile_attention.py) instead of chapter "
                "05's; none (neither flag): when the kernels are compiled (under the Triton interpreter chapter "
                "04's PyTorch prefill is far quicker, and off leaves it so)"})
    watermark: float = field(default=0.01, metadata={
        "help": "fraction of the KV blocks kept free at admission, so running requests can grow "
                "without being preempted at once"})
    gpu_memory_fraction: float = field(default=0.5, metadata={
        "help": "KV budget on CUDA when num_blocks is none: this fraction of the free GPU memory"})
    cpu_kv_gib: float = field(default=1.0, metadata={
        "help": "KV budget on a CPU when num_blocks is none, in GiB"})
    keep_traces: int | None = field(default=0, metadata={
        "help": "StepTraces to keep in Engine.traces: 0 keeps none (a step then builds one only for a caller "
                "that asks, Engine.step(trace=True): LLM's pictures, the server's open dashboards), N keeps the "
                "last N steps, none keeps every step"})
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
    structured_backend: str = field(default="minicb", metadata={
        "help": "what compiles a request's structured output (a JSON schema, regex, choice or json_object) "
                "into the token mask its rows are sampled under (chapter 12, minicb/structured/): minicb (the "
                "DFA the chapter builds) or xgrammar (the xgrammar package, when installed)",
        "choices": ["minicb", "xgrammar"]})
    jump_forward: bool = field(default=False, metadata={
        "help": "structured output: where the grammar allows only one continuation (a fixed key, a closing "
                "brace), give its tokens to chapter 11's verifier as drafts, so one forward checks them all; "
                "the tokens are the same either way"})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that is out of bounds, its value and what is allowed.

        Every rule about the settings is here, so nothing downstream restates one:
        the scheduler, the speculator and the commands trust a config that passed.
        Fields may be changed after construction, so the engine calls this again.
        """
        def whole(name: str, value, low: int = 1, none_ok: bool = False) -> None:
            if value is None and none_ok:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                also = " or None" if none_ok else ""
                raise ValueError(f"{name}={value!r}; it must be an integer >= {low}{also}")

        whole("block_size", self.block_size)
        whole("num_blocks", self.num_blocks, none_ok=True)
        whole("max_num_seqs", self.max_num_seqs)
        whole("max_num_batched_tokens", self.max_num_batched_tokens)
        whole("keep_traces", self.keep_traces, low=0, none_ok=True)
        whole("speculative_ngram", self.speculative_ngram, none_ok=True)
        whole("num_speculative_tokens", self.num_speculative_tokens)
        for name in ("attention", "cpu_decode", "cpu_ops", "linear_backend", "cpu_threads", "structured_backend"):
            allowed = next(f for f in fields(self) if f.name == name).metadata["choices"]
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}; it must be True or False")
        for name in ("cuda_graphs", "tile_prefill"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name}={getattr(self, name)!r}; use None (the engine decides), True or False")
        if self.tile_prefill and self.attention != "triton":
            raise ValueError(f"tile_prefill=True needs attention='triton' (the query-tile kernel is a Triton "
                             f"kernel); attention={self.attention!r}")
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark={self.watermark!r}; it must be a fraction in [0, 1)")
        if not (isinstance(self.gpu_memory_fraction, (int, float)) and 0 < self.gpu_memory_fraction <= 1):
            raise ValueError(f"gpu_memory_fraction={self.gpu_memory_fraction!r}; it must be in (0, 1]")
        if not (isinstance(self.cpu_kv_gib, (int, float)) and self.cpu_kv_gib > 0):
            raise ValueError(f"cpu_kv_gib={self.cpu_kv_gib!r}; it must be > 0")
        # A request verifying k drafts computes its newest token and the k drafts in one step.
        if ((self.speculative_ngram is not None or self.jump_forward)
                and 1 + self.num_speculative_tokens > self.max_num_batched_tokens):
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: a request verifying them "
                             f"computes {1 + self.num_speculative_tokens} tokens in a step, more than "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}; lower it or raise the budget")
