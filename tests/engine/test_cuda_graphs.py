"""The decode runner of minicb/cuda_graphs.py: when the engine has one, and the same outputs as without it.

A CPU has no CUDA graphs, so here the runner runs eagerly: the same static
buffers, the same padding rows and scratch block, the same bucket choice; only
the replay is missing. That is what these tests check, on the tiny model, with
both attention backends (Triton interpreted). With MINICB_DEVICE=cuda (make
gpu-check) the same tests capture and replay real graphs, with the Triton
backend only (chapter 04's decode cannot be captured); the last test runs on a
CUDA GPU only.

The buckets and the padding rows are the chapter's exercise: their tests are
tests/chapters/test_ch10_buckets.py and tests/chapters/test_ch10_padding.py (which import the
helpers below), graded by `python -m minicb check 10`.
"""
import random
import subprocess
import sys
import types

import pytest
import torch

from minicb import paged_attention, triton_attention
from minicb.cuda_graphs import DecodeGraphs, operator_calls, runner_mode
from minicb.engine import Engine, EngineConfig
from minicb.model import random_model
from minicb.model_runner import ModelRunner, StepBatch, prepare
from minicb.sampling import SamplingParams
from minicb.scheduler import SchedulerOutput

BACKENDS = ["torch", "triton"]


@pytest.fixture
def backend(request, device):
    """The attention backend of a parametrized test, skipped where the runner cannot use it."""
    if request.param == "torch" and device.startswith("cuda"):
        pytest.skip("on CUDA the runner captures graphs, which need the Triton decode (see runner_mode)")
    return request.param


def test_when_the_engine_has_a_runner():
    from minicb.attention_backends import StudentAttention, TorchAttention, TritonAttention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    triton = TritonAttention(triton_attention)  # capturable: chapter 05's reference kernels
    gather = TorchAttention(paged_attention)  # chapter 04's gather has a data-dependent width
    student = StudentAttention(types.SimpleNamespace(__name__="exercise"))  # checks on the host: graphs unsafe
    assert [runner_mode(setting, cpu, triton) for setting in (None, True, False)] == [None, "eager", None]
    assert [runner_mode(setting, cuda, triton) for setting in (None, True, False)] == ["graphs", "graphs", None]
    assert runner_mode(None, cuda, gather) is None and runner_mode(None, cuda, student) is None
    for backend in (gather, student):
        with pytest.raises(ValueError, match="attention='triton'"):
            runner_mode(True, cuda, backend)
    with pytest.raises(ValueError, match="cuda_graphs='yes'"):
        EngineConfig(cuda_graphs="yes")  # the setting itself is EngineConfig's to check


def test_the_default_engine_on_a_cpu_is_unchanged():
    engine = Engine(random_model(seed=0), EngineConfig(num_blocks=16))
    assert type(engine.runner) is ModelRunner, f"the default runner on a CPU is a {type(engine.runner).__name__}"
    assert engine.pool.num_blocks == engine.allocator.num_blocks == 16  # no scratch block


def test_the_runner_adds_a_scratch_block_no_sequence_owns():
    engine = Engine(random_model(seed=0), EngineConfig(num_blocks=16, cuda_graphs=True))  # on the CPU
    assert isinstance(engine.runner, DecodeGraphs), f"cuda_graphs=True built a {type(engine.runner).__name__}"
    assert engine.pool.num_blocks == 17 and engine.allocator.num_blocks == 16
    assert engine.runner.scratch_block == 16 and engine.runner.graphs == {}  # no graphs on a CPU


def test_the_runner_does_not_import_the_engine():
    # The engine builds the runner; a runner that imported the engine back would tie
    # chapter 10's module to chapter 06's, and make every change to one a change to both.
    code = "import sys, minicb.cuda_graphs; print(sorted(m for m in sys.modules if m.startswith('minicb.')))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "'minicb.engine'" not in run.stdout, f"importing minicb.cuda_graphs imported: {run.stdout.strip()}"


def test_operator_calls_counts_the_outermost_calls_only():
    x = torch.ones(2, 3)
    calls = operator_calls(lambda: torch.nn.functional.linear(x * 2, torch.ones(4, 3)) + 1)
    assert calls["aten::mul"] == 1 and calls["aten::linear"] == 1 and calls["aten::add"] == 1, calls
    assert "aten::addmm" not in calls and "aten::mm" not in calls, f"linear's inner calls were counted: {calls}"


# ---- a decode-only step, by hand --------------------------------------------------------


def decoding_engine(attention: str, device="cpu", prompt_lens=(3, 9, 14), max_num_seqs=8):
    """An engine with the runner on, whose requests are past their prefill: its next step is decode-only."""
    # cpu_ops="torch": on the CPU, the forward a GPU runs (the compiled CPU norms hand Numba numpy views).
    engine = Engine(random_model(seed=3).to(device), EngineConfig(max_num_seqs=max_num_seqs, attention=attention,
                                                                 block_size=4, num_blocks=40, cuda_graphs=True,
                                                                 cpu_ops="torch"))
    for i, n in enumerate(prompt_lens):
        engine.add_request([(11 * i + 5 * t) % 250 + 3 for t in range(n)], SamplingParams(max_tokens=6))
    engine.step()  # the prefills, eagerly
    return engine


def decode_batch(engine, seqs) -> StepBatch:
    """The StepBatch of a decode-only step of seqs (each computes its newest token), built by hand.
    Their newest tokens' slots must be allocated: seqs come from a schedule() that has not been run yet."""
    out = SchedulerOutput(decodes=list(seqs), num_scheduled={seq.seq_id: 1 for seq in seqs})
    return prepare(out, engine.allocator)


def eager_logits(engine, batch: StepBatch) -> torch.Tensor:
    """The oracle: the eager runner's forward over the engine's pool (no buffers, no padding) -> [S, V]."""
    return ModelRunner(engine.model, engine.pool, engine.attention).forward(batch)


def changed_slots(before, after) -> set[tuple[int, int]]:
    """(block, offset) of every pool slot whose K or V changed in any layer."""
    changed = set()
    for old, new in zip(before, after):
        diff = (old != new).flatten(2).any(dim=2)  # [num_blocks, block_size]
        changed |= {tuple(ix) for ix in diff.nonzero().tolist()}
    return changed


def test_steps_with_prompts_run_eagerly_and_decode_only_steps_use_the_runner():
    engine = decoding_engine("torch", prompt_lens=(3, 9))
    runner, running = engine.runner, engine.scheduler.schedule().decodes  # a decode-only step: slots allocated
    decodes = decode_batch(engine, running)
    assert runner.takes(decodes)
    mixed = decode_batch(engine, running)
    mixed.num_decodes = 1  # the second row a 1-token chunk of a prompt: the batch is not decode-only
    empty = prepare(SchedulerOutput(), engine.allocator)
    too_many = decode_batch(engine, running * 5)  # 10 rows > the largest bucket, 8
    wrong = [name for name, batch in (("mixed", mixed), ("empty", empty), ("10 rows", too_many))
             if runner.takes(batch)]
    assert not wrong, f"the runner takes batches it must leave to the eager forward: {wrong}"
    # forward() sends each batch its way: the decode-only one through decode(), the others eagerly.
    calls = []
    decode = runner.decode
    runner.decode = lambda batch: calls.append(batch.num_seqs) or decode(batch)
    for batch in (decodes, mixed, too_many):
        logits = runner.forward(batch)
        assert logits.shape == (batch.num_seqs, engine.model.config.vocab_size), tuple(logits.shape)
    assert calls == [2], f"decode() ran for batches of {calls} rows; want only the decode-only batch of 2"


def test_decode_refuses_a_batch_it_cannot_take():
    engine = decoding_engine("torch", prompt_lens=(3, 9))
    batch = decode_batch(engine, engine.scheduler.schedule().decodes * 5)
    with pytest.raises(ValueError, match="a batch of 10 sequences, 10 of them decodes"):
        engine.runner.decode(batch)
    batch.num_decodes = 9
    with pytest.raises(ValueError, match="9 of them decodes"):
        engine.runner.decode(batch)


# ---- whole runs: the same tokens with the runner on and off ----------------------------------


def serve(engine, requests) -> dict[int, tuple[list[int], str]]:
    """Run (arrival_step, prompt, params) requests to the end -> request index -> (tokens, finish reason)."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    index_of, finished, step = {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and requests[pending[0]][0] <= step:
            i = pending.pop(0)
            index_of[engine.add_request(requests[i][1], requests[i][2])] = i
        for seq in engine.step().finished:
            finished[index_of[seq.request_id]] = (seq.output_token_ids, seq.finish_reason)
        step += 1
    return finished


def check_decodes_against_eager(engine, same_tokens: bool = True) -> list[float]:
    """Make every runner step also compute the eager logits; returns the max abs difference of each step.
    same_tokens: also assert that each row's greedy token is the same."""
    diffs, decode = [], engine.runner.decode

    def checked(batch):
        logits = decode(batch).clone()  # [S, V]
        want = eager_logits(engine, batch)  # writes the very same K/V again
        assert logits.shape == want.shape, f"logits {tuple(logits.shape)}, want {tuple(want.shape)}"
        if same_tokens:
            assert torch.equal(logits.argmax(-1), want.argmax(-1)), "greedy tokens differ from the eager step"
        diffs.append((logits.float() - want.float()).abs().max().item())
        return logits

    engine.runner.decode = checked  # forward() finds it on the instance
    return diffs


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_outputs_are_identical_with_the_runner_on_and_off(backend, device):
    attention, rng = backend, random.Random(7)
    count, longest = (10, 12) if attention == "torch" or device != "cpu" else (5, 8)  # the interpreter is slow
    requests = [(rng.randint(0, 8), [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))],
                 SamplingParams(max_tokens=rng.randint(1, longest))) for _ in range(count)]
    model = random_model(seed=5).to(device)
    runs = {}
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=6, attention=attention, block_size=4, num_blocks=60,
                                            cuda_graphs=graphs, keep_traces=None))
        diffs = check_decodes_against_eager(engine) if graphs else []
        runs[graphs] = serve(engine, requests)
    assert runs[True] == runs[False]
    decode_only = [t for t in engine.traces if t.slots and all(s.phase in ("decode", "empty") for s in t.slots)
                   and any(s.phase == "decode" for s in t.slots)]
    assert len(diffs) == len(decode_only) > 0, "every decode-only step, and only those, should use the runner"
    assert max(diffs) <= 1e-4, f"logits differ from the eager step's by up to {max(diffs):.2e}"
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_chunked_prefill_and_prefix_caching_work_with_the_runner(device):
    # Chunked steps mix decodes with prompt chunks and run eagerly; the decode-only
    # steps between them go through the runner. Tokens must not change.
    rng = random.Random(9)
    shared = [rng.randrange(3, 256) for _ in range(9)]
    requests = [(rng.randint(0, 8), shared + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))],
                 SamplingParams(max_tokens=rng.randint(1, 12))) for _ in range(10)]
    model = random_model(seed=5).to(device)
    runs = {}
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=6, block_size=4, num_blocks=60, cuda_graphs=graphs,
                                            enable_chunked_prefill=True, max_num_batched_tokens=7,
                                            enable_prefix_caching=True))
        runs[graphs] = serve(engine, requests)
    assert runs[True] == runs[False], "chunked prefill with prefix caching: the runner changed the tokens"


def test_the_forward_a_graph_captures_reads_nothing_on_the_host():
    if not triton_attention.INTERPRETED:
        pytest.skip("the kernels are compiled for CUDA; this test builds CPU tensors")
    from test_host_syncs import count_host_reads

    engine = decoding_engine("triton")
    runner, out = engine.runner, engine.scheduler.schedule()
    seqs = out.decodes
    runner.decode(prepare(out, engine.allocator))  # fill the buffers as a real step does
    meta = runner.metadata(4, [engine.allocator.block_table(s.seq_id) for s in seqs] + [[runner.scratch_block]],
                           [s.num_computed_tokens + 1 for s in seqs] + [1], runner.scratch_slot)
    reads = count_host_reads(lambda: runner.run_bucket(4, meta))
    assert reads == [], f"{len(reads)} host reads in the runner's forward:\n" + "\n".join(reads)


# ---- CUDA only: capture and replay ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA graphs exist only on a CUDA GPU; on a CPU the runner runs eagerly, which the "
                           "tests above check (make gpu-check runs this one)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_and_replay_on_cuda(dtype):
    model = random_model(seed=5).to("cuda", dtype)
    rng = random.Random(3)
    requests = [(rng.randint(0, 12), [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))],
                 SamplingParams(max_tokens=rng.randint(1, 20))) for _ in range(20)]
    runs = {}
    for graphs in (False, None):  # None: the default, which on CUDA with Triton captures
        engine = Engine(model, EngineConfig(max_num_seqs=12, attention="triton", block_size=4, num_blocks=200,
                                            cuda_graphs=graphs))
        if graphs is None:
            runner = engine.runner
            assert isinstance(runner, DecodeGraphs), f"the default runner on CUDA is a {type(runner).__name__}"
            assert sorted(runner.graphs) == runner.buckets == [1, 2, 4, 8, 12], sorted(runner.graphs)
            diffs = check_decodes_against_eager(engine, same_tokens=dtype == torch.float32)
        runs[graphs] = serve(engine, requests)
    assert diffs, "no decode step replayed a graph"
    if dtype == torch.float32:
        assert runs[None] == runs[False], "greedy tokens differ with graphs on and off"
        assert max(diffs) <= 1e-4, f"replayed logits differ from eager ones by up to {max(diffs):.2e}"
    else:
        # bf16: a padded batch may run other matmul kernels than an unpadded one, so the logits
        # agree to bf16's precision and a near tie may pick another token.
        assert max(diffs) <= 0.1, f"replayed logits differ from eager ones by up to {max(diffs):.2e}"
