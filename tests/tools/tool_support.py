"""What the tests of tools/ share: a script of tools/ loaded as a module, quiet children, and whether a
file runs whole in this process.

tools/ is a folder of scripts, not a package, so its files are loaded from their path.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types

from minicb.impl import ROOT


def load_tool(name: str) -> types.ModuleType:
    """tools/<name>.py as a module named `name`, its main() not run."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass in the file looks its module up while the file runs
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def sleeping_children():
    """Child processes started inside get OMP_WAIT_POLICY=PASSIVE and no GOMP_SPINCOUNT.

    For grading two children at once on two cores: OpenMP threads that spin between
    operators (make test's GOMP_SPINCOUNT, right for one process alone) take the cores
    from each other. test_mutants.py took 327 s with them spinning and 171 s asleep
    (Intel Xeon, 2 cores, 2026-12-04). The environment is put back on the way out.
    """
    saved = {name: os.environ.pop(name, None) for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def runs_whole_files(config) -> bool:
    """Whether this process runs every selected test of a file, so that a fixture may start them all
    ahead: no pytest-xdist, or xdist handing out whole files (make test's `--dist loadfile`). With
    `-n N` alone xdist spreads a file's tests over its workers, and each would grade them all."""
    return config.getoption("dist", "no") in ("no", "loadfile", "loadscope")
