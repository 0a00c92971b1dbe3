"""What the tests of tools/ share: a script of tools/ loaded as a module.

tools/ is a folder of scripts, not a package, so its files are loaded from their path.
"""
from __future__ import annotations

import importlib.util
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
