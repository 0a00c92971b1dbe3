"""Planted bugs in chapters 06-11 of kinds tests/tools/test_mutants.py's first list does not have.

Each is a Mutant (tests/tools/mutant_support.py): a plain text edit of the reference's
source, graded as `check N --file` grades a submission; the grade must fail on a test
of what the code does (test_mutants.py runs them).
"""
from __future__ import annotations

import inspect
import textwrap

from minicb.block_allocator import BlockAllocator
from mutant_support import DECODE_GRAPHS_SUBCLASS, SPECULATOR_GIVEN, STUDENT_CHUNK_KERNEL, Mutant

# Chapter 07's append as a student writes it out (the reference calls chapter 03's).
APPEND_WRITTEN_OUT = textwrap.dedent(inspect.getsource(BlockAllocator.append))




MUTANTS: list[Mutant] = [
    # ---- chapter 06: the scheduler
    Mutant(6, 1, "admission does not charge the admitted prompts to the step's budget", "Scheduler.admit",
           [("        budget -= num_new\n", "        budget -= 0\n")]),
    Mutant(6, 2, "postprocess never sets finish_time on a finished completion", "Scheduler.postprocess",
           [("                    completion.finish_time = now\n", "")]),
    Mutant(6, 2, "postprocess checks max_tokens against the count before the new token, so one token too many",
           "Scheduler.postprocess",
           [("reason = finish_reason(token, len(completion.output_token_ids),",
             "reason = finish_reason(token, len(completion.output_token_ids) - 1,")]),
    Mutant(6, 2, "postprocess forks one completion too few, so the last of n completions is lost",
           "Scheduler.postprocess", [("self.fork(seq, len(tokens) - 1, out)", "self.fork(seq, len(tokens) - 2, out)")]),
    Mutant(6, 3, "grow reports success when it preempted the very sequence it was growing", "Scheduler.grow",
           [("                return False\n", "                return True\n")]),
    # ---- chapter 07: prefix caching
    Mutant(7, 1, "cache_full_blocks fills the key -> block map but not block -> key, so a freed block loses "
           "its cache", "CachingBlockAllocator.cache_full_blocks",
           [("        self._key_of_block[block] = key\n", "")]),
    Mutant(7, 2, "allocate_prefix revives its hits before checking the pool, so a failed call leaves them held",
           "CachingBlockAllocator.allocate_prefix",
           [("if num_fresh + len(revived) > self.num_free_blocks:", "if False:")]),
    Mutant(7, 2, "allocate_prefix takes fresh blocks for the cached prefix too", "CachingBlockAllocator.allocate_prefix",
           [("num_fresh = self.blocks_needed(len(token_ids)) - len(hits)", "num_fresh = self.blocks_needed(len(token_ids))")]),
    Mutant(7, 3, "evict drops the lookup's entry but the block keeps its old key", "CachingBlockAllocator.evict",
           [("del self._block_of_key[key], self._key_of_block[block]", "del self._block_of_key[key]")]),
    Mutant(7, 4, "append's copy-on-write returns the copy as (dst, src)", "CachingBlockAllocator.append",
           [("copy = (src, dst)", "copy = (dst, src)")], source=APPEND_WRITTEN_OUT),
    Mutant(8, 2, "chunk_attention never applies the causal mask", "chunk_attention",
           [("    scores = scores.masked_fill(", "    _unused = scores.masked_fill(")]),
    Mutant(8, 2, "chunk_attention takes the softmax over the queries, not the keys", "chunk_attention",
           [("scores.softmax(-1)", "scores.softmax(-2)")]),
    Mutant(8, 3, "the chunk kernel ignores a scale it is given", "chunk_attention_triton",
           [("scale = 1.0 / math.sqrt(head_dim) if scale is None else scale", "scale = 1.0 / math.sqrt(head_dim)")],
           source=STUDENT_CHUNK_KERNEL),
    Mutant(8, 3, "the chunk kernel pairs query head h with KV head h % n_kv_heads", "chunk_attention_triton",
           [("kv_head = head // (N_HEADS // N_KV_HEADS)", "kv_head = head % N_KV_HEADS")], source=STUDENT_CHUNK_KERNEL),
    Mutant(8, 3, "the chunk kernel's grid drops the last partial tile of new tokens", "chunk_attention_triton",
           [("grid = (triton.cdiv(q_len, 16), n_heads)", "grid = (q_len // 16, n_heads)")], source=STUDENT_CHUNK_KERNEL),
    # ---- chapter 09: the server's engine thread
    Mutant(9, 2, "take_commands blocks on an empty inbox even when the engine is busy", "take_commands",
           [("commands = [inbox.get()] if wait else []", "commands = [inbox.get()]")]),
    Mutant(9, 2, "take_commands hands the commands out newest first", "take_commands",
           [("            return commands\n", "            return commands[::-1]\n")]),
    Mutant(9, 2, "an abort's completions do not go into handle.ended", "apply_commands",
           [("                handle.ended.add(seq.completion)\n", "")]),
    Mutant(9, 2, "a stop command does not stop the batch: the commands after it are applied", "apply_commands",
           [("            applied.stop = True\n            break\n", "            applied.stop = True\n            continue\n")]),
    Mutant(9, 1, "group_step looks a finished completion up by its seq_id, so completions other than 0 never end",
           "group_step", [("handle = owners.get(seq.request_id)", "handle = owners.get(seq.seq_id)")]),
    # ---- chapter 10: the GPU step
    Mutant(10, 1, "smallest_bucket compares with >, so a step that fills a bucket exactly takes the next one",
           "smallest_bucket", [("if b >= num_seqs)", "if b > num_seqs)")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 1, "smallest_bucket returns the largest bucket, not None, when the rows fit none", "smallest_bucket",
           [("if b >= num_seqs), None)", "if b >= num_seqs), buckets[-1])")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 1, "batch_buckets leaves out the multiples of 8 past 8", "batch_buckets",
           [("sizes.update(range(16, max_num_seqs, 8))", "pass")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 1, "batch_buckets accepts max_num_seqs 0", "batch_buckets",
           [("or max_num_seqs < 1:", "or max_num_seqs < 0:")], DECODE_GRAPHS_SUBCLASS),
    Mutant(10, 2, "padding rows have a context of 0 tokens, not 1", "pad_decode_inputs",
           [("[p + 1 for p in positions] + [1] * pad", "[p + 1 for p in positions] + [0] * pad")],
           DECODE_GRAPHS_SUBCLASS),
    Mutant(11, 3, "rollback steps the count back first, then truncates from the lowered count: twice the rejects",
           "rollback", [("    seq.num_computed_tokens -= num_rejected\n", ""),
                        ("    allocator.truncate(seq.seq_id, seq.num_computed_tokens - num_rejected)",
                         "    seq.num_computed_tokens -= num_rejected\n"
                         "    allocator.truncate(seq.seq_id, seq.num_computed_tokens - num_rejected)")], recompile=SPECULATOR_GIVEN),
    Mutant(11, 1, "prompt lookup matches on the first token of the last n only", "propose_ngram",
           [("token_ids[start] == tail[0] and token_ids[start:start + n] == tail", "token_ids[start] == tail[0]")],
           recompile=SPECULATOR_GIVEN),
    Mutant(11, 2, "greedy verification adds no bonus token when every draft is accepted", "accept_greedy",
           [("    tokens.append(argmax[len(tokens)])", "    if len(tokens) < len(draft_token_ids):\n"
             "        tokens.append(argmax[len(tokens)])")], recompile=SPECULATOR_GIVEN),
    # Three the grader passed until a test of their kind was written (test_ch06_scheduler.py, test_ch07_prefix_cache.py).
    Mutant(6, 3, "grow makes the copy-on-write copy but does not record it for the engine", "Scheduler.grow",
           [("            out.block_copies.append(copy)", "            pass")]),
    Mutant(6, 3, "schedule_running serves the requests still in their prompt before the decodes",
           "Scheduler.schedule_running", [("enumerate(decoding + prefilling)", "enumerate(prefilling + decoding)")]),
    Mutant(7, 3, "free gives a sequence's blocks back first block first, so the LRU evicts its prefix first",
           "CachingBlockAllocator.free", [("for block in reversed(table):", "for block in table:")],
           source=textwrap.dedent(inspect.getsource(BlockAllocator.free))),
]
