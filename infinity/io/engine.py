"""`AioEngine` and `IOHandle`: the Python face of the C++ I/O engine.

The C++ core (``infinity._aio``) takes raw addresses, byte counts and file
offsets; this module validates tensors, picks the backend (io_uring or POSIX),
caches opened files, keeps tensors alive while their I/O is in flight, and
turns failures into `AioError`.
"""
import errno
import logging
import os
import threading

import torch

from .. import _aio
from .errors import AioError

log = logging.getLogger("infinity.io")

_probe_lock = threading.Lock()
_probe_result = None  # cached errno of the io_uring probe (0 = works)
_warned = set()


def warn_once(key, msg, *args):
    with _probe_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def uring_status():
    """(ok, reason): whether io_uring can run here, and why not."""
    global _probe_result
    if not _aio.built_with_liburing():
        return False, ("this build of infinity has no io_uring: liburing headers were missing at build time "
                       "(install liburing-dev, then rebuild with `bash scripts/setup.sh`)")
    with _probe_lock:
        if _probe_result is None:
            _probe_result = _aio.uring_probe()
        err = _probe_result
    if err == 0:
        return True, "io_uring works"
    why = f"io_uring_setup failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = f.read().strip()
        if disabled not in ("", "0"):
            why += f"; kernel.io_uring_disabled={disabled} (set it to 0 with sysctl as root)"
    except OSError:
        pass
    if err == errno.EPERM:
        why += "; likely blocked by a seccomp profile (containers: allow io_uring_setup/enter)"
    elif err == errno.ENOSYS:
        why += "; the kernel has no io_uring (CONFIG_IO_URING)"
    return False, why


def _choose_kind(engine):
    if engine not in ("auto", "uring", "posix"):
        raise ValueError(f"engine must be 'auto', 'uring' or 'posix', got {engine!r}")
    if engine == "posix":
        return "posix"
    ok, why = uring_status()
    if ok:
        return "uring"
    if engine == "uring":
        raise AioError(errno.ENOSYS if not _aio.built_with_liburing() else (_probe_result or errno.EPERM),
                       f"engine='uring' was requested but io_uring cannot run: {why}",
                       hint="use engine='auto' or 'posix' to fall back to the POSIX engine")
    if not _aio.built_with_liburing():
        warn_once("no-liburing", "infinity was built without liburing (package liburing-dev missing): "
                  "using the slower POSIX I/O engine; install liburing-dev and rebuild")
    else:
        warn_once("uring-refused", "io_uring unavailable, using the POSIX I/O engine: %s", why)
    return "posix"


def _check_int(name, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be an int {rng}, got {v!r}")


def tensor_span(tensor, what="tensor"):
    """(address, nbytes) of a contiguous CPU tensor; ValueError otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor (got device {tensor.device}); copy it to a host "
                         "buffer first")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (shape {tuple(tensor.shape)}, stride "
                         f"{tuple(tensor.stride())}); call .contiguous() first")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


class IOHandle:
    """One asynchronous transfer. `wait()` returns the bytes moved or raises AioError.

    Holds a reference to the tensor (and the files) until the transfer completed.
    """

    __slots__ = ("_req", "_keep", "_op", "_result", "_error", "__weakref__")

    def __init__(self, req, keep, op):
        self._req = req
        self._keep = keep
        self._op = op
        self._result = None
        self._error = None

    def done(self):
        return self._result is not None or self._error is not None or self._req.done()

    def wait(self):
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise self._error
        n = self._req.wait()
        err = self._req.error()
        self._keep = None  # transfer complete: the tensor may go
        if err is not None:
            code, path, off, length, msg = err
            self._error = AioError(code, msg, path or None, off, length)
            raise self._error
        self._result = n
        return n

    @property
    def nbytes(self):
        return self._req.total

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"<IOHandle {self._op} {self._req.total} bytes {state}>"


class AioEngine:
    """Asynchronous file I/O on a fixed pool of worker threads.

    `engine`: "auto" (io_uring when it works here, else POSIX with one warning),
    "uring" (error when io_uring cannot run) or "posix". `direct=True` opens
    files with O_DIRECT (falling back to buffered I/O, with one warning, where
    the file system refuses it).
    """

    def __init__(self, block_size=1 << 20, queue_depth=32, threads=1, engine="auto", *, direct=True):
        # (a request is split into chunks whose length the C++ engine keeps in 32 bits)
        _check_int("block_size", block_size, 4096, 1 << 30)
        if block_size % 4096:
            raise ValueError(f"block_size must be a multiple of 4096 bytes, got {block_size}")
        _check_int("queue_depth", queue_depth, 1, 4096)
        _check_int("threads", threads, 1, 256)
        kind = _choose_kind(engine)
        try:
            self._impl = _aio.Engine(kind, block_size, queue_depth, threads)
        except OSError as e:
            if not (engine == "auto" and kind == "uring"):
                raise AioError.from_os_error(e, f"cannot start the {kind} I/O engine") from None
            # the probe passed but these rings could not be set up (e.g. RLIMIT_MEMLOCK
            # for many or deep rings): auto means "whatever works here"
            warn_once(("uring-setup", block_size, queue_depth, threads),
                      "io_uring rings could not be created (%s): using the POSIX engine", e)
            kind = "posix"
            self._impl = _aio.Engine(kind, block_size, queue_depth, threads)
        self.kind = kind
        self.direct = bool(direct)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        self._files = {}
        self._lock = threading.Lock()
        self._inflight = {}
        self._submits = 0
        self._closed = False

    # ---------------------------------------------------------------- files
    def open(self, path, create=False, *, truncate=False):
        """Opens `path` (O_DIRECT when possible) and returns a file object for pread/pwrite."""
        path = os.fspath(path)
        try:
            f = _aio.File.open(path, create, self.direct, truncate, 0o600)
        except OSError as e:
            raise AioError.from_os_error(e, f"cannot open {path}") from None
        if f.direct_refused:
            warn_once(("buffered", os.path.dirname(os.path.abspath(path))),
                      "O_DIRECT is not supported for %s: using buffered I/O there (slower, uses page cache)",
                      path)
        return f

    def _file(self, file, create):
        if isinstance(file, _aio.File):
            if file.closed:
                raise ValueError(f"file {file.path} is closed")
            return file
        if not isinstance(file, (str, bytes, os.PathLike)):
            raise ValueError(f"file must be a path or an object from engine.open(), got {type(file).__name__}")
        key = os.path.abspath(os.fsdecode(file))
        with self._lock:
            f = self._files.get(key)
        if f is None:
            f = self.open(key, create=create)
            with self._lock:
                f = self._files.setdefault(key, f)
        return f

    # ------------------------------------------------------------- transfers
    def pread(self, tensor, file, offset):
        """Reads tensor.nbytes bytes at `offset` of `file` into `tensor` (async)."""
        return self._one(_aio.OP_READ, tensor, file, offset, create=False)

    def pwrite(self, tensor, file, offset):
        """Writes the bytes of `tensor` at `offset` of `file` (created if missing; async)."""
        return self._one(_aio.OP_WRITE, tensor, file, offset, create=True)

    def _one(self, op, tensor, file, offset, create):
        ptr, nbytes = tensor_span(tensor)
        _check_int("offset", offset, 0)
        f = self._file(file, create)
        return self.submit(op, [(f, ptr, offset, nbytes)], tensor)

    def submit(self, op, segments, keep):
        """Low level: one request made of `(file, address, offset, nbytes)` segments.

        `keep` is kept alive until the request completes (the tensor owning the
        addresses). Used by SwapSpace to stripe one tensor over several files.
        """
        if self._closed:
            raise RuntimeError("the AioEngine is closed")
        try:
            req = self._impl.submit(op, segments)
        except OSError as e:
            raise AioError.from_os_error(e) from None
        except RuntimeError as e:
            raise RuntimeError(f"cannot submit I/O: {e}") from None
        h = IOHandle(req, (keep, segments), "read" if op == _aio.OP_READ else "write")
        with self._lock:
            self._inflight[id(h)] = h
            self._submits += 1
            if self._submits % 64 == 0:
                for k in [k for k, v in self._inflight.items() if v.done()]:
                    del self._inflight[k]
        return h

    # -------------------------------------------------------------- lifetime
    def drain(self):
        """Waits until every submitted transfer has completed (errors stay in their handles)."""
        self._impl.drain()
        with self._lock:
            self._inflight.clear()

    def close(self):
        """Waits for in-flight transfers, stops the workers, closes cached files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._impl.close()
        with self._lock:
            self._inflight.clear()
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return (f"AioEngine(kind={self.kind!r}, block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"threads={self.threads}, direct={self.direct})")
