"""Private per-rank swap directories: `<path>/infinity-rank<r>/`, mode 0700, locked.

The lock file holds our PID under an exclusive flock. A live owner makes a
second user fail with its PID; a dead owner's directory is reaped silently.
"""
import errno
import fcntl
import time
import logging
import os
import stat

from infinity.procutil import pid_alive

from .errors import AioError
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.io")

LOCK_NAME = "lock"
PREFIX = "infinity-rank"


def ensure_user_dir(path):
    """Creates `path` if missing; returns True if we created it. AioError if unusable."""
    if "\x00" in os.fspath(path):
        raise AioError(errno.EINVAL, f"swap path {os.fspath(path)!r} contains a NUL byte",
                       os.fspath(path), hint="no file system path can hold one: fix the "
                       "offload.nvme_paths entry / --path")
    created = False
    if not os.path.exists(path):
        try:
            makedirs(path, 0o755)
            created = True
        except FileExistsError:
            pass
        except OSError as e:
            raise AioError(e.errno, f"cannot create the swap directory {path}: {os.strerror(e.errno)}",
                           path, hint="create it yourself, fix its parent's permissions, or choose "
                           "another offload.nvme_paths entry / --path") from None
    if not os.path.isdir(path):
        raise AioError(errno.ENOTDIR, f"swap path {path} exists but is not a directory", path,
                       hint="point offload.nvme_paths / --path at a directory")
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            raise AioError(errno.EROFS, f"swap directory {path} is on a read-only file system", path,
                           hint="choose a writable path for offload.nvme_paths / --path")
    except OSError as e:
        if isinstance(e, AioError):
            raise
    if not os.access(path, os.W_OK | os.X_OK):
        raise AioError(errno.EACCES, f"swap directory {path} is not writable by this user", path,
                       hint="fix its permissions or choose another path")
    return created


# Another rank sharing the swap path checks whether this directory's owner is alive by
# taking its lock for a moment (_reap_others); a live owner holds it for its whole run.
# So a lock that is busy for less than this is not a reason to refuse.
LOCK_PATIENCE_S = 2.0


def _flock_patiently(fd):
    """Take the exclusive lock, retrying while another process holds it for at most
    ``LOCK_PATIENCE_S`` (a reaper's liveness check); BlockingIOError after that, or at
    once when the holder is this process (another engine here)."""
    deadline = time.monotonic() + LOCK_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline or _read_pid(fd) == os.getpid():
                raise
            time.sleep(0.02)


def _read_pid(fd):
    try:
        data = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return int(data) if data else 0
    except (OSError, ValueError):
        return 0


def _remove_tree_flat(d):
    """Removes the (flat) contents of a private dir and the dir itself."""
    for name in os.listdir(d):
        try:
            os.unlink(os.path.join(d, name))
        except IsADirectoryError:
            pass
        except FileNotFoundError:
            pass
    try:
        os.rmdir(d)
    except OSError:
        pass


class PrivateDir:
    """The locked private directory of one rank under one user path."""

    def __init__(self, path, rank):
        self.user_path = path
        self.created_user_path = ensure_user_dir(path)
        self.path = os.path.join(path, f"{PREFIX}{rank}")
        self.lock_fd = -1
        self._reap_others(rank)
        for _attempt in range(10):
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise AioError(e.errno, f"cannot create the private swap directory {self.path}: "
                               f"{os.strerror(e.errno)}", self.path,
                               hint="make the swap path writable or choose another one") from None
            st = os.lstat(self.path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise AioError(errno.EEXIST, f"{self.path} exists and is not a directory owned by this "
                               "user; refusing to put swap files there", self.path,
                               hint="remove it or choose another path")
            os.chmod(self.path, 0o700)
            if self._try_lock():
                return
        raise AioError(errno.EBUSY, f"cannot lock {self.path}: it keeps changing under us", self.path)

    def _try_lock(self):
        lock_path = os.path.join(self.path, LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            return False  # directory reaped by someone meanwhile: retry
        except OSError as e:
            raise AioError(e.errno, f"cannot create the lock file {lock_path}: {os.strerror(e.errno)}",
                           lock_path) from None
        try:
            _flock_patiently(fd)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            if pid == os.getpid():
                raise AioError(errno.EBUSY, f"swap directory {self.path} is in use by another engine in "
                               f"this process (PID {pid}) that has not been closed", self.path,
                               hint="close() the other engine (or leave its `with` block) first, or give "
                               "this one another nvme path (offload.nvme_paths)") from None
            raise AioError(errno.EBUSY, f"swap directory {self.path} is in use by another live process "
                           f"(PID {pid or 'unknown'})", self.path,
                           hint="give this run another nvme path (offload.nvme_paths / --path) or rank, "
                           "or stop that process") from None
        # We hold the lock; make sure the file is still the one in the directory.
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return False
        old = _read_pid(fd)
        if old and old != os.getpid():
            log.info("reaping stale swap directory %s of dead process %d", self.path, old)
        for name in os.listdir(self.path):  # leftovers of a dead owner (named-file fallback)
            if name != LOCK_NAME:
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError:
                    pass
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.lock_fd = fd
        return True

    def _reap_others(self, rank):
        """Removes private dirs of other ranks whose owner is dead."""
        try:
            names = os.listdir(self.user_path)
        except OSError:
            return
        for name in names:
            if not name.startswith(PREFIX) or name == f"{PREFIX}{rank}":
                continue
            d = os.path.join(self.user_path, name)
            lock_path = os.path.join(d, LOCK_NAME)
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            pid = _read_pid(fd)
            if pid and not pid_alive(pid):
                log.info("reaping stale swap directory %s of dead process %d", d, pid)
                _remove_tree_flat(d)
            os.close(fd)

    def close(self):
        """Removes the lock file and the private directory (and the user dir if we made it)."""
        if self.lock_fd < 0:
            return
        try:
            for name in os.listdir(self.path):
                if name != LOCK_NAME:
                    os.unlink(os.path.join(self.path, name))
            os.unlink(os.path.join(self.path, LOCK_NAME))
            os.rmdir(self.path)
        except OSError as e:
            log.warning("could not remove swap directory %s: %s", self.path, e)
        finally:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.created_user_path:
            try:
                os.rmdir(self.user_path)  # only if empty
            except OSError:
                pass
