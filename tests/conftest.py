"""Shared fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def swap_dir(tmp_path):
    """A fresh directory to use as an NVMe swap path (on the real disk, O_DIRECT capable)."""
    d = tmp_path / "swap"
    yield str(d)
    # Tests assert themselves that nothing is left behind; this is just hygiene.


def pytest_report_header(config):
    return f"torch {torch.__version__}, cpus {os.cpu_count()}"
