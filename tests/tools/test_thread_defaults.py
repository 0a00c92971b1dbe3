"""OpenMP's wait policy: minicb chooses PASSIVE before torch loads, unless told otherwise.

Each case runs in a fresh process: the policy only counts when it is in the
environment as torch's OpenMP runtime loads, so what matters is the order of
imports there. (Its effect on throughput is measured by tools/busy_bench.py.)
"""
import os
import subprocess
import sys

import pytest

REPORT = "import os; print(repr(os.environ.get('OMP_WAIT_POLICY')))"


def policy_after(code: str, env_policy: str | None) -> str | None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", f"{code}; {REPORT}"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first_import", ["import minicb", "import minicb.engine", "from minicb import LLM"])
def test_importing_minicb_first_sets_passive(first_import):
    got = policy_after(f"{first_import}; import torch", None)
    assert got == "PASSIVE", f"after `{first_import}` OMP_WAIT_POLICY is {got!r}; want 'PASSIVE'"


def test_a_policy_in_the_environment_wins():
    got = policy_after("import minicb; import torch", "ACTIVE")
    assert got == "ACTIVE", f"minicb replaced the caller's OMP_WAIT_POLICY=ACTIVE with {got!r}"


def test_torch_imported_first_keeps_its_default():
    # Setting the variable after torch's runtime has loaded would only mislead: leave it alone.
    got = policy_after("import torch; import minicb", None)
    assert got is None, f"minicb set OMP_WAIT_POLICY={got!r} after torch had loaded"
