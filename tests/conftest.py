"""Shared pytest setup.

`--impl student` runs the chapter tests against chapters/NN-*/exercise.py
instead of the reference in minicb/ (the same as MINICB_IMPL=student).
"""
import os


def pytest_addoption(parser):
    parser.addoption("--impl", choices=["reference", "student"], default=None,
                     help="which implementation the chapter tests load (default: MINICB_IMPL or reference)")


def pytest_configure(config):
    choice = config.getoption("--impl")
    if choice:
        os.environ["MINICB_IMPL"] = choice


import pytest  # noqa: E402
import torch  # noqa: E402

from minicb.triton_mode import choose_triton_mode  # noqa: E402

# Before any test module imports triton: interpret its kernels when there is no GPU.
choose_triton_mode()


@pytest.fixture(scope="session")
def device() -> str:
    """The device tests run on: MINICB_DEVICE (make gpu-check sets 'cuda'), else cpu."""
    name = os.environ.get("MINICB_DEVICE", "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"MINICB_DEVICE={name} but torch.cuda.is_available() is False")
    return name


@pytest.fixture
def paged_args():
    """Valid decode arguments (q, k_cache, v_cache, block_tables, context_lens) to break on purpose:
    2 sequences, 4 query heads over 2 KV heads, head_dim 8, 6 blocks of 4 slots, 3 table columns."""
    q = torch.randn(2, 4, 8)
    k_cache = torch.randn(6, 4, 2, 8)
    v_cache = torch.randn(6, 4, 2, 8)
    block_tables = torch.tensor([[3, 0, -1], [5, 99, -7]], dtype=torch.int32)  # past the used blocks: anything
    context_lens = torch.tensor([5, 4], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, context_lens


# ---- the real model, shared by the slow tests -----------------------------------------


@pytest.fixture(scope="session")
def smollm2(device):
    """(model, tokenizer, prompts): SmolLM2 loaded once, and the first 32 bundled chat
    prompts in its chat template, as token ids."""
    from minicb.data import load_chat_prompts
    from minicb.tokenizer import load_tokenizer
    from minicb.weights import load_model

    model, tokenizer = load_model(device=device), load_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in load_chat_prompts(32)]
    return model, tokenizer, prompts


@pytest.fixture(scope="session")
def chapter01_answers(smollm2):
    """answers(n, max_tokens) -> the reference chapter 01 greedy Generations of the first n prompts.

    Chapter 01 decodes one prompt at a time, the slowest part of the real-model
    tests, so each answer is computed once per session and shared (chapters 02
    and 06 both compare against it). It is computed on first use: a test calls
    the code under test first, so against the stubs it fails in seconds.
    """
    from minicb.naive import generate_with_cache  # the reference: it is the oracle
    from minicb.sampling import SamplingParams

    model, _, prompts = smollm2
    cache = {}

    def answers(n: int, max_tokens: int):
        for i in range(n):
            if (i, max_tokens) not in cache:
                cache[i, max_tokens] = generate_with_cache(model, prompts[i], SamplingParams(max_tokens=max_tokens))
        return [cache[i, max_tokens] for i in range(n)]

    return answers


# ---- chapter 06: each scheduler task graded on its own --------------------------------

# The scheduler's exercise methods, by task (chapters/06-continuous-batching/exercise.py).
SCHEDULER_TASKS = {1: "admit", 2: "postprocess", 3: "schedule_decodes"}


@pytest.fixture
def one_scheduler_task(request, monkeypatch):
    """Run a chapter 06 test on the graded scheduler's method for the test's own task,
    with the reference's methods for the other two tasks.

    Every scheduler test drives whole steps (admit, decode, postprocess), so a test
    of task 1 also calls the methods of tasks 2 and 3. Without this, a student who
    has written only `admit` would still fail task 1 on the other two stubs. With
    the reference loaded, nothing changes.
    """
    import importlib
    import types

    from minicb import impl

    marker = request.node.get_closest_marker("task")
    if marker is None:
        pytest.fail(f"{request.node.nodeid} needs @pytest.mark.task(k): it runs the graded method of task k")
    graded, reference = impl.load("scheduler"), importlib.import_module("minicb.scheduler")
    if graded is reference:
        return
    task = marker.args[0]
    others = {name: getattr(reference.Scheduler, name) for t, name in SCHEDULER_TASKS.items() if t != task}
    scheduler = types.SimpleNamespace(**vars(graded))
    scheduler.Scheduler = type("Scheduler", (graded.Scheduler,), others)
    load = impl.load
    monkeypatch.setattr(impl, "load", lambda module: scheduler if module == "scheduler" else load(module))
