"""Leased, reusable flat buffers for one memory tier, bounded by a byte budget.

Buffers are allocated lazily (page-aligned, pinned when possible through
``infinity.io.aligned_empty``), handed out with :meth:`BufferPool.lease` and given
back with :meth:`BufferPool.give_back`; nothing is allocated per operation once the
working set has been seen.  Buffers are kept per exact size class (bytes rounded up
to 4096), so a pool serving a handful of group sizes reuses them exactly.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from .accounting import Accounting

log = logging.getLogger("infinity.memory")

__all__ = ["BufferPool", "PoolExhausted", "round_up", "aligned_buffer", "leased_size",
           "per_size_class"]

ALIGN = 4096


def round_up(n: int, m: int) -> int:
    return (int(n) + m - 1) // m * m


def leased_size(buf: torch.Tensor) -> int:
    """The bytes a pool buffer occupies: its length rounded up to 4096."""
    return round_up(buf.numel() * buf.element_size(), ALIGN)


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` (multiple of 4096), page-aligned when possible."""
    try:
        from infinity.io import aligned_empty  # the I/O engineer's allocator
    except ImportError:  # pragma: no cover - only while infinity.io is being written
        aligned_empty = None
    if aligned_empty is not None:
        return aligned_empty(nbytes, torch.uint8)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


def per_size_class(sizes, most) -> list[int]:
    """``sizes`` with each distinct size kept at most ``most`` times (an int, or a function
    of the size): the buffers a window of leases needs, for :meth:`BufferPool.reserve`."""
    counts: dict[int, int] = {}
    for n in sizes:
        counts[n] = counts.get(n, 0) + 1
    return [n for n, c in counts.items()
            for _ in range(min(c, most(n) if callable(most) else most))]


class PoolExhausted(MemoryError):
    """The pool's budget cannot hold another buffer of the requested size."""


class BufferPool:
    """Size-classed pool of flat byte buffers for one tier (``"device"`` or ``"host"``)."""

    def __init__(self, tier: str, budget_bytes: int | None, accounting: Accounting, *,
                 allocator=None, on_drop=None):
        self.tier = tier
        self._allocator = allocator or aligned_buffer   # nbytes -> flat uint8 tensor
        # on_drop(raw): a free buffer leaves the pool for good (its owner may forget
        # per-buffer state, e.g. the CUDA tier's last-use event of that address)
        self._on_drop = on_drop
        self.budget = budget_bytes
        self.acct = accounting
        self._free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0      # bytes held by the pool (leased + free)
        self.leased = 0
        # data_ptr -> size of every buffer out on lease: a buffer given back twice (or
        # one this pool never leased) is refused instead of being handed to two owners
        self._out: dict[int, int] = {}
        # reclaim(nbytes): asked to give leased buffers back (give_back) when a lease would
        # exceed the budget (the parameter cache lends its copies, MemoryManager.reclaim);
        # set with set_reclaimer
        self._reclaim = None

    def set_reclaimer(self, fn) -> None:
        """``fn(nbytes)`` gives leased buffers back when a lease would exceed the budget (the
        one borrower whose buffers are reclaimable: the parameter cache).  None detaches."""
        if fn is not None and self._reclaim is not None and fn != self._reclaim:
            raise RuntimeError(f"{self.tier} tier pool: a reclaimer is already attached")
        self._reclaim = fn

    def can_lease(self, nbytes: int) -> bool:
        size = round_up(nbytes, ALIGN)
        if self._free.get(size):
            return True
        if self.budget is None:
            return True
        spare = sum(round_up(k, 1) * len(v) for k, v in self._free.items())
        return self.allocated - spare + size <= self.budget

    def lease(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of ``dtype`` covering ``nbytes`` (rounded up to 4096)."""
        size = round_up(nbytes, ALIGN)
        lst = self._free.get(size)
        if lst:
            raw = lst.pop()
        else:
            if self.budget is not None and self.allocated + size > self.budget:
                self._trim(self.allocated + size - self.budget)
            if self.budget is not None and self.allocated + size > self.budget \
                    and self._reclaim is not None:
                self._reclaim(self.allocated + size - self.budget)
                lst = self._free.get(size)
                if lst:                   # a reclaimed buffer of this size: reuse it
                    return self._hand_out(lst.pop(), size, nbytes, dtype)
                self._trim(self.allocated + size - self.budget)
            if self.budget is not None and self.allocated + size > self.budget:
                raise PoolExhausted(
                    f"{self.tier} tier: cannot lease {size} bytes: {self.leased} bytes leased, "
                    f"budget {self.budget} bytes")
            raw = self._allocator(size)
            self.allocated += size
            self.acct.alloc(self.tier, size)
        return self._hand_out(raw, size, nbytes, dtype)

    def _hand_out(self, raw: torch.Tensor, size: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        self.leased += size
        self._out[raw.data_ptr()] = size
        esize = torch.empty((), dtype=dtype).element_size()
        return raw.view(dtype)[: nbytes // esize]

    @contextlib.contextmanager
    def scoped(self, nbytes: int, dtype: torch.dtype):
        """``with pool.scoped(n, dtype) as buf:`` a lease given back when the block ends,
        however it ends (a scratch or staging buffer that lives in one scope)."""
        buf = self.lease(nbytes, dtype)
        try:
            yield buf
        finally:
            self.give_back(buf)

    def is_leased(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is out on lease from this pool."""
        return self._out.get(buf.data_ptr()) == leased_size(buf)

    def _check_out(self, buf: torch.Tensor, what: str) -> int:
        size = leased_size(buf)
        held = self._out.get(buf.data_ptr())
        if held is None:
            raise ValueError(
                f"{self.tier} tier pool: {what} of a buffer ({size} bytes at 0x{buf.data_ptr():x}) that is "
                f"not on lease from this pool: returned twice, or never leased here. Returning it would "
                f"let two owners share memory; this is a bug in the caller")
        if held != size:
            raise ValueError(
                f"{self.tier} tier pool: {what} of a {size}-byte view of a {held}-byte leased buffer; "
                f"give back the tensor lease() returned")
        return size

    def give_back(self, buf: torch.Tensor) -> None:
        size = self._check_out(buf, "give_back")
        del self._out[buf.data_ptr()]
        raw = buf.view(torch.uint8)
        # rebuild the full-size raw view over the same storage start
        raw = torch.empty(0, dtype=torch.uint8, device=buf.device).set_(buf.untyped_storage(), buf.storage_offset()
                                                     * buf.element_size(), (size,))
        self._free.setdefault(size, []).append(raw)
        self.leased -= size

    def reserve(self, sizes) -> int:
        """Allocate free buffers of ``sizes`` (bytes each) ahead of their first lease, as
        far as the budget allows without trimming; a size the free list already holds is
        not allocated twice.  Host buffers are pinned (``cudaHostRegister``) when they are
        allocated, so reserving at ``initialize`` keeps that out of the first steps'
        hooks.  Returns the bytes allocated."""
        have = {k: len(v) for k, v in self._free.items()}
        added = 0
        for n in sizes:
            size = round_up(n, ALIGN)
            if have.get(size, 0) > 0:
                have[size] -= 1
                continue
            if self.budget is not None and self.allocated + size > self.budget:
                continue
            raw = self._allocator(size)
            self.allocated += size
            self.acct.alloc(self.tier, size)
            self._free.setdefault(size, []).append(raw)
            added += size
        return added

    def adopt(self, buf: torch.Tensor) -> bool:
        """Count a buffer from elsewhere as leased from this pool (``give_back`` then
        keeps it here), if the budget can hold it (free buffers are trimmed to make room).
        Returns False, changing nothing, when it cannot."""
        size = leased_size(buf)
        if self.budget is not None and self.allocated + size > self.budget:
            spare = sum(k * len(v) for k, v in self._free.items())
            if self.allocated - spare + size > self.budget:
                return False
            self._trim(self.allocated + size - self.budget)
        if buf.data_ptr() in self._out:
            raise ValueError(f"{self.tier} tier pool: adopt of a buffer already on lease from this pool")
        self.allocated += size
        self.leased += size
        self._out[buf.data_ptr()] = size
        self.acct.alloc(self.tier, size)
        return True

    def detach(self, buf: torch.Tensor) -> None:
        """A leased buffer leaves the pool for good (its owner frees it by dropping it)."""
        size = self._check_out(buf, "detach")
        del self._out[buf.data_ptr()]
        if self._on_drop is not None:
            self._on_drop(buf)
        self.leased -= size
        self.allocated -= size
        self.acct.free(self.tier, size)

    def _trim(self, need: int) -> None:
        """Drop free buffers (of any size) until ``need`` bytes are returned."""
        for size in sorted(self._free, reverse=True):
            lst = self._free[size]
            while lst and need > 0:
                raw = lst.pop()
                if self._on_drop is not None:
                    self._on_drop(raw)
                self.allocated -= size
                self.acct.free(self.tier, size)
                need -= size

    def trim(self) -> None:
        """Drop every free (not leased) buffer."""
        self._trim(self.allocated - self.leased)

    def close(self) -> None:
        self._trim(self.allocated)
        self._free.clear()
