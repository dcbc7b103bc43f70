"""What is in flight for a fetch or a tile read of the memory manager
(:class:`~infinity.memory.manager.MemoryManager`), and its fetch path for quantized groups
(``offload.frozen_weights``: Note [Quantized homes] in infinity/memory/frozen_quant.py).
"""
from __future__ import annotations

import contextlib
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
            if g.home == "device":                # the payload is in device memory
                f = Fetch(None, t0, qsrc=g.host_buf)
                g.begin_to_device(buf, f)
                self._inflight[g.gid] = g
                return True
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
        if g.home == "cpu" and not g.sharded:      # (across ranks: counted at the read)
            self.acct.count("frozen_host_read_bytes", g.home_nbytes)

    def _read_range_quantized(self, g: GroupRecord, lo: int, hi: int):
        """``read_range`` of a quantized group at its home (Note [Quantized tiles] in
        infinity/memory/frozen_quant.py): the spans of the payload that hold elements
        ``lo .. hi`` -- in place from a host home, else each 4 KiB-aligned span read from
        NVMe into one host lease -- moved to the device when it is separate memory, and
        decoded there into a working-precision lease; returns ``(tensor, lease)``."""
        rr = g.quant.range_read(g, lo, hi)
        isz = g.dtype.itemsize
        out = self.dev.lease_or_overflow(rr.count * isz, g.dtype, "a parameter tile", True)
        t0 = time.perf_counter()
        with contextlib.ExitStack() as scope:
            try:
                if g.host_buf is not None:        # a host home (or the device's)
                    views = {k: g.host_buf[a:b] for k, a, b in rr.spans}
                    if g.home == "cpu":
                        self.acct.count("frozen_host_read_bytes", rr.nbytes)
                else:
                    views = self._read_spans(g, rr.spans, scope, t0)
                if not self.dev.zero_copy and g.home != "device":
                    views = self._spans_to_device(views, rr.nbytes, scope, t0)
                rr.decode(views, out[:rr.count])
            except BaseException:
                self._give_back(self.dev, out)
                raise
        return out[lo - rr.first:hi - rr.first], out

    def _read_spans(self, g: GroupRecord, spans, scope, t0: float) -> dict:
        """The ``(name, lo, hi)`` byte spans of ``g``'s NVMe payload read into one host
        lease -- 4 KiB-aligned, spans sharing or touching a page read together (the small
        scale tensors of a tile lie side by side); the views of exactly those bytes."""
        reads = []                              # [a0, a1] aligned, ascending, merged
        for _k, a, b in sorted(spans, key=lambda x: x[1]):
            a0, a1 = a // 4096 * 4096, min(-(-b // 4096) * 4096, g.extent.nbytes)
            if reads and a0 <= reads[-1][1]:
                reads[-1][1] = max(reads[-1][1], a1)
            else:
                reads.append([a0, a1])
        at, end = [], 0
        for a0, a1 in reads:
            at.append(end)
            end += a1 - a0
        staging = scope.enter_context(self.host_pool.scoped(end, torch.uint8))
        handles = []
        try:
            for (a0, a1), o in zip(reads, at):
                handles.append(self.swap.read(g.extent, staging[o:o + a1 - a0], a0))
        finally:
            err = None
            for h in handles:             # every read finishes before its buffer is reused
                try:
                    h.wait()
                except Exception as e:  # noqa: BLE001 - the first error is raised below
                    err = err or e
            if err is not None:
                raise err
        self._link("nvme_read", end, t0)
        self.acct.count("frozen_nvme_read_bytes", end)
        views = {}
        for k, a, b in spans:
            (a0, _a1), o = next((r, o) for r, o in zip(reads, at) if r[0] <= a < r[1] or
                                (a == b and r[0] <= a <= r[1]))
            views[k] = staging[o + a - a0:o + b - a0]
        return views

    def _spans_to_device(self, views: dict, nbytes: int, scope, t0: float) -> dict:
        """Separate device memory: the payload spans copied up into one device lease (each
        at a 64-byte aligned offset), waited for before they are decoded there."""
        offs, end = {}, 0
        for k, v in views.items():
            offs[k] = end
            end = -(-(end + v.numel()) // 64) * 64
        buf = self.dev.lease_or_overflow(end, torch.uint8, "a quantized tile's payload", True)
        scope.callback(self._give_back, self.dev, buf)
        out = {}
        for k, v in views.items():
            dst = buf[offs[k]:offs[k] + v.numel()]
            x = self.dev.h2d(dst, v)
            x.wait_host()
            self.dev.compute_waits(x)
            out[k] = dst
        self._link("h2d", nbytes, t0)
        return out

    def _read_done(self, g: GroupRecord, t0: float, t1) -> None:
        """An NVMe read of ``g``'s home finished: the link, and frozen bytes per tier."""
        self._link("nvme_read", g.home_nbytes, t0, t1)
        if not g.trainable:
            self.acct.count("frozen_nvme_read_bytes", g.home_nbytes)
