"""Readiness checks of the I/O stack, printed by `infinity doctor`.

Each check is a dict: name, ok (bool), detail, fix (what to do when not ok).
"""
import errno
import os
import shutil

import torch

from .. import _aio
from .engine import uring_status
from infinity.fsmode import existing_ancestor


def format_bytes(n):
    """Sizes that read well at any scale: 16.8 MB, 61.6 MB, 20.0 GB, 512 B."""
    for unit, div in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _check(name, ok, detail, fix=""):
    return {"name": name, "ok": bool(ok), "detail": detail, "fix": "" if ok else fix}


def _liburing_check():
    built = _aio.built_with_liburing()
    return _check("liburing build", built,
                  "the I/O extension links liburing" if built else
                  "the I/O extension was built WITHOUT liburing (POSIX engine only)",
                  "apt-get install liburing-dev, then rebuild: bash scripts/setup.sh")


def _uring_check():
    ok, why = uring_status()
    return _check("io_uring", ok, why,
                  "allow io_uring (sysctl kernel.io_uring_disabled=0; in containers allow the "
                  "io_uring_* syscalls in seccomp) or accept the slower POSIX engine (engine='posix')")


def _odirect_check(path):
    """Opens a temporary file with O_DIRECT where the swap files would go and round-trips a block."""
    base = path if os.path.isdir(path) else existing_ancestor(path)
    name = "O_DIRECT"
    if _read_only(base):
        return _read_only_check(name, base, path)
    if not os.path.isdir(base):
        return _check(name, False, f"{base} is not a directory (needed for {path})",
                      "choose a directory on a local NVMe drive as --nvme-path")
    if not os.access(base, os.W_OK):
        what = "the swap directory" if base == path else f"{base}, where {path} would be created,"
        return _check(name, False, f"{what} exists but is not writable by this user "
                      f"(uid {os.geteuid()})",
                      f"make it writable (`ls -ld {base}`, then chown/chmod) or choose a writable "
                      "--nvme-path")
    try:
        f = _aio.File.open_tmpfile(base, True)
    except OSError as e:
        if e.errno == errno.EROFS:
            return _read_only_check(name, base, path)
        return _check(name, False, f"cannot create a file in {base}: {e.strerror}",
                      "choose a writable --nvme-path")
    try:
        if not f.direct:
            return _check(name, False, f"{base}: the file system refuses O_DIRECT; infinity would use "
                          "buffered I/O (page cache, slower, more RAM)",
                          "put swap on an ext4/xfs file system on a local NVMe drive")
        from .buffers import aligned_empty
        from .engine import AioEngine
        blk = max(4096, f.offset_align)
        src = aligned_empty(blk)
        src.copy_(torch.arange(blk, dtype=torch.int64).remainder(251).to(torch.uint8))
        dst = aligned_empty(blk)
        with AioEngine(block_size=1 << 20, queue_depth=4, engine="posix") as eng:
            eng.pwrite(src, f, 0).wait()
            eng.pread(dst, f, 0).wait()
        ok = torch.equal(src, dst)
        return _check(name, ok, f"{base}: O_DIRECT works, alignment memory {f.mem_align} B / offset "
                      f"{f.offset_align} B (from {f.align_source})" + ("" if ok else "; READ BACK DIFFERS"),
                      "the device returned different bytes: check the drive (dmesg, smartctl)")
    except OSError as e:
        return _check(name, False, f"{base}: O_DIRECT round trip failed: {e}",
                      "run `infinity bench-io --engine posix --nvme-path DIR` and check dmesg")
    finally:
        f.close()


def _read_only(base):
    """Whether ``base`` lies on a file system mounted read-only (EROFS on any write)."""
    try:
        return bool(os.statvfs(base).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _read_only_check(name, base, path):
    where = base if base == path else f"{base} (where {path} would be created)"
    return _check(name, False, f"{where} is on a read-only file system (EROFS): nothing can be "
                  "written there",
                  f"check the mount with `findmnt -T {base}` (OPTIONS shows ro): remount it "
                  f"read-write (`mount -o remount,rw` on its TARGET) or choose a --nvme-path on a "
                  "writable drive")


def _free_space_check(path, need=None, need_what=""):
    """Free space at ``path`` against ``need`` bytes (``need_what`` says whose need it is);
    without ``need`` the free space is only reported."""
    base = existing_ancestor(path)
    try:
        usage = shutil.disk_usage(base)
    except OSError as e:
        return _check("free space", False, f"cannot stat {base}: {e}", "choose an existing --nvme-path")
    free = format_bytes(usage.free)
    if need is None:
        return _check("free space", True, f"{free} free at {base}")
    what = f" ({need_what})" if need_what else ""
    ok = usage.free >= need
    return _check("free space", ok,
                  f"{free} free at {base}; {format_bytes(need)} needed{what}",
                  f"free {format_bytes(need - usage.free)} there or choose a larger drive "
                  "(--nvme-path)" + ("" if need_what == "--need" else
                                     ", or check against your own model's need with --need SIZE"))


def _memlock_check():
    soft, hard = _aio.memlock_limit()
    fmt = lambda v: "unlimited" if v < 0 else f"{v / 2**20:.0f} MiB"  # noqa: E731
    is_root = os.geteuid() == 0
    ok = soft < 0 or soft >= 2**30 or is_root
    detail = f"RLIMIT_MEMLOCK soft {fmt(soft)}, hard {fmt(hard)}" + (
        " (root: CAP_IPC_LOCK ignores it)" if is_root else "")
    return _check("RLIMIT_MEMLOCK", ok, detail,
                  "raise it (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf) so host "
                  "buffers can be locked; otherwise they may be swapped out")


THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_check(path=THP_PATH):
    """Host buffers ask for transparent huge pages (madvise): a buffer of 4 KiB pages breaks
    each O_DIRECT request into ~100 physical segments, measured 2-4x slower here."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as e:
        return _check("transparent huge pages", True, f"cannot read {path} ({e.strerror}); "
                      "assuming the kernel default")
    mode = text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else text
    return _check("transparent huge pages", mode in ("always", "madvise"),
                  f"mode {mode!r} ({text})",
                  f"host staging buffers cannot get huge pages, so O_DIRECT transfers are split "
                  f"into many small segments (2-4x slower here): as root, "
                  f"`echo madvise > {path}`")


def doctor_checks(path="./infinity-swap", need=None, need_what=""):
    """``need``: bytes of swap the run needs at ``path`` (None: free space only reported)."""
    path = os.path.expanduser(os.fspath(path))
    return [_liburing_check(), _uring_check(), _odirect_check(path),
            _free_space_check(path, need, need_what), _memlock_check(), _thp_check()]
