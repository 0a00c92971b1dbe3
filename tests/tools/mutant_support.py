"""The Mutant record (one realistic bug planted in one task's code) and the given code mutants share.

Its own module, so that the lists of mutants can live in several files: test_mutants.py
holds the first ones and grades them all, mutants_ch01_05.py, mutants_ch06_11.py and
mutants_ch12.py the later kinds.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    # Source of a student's own solution to mutate instead of the reference's `target`
    # (chapter 08's kernel: the reference hands the chunk to a shared kernel instead).
    source: str = ""


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
# Chapter 08's admission, overridden in the exercise file (the rest of the loop is given).
ADMIT_IMPORTS = "from minicb.scheduler import RequestStatus\n"

# Chapter 11's given code, written again in the mutant's file so that it calls the mutated function.
SPECULATOR_GIVEN = ("verify", "Speculator")

# Chapter 12's given Grammar as the exercise has it, so the engine runs the mutated code: its masks
# from the file's allowed_tokens_trie and its matchers of the file's Matcher (the reference's own
# Grammar takes the vectorized walk and the reference's Matcher).
GRAMMAR_GIVEN = """
class Grammar(Grammar):
    def mask(self, state):
        if state not in self._masks:
            allowed = allowed_tokens_trie(self.dfa, self.vocab, state)
            self._masks[state] = torch.from_numpy(np.asarray(allowed, dtype=bool))
        return self._masks[state]

    def matcher(self):
        return Matcher(self)
"""
