"""tools/eval_check.py on small samples files in lm-eval's format: what it reads, and what it calls a difference.

make eval-check takes minutes and a second venv; this is the part of it that
decides pass or fail, checked in milliseconds without lm-eval. The fixtures are
lines as lm-eval 0.4 writes them (numbers as strings, one [loglikelihood,
is_greedy] pair per choice), cut down to the fields the tool reads.
"""
import json

import pytest

from tool_support import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("eval_check")


def mc_line(doc_id, loglikelihoods, acc, prompt_hash="p"):
    """A multiple-choice document as lm-eval writes it in samples_<task>_<date>.jsonl."""
    return {"doc_id": doc_id, "doc": {"question": "?"}, "target": "0",
            "arguments": {f"gen_args_{i}": {"arg_0": "Question: ?\nAnswer:", "arg_1": f" c{i}"}
                          for i in range(len(loglikelihoods))},
            "resps": [[[str(ll), "False"]] for ll in loglikelihoods],
            "filtered_resps": [[str(ll), "False"] for ll in loglikelihoods],
            "filter": "none", "metrics": ["acc", "acc_norm"], "doc_hash": "d", "prompt_hash": prompt_hash,
            "target_hash": "t", "acc": acc, "acc_norm": acc}


def gen_line(doc_id, text, exact_match):
    return {"doc_id": doc_id, "doc": {"answer": "Paris"}, "target": "Paris",
            "arguments": {"gen_args_0": {"arg_0": "Q: ?\nA:", "arg_1": {"until": ["\n"]}}},
            "resps": [[" " + text]], "filtered_resps": [text], "filter": "strip",
            "metrics": ["exact_match"], "doc_hash": "d", "prompt_hash": "g", "target_hash": "t",
            "exact_match": exact_match}


MC_LL0 = [-10.5, -13.25, -18.0, -19.5]
MC = [mc_line(0, MC_LL0, 1.0), mc_line(1, [-9.0, -7.5, -12.0, -8.0], 1.0)]
GEN = [gen_line(0, "Paris", 1.0), gen_line(1, "7", 0.0)]


def write_run(out, backend, task, lines, metrics, wall_s):
    """The folder one lm-eval run leaves, as tools/eval_check.sh lays it out."""
    folder = out / backend / task / "model__name"
    folder.mkdir(parents=True)
    (folder / f"samples_{task}_2026-01-01T00-00-00.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    results = {"results": {task: {"alias": task, **metrics}}, "lm_eval_version": "0.4.13",
               "transformers_version": "5.0"}
    (folder / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results))
    (out / backend / task / "wall_s").write_text(f"{wall_s}\n")
    (out / backend / task / "evaluate_s").write_text(f"{wall_s - 2}\n")
    (out / backend / task / "load").write_text("1.5\n")


def runs(tool, ours, reference, kind="mc"):
    task = f"t_{kind}"
    return (tool.Run("minicb", task, {s.doc_id: s for s in map(tool.parse_sample, ours)}, {}, 1.0),
            tool.Run("hf", task, {s.doc_id: s for s in map(tool.parse_sample, reference)}, {}, 3.0))


def test_reads_loglikelihoods_and_generations_from_lm_evals_strings(tool):
    mc = tool.parse_sample(MC[0])
    assert mc.loglikelihoods == [-10.5, -13.25, -18.0, -19.5] and mc.generation is None
    assert mc.metrics == {"acc": 1.0, "acc_norm": 1.0}
    gen = tool.parse_sample(GEN[1])
    assert gen.generation == "7" and gen.loglikelihoods is None and gen.metrics == {"exact_match": 0.0}


def test_a_bad_line_is_named(tool, tmp_path):
    path = tmp_path / "samples_x.jsonl"
    path.write_text(json.dumps(MC[0]) + "\n" + json.dumps({**MC[1], "resps": [[["nan?", "False"]]]}) + "\n")
    with pytest.raises(ValueError, match="line 2.*'nan\\?'"):
        tool.read_samples(path)


def test_equal_runs_and_differences_within_the_tolerance_pass(tool):
    close = [mc_line(0, [-10.5 + 5e-5, -13.25, -18.0, -19.5 - 9e-5], 1.0), MC[1]]
    result = tool.compare(*runs(tool, close, MC))
    assert result.ok, result.problems
    assert result.num_scores == 8
    assert result.max_abs_diff == pytest.approx(9e-5) and result.worst == "doc 0, choice 3"


def test_a_loglikelihood_past_the_tolerance_fails_naming_document_and_choice(tool):
    off = [MC[0], mc_line(1, [-9.0, -7.5, -12.0 + 2e-4, -8.0], 1.0)]
    problems = tool.compare(*runs(tool, off, MC)).problems
    assert len(problems) == 1 and problems[0].startswith("doc 1, choice 2:"), problems


def test_nan_or_a_missing_choice_fails(tool):
    assert not tool.compare(*runs(tool, [mc_line(0, [float("nan"), -13.25, -18.0, -19.5], 1.0), MC[1]], MC)).ok
    assert not tool.compare(*runs(tool, [mc_line(0, [-10.5, -13.25, -18.0], 1.0), MC[1]], MC)).ok


def test_other_prompts_other_documents_or_other_scores_fail(tool):
    assert "different prompts" in tool.compare(*runs(tool, [mc_line(0, MC_LL0, 1.0, "q"), MC[1]], MC)).problems[0]
    assert "documents differ" in tool.compare(*runs(tool, MC[:1], MC)).problems[0]
    rescored = tool.compare(*runs(tool, [mc_line(0, MC_LL0, 0.0), MC[1]], MC)).problems
    assert rescored and "scored" in rescored[0]



def test_a_different_generation_fails_even_when_both_score_zero(tool):
    assert tool.compare(*runs(tool, GEN, GEN, "gen")).ok
    problems = tool.compare(*runs(tool, [GEN[0], gen_line(1, "seven!", 0.0)], GEN, "gen")).problems
    assert problems == ["doc 1: generated 'seven!' (minicb) vs '7' (hf)"]


def test_task_metrics_must_be_equal(tool):
    ours, reference = runs(tool, MC, MC)
    ours.metrics, reference.metrics = {"acc,none": 0.9}, {"acc,none": 0.9 + 1e-6}
    assert tool.compare(ours, reference).problems == ["acc,none: 0.9 (minicb) vs 0.900001 (hf)"]


def test_main_reads_the_scripts_layout_prints_the_table_and_exits_by_the_outcome(tool, tmp_path, capsys):
    mc_metrics = {"acc,none": 1.0, "acc_stderr,none": 0.0, "acc_norm,none": 1.0, "acc_norm_stderr,none": 0.0}
    gen_metrics = {"exact_match,strip": 0.5, "exact_match_stderr,strip": 0.5}
    for backend, wall in (("minicb", 10.0), ("hf", 25.0)):
        write_run(tmp_path, backend, "facts_mc", MC, mc_metrics, wall)
        write_run(tmp_path, backend, "facts_gen", GEN, gen_metrics, wall / 5)
    report = tmp_path / "report.md"
    assert tool.main([str(tmp_path), "--tasks", "facts_mc", "facts_gen", "--report", str(report),
                      "--min-speedup", "2"]) == 0
    out = capsys.readouterr().out
    assert f"CPU: {tool.cpu_model()}" in out and report.read_text().strip() in out
    row = next(line for line in out.splitlines() if line.startswith("| facts_mc "))
    assert row.split(" | ")[1:] == ["2", "acc / acc_norm", "1.0000 / 1.0000", "1.0000 / 1.0000", "8",
                                    "0.0e+00", "10.0", "25.0", "2.50x", "8.0", "23.0", "2.88x",
                                    "1.5 / 1.5", "ok |"]

    # The same runs, but the goal set higher than minicb reached: a failure, named.
    assert tool.main([str(tmp_path), "--min-speedup", "3"]) == 1
    assert "facts_mc: minicb 8.0 s vs hf 23.0 s (evaluate()), 2.88x; the goal is 3x" in capsys.readouterr().err

    # One choice of one document scored differently by minicb: exit 1, and the document named.
    (tmp_path / "minicb" / "facts_mc").joinpath("model__name", "samples_facts_mc_2026-01-01T00-00-00.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in [MC[0], mc_line(1, [-9.0, -7.4, -12.0, -8.0], 1.0)]))
    assert tool.main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "FAIL (1)" in captured.out and "facts_mc: doc 1, choice 1: log-likelihood -7.400000 (minicb)" in captured.err


def test_a_missing_run_says_which(tool, tmp_path):
    write_run(tmp_path, "minicb", "facts_mc", MC, {"acc,none": 1.0}, 1.0)
    with pytest.raises(FileNotFoundError, match="hf/facts_mc"):
        tool.main([str(tmp_path)])
