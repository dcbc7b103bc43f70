"""DIO alignment discovery without statx (older kernels) and the buffered fallback on a file
system that refuses O_DIRECT; bytes read back equal bytes written in both."""
import logging
import os
import sys

import pytest
import torch

import infinity.io.engine as engine_mod
from infinity.io import AioEngine, SwapSpace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iotest_helpers import mount_tmpfs, random_bytes, umount  # noqa: E402


def _sysfs_lbs(path):
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for p in (f"{base}/queue/logical_block_size", f"{base}/../queue/logical_block_size"):
        try:
            with open(p) as f:
                return int(f.read())
        except OSError:
            continue
    return None


def _roundtrip(eng, path):
    for size, off in [(1, 0), (4097, 513), (65536 + 7, 4096 * 3 + 1)]:
        src = random_bytes(size, seed=size)
        eng.pwrite(src, path, off).wait()
        dst = torch.zeros_like(src)
        eng.pread(dst, path, off).wait()
        assert torch.equal(src, dst), (size, off)


@pytest.mark.parametrize("kind", ["posix", "auto"])
def test_without_statx_alignment_is_the_devices_logical_block_size(tmp_path, monkeypatch, kind):
    lbs = _sysfs_lbs(tmp_path)
    if lbs is None:
        pytest.skip(f"{tmp_path} is not on a block device with a sysfs queue")
    monkeypatch.setenv("INFINITY_AIO_IGNORE_STATX", "1")
    with AioEngine(engine=kind) as eng:
        f = eng.open(tmp_path / "f", create=True)
        assert f.align_source == "fallback"
        assert (f.mem_align, f.offset_align) == (lbs, lbs)
        assert f.direct
        _roundtrip(eng, f)
        f.close()
    monkeypatch.delenv("INFINITY_AIO_IGNORE_STATX")
    with AioEngine(engine="posix") as eng:
        f = eng.open(tmp_path / "g", create=True)
        assert f.align_source != "fallback"            # statx answers on this kernel
        f.close()


def test_buffered_fallback_on_a_file_system_without_o_direct(tmp_path, caplog):
    """ramfs refuses O_DIRECT: the engine reopens buffered with one warning per directory,
    and swap round trips still return the bytes written."""
    mnt = tmp_path / "ram"
    os.makedirs(mnt)
    import subprocess
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True,
                       text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here (need root): {r.stderr.strip()}")
    try:
        engine_mod._warned.clear()        # the warning is once per directory and process
        caplog.set_level(logging.WARNING, logger="infinity.io")
        with AioEngine(engine="posix") as eng:
            f1 = eng.open(mnt / "a", create=True)
            f2 = eng.open(mnt / "b", create=True)
            assert f1.direct_refused and not f1.direct and f2.direct_refused
            _roundtrip(eng, f1)
            f1.close()
            f2.close()
            with SwapSpace([str(mnt)], eng) as sw:
                ext = sw.allocate(3 * 4096 + 11)
                src = random_bytes(3 * 4096 + 11, seed=7)
                sw.write(ext, src).wait()
                dst = torch.zeros_like(src)
                sw.read(ext, dst).wait()
                assert torch.equal(src, dst)
        warns = [r for r in caplog.records if "O_DIRECT is not supported" in r.getMessage()]
        assert len(warns) == 1, [r.getMessage() for r in warns]
        assert sorted(os.listdir(mnt)) == ["a", "b"]   # the swap dir went away with close
    finally:
        umount(mnt)
