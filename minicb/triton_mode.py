"""Chapter 05: choosing, once per process, whether Triton kernels compile or run interpreted.

Triton decides when a kernel is defined (`@triton.jit`), and it decides for its
own library of kernels (`tl.sum`, `tl.max`, ...) when `triton.language` is first
imported: with TRITON_INTERPRET=1 in the environment they become Python
functions run by the interpreter, on CPU tensors; without it they compile for
the GPU and read CUDA tensors. Both halves must agree, so the choice has to be
made before anything imports triton, and it holds for the whole process.

minicb makes it in this one function, and only where a program starts: the
CLI (`python -m minicb`), the tests (tests/conftest.py), the notebooks, chapter
05's exercise file, and `python -m minicb.triton_attention`. Importing a
library module never changes the environment. A script of your own that runs
`attention="triton"` on a machine without CUDA calls it first:

    from minicb.triton_mode import choose_triton_mode
    choose_triton_mode()          # before anything imports triton

Chapter text: chapters/05-triton-attention/README.md, "Developing without a GPU".
"""
from __future__ import annotations

import os
import sys


def choose_triton_mode() -> bool:
    """Interpret Triton kernels on the CPU when there is no CUDA GPU. Returns True if interpreting.

    A TRITON_INTERPRET the user has set is left alone (TRITON_INTERPRET=1 forces
    the interpreter on a GPU machine too, to debug). Calling it again is free.
    """
    import torch  # here, not at the top: this module must stay cheap to import

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        if "triton" in sys.modules:
            # Too late: triton.language's own kernels were defined compiled, and
            # interpreted kernels calling them would fail deep inside Triton.
            raise RuntimeError("choose_triton_mode() must run before anything imports triton, but triton is "
                               "already imported; call it first thing, or start Python with TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
