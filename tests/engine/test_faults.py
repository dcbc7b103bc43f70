"""NVMe faults: a path that is too small or read-only fails up front with a clear error;
a swap file that loses its space mid-run (filled tmpfs) raises a clear error on the next
step; close() still cleans up and no files remain.  Needs root (tmpfs mounts)."""
import os
import subprocess

import pytest
import torch
from torch import nn

import infinity


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = []

    def mount(size, ro=False):
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
        mounted.append(mnt)
        return str(mnt)
    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def _cfg(path):
    return {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [path]}}


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def test_too_small_path_fails_up_front_and_leaves_nothing(tmpfs):
    mnt = tmpfs("2m")
    path = os.path.join(mnt, "swap")
    with pytest.raises(OSError) as ei:
        infinity.initialize(_model(), _cfg(path))
    assert ei.value.errno == 28 and path in str(ei.value) and "offload.nvme_paths" in str(ei.value)
    assert os.listdir(mnt) == []


def test_read_only_path_fails_up_front(tmpfs):
    mnt = tmpfs("8m", ro=True)
    with pytest.raises(OSError) as ei:
        infinity.initialize(_model(), _cfg(os.path.join(mnt, "swap")))
    assert "swap" in str(ei.value) and ("read-only" in str(ei.value).lower()
                                        or "cannot create" in str(ei.value))


def test_space_lost_mid_run_raises_clear_error_and_close_cleans_up(tmpfs):
    mnt = tmpfs("32m")
    path = os.path.join(mnt, "swap")
    x = torch.randn(2, 256)
    eng = infinity.initialize(_model(), _cfg(path))
    eng.backward(eng(x).square().mean())
    eng.step()
    # the swap file is already unlinked: reach it through /proc, drop its preallocated
    # blocks, then fill the file system so the next write cannot allocate
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(mnt) and "(deleted)" in target:
            os.truncate(f"/proc/self/fd/{fd}", 0)
    filler = os.path.join(mnt, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 20))
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        for _ in range(2):
            eng.backward(eng(x).square().mean())
            eng.step()
    msg = str(ei.value)
    assert ei.value.errno in (28, 61, 5), msg       # ENOSPC / ENODATA (short read) / EIO
    assert mnt in msg or "swap" in msg, msg
    os.unlink(filler)
    eng.close()
    eng.close()                                      # idempotent
    assert _files(mnt) == []
    assert not os.path.exists(path)
