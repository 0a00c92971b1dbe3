"""minicb: learn LLM serving by building it, from naive generation to continuous batching.

    from minicb import LLM, SamplingParams
    llm = LLM()
    print(llm.generate(["What is 2+2?"], SamplingParams(max_tokens=32))[0].text)

The chapters map to files as README.md's table shows.
"""
import os
import sys

# The course release: what a student's exercise files are written against. pyproject.toml
# reads the version from here; chapters/CHANGELOG.md has an entry for each release, with
# its date and the commit it starts from, and `python -m minicb check` names it.
__version__ = "0.2.0"
__course_date__ = "2026-12-03"

# OpenMP threads that finish a parallel op spin, waiting for the next, unless told
# to sleep. Alone on a machine that saves microseconds; beside a browser, Jupyter
# or another job, the spinning threads take the cores the others need and the
# step waits for them (docs/results.md, "Threads on a busy machine"). The policy is read
# once, when torch loads its OpenMP runtime, so it can only be chosen here, before
# the first `import torch`. A value already in the environment wins, and a program
# that imported torch before minicb keeps torch's default.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput"]


def __getattr__(name):
    # LLM pulls in torch, transformers and the engine, SamplingParams torch; load them
    # on first use so `import minicb.trace` or `python -m minicb serve --help` stays light.
    if name in ("SamplingParams", "StructuredOutput"):
        from minicb import sampling
        return getattr(sampling, name)
    if name in ("LLM", "RequestOutput"):
        from minicb import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'minicb' has no attribute {name!r}")
