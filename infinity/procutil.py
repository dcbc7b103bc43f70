"""Process facts shared by the swap-directory lock and the checkpoint writer, and the
heap trim of work that frees many large temporaries."""
import ctypes
import ctypes.util
import os

__all__ = ["pid_alive", "trim_heap"]

_LIBC = None


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).
    glibc raises its mmap threshold after a large block is freed, so the next temporaries
    of that size come from the heap, whose freed pages stay resident: quantizing a base
    group by group (``initialize`` adopting a model built under ``infinity.Init``) would
    otherwise grow the resident set by a fraction of the whole model."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (on this host)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
