"""tools/soak.py, short: 20 s of mixed requests against a tiny-model server in a child process.

The maintainer's soak runs for minutes; this one runs the same code for 20 s
(about 50 s in all, with the warm-up, two rests and the shutdown) and checks
that the tool's verdict passes on today's server and that its counts are
sensible: every kind of request was sent, every good one was answered well,
every bad one got its 4xx, nothing failed, and the server's /health shows every
KV block free at the end. Two small tests check the pieces the verdict rests
on: /proc is read right, and the bounds fail when they should.
"""
import json
import os

import pytest

from minicb.impl import ROOT

from tool_support import load_tool

SCRIPT = ROOT / "tools" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    return load_tool("soak")


def test_a_short_soak_passes_with_every_kind_of_request(soak, tmp_path, capsys):
    out = tmp_path / "soak.json"
    # --threads 1: the server's torch pool, on a CPU shared with the tool's own clients.
    code = soak.main(["--duration", "20", "--json", str(out), "--", "--threads", "1"])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0 and result["passed"], f"the soak failed:\n{printed}"

    for kind, counts in result["requests"].items():
        assert counts["sent"] > 0, f"no {kind} request was sent in 20 s:\n{printed}"
        assert counts["ok"] == counts["sent"], f"{kind}: {counts}:\n{printed}"
    bad = sum(result["requests"][kind]["sent"] for kind in soak.BAD_KINDS)
    assert result["errors"] == {**{k: 0 for k in soak.ERROR_KINDS}, "expected_4xx": bad}, result["errors"]
    assert result["soak_requests"] == sum(c["sent"] for c in result["requests"].values())
    assert result["warmup_requests"] == 64

    health = result["health"]
    assert health["kv_blocks_free"] == health["kv_blocks"] > 0 and health["step_failures"] == 0, health
    # The samples: some under load (its client connections open), the two at rest around them.
    phases = [s["phase"] for s in result["samples"]]
    assert phases.count("start") == phases.count("end") == 1 and phases.count("soak") >= 5, phases
    start, end = result["start"], result["end"]
    assert start["rss_mib"] > 10 and start["fds"] > 0 and start["threads"] > 1, start
    assert max(s["fds"] for s in result["samples"] if s["phase"] == "soak") > start["fds"], \
        "the clients' connections never showed among the server's fds: is the right process watched?"
    assert end["rss_mib"] <= start["rss_mib"] * 1.05 and end["fds"] <= start["fds"], (start, end)


def test_read_process_counts_what_a_process_holds(soak):
    before = soak.read_process(os.getpid())
    files = [open(SCRIPT) for _ in range(3)]
    try:
        during = soak.read_process(os.getpid())
    finally:
        for f in files:
            f.close()
    assert during["fds"] == before["fds"] + 3, (before, during)
    assert before["threads"] >= 1 and before["rss_mib"] > 10, before


def test_the_verdict_fails_past_each_bound(soak):
    start = {"rss_mib": 400.0, "fds": 7, "threads": 5}
    health = {"kv_blocks_free": 64, "kv_blocks": 64, "step_failures": 0}
    errors = {k: 0 for k in soak.ERROR_KINDS}

    def failed(end=start, errors=errors, health=health, exit_code=0):
        checks = soak.verdict(start, end, errors, health, exit_code, own_server=True)
        return sorted(name for name, check in checks.items() if not check["ok"])

    assert failed() == []
    assert failed(end={**start, "rss_mib": 400 * 1.049}) == []
    assert failed(end={**start, "rss_mib": 400 * 1.051}) == ["memory"]
    assert failed(end={**start, "fds": 8}) == ["fds"]
    assert failed(end={**start, "threads": 6}) == ["threads"]
    assert failed(errors={**errors, "expected_4xx": 9}) == []
    for kind in ("unexpected_4xx", "5xx", "connection", "wrong_answer"):
        assert failed(errors={**errors, kind: 1}) == ["errors"], kind
    assert failed(health={**health, "kv_blocks_free": 63}) == ["health"]
    assert failed(health={**health, "step_failures": 1}) == ["health"]
    assert failed(exit_code=1) == ["exit"]
