"""OpenMP's wait policy: importing minicb leaves it to the environment and libgomp.

minicb once set OMP_WAIT_POLICY=PASSIVE as it loaded, which cost a quarter of a
decode step on an idle machine; now the engine follows the machine's load by its
thread count instead (minicb/cpu_threads.py, tests/engine/test_cpu_threads.py).
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
def test_importing_minicb_first_sets_no_policy(first_import):
    got = policy_after(f"{first_import}; import torch", None)
    assert got is None, f"after `{first_import}` OMP_WAIT_POLICY is {got!r}; minicb must leave it unset"


@pytest.mark.parametrize("policy", ["ACTIVE", "PASSIVE"])
def test_a_policy_in_the_environment_stays(policy):
    got = policy_after("import minicb; import torch", policy)
    assert got == policy, f"minicb replaced the caller's OMP_WAIT_POLICY={policy} with {got!r}"
