"""Helpers shared by the I/O engine tests (imported by path: pytest runs in importlib mode)."""
import os

import pytest
import torch

from infinity.io import AioEngine, uring_status

ENGINES = ["uring", "posix"]


def engine_or_skip(kind, **kw):
    if kind == "uring":
        ok, why = uring_status()
        if not ok:
            pytest.skip(f"io_uring unavailable here: {why}")
    return AioEngine(engine=kind, **kw)


def random_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def listing(root):
    """Every file and directory below root (relative), for 'nothing left behind' checks."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(out)


def mount_tmpfs(target, size="1M", readonly=False):
    """Mounts a small tmpfs at `target` (root only); pytest.skip with the reason otherwise."""
    import subprocess
    os.makedirs(target, exist_ok=True)
    opts = f"size={size},mode=0755" + (",ro" if readonly else "")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (need root/CAP_SYS_ADMIN): {r.stderr.strip()}")


def umount(target):
    import subprocess
    subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=20)
