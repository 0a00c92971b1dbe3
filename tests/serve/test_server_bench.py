"""`python -m minicb bench-serve` against a live server (the tiny model): a report with sane numbers.

The numbers themselves are timings and vary; what must hold is their
arithmetic: every request completes, output tokens are the server's own count,
p50 <= p99, TTFT <= latency, and throughput is tokens over the run's wall time.
"""
from __future__ import annotations

import json

import pytest

from minicb.bench import serve as bench_serve
from serve_support import TINY, metric, tiny_server


@pytest.mark.parametrize("load", [["--request-rate", "inf"], ["--request-rate", "40", "--max-concurrency", "4"]],
                         ids=["all-at-once", "poisson-capped"])
def test_bench_serve_reports_sane_numbers(tmp_path, capsys, load):
    out = tmp_path / "serve.json"
    with tiny_server(max_num_seqs=4) as (url, _):
        code = bench_serve.main(["--url", url, "--num-prompts", "10", "--max-tokens", "12", "--json", str(out),
                                 "--timeout", "60", *load])
        import httpx
        generated = metric(httpx.get(url + "/metrics", timeout=10).text, "minicb_generation_tokens_total")
    assert code == 0
    printed = capsys.readouterr().out
    assert "| TTFT (ms) |" in printed and "| output tokens |" in printed and "tok/s" in printed

    report = json.loads(out.read_text())
    s, meta = report["summary"], report["meta"]
    assert meta["model"] == TINY and meta["num_prompts"] == 10
    assert s["completed"] == 10 and s["failed"] == 0
    records = report["requests"]
    assert sorted(r["index"] for r in records) == list(range(10))
    assert all(1 <= r["output_tokens"] <= 12 and r["prompt_tokens"] > 0 for r in records)
    # The warm-up request's tokens count on the server, not in the report.
    assert s["output_tokens"] == sum(r["output_tokens"] for r in records) <= generated
    for key in ("ttft_s", "latency_s", "itl_s", "tpot_s"):
        stats = s[key]
        assert stats["mean"] > 0 and 0 < stats["p50"] <= stats["p99"], key
    assert all(0 < r["ttft"] <= r["latency"] for r in records)
    assert s["latency_s"]["p99"] <= s["wall_s"] + 1e-6
    assert s["output_token_throughput"] == pytest.approx(s["output_tokens"] / s["wall_s"])
    assert s["request_throughput"] == pytest.approx(10 / s["wall_s"])


def test_bench_serve_reports_an_unreachable_server(capsys):
    assert bench_serve.main(["--url", "http://127.0.0.1:9", "--num-prompts", "2", "--timeout", "5"]) == 2
    assert "could not benchmark" in capsys.readouterr().err
