"""Bad paths, read-only and full file systems, bad arguments: clear errors, nothing left behind."""
import errno
import logging
import os
import sys

import pytest
import torch

import infinity.io.engine as engine_mod
from infinity.io import AioEngine, AioError, SwapSpace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iotest_helpers import listing, mount_tmpfs, random_bytes, umount  # noqa: E402


@pytest.fixture
def eng():
    e = AioEngine(engine="posix", block_size=1 << 16, queue_depth=4)
    yield e
    e.close()


@pytest.fixture
def ro_mount(tmp_path):
    mnt = tmp_path / "ro"
    mount_tmpfs(mnt, size="1M", readonly=True)
    yield mnt
    umount(mnt)


@pytest.fixture
def tiny_mount(tmp_path):
    mnt = tmp_path / "tiny"
    mount_tmpfs(mnt, size="1M")
    yield mnt
    umount(mnt)


def test_path_that_cannot_be_created(eng, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(AioError) as ei:
        SwapSpace(str(blocker / "sub" / "swap"), eng)
    assert ei.value.errno == errno.ENOTDIR
    assert str(blocker / "sub" / "swap") in str(ei.value) and "choose another" in str(ei.value)
    with pytest.raises(AioError) as ei:
        SwapSpace(str(blocker), eng)
    assert ei.value.errno == errno.ENOTDIR and "not a directory" in str(ei.value)
    assert listing(tmp_path) == ["file"]


def test_read_only_directory(eng, ro_mount):
    with pytest.raises(AioError) as ei:
        SwapSpace(str(ro_mount), eng)
    assert ei.value.errno == errno.EROFS and str(ro_mount) in str(ei.value)
    with pytest.raises(AioError) as ei:
        SwapSpace(str(ro_mount / "sub"), eng)
    assert ei.value.errno == errno.EROFS and str(ro_mount / "sub") in str(ei.value)
    with pytest.raises(AioError) as ei:
        eng.pwrite(torch.zeros(10, dtype=torch.uint8), ro_mount / "f", 0).wait()
    assert ei.value.errno == errno.EROFS
    assert listing(ro_mount) == []


def test_file_system_too_small(eng, tiny_mount):
    s = SwapSpace(str(tiny_mount / "swap"), eng)
    try:
        with pytest.raises(AioError) as ei:
            s.allocate(4 << 20)
        e = ei.value
        assert e.errno == errno.ENOSPC and isinstance(e, OSError)
        assert str(tiny_mount / "swap") in str(e) and "available" in str(e)
        assert s.bytes_allocated == 0
        with pytest.raises(AioError) as ei:
            s.reserve(8 << 20)
        assert ei.value.errno == errno.ENOSPC and "only" in str(ei.value)
        # still usable for what fits
        x = s.allocate(100_000)
        t = random_bytes(100_000)
        s.write(x, t).wait()
        out = torch.empty_like(t)
        s.read(x, out).wait()
        assert torch.equal(out, t)
    finally:
        s.close()
    assert listing(tiny_mount) == []


def test_write_past_free_space_via_engine(eng, tiny_mount):
    with pytest.raises(AioError) as ei:
        eng.pwrite(random_bytes(4 << 20), tiny_mount / "big", 0).wait()
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename == str(tiny_mount / "big")
    assert ei.value.offset is not None and ei.value.length


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        AioEngine(block_size=1000)
    with pytest.raises(ValueError):
        AioEngine(queue_depth=0)
    with pytest.raises(ValueError):
        AioEngine(threads=0)
    with pytest.raises(ValueError):
        AioEngine(engine="spdk")
    e = AioEngine(engine="posix")
    e.close()
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.pwrite(torch.zeros(1), tmp_path / "x", 0)
    with pytest.raises(AioError) as ei:
        AioEngine(engine="posix").pread(torch.zeros(1), tmp_path / "missing", 0)
    assert ei.value.errno == errno.ENOENT and "missing" in str(ei.value)


def test_no_liburing_build_warns_once_and_uring_fails(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(engine_mod._aio, "built_with_liburing", lambda: False)
    monkeypatch.setattr(engine_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="infinity.io"):
        for _ in range(3):
            with AioEngine(engine="auto") as e:
                assert e.kind == "posix"
    warnings = [r for r in caplog.records if "liburing-dev" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(AioError) as ei:
        AioEngine(engine="uring")
    assert "liburing-dev" in str(ei.value)


def test_uring_refused_by_kernel(monkeypatch, caplog):
    monkeypatch.setattr(engine_mod, "_probe_result", errno.EPERM)
    monkeypatch.setattr(engine_mod, "_warned", set())
    with pytest.raises(AioError) as ei:
        AioEngine(engine="uring")
    assert ei.value.errno == errno.EPERM and "seccomp" in str(ei.value)
    with caplog.at_level(logging.WARNING, logger="infinity.io"):
        with AioEngine(engine="auto") as e:
            assert e.kind == "posix"
    assert any("POSIX" in r.getMessage() for r in caplog.records)


def test_auto_falls_back_when_the_rings_cannot_be_created(tmp_path, monkeypatch, caplog):
    """The probe passes but creating the engine's rings fails (e.g. memlock for deep rings):
    "auto" warns once and uses POSIX; "uring" raises with the reason."""
    from infinity import _aio
    real = _aio.Engine

    def engine(kind, *a):
        if kind == "uring":
            raise OSError(errno.ENOMEM, "io_uring_queue_init: Cannot allocate memory")
        return real(kind, *a)
    monkeypatch.setattr(engine_mod, "_probe_result", 0)
    monkeypatch.setattr(engine_mod, "_warned", set())
    monkeypatch.setattr(_aio, "Engine", engine)
    if not _aio.built_with_liburing():
        pytest.skip("built without liburing: auto never tries io_uring")
    with pytest.raises(AioError) as ei:
        AioEngine(engine="uring")
    assert ei.value.errno == errno.ENOMEM
    with caplog.at_level(logging.WARNING, logger="infinity.io"):
        with AioEngine(engine="auto") as e:
            assert e.kind == "posix"
            src = torch.arange(5000, dtype=torch.uint8)
            e.pwrite(src, tmp_path / "f", 3).wait()
            dst = torch.zeros_like(src)
            e.pread(dst, tmp_path / "f", 3).wait()
            assert torch.equal(src, dst)
    assert sum("POSIX engine" in r.getMessage() for r in caplog.records) == 1


def test_block_size_is_capped_at_1_gib():
    with pytest.raises(ValueError, match="block_size"):
        AioEngine(block_size=1 << 32)
    with AioEngine(block_size=1 << 30, engine="posix") as e:
        assert e.block_size == 1 << 30
