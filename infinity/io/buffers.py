"""Aligned host buffers: page-aligned, mlock'ed where permitted, pinned for CUDA.

`aligned_empty` maps anonymous memory (so the address is page aligned, the
fast path of O_DIRECT), wraps it in a tensor without a copy, and lets the
tensor own the mapping: when the last tensor/view is garbage-collected the
mapping is unmapped (and with it unlocked / unregistered).
"""
import logging
import mmap
import threading
import weakref

import torch

from .. import _aio

log = logging.getLogger("infinity.io")

PAGE = mmap.PAGESIZE
# host buffers are registered with CUDA only once an engine computes on a CUDA device
# (enable_cuda_pinning at initialize): a CPU model never creates a CUDA context (which
# also breaks forked DataLoader workers)
_pin_for_cuda = False


def enable_cuda_pinning() -> None:
    """From now on :func:`aligned_empty` registers its memory with CUDA (page-locked, so
    host<->device copies are truly asynchronous).  Called by ``initialize`` for a model
    that computes on CUDA."""
    global _pin_for_cuda
    _pin_for_cuda = True


def cuda_pinning_enabled() -> bool:
    return _pin_for_cuda
HUGE = 2 << 20  # x86-64 / arm64 (4 KiB granule) transparent huge page size
_warned = set()
_warn_lock = threading.Lock()


def _warn_once(key, msg, *args):
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def _unregister(cudart, ptr, _mapping):
    # `_mapping` (the mmap) is an argument only to keep the memory mapped until now
    cudart.cudaHostUnregister(ptr)


def _cuda_register(ptr, nbytes, owner, mapping):
    """cudaHostRegister the mapping once :func:`enable_cuda_pinning` was called (a CUDA
    engine exists); never for CPU-only runs.

    Unregistered when ``owner`` (the exporter the tensor's storage holds) dies, *before*
    ``mapping`` is unmapped: the finalizer holds ``mapping`` until it has run (an mmap
    unmaps in its own dealloc before its weakref callbacks run)."""
    if not _pin_for_cuda:
        return
    consequence = ("host buffers are not pinned: every host<->device copy becomes a "
                   "synchronous staged copy that no longer overlaps compute (check "
                   "`ulimit -l` and the container's locked-memory limit)")
    try:
        if not torch.cuda.is_available():
            return
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(rc) != 0:
            _warn_once("cudaHostRegister", "cudaHostRegister of %d bytes failed (code %s): %s",
                       nbytes, int(rc), consequence)
            return
        weakref.finalize(owner, _unregister, cudart, ptr, mapping)
    except Exception as e:  # CUDA present but unusable: tensors still work, unpinned
        _warn_once("cudaHostRegister", "cannot pin host buffers for CUDA (%s): %s", e,
                   consequence)


def aligned_empty(numel, dtype=torch.uint8, *, lock=True):
    """An uninitialised, page-aligned, contiguous CPU tensor of `numel` elements.

    The memory is mlock'ed when RLIMIT_MEMLOCK permits (a warning is logged once
    otherwise) and registered with CUDA once an engine computes on CUDA
    (:func:`enable_cuda_pinning`). Mappings of 2 MiB or
    more ask for transparent huge pages (``MADV_HUGEPAGE``): physically contiguous
    memory makes each O_DIRECT request a few DMA segments (see docs/benchmarks.md,
    "I/O engine vs fio"). It is freed when
    the tensor (and every view of it) is garbage-collected.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty: numel must be a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    mapsize = max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
    try:
        mm = mmap.mmap(-1, mapsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise MemoryError(f"aligned_empty: cannot map {mapsize} bytes of host memory: {e}") from e
    if mapsize >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # Transparent huge pages (honoured when THP is `always` or `madvise`): each 2 MiB
        # is then physically contiguous, so an O_DIRECT request is a few DMA segments
        # instead of up to one per 4 KiB page. On a virtio disk a fragmented buffer
        # (~100 segments per 1 MiB request) measured ~2x slower than a contiguous one.
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: 4 KiB pages, still correct
            pass
    # the storage holds the memoryview (the buffer's exporter), the memoryview holds mm
    view = memoryview(mm)
    raw = torch.frombuffer(view, dtype=torch.uint8)
    ptr = raw.data_ptr()
    if lock:
        err = _aio.mlock(ptr, mapsize)
        if err:
            soft, _ = _aio.memlock_limit()
            _warn_once("mlock", "cannot mlock host buffers (errno %d, RLIMIT_MEMLOCK %s bytes): they "
                       "may be swapped out; raise `ulimit -l` for best performance", err,
                       "unlimited" if soft < 0 else soft)
    _cuda_register(ptr, mapsize, view, mm)
    del view, mm
    out = raw[:nbytes]
    return out.view(dtype) if dtype != torch.uint8 else out


def is_aligned(tensor, alignment=4096):
    """True when the tensor's address and byte length are multiples of `alignment`."""
    return tensor.data_ptr() % alignment == 0 and (tensor.numel() * tensor.element_size()) % alignment == 0
