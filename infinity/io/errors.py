"""`AioError`: an `OSError` from the I/O engine that says where and what to do."""
import errno as _errno
import os

_HINTS = {
    _errno.ENOSPC: "free space on that file system or point offload.nvme_paths at a larger one",
    _errno.EDQUOT: "raise the disk quota or use another offload.nvme_paths directory",
    _errno.EACCES: "make the directory writable by this user or choose another path",
    _errno.EPERM: "make the directory writable by this user or choose another path",
    _errno.EROFS: "the file system is read-only: choose a writable path",
    _errno.ENODATA: "read only what was written (offset + length past the end of the data)",
    _errno.EIO: "the device reported an I/O error: check `dmesg` and the drive's health",
    _errno.EINVAL: "the file system may not support O_DIRECT here; run `infinity doctor --path DIR`",
    _errno.ENOSYS: "install liburing-dev and rebuild (bash scripts/setup.sh), or use engine='posix'",
    _errno.EBUSY: "use another path or rank, or stop the other process",
}


class AioError(OSError):
    """An I/O error of the infinity engine.

    Carries ``errno``, ``filename`` (the path), ``offset`` and ``length`` (bytes)
    of the failed transfer; ``str()`` includes a suggestion of what to do.
    """

    def __init__(self, err, message, filename=None, offset=None, length=None, hint=None):
        hint = hint if hint is not None else _HINTS.get(err)
        text = message + (f" ({hint})" if hint else "")
        super().__init__(err, text, filename)
        self.offset = offset
        self.length = length

    def __str__(self):
        return f"[Errno {self.errno}] {self.strerror}"

    def __reduce__(self):
        return (type(self), (self.errno, self.strerror, self.filename, self.offset, self.length, ""))

    @classmethod
    def from_os_error(cls, e, context=""):
        """Wraps an OSError (from the C++ extension or the OS) with context."""
        if isinstance(e, AioError):
            return e
        msg = e.strerror or str(e)
        if context:
            msg = f"{context}: {msg}"
        return cls(e.errno or _errno.EIO, msg, e.filename,
                   getattr(e, "aio_offset", None), getattr(e, "aio_length", None))


def errno_name(err):
    return _errno.errorcode.get(err, str(err)) + f" ({os.strerror(err)})" if err else "0"
