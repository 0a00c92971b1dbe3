"""The grader, graded: `python -m minicb check N` must fail planted bugs.

A chapter's tests are only as good as the bugs they catch. Each mutant below is
the reference module with one realistic mistake planted in one task's code,
the kind a class of students makes (a ref count forgotten, a queue overtaken,
a mask off by one). It is written out as an exercise file and graded with
`check N --file` exactly as a teacher would grade a submission. The grade must
fail, on a real test failure (not an import or collection error).

Every task of every chapter with an exercise has at least one mutant
(`test_every_task_has_a_mutant`), so a new chapter cannot ship tests that pass
anything. The mutants are plain text edits of the reference source: when the
reference changes so that an edit no longer applies, the test says which.
"""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass

import pytest

from minicb import check, impl

pytestmark = pytest.mark.slow  # one pytest run per mutant: a few minutes in all


@dataclass
class Mutant:
    chapter: int
    task: int
    bug: str  # what a student got wrong, in words
    target: str  # "function" or "Class.method" of the chapter's reference module
    edits: list[tuple[str, str]]  # (old, new) text replacements in the target's source
    extra: str = ""  # more source for the file, e.g. a given wrapper that must call the mutated function
    # Reference functions to define again in the mutant's file, unchanged, so that they
    # call the mutated function (a copied function still calls the reference's).
    recompile: tuple[str, ...] = ()


# The exercises' own wrapper, so the reference loop runs the mutated run_batch.
RUN_STATIC_WRAPPER = """
def run_static(model, prompts, params, batch_size=16, batch_runner=None):
    return _reference.run_static(model, prompts, params, batch_size, batch_runner=batch_runner or run_batch)
"""

# The exercise's given runner, so the engine's decode steps run the mutated functions.
DECODE_GRAPHS_SUBCLASS = """
class DecodeGraphs(_reference.DecodeGraphs):
    def buckets_up_to(self, max_num_seqs):
        return batch_buckets(max_num_seqs)

    def bucket_for(self, num_seqs):
        return smallest_bucket(self.buckets, num_seqs)

    def pad(self, token_ids, positions, slots, block_tables, bucket):
        return pad_decode_inputs(token_ids, positions, slots, block_tables, bucket, self.scratch_block,
                                 self.pool.block_size, self.max_blocks)
"""

# Chapter 11's given code, written again in the mutant's file so that it calls the mutated function.
SPECULATOR_GIVEN = ("verify", "Speculator")

MUTANTS = [
    # ---- chapter 01: naive generation
    Mutant(1, 1, "the no-cache loop samples from the first position's logits, not the last", "generate_no_cache",
           [("logits_at=last)", "logits_at=torch.zeros_like(last))")]),
    Mutant(1, 2, "the cache's causal mask lets each query see one future key", "ContiguousKVCache.__call__",
           [(".tril(diagonal=start)", ".tril(diagonal=start + 1)")]),
    Mutant(1, 3, "the cached loop feeds each decode at the wrong position", "generate_with_cache",
           [("positions = torch.tensor([[cache.seq_len]]", "positions = torch.tensor([[cache.seq_len + 1]]")]),
    # ---- chapter 02: static batching
    Mutant(2, 1, "left_pad marks the padding as real tokens", "left_pad",
           [("mask[row, P - len(p):] = True", "mask[row, :] = True")]),
    Mutant(2, 2, "the padded cache masks the generated columns too", "PaddedKVCache.__init__",
           [("torch.ones(B, max_len, dtype=torch.bool", "torch.zeros(B, max_len, dtype=torch.bool")]),
    Mutant(2, 3, "run_batch does not count the finished rows' wasted steps", "run_batch",
           [("stats.idle_slot_steps += B - sum(live)", "stats.idle_slot_steps += 0")], RUN_STATIC_WRAPPER),
    # ---- chapter 03: the block allocator
    # ---- chapter 04: paged attention in PyTorch
    Mutant(4, 1, "store_kv treats slot 0 as padding", "store_kv",
           [("keep = slot_mapping >= 0", "keep = slot_mapping > 0")]),
    Mutant(4, 2, "the gather reads only as many blocks as the shortest sequence needs",
           "paged_decode_attention_gather", [("int(context_lens.max())", "int(context_lens.min())")]),
    Mutant(4, 3, "the online softmax forgets to rescale the accumulator when the max grows",
           "paged_decode_attention_online", [("acc = acc * rescale[..., None] +", "acc = acc +")]),
    Mutant(4, 4, "the prefill's causal mask hides each query's own key", "paged_prefill_attention_unchecked",
           [("<= q_positions[:, None]", "< q_positions[:, None]")], recompile=("paged_prefill_attention",)),
    # ---- chapter 05: paged attention in Triton (host-side bugs: the kernels are shared)
    Mutant(5, 1, "store_kv launches one program too few", "store_kv_unchecked",
           [("_store_kv_kernel[(k.shape[0],)]", "_store_kv_kernel[(k.shape[0] - 1,)]")], recompile=("store_kv",)),
    Mutant(5, 2, "the decode wrapper drops the 1/sqrt(head_dim) scale", "paged_decode_attention",
           [("context_lens, scale)", "context_lens, 1.0)")]),
    Mutant(5, 3, "split-K leaves out each sequence's newest token", "paged_decode_attention_split_k",
           [("context_lens, scale, num_splits)", "context_lens - 1, scale, num_splits)")]),
    Mutant(5, 4, "prefill rows see one token too few (not themselves)", "paged_prefill_attention_unchecked",
           [("(ends - 1 - rows)", "(ends - rows)")], recompile=("paged_prefill_attention",)),
    Mutant(3, 1, "a failed allocate leaves the sequence registered", "BlockAllocator.allocate",
           [("    needed = self.blocks_needed(num_tokens)\n",
             "    needed = self.blocks_needed(num_tokens)\n    self._block_tables[seq_id] = []\n")]),
    Mutant(3, 2, "append takes a block but forgets to count the new token", "BlockAllocator.append",
           [("self._num_tokens[seq_id] = num_tokens + 1", "self._num_tokens[seq_id] = num_tokens")]),
    Mutant(3, 3, "append writes into a shared last block instead of copying it", "BlockAllocator.append",
           [("elif self._ref_counts[table[-1]] > 1:", "elif False:")]),
    Mutant(3, 3, "fork forgets to count the child's reference to each block", "BlockAllocator.fork",
           [("self._ref_counts[block] += 1", "pass")]),
    Mutant(3, 4, "slot_mapping is off by one inside each block", "BlockAllocator.slot_mapping",
           [("table[position // size] * size + position % size", "table[position // size] * size + (position + 1) % size")]),
    Mutant(3, 5, "paged memory rounds the last block down, not up", "memory_waste",
           [("math.ceil(length / block_size)", "(length // block_size)")]),
    # ---- chapter 06: the scheduler
    Mutant(6, 1, "admit allocates the prompt only, not prompt + outputs, when a preempted request returns",
           "Scheduler.admit",
           [("self.allocator.allocate_prefix(seq.request_id, seq.token_ids)",
             "self.allocator.allocate_prefix(seq.request_id, seq.prompt_token_ids)")]),
    Mutant(6, 1, "later requests overtake the head of the queue when it does not fit", "Scheduler.admit",
           [("    while self.waiting and not out.preempted:\n"
             "        seq = self.waiting[0]\n",
             "    for seq in list(self.waiting):\n"
             "        if out.preempted:\n"
             "            break\n"),
            ("            break  # FIFO: nobody overtakes the head of the queue\n        self.waiting.popleft()",
             "            continue\n        self.waiting.remove(seq)")]),
    Mutant(6, 1, "admission ignores the watermark", "Scheduler.admit",
           [("reserve = self.watermark_blocks if self.running else 0", "reserve = 0")]),
    Mutant(6, 1, "admission counts the running sequences but not the slots promised to their siblings",
           "Scheduler.admit", [("self.slots_promised() + 1", "len(self.running) + 1")]),
    Mutant(6, 1, "admission never counts the step as empty, so a prompt longer than the budget never runs",
           "Scheduler.admit", [("budget, out.is_empty)", "budget, False)")]),
    Mutant(6, 2, "postprocess never finishes a sequence whose context is full", "Scheduler.postprocess",
           [("completion.num_tokens, self.max_model_len)", "completion.num_tokens, 10**9)")]),
    Mutant(6, 2, "postprocess forgets the EOS tokens", "Scheduler.postprocess",
           [("self.eos_token_ids, completion.num_tokens", "[], completion.num_tokens")]),
    Mutant(6, 3, "grow preempts the oldest running request, not the newest",
           "Scheduler.grow", [("victim = self.running[-1]", "victim = self.running[0]")]),
    Mutant(6, 3, "schedule_running does not charge the running requests' tokens to the budget",
           "Scheduler.schedule_running", [("budget -= num_new", "budget -= 0")]),
    # ---- chapter 07: prefix caching
    Mutant(7, 1, "block keys hash each block alone, not chained to the parent's key", "block_keys",
           [("parent = hash((parent, tuple(", "parent = hash((None, tuple(")]),
    Mutant(7, 1, "cache_full_blocks lets a second block take over a key that is served",
           "CachingBlockAllocator.cache_full_blocks",
           [("if block in self._key_of_block or key in self._block_of_key:", "if block in self._key_of_block:")]),
    Mutant(7, 2, "the lookup shares a full last block, leaving no token to compute", "CachingBlockAllocator.cached_prefix",
           [("max(0, len(token_ids) - 1) // self.block_size", "len(token_ids) // self.block_size")]),
    Mutant(7, 2, "allocate_prefix leaves its evictable hits in the LRU queue", "CachingBlockAllocator.allocate_prefix",
           [("del self._evictable[block]", "pass")]),
    Mutant(7, 3, "evict takes the most recently freed block", "CachingBlockAllocator.evict",
           [("self._evictable.popitem(last=False)", "self._evictable.popitem(last=True)")]),
    # (free drops each block through _drop, which truncate, chapter 11, shares: the bug sits there.)
    Mutant(7, 3, "free sends cached blocks to the plain free list, losing the cache", "CachingBlockAllocator._drop",
           [("if key is None:", "if True:")]),
    Mutant(7, 4, "append writes into a shared partial block instead of copying it", "CachingBlockAllocator.append",
           [("elif self._ref_counts[table[-1]] > 1:", "elif False:")]),
    # ---- chapter 08: chunked prefill
    Mutant(8, 1, "chunk_size ignores the budget", "chunk_size", [("min(num_remaining, budget)", "num_remaining")],
           recompile=("ChunkedScheduler",)),
    Mutant(8, 1, "the rule keeps chapter 06's exception: in an empty step a prompt runs whole, over the budget",
           "ChunkedScheduler.tokens_to_compute",
           [("return chunk_size(num_remaining, budget)",
             "return num_remaining if step_is_empty else chunk_size(num_remaining, budget)")]),
    Mutant(8, 2, "the chunk's mask forgets the offset: new token r sees keys up to r", "offset_causal_mask",
           [("torch.arange(context_len - q_len, context_len,", "torch.arange(0, q_len,")]),
    Mutant(8, 3, "the Triton wrapper tells the kernel one key fewer", "chunk_attention_triton",
           [("torch.tensor([context_len], **int32)", "torch.tensor([context_len - 1], **int32)")]),
    # ---- chapter 09: the server's engine thread (one per task: each costs ~15 s of the suite)
    Mutant(9, 1, "a request leaves owners when its first completion finishes, so its other completions' "
           "tokens are dropped", "group_step",
           [("handle = owners.get(seq.owner_id)", "handle = owners.pop(seq.owner_id, None)"),
            ("del owners[seq.owner_id]", "pass")]),
    Mutant(9, 2, "take_commands stops after one queued command, so an abort waits steps behind the others",
           "take_commands", [("commands.append(inbox.get_nowait())", "return commands + [inbox.get_nowait()]")]),
    Mutant(9, 2, "an abort of completion 0 is read as an abort of the whole request (0 is falsy)",
           "apply_commands", [("engine.abort(rid, completion)", "engine.abort(rid, completion or None)"),
                              ("if completion is None or", "if not completion or")]),
    # ---- chapter 10: the GPU step
    Mutant(10, 1, "the buckets leave out max_num_seqs when it is not a multiple of 8", "batch_buckets",
           [("sizes.add(max_num_seqs)", "pass")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "padding rows write their K/V into slot 0, a real sequence's block", "pad_decode_inputs",
           [("scratch_slot = scratch_block * block_size", "scratch_slot = 0")], DECODE_GRAPHS_SUBCLASS),
    # ---- chapter 11: speculative decoding (verify and Speculator written again, so the engine calls the bug)
    Mutant(11, 1, "prompt lookup takes the earliest match of the last n tokens, not the latest", "propose_ngram",
           [("range(len(token_ids) - n - 1, -1, -1)", "range(len(token_ids) - n)")],
           recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "the residual step samples from p instead of max(0, p - q)", "rejection_sample",
           [("residual = (p - q).clamp(min=0)", "residual = p")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "greedy verification keeps checking drafts after the first mismatch", "accept_greedy",
           [("            break\n", "            continue\n")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "rejection sampling draws the bonus token from the first row, not the last", "rejection_sample",
           [("target_probs[len(draft_token_ids)]", "target_probs[0]")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 3, "rollback steps the computed count back but keeps the rejected drafts' slots and blocks",
           "rollback", [("allocator.truncate(seq.request_id, seq.num_computed_tokens - num_rejected)", "pass")],
           recompile=SPECULATOR_GIVEN),
]


def mutant_source(mutant: Mutant) -> str:
    """An exercise file: the reference module's names, with the target redefined with the bug."""
    module = impl.module_for_chapter(mutant.chapter)
    reference = __import__(f"minicb.{module}", fromlist=["_"])
    owner, _, method = mutant.target.rpartition(".")
    code = getattr(getattr(reference, owner), method) if owner else getattr(reference, mutant.target)
    source = textwrap.dedent(inspect.getsource(code))
    for old, new in mutant.edits:
        assert old in source, (f"chapter {mutant.chapter} mutant '{mutant.bug}': the reference's "
                               f"{mutant.target} no longer contains {old!r}; update the mutant")
        source = source.replace(old, new, 1)
    # The reference's own source is compiled as its module compiles it: annotations postponed (every
    # chapter module has the __future__ import), so a name imported only for type checking, such as
    # chapter 11's BlockAllocator, does not break the definition.
    lines = ["from __future__ import annotations", "", f"import minicb.{module} as _reference",
             "globals().update({k: v for k, v in vars(_reference).items() if not k.startswith('__')})", ""]
    if owner:
        lines += [f"class {owner}(_reference.{owner}):", textwrap.indent(source, "    ")]
    else:
        lines += [source]
    lines += [textwrap.dedent(inspect.getsource(getattr(reference, name))) for name in mutant.recompile]
    return "\n".join(lines) + "\n" + mutant.extra


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"ch{m.chapter}-task{m.task}-{m.bug[:40]}")
def test_check_fails_the_mutant(mutant, tmp_path):
    path = tmp_path / f"mutant_ch{mutant.chapter}.py"
    path.write_text(mutant_source(mutant))
    # A file that does not run fails every test too, which would prove nothing: it must load here first.
    try:
        impl.load_file(path, f"minicb_mutant_ch{mutant.chapter}", reload=True)
    except Exception as error:
        pytest.fail(f"the mutant file does not even run, so a failed grade proves nothing: {error!r}")
    # Only the mutated task's tests and the integration row, and -x: the first failure is
    # enough (and hypothesis' 10,000 cases would take a minute).
    report = check.run_tests(mutant.chapter, path, ["-m", "not slow", "-x", "-k", "not hypothesis"],
                             tasks=[mutant.task, "all"])
    assert not report.errors, f"the mutant did not even load, so this proves nothing: {report.errors}"
    failed = [r for r in report.results if r.outcome == "failed"]
    assert failed, (f"check {mutant.chapter} passed a submission whose task {mutant.task} has a bug: "
                    f"{mutant.bug} ({len(report.results)} tests ran)")


def test_the_unmutated_reference_passes(tmp_path):
    # The control: the same file-writing with no edit must pass, or the catches above prove nothing.
    path = tmp_path / "reference_ch6.py"
    path.write_text(mutant_source(Mutant(6, 1, "none", "Scheduler.admit", [])))
    report = check.run_tests(6, path, ["-m", "not slow"])
    assert report.passed, (f"the reference, written out as an exercise file, should pass check 6: "
                           f"{[(r.nodeid, r.message) for r in report.results if r.outcome == 'failed']} "
                           f"{report.errors}")


def test_every_task_has_a_mutant():
    for module, (chapter, _) in impl.CHAPTERS.items():
        text = impl.exercise_path(module).read_text()
        tasks = {int(t) for t in __import__("re").findall(rf"Chapter {chapter}, task (\d+)", text)}
        covered = {m.task for m in MUTANTS if m.chapter == chapter}
        assert tasks <= covered, f"chapter {chapter}: tasks {sorted(tasks - covered)} have no mutant in MUTANTS"
