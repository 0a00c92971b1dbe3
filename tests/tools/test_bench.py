"""The benchmark's metric functions on hand-made numbers, the bundled prompts, and one smoke run.

The benchmark itself is not a test: these only check that what it reports is
computed right. Hand-worked values are the oracle for the metrics; chapter 02's
own counters are the oracle for the static-batch token count.
"""
import json
import math
import random
import time

import numba
import pytest
import torch

from minicb import LLM, cpu_attention
from minicb.bench import cli, metrics, report, runners, workloads
from minicb.data import load_chat_prompts
from minicb.model import random_model
from minicb.naive import first_difference
from minicb.sampling import SamplingParams
from minicb.static_batching import run_static
from minicb.trace import SlotState, StepTrace
from minicb.weights import save_checkpoint

# ---- metrics -------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert metrics.percentile(values, 0) == 1.0
    assert metrics.percentile(values, 100) == 4.0
    assert metrics.percentile(values, 50) == 2.5  # halfway between 2 and 3
    assert metrics.percentile(values, 99) == pytest.approx(3.97)  # rank 2.97: 3 + 0.97 * (4 - 3)
    assert metrics.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="empty"):
        metrics.percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        metrics.percentile(values, 101)


def test_tpot_excludes_the_first_token():
    # 10 tokens in 1.0 s, the first after 0.1 s: the other 9 took 0.9 s.
    assert metrics.tpot(latency=1.0, ttft=0.1, num_output_tokens=10) == pytest.approx(0.1)
    assert metrics.tpot(latency=1.0, ttft=1.0, num_output_tokens=1) is None


def test_summarize_timings_by_hand():
    timings = [metrics.RequestTiming(arrival=0.0, first_token=0.5, finish=2.0, num_output_tokens=4),
               metrics.RequestTiming(arrival=1.0, first_token=1.5, finish=5.0, num_output_tokens=1)]
    got = metrics.summarize_timings(timings)
    # Wall = last finish - first arrival = 5 s; 5 tokens, 2 requests.
    assert got["wall_s"] == 5.0 and got["output_tokens"] == 5
    assert got["output_tok_s"] == pytest.approx(1.0) and got["req_s"] == pytest.approx(0.4)
    assert got["latency_mean_s"] == pytest.approx(3.0)  # latencies 2 and 4
    assert got["latency_p50_s"] == pytest.approx(3.0)
    assert got["ttft_mean_s"] == pytest.approx(0.5)
    assert got["tpot_mean_s"] == pytest.approx(0.5)  # (2 - 0.5) / 3; the 1-token request has no TPOT
    assert got["itl_mean_s"] is None, "no request said when its tokens came: no ITL"


def test_itl_pools_every_gap_between_tokens():
    timings = [metrics.RequestTiming(0.0, 0.5, 2.0, 4, token_times=[0.5, 0.6, 0.7, 2.0]),  # gaps .1 .1 1.3
               metrics.RequestTiming(1.0, 1.5, 1.5, 1, token_times=[1.5]),  # one token: no gap
               metrics.RequestTiming(0.0, 0.2, 0.4, 2, token_times=[0.2, 0.4])]  # gap .2
    got = metrics.summarize_timings(timings)
    assert got["itl_mean_s"] == pytest.approx(1.7 / 4), f"4 gaps summing to 1.7 s: ITL mean {got['itl_mean_s']}"
    assert got["itl_p99_s"] == pytest.approx(metrics.percentile([0.1, 0.1, 1.3, 0.2], 99))


def test_static_batch_tokens_by_hand():
    # Prompts 3 and 5 padded to 5: prefill computes 2 * 5 = 10, of which 8 are real.
    # Outputs 2 and 4 tokens: 3 decode steps of 2 rows = 6 computed; rows are live for 1 and 3.
    assert metrics.static_batch_tokens([3, 5], [2, 4]) == (16, 12)
    assert metrics.static_batch_tokens([7], [5]) == (11, 11)  # a batch of one wastes nothing


def test_static_batch_tokens_matches_chapter_02_counters():
    model = random_model()
    prompts = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 2, 9)]
    stats = run_static(model, prompts, params, batch_size=3).stats
    got = metrics.static_batch_tokens([len(p) for p in prompts], [5, 2, 9])
    assert got == (stats.computed_tokens, stats.useful_tokens), \
        f"formula gives (computed, useful) = {got}, run_static counted {(stats.computed_tokens, stats.useful_tokens)}"


def test_busy_slot_steps_by_hand():
    # Outputs of 2 and 4 tokens in 3 slots: 4 steps x 3 slots = 12 slot-steps, of which
    # the rows were live for 2 + 4 = 6; the third slot stood empty throughout.
    assert metrics.busy_slot_steps([2, 4], num_slots=3) == (6, 12)
    assert metrics.busy_slot_steps([5], num_slots=1) == (5, 5)  # one prompt at a time: always busy
    with pytest.raises(ValueError, match="3 requests does not fit in 2 slots"):
        metrics.busy_slot_steps([1, 1, 1], num_slots=2)


def test_continuous_busy_slots_count_the_empty_slots():
    # 5 requests, 4 slots: once the queue runs dry, slots stand empty until the longest
    # (9 tokens) ends. Utilisation stays 100% (nothing computed is wasted); busy slots do not.
    lens = (2, 9, 3, 4, 6)
    llm = LLM.from_model(random_model(), max_num_seqs=4, block_size=4, num_blocks=64)
    requests = [workloads.Request([5 + i] * 3, max_tokens=n, ignore_eos=True) for i, n in enumerate(lens)]
    result = runners.run_minicb_continuous(llm, requests, None, progress=False)
    assert [len(t) for t in result.token_ids] == list(lens) and result.utilisation == 1.0
    assert result.busy_slots == pytest.approx(sum(lens) / (4 * len(llm.traces))), \
        f"busy slots {result.busy_slots}: want {sum(lens)} live slot-steps of 4 x {len(llm.traces)}"
    assert result.busy_slots < 1


def test_waste_pct():
    assert metrics.waste_pct(reserved=100, used=25) == 75.0
    assert metrics.waste_pct(reserved=0, used=0) == 0.0
    with pytest.raises(ValueError, match="used=5"):
        metrics.waste_pct(reserved=4, used=5)


def _trace(step, slots, running, free, finished=(), preempted=()):
    return StepTrace(step=step, slots=[SlotState(*s) for s in slots], running=list(running),
                     finished=list(finished), preempted=list(preempted), num_blocks=10, num_free_blocks=free)


def test_paged_kv_at_peak_by_hand():
    # block_size 4. Step 0: A prefills 6 tokens (2 blocks), B prefills 3 (1 block): 3 blocks, 9 tokens.
    # Step 1: both decode (7 and 4 tokens, still 3 blocks); B finishes and frees its block.
    # Step 2: A decodes to 8 tokens; C prefills 9 (3 blocks): 5 blocks = 20 slots, 17 tokens. The peak.
    # Step 3: C is preempted (its 3 blocks freed), A decodes to 9 tokens (3 blocks).
    traces = [
        _trace(0, [(0, "prefill", 6), (1, "prefill", 3)], running=[0, 1], free=7),
        _trace(1, [(0, "decode", 1), (1, "decode", 1)], running=[0], free=8, finished=[(1, "stop")]),
        _trace(2, [(0, "decode", 1), (2, "prefill", 9)], running=[0, 2], free=5),
        _trace(3, [(0, "decode", 1), (None, "empty", 0)], running=[0], free=7, preempted=[2]),
    ]
    assert metrics.paged_kv_at_peak(traces, block_size=4) == (20, 17)


def test_first_difference_names_the_token():
    # The message every engine comparison prints (minicb/naive.py, shared by tests and the bench).
    text = first_difference([1, 9, 3], [1, 2, 3], ("static", "naive"))
    assert text.startswith("first difference at token 1: static 9, naive 2"), text
    assert "then lengths differ: got 3, want 2" in first_difference([1, 2, 3], [1, 2])
    assert "\n" not in first_difference(list(range(50)), list(range(49)))  # long lists are not printed whole


def test_run_workload_ratios_errors_and_agreement():
    def fake(tokens_per_s, answers):
        # Each request finishes `len(answer)` tokens at 1 / tokens_per_s per token, all from time 0.
        def run(requests, arrivals, progress):
            timings = [metrics.RequestTiming(0.0, 1 / tokens_per_s, len(a) / tokens_per_s, len(a)) for a in answers]
            return runners.EngineResult([list(a) for a in answers], timings, utilisation=1.0, kv_waste_pct=0.0)
        return run

    def broken(requests, arrivals, progress):
        raise RuntimeError("no such kernel")

    requests = [workloads.Request([5, 6], max_tokens=4), workloads.Request([7], max_tokens=4)]
    rows = runners.run_workload({"minicb-static": fake(10, [[1, 2], [3, 4]]),
                               "minicb-continuous": fake(30, [[1, 2], [3, 9]]),
                               "hf-generate": broken}, requests, None)
    assert rows["hf-generate"] == {"error": "RuntimeError: no such kernel"}
    assert rows["minicb-continuous"]["speedup_vs_minicb-static"] == pytest.approx(3.0)
    assert rows["minicb-continuous"]["speedup_vs_hf-generate"] is None  # the baseline failed
    assert rows["minicb-static"]["same_as_continuous"] == 1  # the second answers differ
    table = report.markdown_table(rows, num_requests=2)
    assert "| hf-generate | error: RuntimeError: no such kernel |" in table
    assert "| 1/2 |" in table and "| 3.00x |" in table
    assert len({line.count("|") for line in table.splitlines()}) == 1, "every row needs the same number of cells"


def test_run_workload_counts_the_cores_a_run_used():
    # One engine computes for its whole run, the other sleeps through it: about 1 core against about 0
    # (bounds loose enough for a test worker that shares its cores with another).
    def engine(work):
        def run(requests, arrivals, progress):
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                if not work:
                    time.sleep(0.01)
            timings = [metrics.RequestTiming(0.0, 0.1, 0.3, 2) for _ in requests]
            return runners.EngineResult([[1, 2] for _ in requests], timings, utilisation=1.0, kv_waste_pct=0.0)
        return run

    rows = runners.run_workload({"minicb-continuous": engine(True), "hf-generate": engine(False)},
                                [workloads.Request([5], max_tokens=2)], None)
    assert rows["minicb-continuous"]["cores"] > 0.3, rows["minicb-continuous"]["cores"]
    assert rows["hf-generate"]["cores"] < 0.15, rows["hf-generate"]["cores"]


def test_run_workload_rounds_take_turns_and_ratios_pair_rounds():
    calls = []

    def fake(name, speeds, fail_in_round=None):
        # Round i runs at speeds[i] tok/s: each request's 2 tokens end at 2 / speed.
        def run(requests, arrivals, progress):
            round_ = sum(c == name for c in calls)
            calls.append(name)
            if round_ == fail_in_round:
                raise RuntimeError(f"{name} broke in round {round_}")
            speed = speeds[round_]
            timings = [metrics.RequestTiming(0.0, 1 / speed, 2 / speed, 2) for _ in requests]
            return runners.EngineResult([[1, 2] for _ in requests], timings, utilisation=1.0, kv_waste_pct=0.0)
        return run

    requests = [workloads.Request([5, 6], max_tokens=4)]
    # Machine speed drifts: both engines slow down together in round 1, then recover.
    rows = runners.run_workload({"minicb-continuous": fake("minicb-continuous", [30, 12, 33]),
                                 "hf-generate": fake("hf-generate", [10, 3, 10]),
                                 "minicb-static": fake("minicb-static", [20, 20, 20], fail_in_round=1)},
                                requests, None, rounds=3)
    assert calls == ["minicb-continuous", "hf-generate", "minicb-static"] * 2 + ["minicb-continuous", "hf-generate"], \
        f"the engines must take turns, round after round, and one that failed drop out; ran {calls}"
    fast = rows["minicb-continuous"]
    assert fast["output_tok_s_rounds"] == pytest.approx([30, 12, 33])
    assert fast["output_tok_s"] == pytest.approx(30), "the row is the engine's median round"
    # Per-round ratios 3.0, 4.0, 3.3: their median is 3.3, where the ratio of medians would be 30 / 10 = 3.0.
    assert fast["speedup_vs_hf-generate"] == pytest.approx(3.3)
    assert rows["minicb-static"] == {"error": "RuntimeError: minicb-static broke in round 1"}
    assert fast["speedup_vs_minicb-static"] is None and fast["same_as_continuous"] == 1
    table = report.markdown_table(rows, num_requests=1)
    assert "| tok/s per round |" in table.splitlines()[0] and "| 30.0, 12.0, 33.0 |" in table
    assert len({line.count("|") for line in table.splitlines()}) == 1, "every row needs the same number of cells"
    with pytest.raises(ValueError, match="rounds=0"):
        runners.run_workload({}, requests, None, rounds=0)


def test_bench_refuses_rounds_below_one(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--rounds", "0"])
    assert "--rounds=0; it must be >= 1" in capsys.readouterr().err


def test_correctness_guard_reports_the_first_differing_token(monkeypatch):
    model = random_model()
    requests = [workloads.Request([10 + i, 20, 30], max_tokens=4, ignore_eos=True) for i in range(3)]
    assert runners.check_minicb_agrees(model, requests, slots=2, block_size=4, attention="torch") == []

    real_run_static = runners.run_static

    def off_by_one(*args, **kwargs):  # a static batcher that gets prompt 1's third token wrong
        result = real_run_static(*args, **kwargs)
        result.generations[1].token_ids[2] += 1
        return result

    monkeypatch.setattr(runners, "run_static", off_by_one)
    problems = runners.check_minicb_agrees(model, requests, slots=2, block_size=4, attention="torch")
    assert len(problems) == 1 and problems[0].startswith(
        "minicb-static, prompt 1: first difference at token 2: minicb-static"), problems


# ---- workloads -----------------------------------------------------------------------


def test_bundled_chat_prompts():
    prompts = load_chat_prompts()
    assert len(prompts) >= 100
    assert all(isinstance(p, str) and p.strip() for p in prompts), "every prompt must be a non-empty string"
    duplicates = sorted({p for p in prompts if prompts.count(p) > 1})
    assert not duplicates, f"duplicate prompts: {duplicates[:3]}"
    assert load_chat_prompts(5) == prompts[:5]
    for bad in (0, len(prompts) + 1, True, 2.0):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            load_chat_prompts(bad)


def test_random_requests_are_seeded_and_bounded():
    a = workloads.random_requests(vocab_size=256, num_prompts=50, max_tokens=40, max_prompt_len=30, seed=3)
    b = workloads.random_requests(vocab_size=256, num_prompts=50, max_tokens=40, max_prompt_len=30, seed=3)
    assert a == b
    assert all(8 <= len(r.prompt_ids) <= 30 and all(100 <= t < 256 for t in r.prompt_ids) for r in a)
    assert all(1 <= r.max_tokens <= 40 and r.ignore_eos for r in a)
    assert len({r.max_tokens for r in a}) > 5, "output lengths should vary"


def test_poisson_arrivals():
    times = workloads.poisson_arrivals(2000, rate=4.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    mean_gap = times[-1] / (len(times) - 1)
    assert math.isclose(mean_gap, 0.25, rel_tol=0.1), f"mean gap {mean_gap:.3f} s; expected about 1 / rate = 0.25 s"
    with pytest.raises(ValueError, match="rate=0"):
        workloads.poisson_arrivals(3, rate=0, seed=0)


def test_serve_in_batches_only_batches_arrived_requests():
    # A fake engine: every request gets len(prompt) tokens, one forward per 0.01 s.
    batches = []

    def run_batch(batch):
        batches.append([r.prompt_ids[0] for r in batch])
        n = max(len(r.prompt_ids) for r in batch)
        stamps = []
        for _ in range(n):
            time.sleep(0.01)
            stamps.append(time.perf_counter())
        return [[7] * len(r.prompt_ids) for r in batch], stamps, 8 * len(batch)

    requests = [workloads.Request([i] * (i + 1), max_tokens=8) for i in range(4)]
    result = runners.serve_in_batches(run_batch, requests, arrivals=[0.0, 0.0, 0.0, 0.3], batch_size=2,
                                    desc="fake", progress=False)
    # The first batch takes two of the three that arrived at 0; request 3 arrives long after.
    assert batches == [[0, 1], [2], [3]], f"batches formed: {batches}"
    assert [len(t) for t in result.token_ids] == [1, 2, 3, 4]
    late = result.timings[3]
    assert late.arrival == 0.3 and late.first_token >= 0.3 and late.finish > late.first_token
    # Request 0 (1 token) finished at the first forward; request 1 (2 tokens) one forward later.
    assert result.timings[0].finish == result.timings[0].first_token < result.timings[1].finish
    # Busy slots: batches of (1, 2), (3), (4) tokens in 2 slots take 2 + 3 + 4 steps; 10 of 18 slot-steps live.
    assert result.busy_slots == pytest.approx(10 / 18)


# ---- one smoke run of the whole command ----------------------------------------------


def test_bench_runs_every_engine_on_the_tiny_model(tmp_path, device):
    model = random_model()
    save_checkpoint(tmp_path / "tiny", model.config, model.state_dict())
    out = tmp_path / "bench" / "bench.json"
    threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    try:
        # Poisson arrivals take every engine through its arrival-handling path; the
        # tiny model has no tokenizer, so the prompts are random token ids with EOS ignored.
        code = cli.main(["--model", str(tmp_path / "tiny"), "--device", device, "--workload", "poisson",
                           "--num-prompts", "3", "--max-tokens", "5", "--slots", "2", "--hf-batch", "2",
                           "--rate", "50", "--threads", "1", "--out", str(out), "--rounds", "2",
                           "--engines", ",".join(runners.ENGINES)])
    finally:
        torch.set_num_threads(threads)
        numba.set_num_threads(numba_threads)
        cpu_attention._numba_threads = None  # --threads 1 is remembered for later threads; forget it
    assert code == 0
    report = json.loads(out.read_text())
    rows = report["workloads"]["poisson"]["engines"]
    for engine in runners.ENGINES:
        assert "error" not in rows[engine], f"{engine}: {rows[engine].get('error')}"
        assert rows[engine]["requests"] == 3 and rows[engine]["output_tok_s"] > 0
        assert len(rows[engine]["output_tok_s_rounds"]) == 2, f"{engine} must run once a round"
    # Same weights, same greedy decoding, same ignore_eos: minicb's engines agree exactly.
    assert rows["minicb-naive"]["same_as_continuous"] == rows["minicb-static"]["same_as_continuous"] == 3
    assert rows["minicb-prefix-cache"]["same_as_continuous"] == 3, "prefix caching must not change greedy tokens"
    assert rows["minicb-chunked"]["same_as_continuous"] == 3, "chunked prefill must not change greedy tokens"
    assert rows["minicb-spec"]["same_as_continuous"] == 3, "speculative decoding must not change greedy tokens"
    assert rows["minicb-spec"]["tokens_per_step"] >= 1 and rows["minicb-continuous"]["tokens_per_step"] == 1
    assert rows["minicb-chunked"]["itl_p99_s"] is not None and rows["hf-generate"]["itl_mean_s"] is not None
    # Random prompts share no prefix: the paged engines compute every prompt token, the
    # cache serves none, and engines that cannot see inside say n/a.
    assert rows["minicb-continuous"]["cache_hit_pct"] == rows["minicb-prefix-cache"]["cache_hit_pct"] == 0
    assert rows["minicb-continuous"]["prefill_tokens"] >= sum(len(r) for r in [[0] * 8] * 3)
    assert rows["hf-generate"]["prefill_tokens"] is None and rows["hf-generate"]["cache_hit_pct"] is None
    assert rows["minicb-naive"]["busy_slots"] == 1.0 and rows["hf-generate-batch"]["busy_slots"] is None
    for engine in ("minicb-static", "minicb-continuous", "hf-generate"):
        assert 0 < rows[engine]["busy_slots"] <= 1, (engine, rows[engine]["busy_slots"])
    assert report["meta"]["threads"] == 1
    assert "| minicb-continuous |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


def test_shared_prefix_requests_share_the_system_prompt_and_resend_turns():
    from minicb.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    requests = workloads.shared_prefix_requests(tokenizer, 6, max_tokens=8)
    prompts = [r.prompt_ids for r in requests]
    shared = next(n for n in range(min(map(len, prompts)) + 1)
                  if n == min(map(len, prompts)) or len({p[n] for p in prompts}) > 1)
    assert shared >= len(tokenizer.encode(workloads.SYSTEM_PROMPT)), (
        f"the requests share only their first {shared} tokens; the system prompt alone is "
        f"{len(tokenizer.encode(workloads.SYSTEM_PROMPT))}")
    answer = tokenizer.encode(workloads.EARLIER_ANSWER)
    resent = [i for i, r in enumerate(requests)
              if any(r.prompt_ids[j:j + len(answer)] == answer for j in range(len(r.prompt_ids)))]
    assert resent == [2, 5], f"every third request should resend an earlier turn; these do: {resent}"


def test_long_prompt_requests_mix_long_documents_into_chat():
    from minicb.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    requests = workloads.long_prompt_requests(tokenizer, 8, max_tokens=32)
    lengths = [len(r.prompt_ids) for r in requests]
    long_ones = [i for i, n in enumerate(lengths) if n >= 1000]
    assert long_ones == [3, 7], f"every 4th prompt should be 1,000+ tokens: lengths {lengths}"
    assert requests[3].prompt_ids != requests[7].prompt_ids, "the long prompts should differ"
    assert [r.max_tokens for r in requests] == [32, 32, 32, 16] * 2, "long prompts get 16 new tokens at most"


def test_repeat_requests_ask_to_copy_their_text():
    from minicb.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    requests = workloads.repeat_requests(tokenizer, 8, max_tokens=32, seed=0)
    texts = [tokenizer.decode(r.prompt_ids) for r in requests]
    for i, text in enumerate(texts):
        task = workloads.REPEAT_TASKS[i % len(workloads.REPEAT_TASKS)].split("{")[0].strip()
        assert task in text, f"request {i} should carry task {task!r}: {text[:200]!r}"
    # Every task meets every passage, and the typo task's passage has typos in it.
    assert len({tuple(r.prompt_ids) for r in requests}) == 8, "the 8 prompts should all differ"
    assert not any(text in texts[0] for text in workloads.REPEAT_TEXTS), "the typo task's text should have typos"
    assert workloads.add_typos("abcdef " * 50, random.Random(1)) != "abcdef " * 50
