"""Shared pytest setup.

`--impl student` runs the chapter tests against chapters/NN-*/exercise.py
instead of the reference in minicb/ (the same as MINICB_IMPL=student).
"""
import os


def pytest_addoption(parser):
    parser.addoption("--impl", choices=["reference", "student"], default=None,
                     help="which implementation the chapter tests load (default: MINICB_IMPL or reference)")


def pytest_configure(config):
    choice = config.getoption("--impl")
    if choice:
        os.environ["MINICB_IMPL"] = choice


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    """The device tests run on: MINICB_DEVICE (make gpu-check sets 'cuda'), else cpu."""
    name = os.environ.get("MINICB_DEVICE", "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"MINICB_DEVICE={name} but torch.cuda.is_available() is False")
    return name
