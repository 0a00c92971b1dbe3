"""tools/chunked_budget_sweep.py: its --quick mode runs whole, writes its table and plot, and reports sane numbers.

The real sweep runs SmolLM2 for minutes; --quick runs the same code on the tiny
random model in seconds. The numbers checked here do not depend on timing:
greedy tokens are the same for every budget, no step computes more than its
budget, and a smaller budget takes more steps.
"""
import re

import numba
import pytest
import torch

from minicb import cpu_attention

from tool_support import load_tool


@pytest.fixture(scope="module")
def sweep():
    return load_tool("chunked_budget_sweep")


def test_quick_sweep_writes_a_sane_table_and_a_plot(sweep, tmp_path, capsys):
    out = tmp_path / "sweep" / "budget.png"
    threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    try:  # two rounds in turns: the medians' path
        assert sweep.main(["--quick", "--threads", "1", "--repeats", "2", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
        numba.set_num_threads(numba_threads)
        cpu_attention._numba_threads = None  # --threads 1 is remembered for later threads; forget it
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = "\n".join(line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("|"))
    assert table in capsys.readouterr().out, "the table printed is the table saved"
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and re.fullmatch(r"whole|\d+", cells[0]):
            rows[cells[0]] = cells
    budgets = [int(b) for b in sweep.QUICK["budgets"].split(",")]
    assert list(rows) == ["whole", *map(str, budgets)], f"one row for whole admission, then one a budget:\n{table}"
    num = sweep.QUICK["num_prompts"]
    for name, (_, itl_mean, itl_p99, ttft, tok_s, largest, steps, same) in rows.items():
        assert same == f"{num}/{num}", f"{name}: chunking must not change greedy tokens ({same})"
        assert 0 < float(itl_mean.split()[0]) <= float(itl_p99.split()[0]), (name, itl_mean, itl_p99)
        assert float(ttft.split()[0]) >= 0 and float(tok_s) > 0, (name, ttft, tok_s)
        if name != "whole":
            assert int(largest) <= int(name), f"budget {name}: a step computed {largest} tokens"
    assert int(rows["whole"][5]) >= sweep.QUICK_LONG_PROMPT, "whole admission computes a long prompt in one step"
    assert int(rows[str(budgets[0])][6]) > int(rows[str(budgets[-1])][6]), "a smaller budget takes more steps"


def test_bad_budgets_are_refused(sweep):
    for bad in (["--budgets", "64,x"], ["--budgets", "0,64"], ["--max-tokens", "1"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--quick", *bad])
    args = sweep.parse_args(["--budgets", "256,32,32"])
    assert args.budgets == [32, 256] and args.num_prompts == sweep.DEFAULTS["num_prompts"]
