"""minicb: learn LLM serving by building it, from naive generation to continuous batching.

    from minicb import LLM, SamplingParams
    llm = LLM()
    print(llm.generate(["What is 2+2?"], SamplingParams(max_tokens=32))[0].text)

The chapters map to files as README.md's table shows.
"""
from minicb.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    # LLM pulls in torch, transformers and the engine; load it on first use so
    # `import minicb.trace` or `minicb.viz` stays light.
    if name in ("LLM", "RequestOutput"):
        from minicb import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'minicb' has no attribute {name!r}")
