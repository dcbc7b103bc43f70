"""SwapSpace: private locked dirs, anonymous swap files, extents, striping, cleanup."""
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from infinity.io import AioEngine, AioError, SwapSpace, aligned_empty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iotest_helpers import ENGINES, engine_or_skip, listing, random_bytes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def posix_engine():
    e = AioEngine(engine="posix", block_size=1 << 16, queue_depth=8, threads=2)
    yield e
    e.close()


def test_private_dir_layout_and_cleanup(posix_engine, tmp_path):
    user = tmp_path / "swap"  # does not exist yet: created
    s = SwapSpace(str(user), posix_engine, rank=3)
    (d,) = s.dirs
    assert d == str(user / "infinity-rank3")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.listdir(d) == ["lock"]  # the swap file is anonymous (O_TMPFILE)
    lock = os.path.join(d, "lock")
    assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600
    assert open(lock).read().strip() == str(os.getpid())
    ext = s.allocate(10_000)
    s.write(ext, random_bytes(10_000)).wait()
    s.close()
    s.close()  # idempotent
    assert not user.exists()  # we created it, it is empty: removed


def test_existing_user_dir_is_kept(posix_engine, tmp_path):
    (tmp_path / "mine.txt").write_text("x")
    with SwapSpace(tmp_path, posix_engine) as s:
        s.write(s.allocate(5), torch.arange(5, dtype=torch.uint8)).wait()
    assert listing(tmp_path) == ["mine.txt"]


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("npaths", [1, 2, 3])
def test_extent_roundtrip_and_striping(kind, npaths, tmp_path):
    e = engine_or_skip(kind, block_size=1 << 16, queue_depth=8)
    paths = [str(tmp_path / f"p{i}") for i in range(npaths)]
    s = SwapSpace(paths if npaths > 1 else paths[0], e, stripe_bytes=1 << 16)
    try:
        sizes = [1, 7, 4095, 4096, 4097, (1 << 20) - 1, (1 << 20) + 1, 3 << 20]
        exts, data = [], []
        for i, n in enumerate(sizes):
            ext = s.allocate(n)
            assert ext.start % 4096 == 0 and ext.nbytes == n
            t = random_bytes(n, seed=i)
            exts.append(ext)
            data.append(t)
        hs = [s.write(x, t) for x, t in zip(exts, data)]
        assert [h.wait() for h in hs] == sizes
        for x, t in zip(exts, data):
            out = aligned_empty(t.numel())
            assert s.read(x, out).wait() == t.numel()
            assert torch.equal(out, t)
        # sub-ranges at awkward offsets inside an extent (what the optimizer does with tiles)
        big, bt = exts[-1], data[-1]
        for off, n in [(0, 4096), (4096, 65536), (12345, 99_999), ((3 << 20) - 7, 7)]:
            out = torch.empty(n, dtype=torch.uint8)
            s.read(big, out, offset=off).wait()
            assert torch.equal(out, bt[off:off + n])
        patch = random_bytes(70_000, seed=99)
        s.write(big, patch, offset=65_000).wait()
        bt[65_000:135_000] = patch
        out = torch.empty_like(bt)
        s.read(big, out).wait()
        assert torch.equal(out, bt)
        if npaths > 1:  # every file holds a share of the stripes
            sizes_on_disk = [f.size() for f in s._state.files]
            assert all(sz > 0 for sz in sizes_on_disk), sizes_on_disk
            assert sum(sizes_on_disk) >= s.bytes_allocated
    finally:
        s.close()
        e.close()
    for p in paths:
        assert not os.path.exists(p)


def test_allocator_reuse_free_and_errors(posix_engine, tmp_path):
    with SwapSpace(tmp_path / "s", posix_engine) as s:
        a = s.allocate(10_000)
        b = s.allocate(4096)
        assert s.bytes_allocated == 12288 + 4096
        cap = s.capacity
        s.free(a)
        c = s.allocate(8192)  # fits in a's hole
        assert c.start == a.start and s.capacity == cap
        with pytest.raises(ValueError, match="not a live extent"):
            s.read(a, torch.empty(10, dtype=torch.uint8))  # a was freed (c reuses part of it)
        with pytest.raises(ValueError):
            s.free(a)  # double free
        with pytest.raises(ValueError, match="past the end"):
            s.write(b, torch.zeros(4097, dtype=torch.uint8))
        with pytest.raises(ValueError, match="past the end"):
            s.read(b, torch.zeros(10, dtype=torch.uint8), offset=4090)
        with pytest.raises(ValueError, match="contiguous"):
            s.write(c, torch.zeros(8, 8)[:, ::2])
        s.free(b)
        s.free(c)
        assert s.bytes_allocated == 0
        z = s.allocate(0)
        assert s.write(z, torch.empty(0)).wait() == 0
    with pytest.raises(RuntimeError, match="closed"):
        s.allocate(10)


def test_reserve_checks_free_space(posix_engine, tmp_path):
    with SwapSpace(tmp_path / "s", posix_engine) as s:
        s.reserve(8 << 20)
        assert s.capacity >= 8 << 20
        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        with pytest.raises(AioError) as ei:
            s.reserve(free * 4)
        assert ei.value.errno == 28 and str(tmp_path / "s") in str(ei.value)
        assert "available" in str(ei.value)


def _spawn(code, **kw):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


CHILD = """
    import sys, time, torch
    from infinity.io import AioEngine, SwapSpace
    e = AioEngine(engine="posix")
    s = SwapSpace(sys.argv[1] if len(sys.argv) > 1 else {path!r}, e)
    x = s.allocate({nbytes})
    s.write(x, torch.ones({nbytes}, dtype=torch.uint8)).wait()
    print("ready", flush=True)
    time.sleep(60)
"""


def test_lock_conflict_with_live_process_then_stale_reaped(posix_engine, tmp_path):
    path = str(tmp_path / "shared")
    child = _spawn(CHILD.format(path=path, nbytes=1 << 20))
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with pytest.raises(AioError) as ei:
            SwapSpace(path, posix_engine)
        msg = str(ei.value)
        assert f"PID {child.pid}" in msg and "infinity-rank0" in msg and "another" in msg
        # another rank on the same path is fine
        with SwapSpace(path, posix_engine, rank=1) as s1:
            assert s1.dirs[0].endswith("infinity-rank1")
    finally:
        child.kill()
        child.wait()
    # the dead child's directory (lock file only) is reaped silently
    with SwapSpace(path, posix_engine) as s:
        assert os.listdir(s.dirs[0]) == ["lock"]
    assert listing(tmp_path) in ([], ["shared"])


def test_sigkill_leaves_no_swap_data(posix_engine, tmp_path):
    """After SIGKILL the swap space is released (anonymous file) and only a lock file remains,
    which the next start reaps; nothing at all is left after that one closes."""
    from iotest_helpers import mount_tmpfs, umount
    mnt = tmp_path / "mnt"
    mount_tmpfs(mnt, size="64M")
    try:
        before = os.statvfs(mnt).f_bfree
        child = _spawn(CHILD.format(path=str(mnt / "swap"), nbytes=32 << 20))
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        during = os.statvfs(mnt).f_bfree
        assert (before - during) * os.statvfs(mnt).f_frsize >= 32 << 20
        child.kill()
        child.wait()
        for _ in range(50):  # the kernel releases the file when the process is gone
            if os.statvfs(mnt).f_bfree >= before - 8:
                break
            time.sleep(0.1)
        assert os.statvfs(mnt).f_bfree >= before - 8
        assert listing(mnt) == ["swap", "swap/infinity-rank0", "swap/infinity-rank0/lock"]
        # a different rank also reaps the dead rank 0 directory
        with SwapSpace(str(mnt / "swap"), posix_engine, rank=1):
            pass
        assert listing(mnt) == ["swap"] or listing(mnt) == []
    finally:
        umount(mnt)


def test_second_swap_space_in_this_process_says_so(posix_engine, tmp_path):
    path = str(tmp_path / "shared")
    with SwapSpace(path, posix_engine):
        with pytest.raises(AioError) as ei:
            SwapSpace(path, posix_engine)
        msg = str(ei.value)
        assert "another engine in this process" in msg and f"PID {os.getpid()}" in msg
        assert "another live process" not in msg


def test_directories_get_explicit_modes_under_umask_000(posix_engine, tmp_path):
    """Under umask 000 nothing infinity creates is world-writable: the user swap path
    (and its missing parents) 0755, the private rank directory 0700."""
    from infinity.fsmode import makedirs
    old = os.umask(0)
    try:
        path = tmp_path / "a" / "b" / "swap"
        with SwapSpace(str(path), posix_engine) as s:
            for d in (tmp_path / "a", tmp_path / "a" / "b", path):
                assert stat.S_IMODE(os.stat(d).st_mode) == 0o755, d
            assert stat.S_IMODE(os.stat(s.dirs[0]).st_mode) == 0o700
        makedirs(tmp_path / "p" / "q", 0o700, parents_mode=0o755)
        assert stat.S_IMODE(os.stat(tmp_path / "p").st_mode) == 0o755
        assert stat.S_IMODE(os.stat(tmp_path / "p" / "q").st_mode) == 0o700
    finally:
        os.umask(old)


def test_a_rank_checking_liveness_does_not_make_another_rank_fail(posix_engine, tmp_path):
    """Ranks sharing a swap path check each other's directories by taking their lock for
    a moment (reaping dead owners). A rank opening its directory during that moment
    waits for it instead of failing with "in use by another live process"."""
    import fcntl
    import threading
    path = tmp_path / "shared"
    mine = path / "infinity-rank1"
    mine.mkdir(parents=True, mode=0o700)
    fd = os.open(str(mine / "lock"), os.O_RDWR | os.O_CREAT, 0o600)   # no PID written yet
    fcntl.flock(fd, fcntl.LOCK_EX)            # the other rank's liveness check holds it

    def checker_done():
        time.sleep(0.3)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    t = threading.Thread(target=checker_done)
    t.start()
    try:
        with SwapSpace(str(path), posix_engine, rank=1) as sw:
            sw.write(sw.allocate(4096), aligned_empty(4096)).wait()
    finally:
        t.join()


def test_nul_byte_in_a_swap_path_is_an_aio_error(posix_engine, tmp_path):
    import errno

    from infinity.io.swap_dir import ensure_user_dir
    bad = str(tmp_path / "sw\x00ap")
    for make in (lambda: SwapSpace([str(tmp_path / "ok"), bad], posix_engine),
                 lambda: ensure_user_dir(bad)):
        with pytest.raises(AioError) as ei:
            make()
        assert ei.value.errno == errno.EINVAL and "NUL byte" in str(ei.value)
        assert "offload.nvme_paths" in str(ei.value)          # what to do
    assert not (tmp_path / "ok").exists()                      # nothing was created
