"""`SwapSpace`: the NVMe swap store of one rank.

One anonymous (O_TMPFILE or unlinked) swap file per user path, inside a
private locked 0700 directory; an extent allocator over a linear address
space striped across the files in `stripe_bytes` chunks; reads and writes of
(sub-ranges of) extents through an `AioEngine`.
"""
import errno
import logging
import os
import threading
import weakref

from .. import _aio
from .engine import AioEngine, warn_once, tensor_span
from .errors import AioError
from .extents import Extent, ExtentAllocator
from .swap_dir import PrivateDir

log = logging.getLogger("infinity.io")

ALIGN = 4096


class _State:
    """Everything close() must release; shared with the weakref finalizer."""

    def __init__(self):
        self.dirs = []
        self.files = []
        self.pending = {}
        self.lock = threading.Lock()
        self.closed = False


def _cleanup(state):
    with state.lock:
        if state.closed:
            return
        state.closed = True
        pending = list(state.pending.values())
        state.pending.clear()
    for h in pending:  # never free files under in-flight I/O
        try:
            h.wait()
        except Exception as e:  # its owner saw (or will never ask for) this error
            log.debug("swap cleanup: an in-flight transfer failed: %s", e)
    for f in state.files:
        try:
            f.close()
        except Exception as e:
            log.warning("swap cleanup: closing a swap file failed: %s", e)
    state.files = []
    for d in state.dirs:
        try:
            d.close()
        except Exception as e:
            log.warning("cleanup of %s failed: %s", d.path, e)
    state.dirs = []


def _norm_paths(paths):
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    try:
        out = [os.path.abspath(os.fsdecode(p)) for p in paths]
    except TypeError:
        raise ValueError(f"paths must be a path or a list of paths, got {paths!r}") from None
    if not out:
        raise ValueError("SwapSpace needs at least one path")
    for p in out:
        if "\x00" in p:
            raise AioError(errno.EINVAL, f"swap path {p!r} contains a NUL byte", p,
                           hint="no file system path can hold one: fix the offload.nvme_paths "
                                "entry / --path")
    seen, uniq = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq


def default_stripe(block_size: int) -> int:
    """The stripe a :class:`SwapSpace` uses by default for an engine with ``block_size``."""
    return max(int(block_size), 1 << 20)


def reserved_bytes(nbytes: int, block_size: int) -> int:
    """File space :meth:`SwapSpace.reserve` takes for ``nbytes`` of swap: whole stripes."""
    stripe = default_stripe(block_size)
    return -(-int(nbytes) // stripe) * stripe


class SwapSpace:
    """Swap store striped over one or several directories (ideally one per NVMe device)."""

    def __init__(self, paths, engine, *, rank=0, stripe_bytes=None, accounting=None):
        """``accounting``: optional object with ``alloc(tier, n)``/``free(tier, n)`` told of
        every extent (tier ``"nvme"``), so NVMe-tier bytes and peaks appear in stats."""
        if not isinstance(engine, AioEngine):
            raise ValueError(f"engine must be an AioEngine, got {type(engine).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self._engine = engine
        self._accounting = accounting
        self._paths = _norm_paths(paths)
        stripe = stripe_bytes or default_stripe(engine.block_size)
        if stripe % ALIGN:
            raise ValueError(f"stripe_bytes must be a multiple of {ALIGN}, got {stripe}")
        self._stripe = stripe
        self._alloc = ExtentAllocator(ALIGN)
        self._grow_lock = threading.Lock()
        self._capacity = 0
        self._sizes = [0] * len(self._paths)
        self._state = _State()
        self._finalizer = weakref.finalize(self, _cleanup, self._state)
        try:
            for p in self._paths:
                self._state.dirs.append(PrivateDir(p, rank))
            for d in self._state.dirs:
                try:
                    f = _aio.File.open_tmpfile(d.path, engine.direct)
                except OSError as e:
                    raise AioError.from_os_error(e, f"cannot create a swap file in {d.path}") from None
                if f.direct_refused and engine.direct:   # once per directory and process
                    warn_once(("buffered", os.path.abspath(d.user_path)),
                              "O_DIRECT is not supported in %s: swap I/O there is buffered "
                              "(slower, uses page cache)", d.user_path)
                self._state.files.append(f)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ properties
    @property
    def dirs(self):
        """The private directories (one per path)."""
        return [d.path for d in self._state.dirs]

    @property
    def paths(self):
        return list(self._paths)

    @property
    def bytes_allocated(self):
        return self._alloc.allocated

    @property
    def capacity(self):
        return self._capacity

    @property
    def closed(self):
        return self._state.closed

    # ------------------------------------------------------------ allocation
    def _file_sizes_for(self, end):
        """Bytes each file needs to back the virtual range [0, end)."""
        n, S = len(self._paths), self._stripe
        if n == 1:
            return [end]
        full, rem = divmod(end, S)
        sizes = []
        for i in range(n):
            s = (full // n) * S + (S if i < full % n else 0)
            if i == full % n:
                s += rem
            sizes.append(s)
        return sizes

    def _grow(self, end, *, exact=False):
        """Backs the virtual range [0, end) with preallocated file space.

        Grows ahead (doubling, at most 1 GiB at a time, in whole stripes) to save
        fallocate calls, falling back to exactly `end` when that does not fit.
        """
        with self._grow_lock:
            if end <= self._capacity:
                return
            targets = [end]
            if not exact:
                ahead = max(end, min(2 * self._capacity, self._capacity + (1 << 30)))
                ahead = (ahead + self._stripe - 1) // self._stripe * self._stripe
                if ahead > end:
                    targets.insert(0, ahead)
            for k, target in enumerate(targets):
                try:
                    self._fallocate_to(target)
                except AioError as e:
                    if e.errno == errno.ENOSPC and k + 1 < len(targets):
                        continue
                    raise
                self._capacity = target
                return

    def _fallocate_to(self, target):
        sizes = self._file_sizes_for(target)
        for i, (f, need) in enumerate(zip(self._state.files, sizes)):
            have = self._sizes[i]
            if need > have:
                try:
                    f.fallocate(have, need - have)
                except OSError as e:
                    avail = _free_bytes(self._paths[i])
                    raise AioError(e.errno, f"cannot grow the swap file in {self._state.dirs[i].path} "
                                   f"from {have} to {need} bytes ({need - have} more needed, "
                                   f"{avail} available): {os.strerror(e.errno)}",
                                   self._paths[i], have, need - have) from None
                self._sizes[i] = need

    def reserve(self, total_bytes):
        """Preallocates swap space for `total_bytes` (checked against free space first)."""
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes < 0:
            raise ValueError(f"total_bytes must be a non-negative int, got {total_bytes!r}")
        self._check_open()
        target = (total_bytes + self._stripe - 1) // self._stripe * self._stripe
        sizes = self._file_sizes_for(target)
        for i, need in enumerate(sizes):
            more = need - self._sizes[i]
            if more <= 0:
                continue
            avail = _free_bytes(self._paths[i])
            if avail is not None and more > avail:
                raise AioError(errno.ENOSPC, f"swap path {self._paths[i]} needs {more} more bytes "
                               f"({need} in total for {total_bytes} bytes of swap over "
                               f"{len(self._paths)} path(s)) but only {avail} are available",
                               self._paths[i], 0, more)
        self._grow(target, exact=True)

    def allocate(self, nbytes):
        """An extent of at least `nbytes` (4096-aligned start) backed by preallocated space."""
        self._check_open()
        old_end = self._alloc.end
        ext = self._alloc.allocate(nbytes)
        if ext.end > self._capacity:
            try:
                self._grow(ext.end)
            except BaseException:
                self._alloc.undo_grow(ext, old_end)
                raise
        if self._accounting is not None:
            self._accounting.alloc("nvme", ext.span)
        return ext

    def free(self, extent):
        if not isinstance(extent, Extent):
            raise ValueError(f"free() takes an Extent, got {type(extent).__name__}")
        self._alloc.free(extent)
        if self._accounting is not None:
            self._accounting.free("nvme", extent.span)

    # ------------------------------------------------------------- transfers
    def _segments(self, extent, tensor, offset, what):
        if not isinstance(extent, Extent) or not self._alloc.is_live(extent):
            raise ValueError(f"{what}: {extent!r} is not a live extent of this SwapSpace")
        ptr, nbytes = tensor_span(tensor, f"{what} tensor")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{what}: offset must be a non-negative int, got {offset!r}")
        if offset + nbytes > extent.nbytes:
            raise ValueError(f"{what}: {nbytes} bytes at offset {offset} go past the end of the extent "
                             f"({extent.nbytes} bytes)")
        files, n, S = self._state.files, len(self._paths), self._stripe
        v = extent.start + offset
        if n == 1:
            return [(files[0], ptr, v, nbytes)] if nbytes else []
        segs, left, p = [], nbytes, ptr
        while left:
            k, within = divmod(v, S)
            take = min(S - within, left)
            segs.append((files[k % n], p, (k // n) * S + within, take))
            v += take
            p += take
            left -= take
        return segs

    def _submit(self, op, extent, tensor, offset, what):
        self._check_open()
        segs = self._segments(extent, tensor, offset, what)
        h = self._engine.submit(op, segs, tensor)
        st = self._state
        with st.lock:
            st.pending[id(h)] = h
            if len(st.pending) > 256:
                for k in [k for k, v in st.pending.items() if v.done()]:
                    del st.pending[k]
        return h

    def write(self, extent, tensor, offset=0):
        """Writes `tensor`'s bytes at byte `offset` inside `extent`; returns a handle."""
        return self._submit(_aio.OP_WRITE, extent, tensor, offset, "SwapSpace.write")

    def read(self, extent, tensor, offset=0):
        """Reads `tensor.nbytes` bytes at byte `offset` inside `extent` into `tensor`."""
        return self._submit(_aio.OP_READ, extent, tensor, offset, "SwapSpace.read")

    # -------------------------------------------------------------- lifetime
    def _check_open(self):
        if self._state.closed:
            raise RuntimeError("this SwapSpace is closed")

    def close(self):
        """Waits for in-flight transfers, releases the swap files and removes the private dirs."""
        if self._accounting is not None and not self._state.closed:
            # the files go, so do the extents still live in them
            self._accounting.free("nvme", self._alloc.allocated)
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"SwapSpace(paths={self._paths}, allocated={self.bytes_allocated}, "
                f"capacity={self.capacity}, closed={self.closed})")


def _free_bytes(path):
    try:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize
    except OSError:
        return None
