"""Shared fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""
import os
import subprocess
import sys

import pytest
import torch

# helpers shared across areas (tests/injected_failure.py) import by name; the tests run
# with --import-mode=importlib, which does not put tests/ on sys.path by itself
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs("16m")`` -> a fresh tmpfs of that size (root only: skips otherwise),
    unmounted after the test; for full-disk and free-space cases."""
    mounted = []

    def mount(size: str):
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def pytest_report_header(config):
    return f"torch {torch.__version__}, cpus {os.cpu_count()}"
