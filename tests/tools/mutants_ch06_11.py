"""Planted bugs in chapters 06-11 of kinds tests/tools/test_mutants.py's first list does not have.

Each is a Mutant (tests/tools/mutant_support.py): a plain text edit of the reference's
source, graded as `check N --file` grades a submission; the grade must fail on a test
of what the code does (test_mutants.py runs them).
"""
from __future__ import annotations

import inspect
import textwrap

from minicb.block_allocator import BlockAllocator
from mutant_support import Mutant

# Chapter 07's append as a student writes it out (the reference calls chapter 03's).
APPEND_WRITTEN_OUT = textwrap.dedent(inspect.getsource(BlockAllocator.append))

# As in test_mutants.py:
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

# Chapter 08, task 3 as a student writes it: a kernel of its own over dense K/V, one program
# per tile of BLOCK_M new tokens and one query head, walking the keys in tiles of BLOCK_N
# with an online softmax. test_the_unmutated_sources_pass holds it to the chapter's tests.
STUDENT_CHUNK_KERNEL = """
from minicb.triton_mode import choose_triton_mode
choose_triton_mode()
import triton
import triton.language as tl


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, o_ptr, q_len, context_len, scale,
                  N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // (N_HEADS // N_KV_HEADS)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] new-token indices
    dims = tl.arange(0, DIM)  # [DIM] (head_dim rounded up to a power of 2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (rows[:, None] * N_HEADS + head) * HEAD_DIM + dims[None, :],
                mask=(rows < q_len)[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, DIM]
    positions = context_len - q_len + rows  # [BLOCK_M]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    hi = context_len - q_len + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)  # keys the tile's last row sees
    for start in range(0, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        kv_mask = (keys < hi)[:, None] & dim_ok[None, :]
        offsets = (keys[:, None] * N_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, DIM]
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # [BLOCK_M, BLOCK_N]
        s = tl.where((keys[None, :] <= positions[:, None]) & (keys[None, :] < hi), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m = m_new
    tl.store(o_ptr + (rows[:, None] * N_HEADS + head) * HEAD_DIM + dims[None, :], acc / l[:, None],
             mask=(rows < q_len)[:, None] & dim_ok[None, :])


def chunk_attention_triton(q, k, v, scale=None):
    _check_chunk(q, k, v)
    q_len, n_heads, head_dim = q.shape
    if q_len == 0:
        return q.clone()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q32, k32, v32 = (t.float().contiguous() for t in (q, k, v))
    out = torch.empty_like(q32)
    grid = (triton.cdiv(q_len, 16), n_heads)
    _chunk_kernel[grid](q32, k32, v32, out, q_len, k.shape[0], scale, n_heads, k.shape[1], head_dim,
                        triton.next_power_of_2(head_dim), BLOCK_M=16, BLOCK_N=16)
    return out.to(q.dtype)
"""
# Chapter 11's given code, written again in the mutant's file so that it calls the mutated function.
SPECULATOR_GIVEN = ("verify", "Speculator")


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
]
