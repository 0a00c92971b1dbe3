"""Shared pytest setup.

`--impl student` runs the chapter tests against chapters/NN-*/exercise.py
instead of the reference in minicb/ (the same as MINICB_IMPL=student).

The tests live in folders by area: chapters/ (the graded tests/chapters/test_chNN_*.py
that `python -m minicb check N` runs), engine/, serve/ and tools/. The folders have
no __init__.py, so pytest imports each file under its bare name: basenames must stay
unique across the folders.
"""
import os
import pathlib
import sys

# A test imports helpers from its own folder and from others (a chapter 09 test uses
# serve/serve_support.py, chapter 10's padding test engine/test_cuda_graphs.py). pytest
# puts only the folder of the file it is importing on sys.path, so a file run on its
# own, or collected before the folder it needs, would not find them: every area goes
# on the path here, before any test module is imported.
AREAS = ("chapters", "engine", "serve", "tools")
for _area in AREAS:
    _folder = str(pathlib.Path(__file__).resolve().parent / _area)
    if _folder not in sys.path:
        sys.path.insert(0, _folder)


def pytest_addoption(parser):
    parser.addoption("--impl", choices=["reference", "student"], default=None,
                     help="which implementation the chapter tests load (default: MINICB_IMPL or reference)")


def pytest_configure(config):
    choice = config.getoption("--impl")
    if choice:
        os.environ["MINICB_IMPL"] = choice
    # With pytest-xdist's `-n N` (make test), the N workers share the cores: each gets cores // N
    # OpenMP and Numba threads, as do the servers, notebooks and grades they start. Two processes
    # of two threads each on two cores would take turns at every operator instead.
    workers = getattr(config.option, "numprocesses", None)
    if isinstance(workers, int) and workers > 1 and "PYTEST_XDIST_WORKER" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: no affinity
        per_worker = str(max(1, cores // workers))
        for name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ.setdefault(name, per_worker)


import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from minicb import impl, tasks  # noqa: E402
from minicb.triton_mode import choose_triton_mode  # noqa: E402

# Before any test module imports triton: interpret its kernels when there is no GPU.
choose_triton_mode()


def pytest_runtest_setup(item):
    """A graded test of a student's file fails at once, naming the function, when its task's
    functions are not defined in that file: inherited from a given class, misspelt or deleted
    (minicb/tasks.py). Otherwise a given base class could answer for the student."""
    marker = item.get_closest_marker("task")
    match = re.match(r"test_ch(\d\d)_", item.path.name)
    if marker is None or not marker.args or match is None or int(match.group(1)) not in impl.CHAPTER_NUMBERS:
        return
    chapter = int(match.group(1))
    path = impl.student_file(impl.module_for_chapter(chapter))
    if path is None:
        return  # the reference runs
    missing = tasks.missing_functions(path, chapter, marker.args[0])
    if missing:
        pytest.fail(tasks.missing_message(chapter, marker.args[0], missing), pytrace=False)


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
def chapter01_answers(smollm2, request, tmp_path_factory):
    """answers(n, max_tokens) -> the reference chapter 01 greedy Generations of the first n prompts.

    Chapter 01 decodes one prompt at a time, the slowest part of the real-model
    tests, so each answer is computed once per run and shared (chapters 02
    and 06 both compare against it). It is computed on first use: a test calls
    the code under test first, so against the stubs it fails in seconds.

    Under pytest-xdist each worker is a process of its own, and the two chapters'
    files may run on different ones. So a worker also writes each answer it
    computes to a folder named for this run (its test-run id, under the base temp
    folder the workers share), and reads one another worker wrote there instead of
    computing it again. Nothing outlives the run: another run has another id, and a
    process that is no worker of this run (a grade's child pytest) keeps to itself.
    """
    import json

    from minicb.naive import Generation, generate_with_cache  # the reference: it is the oracle
    from minicb.sampling import SamplingParams

    model, _, prompts = smollm2
    cache = {}
    worker = getattr(request.config, "workerinput", None)  # set in xdist's workers only
    shared = tmp_path_factory.getbasetemp().parent / f"chapter01-{worker['testrunuid']}" if worker else None

    def answer(i: int, max_tokens: int) -> Generation:
        path = shared / f"{i}-{max_tokens}.json" if shared else None
        if path is not None and path.is_file():
            return Generation(**json.loads(path.read_text()))
        generation = generate_with_cache(model, prompts[i], SamplingParams(max_tokens=max_tokens))
        if path is not None:  # written whole under another name, then renamed: never read half-written
            shared.mkdir(exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}")
            partial.write_text(json.dumps(vars(generation)))
            os.replace(partial, path)
        return generation

    def answers(n: int, max_tokens: int):
        for i in range(n):
            if (i, max_tokens) not in cache:
                cache[i, max_tokens] = answer(i, max_tokens)
        return [cache[i, max_tokens] for i in range(n)]

    return answers


# ---- chapters 06 on: each task graded on its own -----------------------------------

@pytest.fixture
def one_task(request, monkeypatch):
    """Run a test on the graded module's code for the test's own task, with the
    reference's code for the module's other tasks. The test file names its module
    in a global GRADED_MODULE ("scheduler", "prefix_cache").

    A scheduler test drives whole steps (schedule_running, admit, postprocess), and a prefix
    cache test frees what it allocated, so a test of one task also calls the code
    of the others. Without this, a student who has written only task 1 would
    still fail task 1 on the other stubs. A test marked task("all") runs the
    graded code throughout; with the reference loaded, nothing changes.
    """
    import importlib
    import types

    from minicb import impl

    name = request.module.GRADED_MODULE
    marker = request.node.get_closest_marker("task")
    if marker is None:
        pytest.fail(f"{request.node.nodeid} needs @pytest.mark.task(k): it runs the graded code of task k")
    graded, reference = impl.load(name), importlib.import_module(f"minicb.{name}")
    task = marker.args[0]
    if graded is reference or task == "all":
        return
    module = types.SimpleNamespace(**vars(graded))
    classes: dict[str, dict] = {}
    # The chapter's functions by task, read off its stubs (minicb/tasks.py): one source for this and the grader.
    for other, functions in tasks.task_functions(impl.CHAPTERS[name][0]).items():
        if other == str(task):
            continue
        for qualname in functions:
            owner, _, function = qualname.rpartition(".")
            if owner:
                classes.setdefault(owner, {})[function] = getattr(getattr(reference, owner), function)
            else:  # a module-level function: the graded module's own methods call it too
                monkeypatch.setattr(graded, function, getattr(reference, function))
                setattr(module, function, getattr(reference, function))
    for owner, methods in classes.items():
        setattr(module, owner, type(owner, (getattr(graded, owner),), methods))
    load = impl.load
    monkeypatch.setattr(impl, "load", lambda m: module if m == name else load(m))


# ---- integration rows: the chapter 06 engine against chapter 01 -----------------------


@pytest.fixture(scope="session")
def engine_matches_chapter01():
    """check(model, requests, **engine_config) -> number of preemptions (check.engine: the engine it ran).

    Serves `requests`, a list of (arrival_step, prompt_ids, SamplingParams), through
    the chapter 06 engine built from whatever `impl.load` hands out (so from the
    student's module in a chapter's integration test), and asserts that every
    request finishes once with the reference chapter 01 loop's tokens and finish
    reason, and that every block is free afterwards. Used by the "all" rows of
    chapters 03-06.
    """
    from minicb.engine import Engine, EngineConfig
    from minicb.naive import first_difference, generate_with_cache  # the reference: the oracle

    def check(model, requests, **engine_config):
        engine = check.engine = Engine(model, EngineConfig(**engine_config))
        num_blocks = engine.allocator.num_blocks
        pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
        index_of, finished, preemptions, step = {}, {}, 0, 0
        while pending or engine.has_unfinished():
            while pending and requests[pending[0]][0] <= step:
                i = pending.pop(0)
                index_of[engine.add_request(requests[i][1], requests[i][2])] = i
            for seq in engine.step().finished:
                i = index_of[seq.request_id]
                assert i not in finished, f"request {i} finished twice"
                finished[i] = seq
                preemptions += seq.num_preemptions
            step += 1
            assert step < 3000, f"the engine stopped making progress: {len(finished)} of {len(requests)} finished"
        missing = sorted(set(range(len(requests))) - set(finished))
        assert not missing, f"every request must finish; these never did: {missing}"
        free = engine.allocator.num_free_blocks
        assert free == num_blocks, f"every block must be free after the run, but {free} of {num_blocks} are"
        for i, seq in sorted(finished.items()):
            _, prompt, params = requests[i]
            want = generate_with_cache(model, prompt, params)
            assert (seq.output_token_ids, seq.finish_reason) == (want.token_ids, want.finish_reason), (
                f"request {i} ({len(prompt)}-token prompt, max_tokens {params.max_tokens}, preempted "
                f"{seq.num_preemptions} times): finish {seq.finish_reason!r} vs chapter 01's "
                f"{want.finish_reason!r}; {first_difference(seq.output_token_ids, want.token_ids, ('engine', 'chapter 01'))}")
        return preemptions

    return check


@pytest.fixture(scope="session")
def random_requests():
    """make(vocab_size, count, seed) -> (arrival_step, prompt, greedy SamplingParams) requests of random
    lengths (prompts of 1-20 tokens, 1-14 new tokens, arriving over 40 steps), for the integration rows."""
    import random

    from minicb.sampling import SamplingParams

    def make(vocab_size: int, count: int, seed: int) -> list:
        rng = random.Random(seed)
        return [(rng.randint(0, 40), [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 20))],
                 SamplingParams(max_tokens=rng.randint(1, 14))) for _ in range(count)]

    return make


def pytest_collection_modifyitems(items):
    """Tell schemathesis' tests apart (tests/serve/test_server_schema.py): it makes one test per
    operation, each named for it, but gives them all the function's node id. pytest-xdist hands
    out tests by node id, so make test's workers would run the first operation alone."""
    for item in items:
        label = getattr(item, "operation_label", None)
        if label and f"[{label}]" not in item.nodeid:
            distinct = f"{item.nodeid}[{label}]"
            if hasattr(item, "_id"):  # pytest 9: a structured id (the attribute is private in both)
                item._id = type(item._id).parse(distinct)
            else:
                item._nodeid = distinct
    # test_after_fuzzing_the_server_is_healthy_and_every_block_is_free fails if an operation was not sent.
