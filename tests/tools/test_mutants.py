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

import ast
import inspect
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from minicb import check, impl, tasks
from minicb.block_allocator import BlockAllocator
from tool_support import runs_whole_files, sleeping_children
from mutant_support import (ADMIT_IMPORTS, DECODE_GRAPHS_SUBCLASS, GRAMMAR_GIVEN,  # noqa: F401
                            RUN_STATIC_WRAPPER, SPECULATOR_GIVEN, STUDENT_CHUNK_KERNEL, Mutant)

pytestmark = pytest.mark.slow  # one pytest run per mutant: a few minutes in all


# Prompt lookup written over text: the ids joined by spaces, the last n searched for as a string.
# With ids of one digit it agrees with the token-level lookup; with more, "1 2" sits inside "21 2".
TEXT_LOOKUP = """
def propose_ngram(token_ids, n, k):
    if len(token_ids) <= n:
        return []
    text = " ".join(str(t) for t in token_ids)
    tail = " ".join(str(t) for t in token_ids[-n:])
    at = text.rfind(tail, 0, len(text) - 2)  # an occurrence that starts before the tail itself
    if at < 0:
        return []
    after = text[:at + len(tail)].count(" ") + 1  # the index of the token after the match
    return token_ids[after:after + k]
"""

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
           [("self.allocator.allocate_prefix(seq.seq_id, seq.token_ids)",
             "self.allocator.allocate_prefix(seq.seq_id, seq.prompt_token_ids)")]),
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
    # The reference's append is chapter 03's (its blocks come from the cache's _take): a student writes it out.
    Mutant(7, 4, "append writes into a shared partial block instead of copying it", "CachingBlockAllocator.append",
           [("elif self._ref_counts[table[-1]] > 1:", "elif False:")],
           source=textwrap.dedent(inspect.getsource(BlockAllocator.append))),
    Mutant(7, 2, "the lookup steps over a missing block and keeps counting later hits, so the hit has a hole",
           "CachingBlockAllocator.cached_prefix", [("break  # a prefix tree", "continue  # a prefix tree")]),
    Mutant(7, 1, "block_keys leaves out a last block that is exactly full", "block_keys",
           [("len(token_ids) - block_size + 1", "len(token_ids) - block_size")]),
    Mutant(7, 1, "cache_full_blocks gives a key to the block of a prompt's tokens not yet computed",
           "CachingBlockAllocator.cache_full_blocks",
           [("if len(token_ids) > num_tokens:", "if False:")]),
    Mutant(7, 2, "allocate_prefix shares the cached hits without counting the new holder",
           "CachingBlockAllocator.allocate_prefix", [("self._ref_counts[block] += 1", "pass")]),
    Mutant(7, 2, "allocate_prefix takes its fresh blocks before reviving its hits, so it may evict one of them",
           "CachingBlockAllocator.allocate_prefix",
           [("    for block in revived:\n        del self._evictable[block]\n",
             "    fresh = self._take(num_fresh, f\"allocating sequence {seq_id!r}\")\n"
             "    for block in revived:\n        self._evictable.pop(block, None)\n"),
            ("table = hits + self._take(num_fresh, f\"allocating sequence {seq_id!r}\")", "table = hits + fresh")]),
    Mutant(7, 3, "evict hands the block out but leaves its key in the lookup", "CachingBlockAllocator.evict",
           [("del self._block_of_key[key], self._key_of_block[block]", "del self._key_of_block[block]")]),
    Mutant(7, 3, "a freed block with a key is evictable but also goes on the plain free list",
           "CachingBlockAllocator._drop", [("if key is None:", "self._free.append(block)\n        if key is None:")]),
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
    Mutant(8, 3, "the chunk kernel stops one key short on a full tile of new tokens", "chunk_attention_triton",
           [("tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)", "tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len)")],
           source=STUDENT_CHUNK_KERNEL),
    Mutant(8, 1, "a request admitted again after preemption resumes from the cached count of its first admission",
           "ChunkedScheduler.admit", [("RequestStatus.RUNNING, cached", "RequestStatus.RUNNING, seq.num_cached_tokens")],
           ADMIT_IMPORTS),
    Mutant(8, 1, "every admission computes its cached prefix again (right tokens, wasted work)",
           "ChunkedScheduler.admit", [("RequestStatus.RUNNING, cached", "RequestStatus.RUNNING, 0")], ADMIT_IMPORTS),
    Mutant(8, 1, "chunk_size lets a chunk run one token over the budget", "chunk_size",
           [("min(num_remaining, budget)", "min(num_remaining, budget + 1)")], recompile=("ChunkedScheduler",)),
    Mutant(8, 2, "the offset mask hides each new token's own key", "offset_causal_mask",
           [("keys[None, :] <= positions[:, None]", "keys[None, :] < positions[:, None]")]),
    Mutant(8, 2, "chunk_attention pairs query head h with KV head h % n_kv_heads", "chunk_attention",
           [("k.repeat_interleave(group, dim=1)", "k.repeat(1, group, 1)"),
            ("v.repeat_interleave(group, dim=1)", "v.repeat(1, group, 1)")]),
    Mutant(8, 3, "the chunk kernel's causal mask forgets the chunk's offset: new token r sees keys up to r",
           "chunk_attention_triton", [("positions = context_len - q_len + rows", "positions = rows")],
           source=STUDENT_CHUNK_KERNEL),
    Mutant(8, 2, "chunk_attention ignores a scale it is given", "chunk_attention",
           [("scale = 1.0 / math.sqrt(head_dim) if scale is None else scale", "scale = 1.0 / math.sqrt(head_dim)")]),
    Mutant(8, 2, "chunk_attention's default scale is 1/head_dim", "chunk_attention",
           [("1.0 / math.sqrt(head_dim) if scale is None", "1.0 / head_dim if scale is None")]),
    # ---- chapter 09: the server's engine thread (one per task: each costs ~15 s of the suite)
    Mutant(9, 1, "a request leaves owners when its first completion finishes, so its other completions' "
           "tokens are dropped", "group_step",
           [("handle = owners.get(seq.request_id)", "handle = owners.pop(seq.request_id, None)"),
            ("del owners[seq.request_id]", "pass")]),
    Mutant(9, 2, "take_commands stops after one queued command, so an abort waits steps behind the others",
           "take_commands", [("commands.append(inbox.get_nowait())", "return commands + [inbox.get_nowait()]")]),
    Mutant(9, 2, "an abort of completion 0 is read as an abort of the whole request (0 is falsy)",
           "apply_commands", [("engine.abort(rid, completion)", "engine.abort(rid, completion or None)"),
                              ("if completion is None or", "if not completion or")]),
    Mutant(9, 1, "group_step sends every token to completion 0", "group_step",
           [(".append(Token(t.completion, t.token))", ".append(Token(0, t.token))")]),
    Mutant(9, 1, "group_step does not record a finished completion as ended, so its request never leaves",
           "group_step", [("        handle.ended.add(seq.completion)\n", "")]),
    Mutant(9, 2, "a refused add stops the other commands of the batch", "apply_commands",
           [("                continue\n            handle.request_id = rid", "                break\n"
             "            handle.request_id = rid")]),
    Mutant(9, 2, "an abort of one completion of n removes the whole request from owners", "apply_commands",
           [("if completion is None or len(handle.ended) == handle.params.n:", "if True:")]),
    Mutant(9, 2, "an abort of a request that has already ended is not skipped", "apply_commands",
           [("            if rid not in owners:\n                continue", "            if False:\n                continue")]),
    # ---- chapter 10: the GPU step
    Mutant(10, 1, "the buckets leave out max_num_seqs when it is not a multiple of 8", "batch_buckets",
           [("sizes.add(max_num_seqs)", "pass")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "padding rows write their K/V into slot 0, a real sequence's block", "pad_decode_inputs",
           [("scratch_slot = scratch_block * block_size", "scratch_slot = 0")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "padding a step writes the scratch block into the caller's own block tables", "pad_decode_inputs",
           [("tables[:n, :longest] = torch.tensor([t + [scratch_block] * (longest - len(t)) for t in block_tables],",
             "for t in block_tables:\n        t += [scratch_block] * (longest - len(t))\n"
             "    tables[:n, :longest] = torch.tensor(block_tables,")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 1, "smallest_bucket picks the largest bucket that holds the rows", "smallest_bucket",
           [("next((b for b in buckets if b >= num_seqs), None)",
             "next((b for b in reversed(buckets) if b >= num_seqs), None)")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 1, "batch_buckets keeps 1, 2, 4 and 8 even past max_num_seqs", "batch_buckets",
           [("if b < max_num_seqs}", "}")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "a real row's context length is its position, one token short", "pad_decode_inputs",
           [("[p + 1 for p in positions]", "list(positions)")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "padding rows write their K/V to the scratch block's last slot, past a block", "pad_decode_inputs",
           [("scratch_slot = scratch_block * block_size", "scratch_slot = (scratch_block + 1) * block_size")],
           DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "a real row's table is padded with block 0, not the scratch block", "pad_decode_inputs",
           [("t + [scratch_block] * (longest - len(t))", "t + [0] * (longest - len(t))")], DECODE_GRAPHS_SUBCLASS),
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
           "rollback", [("allocator.truncate(seq.seq_id, seq.num_computed_tokens - num_rejected)", "pass")],
           recompile=SPECULATOR_GIVEN),
    Mutant(11, 1, "prompt lookup ignores k and proposes the whole continuation", "propose_ngram",
           [("token_ids[start + n:start + n + k]", "token_ids[start + n:]")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 1, "prompt lookup lets the last n tokens match themselves, so it never proposes", "propose_ngram",
           [("range(len(token_ids) - n - 1, -1, -1)", "range(len(token_ids) - n, -1, -1)")],
           recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "greedy verification compares each draft with the next position's choice", "accept_greedy",
           [("if draft != argmax[i]:", "if draft != argmax[i + 1] if i + 1 < len(argmax) else True:")],
           recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "rejection sampling accepts with probability q(x) / p(x)", "rejection_sample",
           [("if u * q[x] < p[x]:", "if u * p[x] < q[x]:")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "after a rejection the loop goes on to the next draft", "rejection_sample",
           [("        return tokens\n", "        continue\n")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 3, "rollback frees the rejected drafts' slots and one more", "rollback",
           [("seq.num_computed_tokens - num_rejected)", "seq.num_computed_tokens - num_rejected - 1)")],
           recompile=SPECULATOR_GIVEN),
    Mutant(11, 3, "rollback steps the computed count back but truncates the slots to the old count", "rollback",
           [("seq.num_computed_tokens - num_rejected)", "seq.num_computed_tokens)")], recompile=SPECULATOR_GIVEN),
    # Two slips found by hand, each passed by the grader before a test was written for its kind.
    Mutant(11, 1, "prompt lookup matches the token ids' joined text, so '1 2' is found inside '21 2'",
           "propose_ngram", [], source=TEXT_LOOKUP, recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "rejection sampling draws one uniform for all of a step's drafts", "rejection_sample",
           [("        u = torch.rand((), generator=generator, device=p.device)\n", ""),
            ("    tokens = []\n", "    tokens = []\n    u = torch.rand((), generator=generator)  # one for all\n")],
           recompile=SPECULATOR_GIVEN),
    # ---- chapter 12: structured output (the exercise's given Grammar written again, so the engine calls the bug)
    Mutant(12, 1, "the trie walk does not skip a dead prefix's subtree, so its tokens step on from a sibling's "
           "state: a token whose walk dies midway is allowed", "allowed_tokens_trie",
           [("i = subtree_end[i]  # prune", "i += 1  # prune")], GRAMMAR_GIVEN),
    Mutant(12, 1, "EOS is allowed in every state, not only where the text is a whole match", "allowed_tokens_trie",
           [("allowed[vocab.eos_token_ids] = bool(dfa.accepting[state])", "allowed[vocab.eos_token_ids] = True")],
           GRAMMAR_GIVEN),
    Mutant(12, 2, "the mask picks the most likely allowed token instead of masking (constrains after the choice): "
           "right for greedy, wrong for sampling", "mask_logits",
           [('    return logits.masked_fill(~allowed, float("-inf"))',
             '    best = logits.masked_fill(~allowed, float("-inf")).argmax(-1, keepdim=True)\n'
             '    return torch.full_like(logits, float("-inf")).scatter(-1, best, 0.0)')], GRAMMAR_GIVEN),
    Mutant(12, 2, "the mask multiplies the probabilities and hands them on as logits: nothing is renormalised, "
           "and forbidden tokens keep weight", "mask_logits",
           [('    return logits.masked_fill(~allowed, float("-inf"))', "    return logits.softmax(-1) * allowed")],
           GRAMMAR_GIVEN),
    Mutant(12, 3, "next_state remembers where a token leads by the token alone, whatever state it came from",
           "Grammar.next_state", [("key = (state, token_id)", "key = token_id")], GRAMMAR_GIVEN),
    Mutant(12, 4, "rollback slices from the end, so rollback(0) forgets every token (del states[-0:])",
           "Matcher.rollback", [("del self.states[len(self.states) - num_tokens:]", "del self.states[-num_tokens:]"),
                                ("del self.token_ids[len(self.token_ids) - num_tokens:]",
                                 "del self.token_ids[-num_tokens:]")], GRAMMAR_GIVEN),
    Mutant(12, 4, "fork shares its parent's lists of states and tokens", "Matcher.fork",
           [("list(self.states), list(self.token_ids)", "self.states, self.token_ids")], GRAMMAR_GIVEN),
]


# Later kinds, in files of their own (each a list of Mutant): chapters 01-05, 06-11 and 12.
from mutants_ch01_05 import MUTANTS as EARLY_CHAPTERS  # noqa: E402
from mutants_ch06_11 import MUTANTS as LATE_CHAPTERS  # noqa: E402
from mutants_ch12 import MUTANTS as CHAPTER_12  # noqa: E402

# Each grade is a child pytest (2-30 s on two cores). `make test` grades the first mutant of each
# task above, so every task's tests still meet a planted bug in every run (40 grades: the file took
# 69 s alone on a Zen 5, where all 93 had taken 243 s of a worker). The others above and the later kinds run
# with MINICB_GRADER_CHECKS=all (`make grader-check`, ten minutes or so more), outside `make
# test`'s time budget; the tests they made necessary run in every chapter's grade.
LATER_KINDS = EARLY_CHAPTERS + LATE_CHAPTERS + CHAPTER_12


def first_of_each_task(mutants: list[Mutant]) -> list[Mutant]:
    """The first mutant listed for each (chapter, task), in the list's order."""
    seen: set[tuple[int, int]] = set()
    firsts = []
    for mutant in mutants:
        if (mutant.chapter, mutant.task) not in seen:
            seen.add((mutant.chapter, mutant.task))
            firsts.append(mutant)
    return firsts


if os.environ.get("MINICB_GRADER_CHECKS", "") == "all":
    MUTANTS += LATER_KINDS
else:
    MUTANTS = first_of_each_task(MUTANTS)


def code_of(source: str) -> str:
    """The code of `source` without its docstrings and comments, to compare two versions."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def mutant_source(mutant: Mutant) -> str:
    """An exercise file: the reference module's names, with the target redefined with the bug."""
    module = impl.module_for_chapter(mutant.chapter)
    reference = __import__(f"minicb.{module}", fromlist=["_"])
    owner, _, method = mutant.target.rpartition(".")
    if mutant.source:
        source = mutant.source
    else:
        code = getattr(getattr(reference, owner), method) if owner else getattr(reference, mutant.target)
        source = textwrap.dedent(inspect.getsource(code))
    original = source
    for old, new in mutant.edits:
        assert old in source, (f"chapter {mutant.chapter} mutant '{mutant.bug}': the reference's "
                               f"{mutant.target} no longer contains {old!r}; update the mutant")
        source = source.replace(old, new, 1)
    assert not mutant.edits or code_of(source) != code_of(original), (
        f"chapter {mutant.chapter} mutant '{mutant.bug}': the edits change only a docstring or a comment")
    # The reference's own source is compiled as its module compiles it: annotations postponed (every
    # chapter module has the __future__ import), so a name imported only for type checking, such as
    # chapter 11's BlockAllocator, does not break the definition.
    lines = ["from __future__ import annotations", "", "import inspect", f"import minicb.{module} as _reference",
             "globals().update({k: v for k, v in vars(_reference).items() if not k.startswith('__')})", ""]
    # A submission defines every task's functions (the grader fails a task whose function the file
    # lacks, minicb/tasks.py), so the reference's own, unchanged, stand beside the mutated one, bound
    # by name (`admit = _reference.Scheduler.admit`): the grader reads an assignment as a definition,
    # and a function that calls super() keeps its own class. The mutant must be caught by a test of
    # what it does, not by a missing name.
    given: dict[str, list[str]] = {}
    for names in tasks.task_functions(mutant.chapter).values():
        for qualname in names:
            cls, _, function = qualname.rpartition(".")
            if qualname != mutant.target and function not in mutant.recompile:
                given.setdefault(cls, []).append(function)
    lines += [f"{function} = _reference.{function}" for function in given.pop("", [])]
    for cls in sorted(set(given) | ({owner} if owner else set())):
        body = [f"{function} = inspect.getattr_static(_reference.{cls}, {function!r})"
                for function in given.get(cls, [])]
        body += [source] if cls == owner else []
        lines += [f"class {cls}(_reference.{cls}):", textwrap.indent("\n".join(body), "    ")]
    if not owner:
        lines += [source]
    lines += [textwrap.dedent(inspect.getsource(getattr(reference, name))) for name in mutant.recompile]
    return "\n".join(lines) + "\n" + mutant.extra


def mutant_id(mutant: Mutant) -> str:
    return f"ch{mutant.chapter}-task{mutant.task}-{mutant.bug[:40]}"


def grade(mutant: Mutant, folder) -> check.Report:
    """Write the mutant out as an exercise file and grade it as `check N --file` does."""
    path = folder / f"mutant_ch{mutant.chapter}_{abs(hash(mutant.bug))}.py"
    path.write_text(mutant_source(mutant))
    # A file that does not run fails every test too, which would prove nothing: it must load here first.
    try:
        impl.load_file(path, f"minicb_mutant_{path.stem}", reload=True)
    except Exception as error:
        raise AssertionError(f"the mutant file does not even run, so a failed grade proves nothing: {error!r}")
    # Only the mutated task's tests and the integration row, and -x: the first failure is
    # enough (and hypothesis' 10,000 cases would take a minute).
    # A time limit too: a mutant that makes the engine loop forever must fail this file, not hang it.
    return check.run_tests(mutant.chapter, path, ["-m", "not slow", "-x", "-k", "not hypothesis"],
                           tasks=[mutant.task, "all"], timeout=300)


@pytest.fixture(scope="module")
def grades(request, tmp_path_factory):
    """Every selected mutant's grade, two at a time: each is a child pytest that mostly waits on
    imports, so two share the machine's cores well and halve this file's time."""
    items = request.session.items if runs_whole_files(request.config) else []
    selected = [item.callspec.params["mutant"] for item in items
                if getattr(item, "callspec", None) and "mutant" in item.callspec.params]
    folder = tmp_path_factory.mktemp("mutants")
    with sleeping_children(), ThreadPoolExecutor(max_workers=2) as pool:  # two at once: see tool_support
        ahead = {id(m): pool.submit(grade, m, folder) for m in selected}
        yield lambda m: (ahead.get(id(m)) or pool.submit(grade, m, folder)).result()


@pytest.mark.parametrize("mutant", MUTANTS, ids=mutant_id)
def test_check_fails_the_mutant(mutant, grades):
    report = grades(mutant)
    assert not report.errors, f"the grade did not run to its end, so this proves nothing: {report.errors}"
    failed = [r for r in report.results if r.outcome == "failed"]
    assert failed, (f"check {mutant.chapter} passed a submission whose task {mutant.task} has a bug: "
                    f"{mutant.bug} ({len(report.results)} tests ran)")
    # A file that lacks a task function fails on the name alone (minicb/tasks.py): that proves nothing here.
    caught = [r for r in failed if "does not define" not in r.message]
    assert caught, f"only the grader's name check failed this mutant, no test of what it does: {failed[0].message}"


def test_the_unmutated_reference_passes(tmp_path):
    # The control: the same file-writing with no edit must pass, or the catches above prove nothing.
    path = tmp_path / "reference_ch6.py"
    path.write_text(mutant_source(Mutant(6, 1, "none", "Scheduler.admit", [])))
    report = check.run_tests(6, path, ["-m", "not slow"])
    assert report.passed, (f"the reference, written out as an exercise file, should pass check 6: "
                           f"{[(r.nodeid, r.message) for r in report.results if r.outcome == 'failed']} "
                           f"{report.errors}")


def test_the_unmutated_student_kernel_passes(tmp_path):
    # The control for the mutants of a student's own chunk kernel: as written, it passes task 3.
    report = grade(Mutant(8, 3, "none", "chunk_attention_triton", [], source=STUDENT_CHUNK_KERNEL), tmp_path)
    assert report.passed, (f"the student-style chunk kernel, unmutated, should pass check 8's task 3: "
                           f"{[(r.nodeid, r.message) for r in report.results if r.outcome == 'failed']} "
                           f"{report.errors}")


def test_the_unmutated_given_grammar_passes(tmp_path):
    # The control for chapter 12's mutants: the reference with the exercise's given Grammar passes check 12.
    report = grade(Mutant(12, 1, "none", "allowed_tokens_trie", [], GRAMMAR_GIVEN), tmp_path)
    assert report.passed, (f"the reference with chapter 12's given Grammar should pass check 12's task 1 and "
                           f"row all: {[(r.nodeid, r.message) for r in report.results if r.outcome == 'failed']} "
                           f"{report.errors}")


def test_every_task_has_a_mutant():
    for module, (chapter, _) in impl.CHAPTERS.items():
        text = impl.exercise_path(module).read_text()
        tasks = {int(t) for t in __import__("re").findall(rf"Chapter {chapter}, task (\d+)", text)}
        covered = {m.task for m in MUTANTS if m.chapter == chapter}
        assert tasks <= covered, f"chapter {chapter}: tasks {sorted(tasks - covered)} have no mutant in MUTANTS"
