"""minicb: learn LLM serving by building it, from naive generation to continuous batching.

    from minicb import LLM, SamplingParams
    llm = LLM()
    print(llm.generate(["What is 2+2?"], SamplingParams(max_tokens=32))[0].text)

The chapters map to files as README.md's table shows.
"""
# The course release: what a student's exercise files are written against. pyproject.toml
# reads the version from here; chapters/CHANGELOG.md has an entry for each release, with
# its date and the commit it starts from, and `python -m minicb check` names it.
__version__ = "0.2.0"
__course_date__ = "2026-12-03"

# OpenMP's wait policy is left to libgomp: a thread that finishes a parallel op spins
# a while for the next one, which on an idle machine is worth a quarter of a decode
# step. Beside busy programs the spinning threads would take the cores those need,
# so the engine runs on the cores they leave free instead (minicb/cpu_threads.py,
# EngineConfig.cpu_threads): one thread has nothing to spin. minicb used to set
# OMP_WAIT_POLICY=PASSIVE here, which never spins and cost that quarter everywhere
# (docs/results.md, "Threads on a busy machine"). A value in the environment is
# still torch's to read.

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
