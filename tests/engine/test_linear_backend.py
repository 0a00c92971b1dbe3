"""The matmul library chosen by measurement (minicb/linear_backend.py).

The decision is held to timings handed in, so that it can be seen to pick each
library when that one is the faster; the layers are held to the library they
were given (bit for bit against F.linear or oneDNN's own product); and SmolLM2's
greedy tokens stay HF's with either library.
"""
from __future__ import annotations

import json

import pytest
import torch

from minicb import LLM, SamplingParams
from minicb.config import EngineConfig
from minicb import linear_backend
from minicb.linear_backend import ALWAYS_MKL, pick_thresholds, use_linear_backend
from minicb.model import random_model
from minicb.packed_linear import FusedLinears, PackedLinear, available, pack_linears, packed_layers

ROWS = [1, 4, 32]
pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN packed linear")


def timings(shape, mkl: list[float], onednn: list[float]) -> dict:
    """Injected timings for one shape at ROWS."""
    return {**{(shape, r, "mkl"): t for r, t in zip(ROWS, mkl)},
            **{(shape, r, "onednn"): t for r, t in zip(ROWS, onednn)}}


@pytest.mark.parametrize("mkl, onednn, threshold", [
    ([1.0, 2.0, 9.0], [2.0, 1.0, 5.0], 4),          # MKL at one row (an Intel CPU), oneDNN from 4
    ([2.0, 2.0, 9.0], [1.0, 1.0, 5.0], 0),          # oneDNN everywhere (the AMD machine)
    ([1.0, 1.0, 5.0], [2.0, 2.0, 9.0], ALWAYS_MKL),  # MKL everywhere
    ([2.0, 1.0, 9.0], [1.0, 2.0, 5.0], 32),         # oneDNN at 1 but not at 4: only from 32 on
    ([1.0, 2.0, 5.0], [2.0, 1.0, 9.0], ALWAYS_MKL),  # oneDNN not at the largest: MKL for all
])
def test_the_faster_library_is_picked_per_row_range(mkl, onednn, threshold):
    shape = (8, 16)
    assert pick_thresholds(timings(shape, mkl, onednn), ROWS) == {shape: threshold}


def packed_tiny():
    model = pack_linears(random_model(seed=1))
    layers = packed_layers(model)
    assert {type(m) for m in layers} == {PackedLinear, FusedLinears}, f"the tiny model's products: {layers}"
    return model, layers


def test_each_layer_takes_the_library_it_was_given_by_row_count():
    model, layers = packed_tiny()
    shapes = {(m.in_features, m.out_features) for m in layers}
    injected = {}
    for shape in shapes:
        injected |= timings(shape, [1.0, 2.0, 9.0], [2.0, 1.0, 5.0])  # MKL below 4 rows, oneDNN from 4
    choice = use_linear_backend(model, "auto", ROWS, timings=injected)
    assert all(m.mkl_below == 4 for m in layers) and "mkl below 4 rows" in choice.describe()
    with torch.inference_mode():
        for layer in (next(m for m in layers if isinstance(m, kind)) for kind in (PackedLinear, FusedLinears)):
            for rows, want in ((1, "mkl"), (3, "mkl"), (4, "onednn"), (40, "onednn")):
                x = torch.randn(rows, layer.in_features)
                got, expected = layer(x), layer.plain(x) if want == "mkl" else layer.onednn(x)
                if isinstance(layer, PackedLinear):
                    got, expected = [got], [expected]
                assert all(torch.equal(a, b) for a, b in zip(got, expected)), \
                    f"{type(layer).__name__}: {rows} rows should go to {want}"
    use_linear_backend(model, "onednn", ROWS)
    assert all(m.mkl_below == 0 for m in layers)
    use_linear_backend(model, "mkl", ROWS)
    assert all(m.mkl_below == ALWAYS_MKL for m in layers)


def test_auto_measures_every_shape_at_every_row_count():
    model, layers = packed_tiny()
    choice = use_linear_backend(model, "auto", ROWS)
    shapes = {(m.in_features, m.out_features) for m in layers}
    assert set(choice.timings) == {(s, r, lib) for s in shapes for r in ROWS for lib in ("mkl", "onednn")}
    assert set(choice.thresholds) == shapes and choice.seconds > 0


def test_auto_times_every_layer_of_a_shape_not_one_again_and_again(monkeypatch):
    # One layer timed repeatedly is its weight warm in the cache; a step reads every weight cold.
    model, layers = packed_tiny()
    seen = {"plain": set(), "onednn": set()}
    for kind in (PackedLinear, FusedLinears):
        for library in seen:
            def spy(self, x, call=getattr(kind, library), library=library):
                seen[library].add(id(self))
                return call(self, x)
            monkeypatch.setattr(kind, library, spy)
    use_linear_backend(model, "auto", ROWS)
    for library, ids in seen.items():
        assert ids == {id(m) for m in layers}, f"{library}: timed {len(ids)} of the {len(layers)} products"


def counting_measure(monkeypatch) -> list:
    """Count calls of linear_backend.measure, which still measures."""
    calls, measure = [], linear_backend.measure
    monkeypatch.setattr(linear_backend, "measure", lambda *args: calls.append(args) or measure(*args))
    return calls


def test_a_later_engine_reads_the_timings_an_earlier_one_kept(tmp_path, monkeypatch):
    model, layers = packed_tiny()
    cache = tmp_path / "linear_choice.json"
    measured = counting_measure(monkeypatch)
    first = use_linear_backend(model, "auto", ROWS, cache=cache)
    second = use_linear_backend(model, "auto", ROWS, cache=cache)
    assert len(measured) == 1, f"measured {len(measured)} times; the second call should read {cache}"
    assert second.timings == first.timings and second.thresholds == first.thresholds
    assert second.seconds == first.seconds and second.kept_in == str(cache) and str(cache) in second.describe()
    assert not first.kept_in and "read from" not in first.describe()


@pytest.mark.parametrize("change", ["rows", "threads", "cpu"])
def test_timings_kept_for_another_cpu_thread_count_or_rows_are_measured_again(change, tmp_path, monkeypatch):
    model, _ = packed_tiny()
    cache = tmp_path / "linear_choice.json"
    use_linear_backend(model, "auto", ROWS, cache=cache)
    measured = counting_measure(monkeypatch)
    rows = [1, 4, 16] if change == "rows" else ROWS
    if change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    if change == "cpu":
        monkeypatch.setattr(linear_backend, "cpu_model", lambda: "Another CPU (family 6, model 143; AVX-512)")
    choice = use_linear_backend(model, "auto", rows, cache=cache)
    assert len(measured) == 1 and not choice.kept_in, f"another {change} read the timings kept for this one"
    assert len(json.loads(cache.read_text())) == 2, "the file should keep both measurements"


def test_an_unreadable_cache_is_measured_again_and_written_anew(tmp_path, monkeypatch):
    model, _ = packed_tiny()
    cache = tmp_path / "linear_choice.json"
    cache.write_text('{"half a file')
    measured = counting_measure(monkeypatch)
    choice = use_linear_backend(model, "auto", ROWS, cache=cache)
    assert len(measured) == 1 and not choice.kept_in
    assert use_linear_backend(model, "auto", ROWS, cache=cache).kept_in == str(cache)
    use_linear_backend(model, "onednn", ROWS, cache=tmp_path / "forced.json")
    assert not (tmp_path / "forced.json").exists(), "a forced library measures nothing, so keeps nothing"


def test_a_model_without_packed_layers_runs_mkl_and_refuses_onednn():
    model = random_model(seed=1)
    assert "no packed layers" in use_linear_backend(model, "auto", ROWS).describe()
    with pytest.raises(ValueError, match="linear_backend='onednn' needs oneDNN-packed"):
        use_linear_backend(model, "onednn", ROWS)
    with pytest.raises(ValueError, match="linear_backend='blas' is not one of"):
        use_linear_backend(model, "blas", ROWS)
    with pytest.raises(ValueError, match="linear_backend='blas' is not one of"):
        EngineConfig(linear_backend="blas")


@pytest.mark.slow
def test_smollm2_greedy_tokens_are_hf_s_with_either_library():
    from transformers import AutoModelForCausalLM

    from minicb import weights
    from minicb.data import load_chat_prompts

    hf = AutoModelForCausalLM.from_pretrained(str(weights.resolve_checkpoint(None)), dtype=torch.float32).eval()
    for backend in ("mkl", "onednn"):
        llm = LLM(device="cpu", linear_backend=backend, max_num_seqs=4)
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in load_chat_prompts(3)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=24), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
            eos = llm.tokenizer.eos_token_id
            want = want[:want.index(eos) + 1] if eos in want else want  # HF pads after EOS; the engine stops
            assert out.token_ids == want, f"{backend}: {out.token_ids} against HF's {want}"
