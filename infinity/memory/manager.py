"""The tiered memory manager for parameter groups: homes, fetch, release, budgets.

It owns the :class:`~infinity.memory.record.GroupRecord` objects and moves them
between their home (device / host / NVMe) and the device tier.  On a CPU-only
machine the device tier is host memory bounded by ``device_memory_gb``; an
NVMe-homed group is read *straight into* the buffer compute uses (no staging copy),
a host-homed group is used in place (the host buffer *is* device-addressable).
On CUDA (or the :class:`~infinity.memory.device.SimulatedDevice` used by the tests) the
device tier is a :class:`~infinity.memory.device.DeviceTier`: host-homed groups are
copied H2D on a copy stream, NVMe-homed groups are read into pinned host staging and
then copied H2D; compute waits on the copy's event, staging goes back to the host pool
only once that event completed.  A device-homed group (``offload.params = "none"``) on a
separate device keeps a host mirror for the CPU optimizer and a resident device copy
that :meth:`refresh_resident` updates after each step.

Note [H2D on landing]
~~~~~~~~~~~~~~~~~~~~~
On separate device memory an NVMe-homed group's read lands in pinned host staging and
must then be copied H2D.  The main thread is busy with compute (it only reaches the
manager at the next hook), so a one-thread *lander* waits for each such read (in issue
order, the I/O itself stays concurrent) and issues its H2D on the copy stream the moment
it landed; its job returns the :class:`~infinity.memory.device.Transfer`.  The group's
state changes only on the main thread (``_start_h2d``, at the next poll or wait), which also
raises a failed read for that group alone.  The lander touches nothing but the read
handle, the staging buffer and the device tier's copy call; abandoning a fetch waits for
its job first, so staging never goes back while a copy may still read it.

Link timings: an NVMe read is timed from issue to the first moment its completion is
observed (completions are polled at every fetch/wait/release), not to when compute
happens to wait for it, so the ``nvme_read`` lane shows the device's busy time.

Who calls what: the hooks (``infinity.runtime.hooks``) call :meth:`use`/:meth:`done_with`
through the prefetch coordinator, which calls :meth:`fetch_async` ahead of time.
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .accounting import Accounting
from .fetch import Fetch, QuantizedFetch, ReadyTile, ReadingTile
from .device import DeviceTier, make_device
from .pool import BufferPool, leased_size, per_size_class
from .record import GroupRecord, Location

log = logging.getLogger("infinity.memory")

__all__ = ["Fetch", "MemoryManager"]


class MemoryManager(QuantizedFetch):
    def __init__(self, groups: list[GroupRecord], *, device: torch.device,
                 device_budget: int | None, host_pool: BufferPool, swap=None,
                 accounting: Accounting, timeline=None, device_tier: DeviceTier | None = None,
                 cache: bool = False):
        self.groups = groups
        self.device = device
        self.acct = accounting
        self.timeline = timeline
        self.swap = swap
        self.host_pool = host_pool
        self.dev = device_tier if device_tier is not None else \
            make_device(device, device_budget, accounting)
        self.device_pool: BufferPool = self.dev.pool
        self._inflight: dict[int, GroupRecord] = {}   # gid -> group with a Fetch pending
        self._by_storage: dict[int, GroupRecord] = {}
        self.closed = False
        # the overlapped step (infinity.engine.overlap) listens, attached with
        # attach_listener: on_release(g, buf) when an NVMe-homed group is released (buf None
        # when it stayed cached; returning True takes the buffer over, give it back with
        # give_back_device: Note [Master hand-off]) and reclaim_blocked() when only copies a
        # running step updates could be freed
        self._listener = None
        # parameter cache (see enable_cache): NVMe-homed groups that keep a clean host
        # copy between uses, in host-pool memory nothing else needs at the moment
        self.cache_on = False
        self._pinned: set[int] = set()     # gids whose cached copy a running step updates
        # gid -> callable waiting for a running optimizer step that writes the group's
        # home (overlapped step, mark_home_busy): a fetch of that group waits for it first
        self._home_busy: dict = {}
        # the decided update finished during the next forward (Note [Finish in the next
        # forward]): a fetch of a group waits for its step
        self._home_deferred: dict = {}
        self._failed: dict[int, BaseException] = {}   # gid -> error of its abandoned fetch
        self._lander: ThreadPoolExecutor | None = None   # Note [H2D on landing]
        self._abandoning = False         # inside lenient_returns() (see _give_back)
        if cache:
            self.enable_cache()

    # ------------------------------------------------------------------ setup
    def place(self, g: GroupRecord, staging: torch.Tensor | None = None) -> None:
        """Create ``g``'s home from the parameters' current values (called once)."""
        if g.home == "device" and g.quant is not None:
            # Note [Quantized homes]: a device home keeps the payload in device memory
            # (QLoRA's layout); every use dequantizes it into a leased compute buffer
            g.host_buf = self.device_pool.lease(g.home_nbytes, torch.uint8)
            if self.dev.zero_copy:
                g.quant.pack(g, g.host_buf)
            else:
                with self.host_pool.scoped(g.home_nbytes, torch.uint8) as tmp:
                    g.quant.pack(g, tmp)
                    x = self.dev.h2d(g.host_buf, tmp)
                    x.wait_host()
                    self.dev.compute_waits(x)
            g.set_home_state()
            return
        if g.home == "device" and not self.dev.zero_copy:
            # separate device memory (CUDA): the optimizer side works on a host mirror
            # (the fp32 master in fp32, the low-precision copy it writes otherwise); the
            # resident device copy is refreshed from it after each step (refresh_resident)
            g.host_buf = self.host_pool.lease(g.nbytes, g.dtype)
            self._fill(g, g.host_buf)
            buf = self._alloc_resident(g)
            self._copy_mirror(buf, g.host_buf)
            g.make_resident(buf)
            return
        if g.home == "device":
            buf = self._alloc_resident(g)
            self._fill(g, buf)
            g.make_resident(buf)
            return
        if g.quant is not None and g.home not in ("cpu", "nvme"):
            raise ValueError(f"memory: group {g.gid} ({g.name}): a quantized payload needs a "
                             f"host or NVMe home, not {g.home!r}")
        if g.home == "cpu":
            if g.quant is not None:               # Note [Quantized homes]: the payload
                g.host_buf = self.host_pool.lease(g.home_nbytes, torch.uint8)
                g.quant.pack(g, g.host_buf)
            else:
                g.host_buf = self.host_pool.lease(g.nbytes, g.dtype)
                self._fill(g, g.host_buf)
            g.set_home_state()
            return
        if g.home == "nvme":
            if self.swap is None:
                raise RuntimeError("memory: NVMe home requested but no swap space was opened")
            nb = g.home_nbytes
            g.extent = self.swap.allocate(nb)
            with contextlib.ExitStack() as scope:
                if g.quant is not None:           # Note [Quantized homes]: the payload
                    buf = staging.view(torch.uint8)[:nb] if staging is not None else \
                        scope.enter_context(self.host_pool.scoped(nb, torch.uint8))
                    g.quant.pack(g, buf)
                else:
                    buf = staging.view(g.dtype)[: g.padded_numel] if staging is not None \
                        else scope.enter_context(self.host_pool.scoped(g.nbytes, g.dtype))
                    self._fill(g, buf)
                t0 = time.perf_counter()
                self.swap.write(g.extent, buf).wait()
                self._link("nvme_write", nb, t0)
            g.set_home_state()
            return
        raise ValueError(f"memory: unknown home {g.home!r}")

    def _alloc_resident(self, g: GroupRecord) -> torch.Tensor:
        return self.device_pool.lease(g.nbytes, g.dtype)

    @staticmethod
    def _fill(g: GroupRecord, buf: torch.Tensor) -> None:
        buf.zero_()
        with torch.no_grad():
            for s in g.slots:
                buf[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))

    # ------------------------------------------------------------------ fetch
    def _lease_device(self, g: GroupRecord, allow_overflow: bool) -> torch.Tensor | None:
        """A device buffer for ``g``; None when the budget is full and ``allow_overflow`` is
        false, else one past the budget (warned once, counted) so training progresses."""
        return self.dev.lease_or_overflow(g.nbytes, g.dtype, "the working set of parameters",
                                          allow_overflow)

    def fetch_async(self, g: GroupRecord, *, allow_overflow: bool) -> bool:
        """Start bringing ``g`` to the device tier. Returns False when the budget is full
        (only possible with ``allow_overflow=False``)."""
        if g.state in (Location.DEVICE, Location.READING, Location.TO_DEVICE):
            return True
        self.wait_home(g)   # a running step still writes its home (Note [Overlap safety])
        self._failed.pop(g.gid, None)
        if g.quant is not None:
            return self._fetch_quantized(g, allow_overflow)
        if g.state in (Location.HOST, Location.CACHED) and self.dev.zero_copy:
            # the host home (or a cached copy of an NVMe home) is directly usable by CPU
            # compute: no copy, no extra bytes
            g.begin_to_device(g.host_buf)
            g.finish_to_device()
            if not g.trainable:
                self.acct.count("frozen_host_read_bytes", g.nbytes)   # read in place
            # saved tensors must still be packed as references: autograd keeps the leaf
            # parameter itself, whose .data is swapped out on release
            self._by_storage[g.device_buf.untyped_storage().data_ptr()] = g
            return True
        buf = self._lease_device(g, allow_overflow)
        if buf is None:
            return False
        t0 = time.perf_counter()
        staging = f = None
        try:
            if g.home == "cpu":                       # separate device memory: H2D copy
                g.begin_to_device(buf, Fetch(None, t0, xfer=self.dev.h2d(buf, g.host_buf)))
                if not g.trainable:
                    self.acct.count("frozen_host_read_bytes", g.nbytes)
            elif self.dev.zero_copy:                  # read straight into the compute buffer
                g.begin_read(buf, Fetch(self.swap.read(g.extent, buf), t0))
            else:                                     # NVMe -> pinned staging -> H2D
                staging = self.host_pool.lease(g.nbytes, g.dtype)
                f = Fetch(self.swap.read(g.extent, staging), t0, staging=staging)
                f.landing = self._landing_thread().submit(self._land_job, f, buf)
                g.begin_read(buf, f)
        except BaseException:
            # nothing was recorded: what was submitted finishes first, no buffer may leak
            if f is not None:
                self._settle(f)
            if staging is not None:
                self.host_pool.give_back(staging)
            self.dev.give_back(buf)
            raise
        self._inflight[g.gid] = g
        return True

    def wait_home(self, g: GroupRecord) -> None:
        """Wait for a running optimizer step that writes ``g``'s home (Note [Overlap safety])."""
        for marks in (self._home_busy, self._home_deferred):
            wait = marks.get(g.gid)
            if wait is not None:
                wait()                  # (forgotten only once it returned: an interrupt
                marks.pop(g.gid, None)  # inside it leaves the next fetch waiting too)

    # ------------------------------------------------------------------ tiles
    # Note [Tiles]: a tiled group (memory-centric tiling, infinity.runtime.tiling) is never
    # fetched whole; compute reads element ranges of it, one tile at a time, straight from
    # where its current values are: the fetched buffer (someone fetched it whole), the host
    # home or cached copy (in place on a zero-copy tier, else one H2D of the range), or its
    # NVMe extent (the 4 KiB-aligned byte range around it, read into a device-tier lease).
    def read_range(self, g: GroupRecord, lo: int, hi: int):
        """Elements ``lo .. hi`` of ``g``'s flat values as a device-tier tensor; returns
        ``(tensor, lease)``, give ``lease`` back with :meth:`give_back_range`."""
        if g.state in (Location.READING, Location.TO_DEVICE):
            self.wait_resident(g)
        if g.state is Location.DEVICE and g.device_buf is not None:
            return g.device_buf[lo:hi], None
        if g.quant is not None:          # Note [Quantized tiles] (memory/frozen_quant.py)
            return self._read_range_quantized(g, lo, hi)
        self.wait_home(g)
        isz = g.dtype.itemsize
        if g.state in (Location.HOST, Location.CACHED):
            src = g.host_buf[lo:hi]
            if not g.trainable:
                self.acct.count("frozen_host_read_bytes", (hi - lo) * isz)
            if self.dev.zero_copy:
                return src, None
            buf = self.dev.lease_or_overflow((hi - lo) * isz, g.dtype, "a parameter tile", True)
            view = buf[: hi - lo]
            t0 = time.perf_counter()
            x = self.dev.h2d(view, src)
            x.wait_host()
            self.dev.compute_waits(x)
            self._link("h2d", (hi - lo) * isz, t0)
            return view, buf
        if g.state is not Location.NVME:
            raise RuntimeError(f"memory: cannot read a tile of group {g.gid} ({g.name}) in "
                               f"state {g.state.name}")
        a0 = (lo * isz) // 4096 * 4096
        a1 = min(-(-(hi * isz) // 4096) * 4096, g.extent.nbytes)
        t0 = time.perf_counter()
        if not g.trainable:
            self.acct.count("frozen_nvme_read_bytes", a1 - a0)
        if self.dev.zero_copy:
            buf = self.dev.lease_or_overflow(a1 - a0, torch.uint8, "a parameter tile", True)
            raw = buf[: a1 - a0]
            self.swap.read(g.extent, raw, a0).wait()
            self._link("nvme_read", a1 - a0, t0)
            return raw.view(g.dtype)[(lo * isz - a0) // isz:][: hi - lo], buf
        with self.host_pool.scoped(a1 - a0, torch.uint8) as staging:
            raw = staging[: a1 - a0]
            self.swap.read(g.extent, raw, a0).wait()
            self._link("nvme_read", a1 - a0, t0)
            src = raw.view(g.dtype)[(lo * isz - a0) // isz:][: hi - lo]
            buf = self.dev.lease_or_overflow((hi - lo) * isz, g.dtype, "a parameter tile", True)
            view = buf[: hi - lo]
            x = self.dev.h2d(view, src)
            x.wait_host()
            self.dev.compute_waits(x)
        return view, buf

    def read_range_start(self, g: GroupRecord, lo: int, hi: int):
        """Start :meth:`read_range` (the next tile is read while the current one computes);
        ``.result()`` gives ``(tensor, lease)``, ``.cancel()`` gives it back unused.  An
        NVMe read on a zero-copy tier is left in flight; everything else is read now."""
        if g.state is Location.NVME and self.dev.zero_copy and not g.users and g.quant is None:
            self.wait_home(g)
            if g.state is Location.NVME:
                isz = g.dtype.itemsize
                a0 = (lo * isz) // 4096 * 4096
                a1 = min(-(-(hi * isz) // 4096) * 4096, g.extent.nbytes)
                buf = self.dev.lease_or_overflow(a1 - a0, torch.uint8, "a parameter tile", True)
                t0 = time.perf_counter()
                try:
                    h = self.swap.read(g.extent, buf[: a1 - a0], a0)
                except BaseException:
                    self._give_back(self.dev, buf)
                    raise
                view = buf[: a1 - a0].view(g.dtype)[(lo * isz - a0) // isz:][: hi - lo]
                if not g.trainable:
                    self.acct.count("frozen_nvme_read_bytes", a1 - a0)
                return ReadingTile(self, h, view, buf, a1 - a0, t0)
        return ReadyTile(*self.read_range(g, lo, hi), self)

    def give_back_range(self, lease) -> None:
        if lease is not None:
            self._give_back(self.dev, lease)

    def _landing_thread(self) -> ThreadPoolExecutor:
        if self._lander is None:
            self._lander = ThreadPoolExecutor(1, thread_name_prefix="infinity-h2d-lander")
        return self._lander

    @staticmethod
    def _settle(f: Fetch) -> None:
        """Wait until nothing of ``f`` is in flight (its lander job, read and copy),
        ignoring its errors (an abandoned fetch: they are reported elsewhere or moot)."""
        if f.landing is not None and f.xfer is None:
            try:                              # the lander may still issue its copy
                f.xfer = f.landing.result()
            except Exception:  # noqa: BLE001 - the read failed: no copy was issued
                pass
        if f.handle is not None:
            try:
                f.handle.wait()
            except Exception:  # noqa: BLE001 - already failed; nothing is in flight after
                pass
        if f.xfer is not None:
            f.xfer.wait_host()

    def _land_job(self, f: Fetch, dst: torch.Tensor):
        """Lander thread (Note [H2D on landing]): wait for the read, then issue its H2D."""
        try:
            f.handle.wait()                   # raises the read's AioError (to _start_h2d)
        finally:
            f.t_read = time.perf_counter()
        return self.dev.h2d(dst, f.staging)

    def staging_sizes(self, depth: int) -> list[int]:
        """The pinned host staging the fetches of NVMe-homed groups lease on separate
        device memory (NVMe -> staging -> H2D): per size class, as many buffers as the fetch
        window holds (``depth + 2``, the plan's figure).  ``initialize`` reserves them in
        the host pool, so they are allocated and registered with CUDA before training, not
        inside the first steps' hooks.  Nothing on a zero-copy tier."""
        if self.dev.zero_copy:
            return []
        return per_size_class((self._staging_bytes(g) for g in self.groups if g.home == "nvme"),
                              depth + 2)

    def _staging_bytes(self, g: GroupRecord) -> int:
        """Bytes of the host staging one fetch of NVMe-homed ``g`` leases."""
        return g.home_nbytes

    def fetch_pending(self, g: GroupRecord) -> bool:
        """Whether a fetch of ``g`` was started and not yet waited for."""
        return g.gid in self._inflight

    def _progress(self) -> None:
        """Non-blocking: stamp completed reads, start the H2D of reads that landed in
        staging, give back staging whose H2D completed."""
        for g in list(self._inflight.values()):
            f = g.pending
            if g.state is Location.READING and f.poll_read() and f.staging is not None:
                try:
                    self._start_h2d(g, f)
                except Exception as e:  # g's own wait raises it, not some other group's
                    self._forget_fetch(g, e)
        self.dev.poll()

    def _forget_fetch(self, g: GroupRecord, err: BaseException | None = None) -> None:
        """Abandon ``g``'s in-flight fetch (it failed, or its window did): its buffers go
        back, it returns to its home state, and ``err`` is what waiting for it raises."""
        f = g.pending
        self._inflight.pop(g.gid, None)
        if isinstance(f, Fetch):
            self._settle(f)
            if f.staging is not None:
                self._give_back(self.host_pool, f.staging)
                f.staging = None
            if f.qowner is not None:              # a quantized payload's lease
                self._give_back(f.qowner, f.qsrc)
            f.qsrc = f.qowner = None
        buf = g.abort_fetch()
        if buf is not None:
            self._give_back(self.dev, buf)
        if err is not None:
            self._failed[g.gid] = err

    def _start_h2d(self, g: GroupRecord, f: Fetch) -> None:
        """READING -> TO_DEVICE (CUDA path): the read landed in staging; copy it up."""
        if f.landing is not None:             # issued by the lander as the read landed
            f.xfer = f.landing.result()       # raises the read's AioError
        else:
            f.handle.wait()                   # already complete: returns or raises AioError
            f.xfer = self.dev.h2d(g.device_buf if f.qsrc is None else f.qsrc, f.staging)
        self._read_done(g, f.t0, f.t_read)
        g.read_landed(f)

    def _finish_h2d(self, g: GroupRecord, f: Fetch) -> None:
        """Compute waits on the H2D event; staging is given back once the copy is done."""
        x = f.xfer
        self.dev.compute_waits(x)
        staging, f.staging = f.staging, None

        def done(x=x, staging=staging):
            self._link("h2d", x.nbytes, x.t0, x.t_end)
            if staging is not None:
                self.host_pool.give_back(staging)
        self.dev.retire(x, done)

    def wait_resident(self, g: GroupRecord) -> None:
        """Block until ``g`` is on the device tier (it must have been fetched).  A failed
        read raises here, for ``g`` only, once: the group is back at its home and a later
        use fetches it again."""
        err = self._failed.pop(g.gid, None)
        if err is not None:
            raise err
        try:
            self._wait_resident(g)
        except Exception:
            if g.state in (Location.READING, Location.TO_DEVICE):
                self._forget_fetch(g)
            raise

    def _wait_resident(self, g: GroupRecord) -> None:
        self._progress()
        err = self._failed.pop(g.gid, None)
        if err is not None:
            raise err
        if g.state is Location.READING:
            f = g.pending
            if not f.poll_read():
                wait = f.landing.exception if f.landing is not None else f.handle.wait
                if self.timeline is not None and self.timeline.enabled:
                    with self.timeline.span("wait", f"fetch {g.name or '<root>'}", g.nbytes):
                        wait()
                else:
                    wait()
                if f.landing is None:
                    f.t_read = time.perf_counter()
            if f.staging is not None:
                self._start_h2d(g, f)
            else:
                f.handle.wait()               # complete: returns or raises AioError
                self._read_done(g, f.t0, f.t_read)
                if f.qsrc is not None:
                    self._dequantize(g, f)
                g.finish_read()
        if g.state is Location.TO_DEVICE:
            f = g.pending
            if f is not None and f.xfer is not None:
                self._finish_h2d(g, f)
            if f is not None and f.qsrc is not None:
                self._dequantize(g, f)
            g.finish_to_device()
        elif g.state is not Location.DEVICE:
            raise RuntimeError(f"memory: group {g.gid} ({g.name}) was not fetched "
                               f"(state {g.state.name})")
        self._inflight.pop(g.gid, None)
        # saved tensors in this buffer are packed as references (also when an interrupt
        # kept the fetch from being recorded in _inflight)
        if g.device_buf is not None:
            self._by_storage[g.device_buf.untyped_storage().data_ptr()] = g

    def release(self, g: GroupRecord) -> None:
        """Drop ``g``'s device copy (its home copy stays current)."""
        if not self.paged(g) or g.state in (Location.NVME, Location.HOST, Location.CACHED):
            return
        if g.state is Location.DEVICE and g.device_buf is None:
            g.set_home_state()            # an interrupt landed inside an earlier release
            return
        if g.state is Location.TO_DEVICE and isinstance(g.pending, Fetch) \
                and g.pending.xfer is not None and g.pending.staging is None:
            # fetched but never used: the host home may be updated (optimizer) right
            # after this, so its H2D must have finished reading it
            g.pending.xfer.wait_host()
        if g.state in (Location.READING, Location.TO_DEVICE):
            self.wait_resident(g)
        buf = g.device_buf
        self._by_storage.pop(buf.untyped_storage().data_ptr(), None)
        # (a quantized group's buffer is not its home's bytes: never a cached copy)
        cached = g.home == "nvme" and g.quant is None and (g.host_buf is buf
                                                           or self._admit(g, buf))
        g.release()                       # -> CACHED when a cached copy stays, else home
        if g.home == "nvme" and self._listener is not None:   # Note [Master hand-off]
            if self._listener.on_release(g, None if cached else buf):
                buf = None                # taken over
        if buf is not None and buf is not g.host_buf:
            # a leased compute buffer (a zero-copy host home, or a buffer _admit kept as the
            # cached copy, is used in place: not leased; across ranks the cached copy is a
            # separate shard-sized lease and the gathered buffer always goes back)
            self._give_back(self.dev, buf)       # CUDA: the next copy into it waits for compute
        self._progress()

    def abandon_all(self) -> None:
        """After a failed forward/backward (Note [window abort] in infinity.engine.phase):
        every in-flight fetch finished or abandoned, every paged group released to its
        home, nothing leaked.  The hooks' counters must have been reset first."""
        fetching = {g.gid: g for g in self.groups
                    if g.state in (Location.READING, Location.TO_DEVICE)}
        fetching.update(self._inflight)
        for g in list(fetching.values()):
            try:
                self._wait_resident(g)
            except Exception as e:  # noqa: BLE001 - the window is being dropped anyway
                log.debug("memory: abandoning the fetch of group %d: %s", g.gid, e)
                if g.state in (Location.READING, Location.TO_DEVICE):
                    self._forget_fetch(g)
        self._failed.clear()
        for g in self.groups:
            g.prefetched = False
            if not self.paged(g):
                continue
            if g.state is Location.DEVICE and g.device_buf is None:
                g.set_home_state()        # an interrupt landed inside its release: done
            elif g.state is Location.DEVICE:
                self.release(g)

    def discard_cached(self, gids) -> None:
        """Forget the cached copies of ``gids`` (a rolled-back step updated them in place:
        their NVMe home holds the committed values)."""
        for g in self.groups:
            if g.gid in gids and self.cached(g) and g.state is Location.CACHED:
                self._pinned.discard(g.gid)
                self._evict(g)

    # ------------------------------------------------------------------ parameter cache
    # Note [Cache write-through]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A CACHED group's host copy is never dirty: in fp32 the copy is the master, and the
    # optimizer step updates it in place AND writes its tiles to NVMe in the same pass
    # (StepItem.master_buf).  So a copy is dropped without a write (reclaim, drop_cache,
    # close), a checkpoint load drops every copy before rewriting the homes, and a copy
    # a running overlapped step updates is pinned (never reclaimed until it ended).
    def enable_cache(self) -> None:
        """Keep released NVMe-homed groups' buffers as clean host copies (write-through:
        the optimizer updates a copy in place and writes it to NVMe in the same pass,
        ``StepItem.master_buf``).  A cached group is in state CACHED and is used in place
        like a host-homed one, so neither forward nor backward reads it from NVMe again.
        The copies live in the host pool, within its budget (``offload.host_memory_gb``):
        one is kept when the pool can hold it, and given back (:meth:`reclaim`) when the
        pool needs the memory for something else (gradient buffers).  Only where a copy
        can stay exact: zero-copy device tier, and the caller (the engine) checks fp32
        (the buffer is the master)."""
        if not self.dev.zero_copy:
            raise ValueError("memory: the parameter cache needs a zero-copy device tier")
        if self.host_pool.budget is None:
            raise ValueError("memory: the parameter cache needs a host budget "
                             "(offload.host_memory_gb)")
        self.cache_on = True
        self.host_pool.set_reclaimer(self.reclaim)

    def _admit(self, g: GroupRecord, buf: torch.Tensor) -> bool:
        """Cache ``g``'s just-released buffer when the host pool can hold it."""
        if not self.cache_on or not self.host_pool.adopt(buf):
            return False
        self.device_pool.detach(buf)
        g.host_buf = buf
        self.acct.count("param_cache_admitted")
        return True

    def _evict(self, g: GroupRecord) -> int:
        """Forget ``g``'s cached copy; its buffer goes to the host pool's free list (or,
        while ``g`` is in use, back to the device tier).  Returns the bytes freed."""
        buf = g.host_buf
        if g.state is Location.CACHED:
            g.drop_host_copy()
            self.host_pool.give_back(buf)
        elif g.state is Location.DEVICE and self.device_pool.adopt(buf):
            g.forget_host_copy()          # in use: the buffer stays its device buffer
            self.host_pool.detach(buf)
        else:
            return 0
        self.acct.count("param_cache_evicted")
        return leased_size(buf)

    def reclaim(self, need: int) -> int:
        """The host pool needs ``need`` bytes: evict cached copies, the group latest in
        module order first (backward, where gradients need memory, reaches it last and
        forward uses it last).  Copies a running optimizer step updates are skipped; if
        they are all that is left, the listener's ``reclaim_blocked()`` waits for those
        steps.  Returns the bytes still missing (<= 0: done)."""
        for attempt in range(2):
            for g in reversed(self.groups):
                if need <= 0:
                    return need
                if self.cached(g) and g.gid not in self._pinned:
                    need -= self._evict(g)
            if need <= 0 or attempt or self._listener is None or not self._pinned:
                return need
            self._listener.reclaim_blocked()
        return need

    def drop_cache(self) -> None:
        """Forget every cached copy (before anything writes the NVMe homes directly, e.g.
        a checkpoint load); the groups must not be in use."""
        for g in self.groups:
            if not self.cached(g):
                continue
            if g.state is not Location.CACHED or g.gid in self._pinned:
                raise RuntimeError(f"memory: cannot drop the cached copy of group {g.gid} "
                                   f"({g.name}) in state {g.state.name}; release it first")
            self._evict(g)
        self.host_pool.trim()

    def cached(self, g: GroupRecord) -> bool:
        """Whether NVMe-homed ``g`` holds a clean host copy (the parameter cache): released
        (``Location.CACHED``) or in use with that copy as its compute buffer (DEVICE)."""
        return g.home == "nvme" and g.host_buf is not None

    @property
    def cache_used(self) -> int:
        """Host bytes the cached copies hold."""
        return sum(leased_size(g.host_buf) for g in self.groups if self.cached(g))

    def _give_back(self, owner, buf: torch.Tensor) -> None:
        """Give ``buf`` back to ``owner`` (a pool or the device tier).  While a failed window
        is being abandoned (Note [window abort]) an interrupt may have landed between a
        buffer's return and its owner forgetting it: the pool, which knows what is on
        lease, decides, so nothing is returned twice."""
        pool = getattr(owner, "pool", owner)
        if self._abandoning and not pool.is_leased(buf):
            log.debug("memory: a buffer was already back in its pool (interrupted return)")
            return
        owner.give_back(buf)

    def attach_listener(self, listener) -> None:
        """The one release listener (see ``__init__``); detach_listener removes it."""
        if self._listener is not None and listener is not self._listener:
            raise RuntimeError("memory: a release listener is already attached")
        self._listener = listener

    def detach_listener(self, listener) -> None:
        if self._listener is listener:
            self._listener = None

    def give_back_device(self, buf: torch.Tensor) -> None:
        """Return a device buffer the listener's ``on_release`` took over."""
        self._give_back(self.dev, buf)

    # ------------------------------------------------------------------ running steps
    # what the overlapped step (infinity.engine.overlap) tells the manager about the
    # group steps it runs on its worker (Note [Overlap safety], Note [Cache write-through])
    def mark_home_busy(self, gid: int, wait) -> None:
        """A running optimizer step writes group ``gid``'s home: a fetch of it calls
        ``wait()`` first (once)."""
        self._home_busy[gid] = wait

    def home_busy(self, gid: int) -> bool:
        return gid in self._home_busy or gid in self._home_deferred

    def mark_home_deferred(self, gid: int, wait) -> None:
        """Group ``gid``'s part of a decided update is still to be finished (Note [Finish
        in the next forward]): a fetch of it calls ``wait()`` first (once)."""
        self._home_deferred[gid] = wait

    def clear_home_deferred(self) -> None:
        self._home_deferred.clear()

    def clear_home_busy(self) -> None:
        """Every running step ended: no fetch needs to wait."""
        self._home_busy.clear()

    def pin(self, gid: int) -> None:
        """A running step updates group ``gid``'s cached copy in place: never reclaim it."""
        self._pinned.add(gid)

    def unpin(self, gid: int) -> None:
        self._pinned.discard(gid)

    def pinned(self, gid: int) -> bool:
        return gid in self._pinned

    @contextlib.contextmanager
    def lenient_returns(self):
        """While a failed window is abandoned (Note [window abort]): a buffer already back
        in its pool (an interrupt landed between its return and its owner forgetting it)
        is not returned twice (:meth:`_give_back`)."""
        self._abandoning = True
        try:
            yield
        finally:
            self._abandoning = False

    # ------------------------------------------------------------------ host updates
    def mirrored(self) -> list[GroupRecord]:
        """Device-homed groups with a host mirror (separate device memory only)."""
        return [g for g in self.groups
                if g.home == "device" and g.host_buf is not None and g.quant is None]

    def wait_host_reads(self) -> None:
        """Block until no issued copy still reads a host home or mirror, so the optimizer
        (or a checkpoint load) may write them: in-flight H2D fetches and refreshes."""
        for g in self._inflight.values():
            f = g.pending
            if isinstance(f, Fetch) and f.xfer is not None:
                f.xfer.wait_host()
        self.dev.drain()

    def refresh_resident(self, skip=()) -> None:
        """After the host mirrors changed (optimizer step, checkpoint load): copy them to
        the resident device buffers on the copy stream; compute waits on the copies.
        ``skip``: gids whose device copy is already current."""
        for g in self.mirrored():
            if g.gid not in skip:
                self._copy_mirror(g.device_buf, g.host_buf)

    def _copy_mirror(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Stream-ordered refresh of a resident device buffer from its host mirror, timed
        on the h2d link once it completed."""
        x = self.dev.refresh(dst, src)
        self.dev.retire(x, lambda x=x: self._link("h2d", x.nbytes, x.t0, x.t_end))

    def group_of_storage(self, ptr: int) -> GroupRecord | None:
        return self._by_storage.get(ptr)

    def paged(self, g: GroupRecord) -> bool:
        """Fetched before use and released after (a quantized group on any home)."""
        return g.home != "device" or g.quant is not None

    # ------------------------------------------------------------------ accounting
    def _link(self, name: str, nbytes: int, t0: float, t1: float | None = None) -> None:
        if t1 is None:
            t1 = time.perf_counter()
        self.acct.link(name, nbytes, t1 - t0)
        tl = self.timeline
        if tl is not None and getattr(tl, "enabled", False):
            tl.add(name, "params", t0, t1, nbytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for g in self._inflight.values():
            f = g.pending
            if isinstance(f, Fetch) and f.landing is not None and f.xfer is None:
                try:
                    f.xfer = f.landing.result()
                except Exception:  # noqa: BLE001 - reported by the read's wait below
                    log.debug("memory: pending read of group %d failed during close", g.gid)
            if isinstance(f, Fetch) and f.handle is not None:
                try:
                    f.handle.wait()
                except Exception:  # the close path must not mask the original error
                    log.debug("memory: pending read of group %d failed during close", g.gid)
            if isinstance(f, Fetch) and f.xfer is not None:
                f.xfer.wait_host()
        self._inflight.clear()
        if self._lander is not None:
            self._lander.shutdown(wait=True)
        for g in self.groups:          # cached copies: dropped (Note [Cache write-through])
            if self.cached(g):
                buf = g.host_buf
                if g.state is Location.CACHED:
                    g.drop_host_copy()
                else:
                    g.forget_host_copy()
                self.host_pool.give_back(buf)
        self._pinned.clear()
        self.host_pool.set_reclaimer(None)
        self.dev.close()
