"""infinity.io: the asynchronous NVMe I/O engine and the swap store built on it.

- `AioEngine`, `IOHandle`: async pread/pwrite of CPU tensors (io_uring or POSIX)
- `AioError`: OSError with errno, path, offset, length and what to do
- `aligned_empty`: page-aligned, mlock'ed (pinned on CUDA) host tensors
- `SwapSpace`, `Extent`: striped swap files in private per-rank directories
- `doctor_checks`: readiness checks shown by `infinity doctor`
"""
from .buffers import aligned_empty, is_aligned
from .engine import AioEngine, IOHandle, uring_status
from .errors import AioError
from .extents import Extent
from .swap import SwapSpace


def doctor_checks(path="./infinity-swap", need=None, need_what=""):
    from .doctor import doctor_checks as _dc
    return _dc(path, need, need_what)


__all__ = ["AioEngine", "IOHandle", "AioError", "aligned_empty", "is_aligned", "SwapSpace", "Extent",
           "doctor_checks", "uring_status"]
