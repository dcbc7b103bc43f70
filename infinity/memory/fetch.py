"""What is in flight for a fetch or a tile read of the memory manager
(:class:`~infinity.memory.manager.MemoryManager`), and its fetch path for quantized groups
(``offload.frozen_weights``: Note [Quantized homes] in infinity/memory/frozen_quant.py).
"""
from __future__ import annotations

import time

import torch

from .record import GroupRecord

__all__ = ["Fetch", "ReadyTile", "QuantizedFetch"]


class Fetch:
    """What is in flight for one group between ``fetch_async`` and ``wait_resident``."""
    __slots__ = ("handle", "t0", "t_read", "staging", "xfer", "landing", "qsrc", "qowner")

    def __init__(self, handle, t0: float, staging=None, xfer=None, qsrc=None, qowner=None):
        self.handle = handle          # NVMe read handle (None for a host-homed group)
        self.t0 = t0                  # issue time
        self.t_read = None            # first time the read was seen complete
        self.staging = staging        # pinned host buffer the read lands in (CUDA path)
        self.xfer = xfer              # the H2D Transfer (CUDA path)
        self.landing = None           # the lander's job (Note [H2D on landing])
        # a quantized group (Note [Quantized homes] in infinity/memory/frozen_quant.py): the
        # buffer its payload lands in, dequantized into the compute buffer at the wait, and
        # the pool (or device tier) it goes back to (None: the host home itself, not leased)
        self.qsrc = qsrc
        self.qowner = qowner

    def poll_read(self) -> bool:
        if self.landing is not None:  # the lander waits for the read and stamps t_read
            return self.landing.done()
        if self.t_read is None and self.handle is not None and self.handle.done():
            self.t_read = time.perf_counter()
        return self.t_read is not None


class ReadyTile:
    """A tile already read (:meth:`MemoryManager.read_range_start`)."""
    __slots__ = ("view", "lease", "mm")

    def __init__(self, view, lease, mm=None):
        self.view, self.lease, self.mm = view, lease, mm

    def result(self):
        return self.view, self.lease

    def cancel(self) -> None:
        if self.lease is not None and self.mm is not None:
            self.mm.give_back_range(self.lease)


class ReadingTile:
    """An NVMe tile read in flight into a device-tier lease (zero-copy tier)."""
    __slots__ = ("mm", "h", "view", "buf", "nbytes", "t0")

    def __init__(self, mm, h, view, buf, nbytes, t0):
        self.mm, self.h, self.view, self.buf, self.nbytes, self.t0 = mm, h, view, buf, nbytes, t0

    def result(self):
        try:
            self.h.wait()
        except BaseException:
            self.mm.give_back_range(self.buf)
            raise
        self.mm._link("nvme_read", self.nbytes, self.t0)
        return self.view, self.buf

    def cancel(self) -> None:
        try:
            self.h.wait()
        except Exception:  # noqa: BLE001 - the error that made us cancel matters more
            pass
        self.mm.give_back_range(self.buf)


class QuantizedFetch:
    """The memory manager's fetch of a quantized group (mixed into ``MemoryManager``;
    Note [Quantized homes] in infinity/memory/frozen_quant.py)."""

    def _fetch_quantized(self, g: GroupRecord, allow_overflow: bool) -> bool:
        """``fetch_async`` of a quantized group (Note [Quantized homes] in
        infinity/memory/frozen_quant.py): only the payload moves -- host home: used in place
        (zero-copy tier) or copied H2D into a device-tier lease; NVMe home: read into a host
        lease (zero-copy tier) or into pinned staging, then H2D (Note [H2D on landing]).
        The wait (``_wait_resident``) dequantizes it into the compute buffer."""
        buf = self._lease_device(g, allow_overflow)
        if buf is None:
            return False
        nb = g.home_nbytes
        t0 = time.perf_counter()
        staging = qsrc = f = None
        qowner = self.dev if not self.dev.zero_copy else self.host_pool
        try:
            if not self.dev.zero_copy:
                qsrc = self.dev.lease_or_overflow(nb, torch.uint8, "a quantized payload", True)
            if g.home == "cpu":
                if self.dev.zero_copy:
                    f = Fetch(None, t0, qsrc=g.host_buf)
                else:
                    f = Fetch(None, t0, xfer=self.dev.h2d(qsrc, g.host_buf), qsrc=qsrc,
                              qowner=qowner)
                g.begin_to_device(buf, f)
            elif self.dev.zero_copy:
                qsrc = self.host_pool.lease(nb, torch.uint8)
                f = Fetch(self.swap.read(g.extent, qsrc), t0, qsrc=qsrc, qowner=qowner)
                g.begin_read(buf, f)
            else:
                staging = self.host_pool.lease(nb, torch.uint8)
                f = Fetch(self.swap.read(g.extent, staging), t0, staging=staging, qsrc=qsrc,
                          qowner=qowner)
                f.landing = self._landing_thread().submit(self._land_job, f, qsrc)
                g.begin_read(buf, f)
        except BaseException:
            if f is not None:
                self._settle(f)
            if staging is not None:
                self.host_pool.give_back(staging)
            if qsrc is not None and qsrc is not g.host_buf:
                qowner.give_back(qsrc)
            self.dev.give_back(buf)
            raise
        self._inflight[g.gid] = g
        return True

    def _dequantize(self, g: GroupRecord, f: Fetch) -> None:
        """The payload of a quantized group's fetch has landed in ``f.qsrc`` (and, on
        separate device memory, compute waits for its copy): dequantize it into the compute
        buffer, give the payload's lease back (Note [Quantized homes])."""
        src, owner = f.qsrc, f.qowner
        f.qsrc = f.qowner = None
        try:
            g.quant.unpack(src, g.device_buf, g)
        finally:
            if owner is not None:
                self._give_back(owner, src)   # CUDA: the next copy into it waits for compute
        if g.home == "cpu":
            self.acct.count("frozen_host_read_bytes", g.home_nbytes)

    def _read_done(self, g: GroupRecord, t0: float, t1) -> None:
        """An NVMe read of ``g``'s home finished: the link, and frozen bytes per tier."""
        self._link("nvme_read", g.home_nbytes, t0, t1)
        if not g.trainable:
            self.acct.count("frozen_nvme_read_bytes", g.home_nbytes)
