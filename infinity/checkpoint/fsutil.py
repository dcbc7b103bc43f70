"""Small durable-filesystem helpers: private files/dirs, fsync, atomic replace, swap.

Everything here raises :class:`CheckpointError` with the path and errno text.
"""
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import sys

from .errors import CheckpointError
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.checkpoint")

FILE_MODE = 0o600
DIR_MODE = 0o700

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = None


def _err(what, path, e):
    return CheckpointError(f"{what} {path}: {os.strerror(e.errno) if e.errno else e} "
                           f"(errno {e.errno})")


def make_private_dir(path, *, exist_ok=False):
    """mkdir with mode 0700 (chmod'ed explicitly, so the umask cannot widen/narrow it)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not exist_ok:
            raise CheckpointError(f"{path} already exists") from None
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} exists and is not a directory") from None
        return
    except OSError as e:
        raise _err("cannot create directory", path, e) from e
    os.chmod(path, DIR_MODE)


def check_path(path, what):
    """``path`` as a string; a :class:`CheckpointError` for what no file system path can be
    (a NUL byte; not a path at all) instead of the bare ValueError/TypeError of ``os``."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise CheckpointError(f"{what}: expected a path (str or os.PathLike), got "
                              f"{type(path).__name__}") from None
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if "\x00" in p:
        raise CheckpointError(f"{what} {p!r} contains a NUL byte, which no file system path "
                              f"can hold; pass the directory's name without it")
    return p


def ensure_checkpoint_root(path):
    """Create the checkpoint root (and parents) if missing; it must be a writable dir."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} exists and is not a directory")
    try:
        makedirs(path, DIR_MODE, parents_mode=0o755)
    except OSError as e:
        raise _err("cannot create checkpoint directory", path, e) from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {path} is not writable; "
                              f"fix its permissions or choose another directory")


def open_private_file(path):
    """Create a new file 0600 for writing (fails if it exists); returns an fd."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        raise _err("cannot create file", path, e) from e
    os.fchmod(fd, FILE_MODE)
    return fd


def write_all(fd, data, path="<fd>"):
    """os.write until every byte is written (short writes happen for big buffers)."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    done = 0
    while done < n:
        try:
            w = os.write(fd, mv[done:done + (1 << 30)])
        except OSError as e:
            raise CheckpointError(
                f"writing {n} bytes to {path} failed after {done} bytes: "
                f"{os.strerror(e.errno)} (errno {e.errno}); free disk space or choose "
                f"another checkpoint directory") from e
        if w <= 0:
            raise CheckpointError(f"writing to {path}: write returned {w} after {done}/{n} bytes")
        done += w
    return n


def fsync_fd(fd, path="<fd>"):
    try:
        os.fsync(fd)
    except OSError as e:
        raise _err("fsync failed for", path, e) from e


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _err("cannot open directory for fsync", path, e) from e
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def atomic_write_text(path, text):
    """Replace ``path`` atomically: write a 0600 temp sibling, fsync, rename, fsync dir."""
    d, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".{base}.tmp-{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = open_private_file(tmp)
    try:
        write_all(fd, text.encode("utf-8"), tmp)
        fsync_fd(fd, tmp)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError as e:
        _unlink_quiet(tmp)
        raise _err("cannot rename into place", path, e) from e
    fsync_dir(d)


def _unlink_quiet(p):
    try:
        os.unlink(p)
    except OSError:
        pass


def exchange(a, b):
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE).

    Returns False when the kernel/filesystem/libc does not support it (the caller
    then falls back to two renames); raises CheckpointError on real errors.
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.renameat2  # noqa: B018 - probe the symbol
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                         ctypes.c_uint(_RENAME_EXCHANGE))
    if rc == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise CheckpointError(f"cannot exchange {a} and {b}: {os.strerror(e)} (errno {e})")


def remove_tree(path):
    """Remove a directory tree we created; logs (does not raise) on failure."""
    def onerr(func, p, exc):
        log.warning("could not remove %s: %s", p, exc[1] if isinstance(exc, tuple) else exc)
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=onerr)
            else:
                shutil.rmtree(path, onerror=onerr)
        else:
            _unlink_quiet(path)
