"""ZeRO stage 3: each rank homes only its shard of every parameter group.

:class:`PartitionedMemoryManager` is a :class:`infinity.memory.manager.MemoryManager`
(the same ``place``/``fetch_async``/``wait_resident``/``release``/``close``, the same
``Fetch`` records and the same :class:`~infinity.memory.device.DeviceTier` protocol), so
the hooks and the prefetch coordinator drive it unchanged; what differs is what a fetch
does:

* ``place``: the group's flat values are assembled once in a staging buffer and only
  this rank's shard ``[lo, hi)`` is kept at its home (``record.sharded``; the home is not
  rewritten): a host buffer (``"cpu"``), a shard-sized NVMe extent in this rank's own swap
  directory (``"nvme"``), or resident device memory (``"device"``: on separate device
  memory with a host mirror that the CPU optimizer updates, copied back to the device
  shard after each step by :meth:`refresh_resident`).
* ``fetch_async``: leases a full-size compute buffer on the device tier (within its
  budget, or counted as an overflow) and hands the fetch to a single worker thread that
  brings this rank's shard into its slot of that buffer — NVMe: read straight into it
  (CPU) or into pinned host staging and then H2D on the copy stream (separate device
  memory); host home: H2D (separate) or used as the all-gather's input (CPU); device
  home: the resident shard is the input — and then all-gathers the other ranks' shards
  **into the device buffer** (in place, no clone), on the device tier's side stream.
  Compute waits on the gather's completion marker (:meth:`DeviceTier.compute_waits`).
  Because the prefetch coordinator calls ``fetch_async`` ``depth`` groups ahead, the
  reads, copies and all-gathers of the next groups overlap the compute of the current
  one.  All parameter all-gathers are issued by that one thread on the ``param`` process
  group, in ``fetch_async`` order, which is the same on every rank.
* ``release``: the base's: the full buffer goes back to the device tier; the shard at
  home is current (the optimizer updates it in place), nothing is written back.  With the
  parameter cache on, an NVMe-homed group keeps a clean host copy of this rank's shard,
  which later fetches all-gather from (Note [Shard cache]).
* ``read_range_start`` / ``read_range``: one tile of a group that memory-centric tiling
  never fetches whole, gathered from the owners of its pieces (Note [Tiles across ranks]).
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.memory.manager import Fetch, MemoryManager, ReadyTile
from infinity.memory.pool import leased_size
from infinity.memory.record import GroupRecord, Location
from infinity.zero.comm import Comm
from infinity.zero.partition import Partition
from infinity.zero.quantized_shards import PendingGather, QuantizedShards, qshard_bytes

log = logging.getLogger("infinity.zero")

__all__ = ["PartitionedMemoryManager"]


class _PendingTile:
    """A tile being gathered on the worker (:meth:`PartitionedMemoryManager.read_range_start`)."""
    __slots__ = ("mm", "fut", "view", "buf", "staging")

    def __init__(self, mm, fut, view, buf, staging):
        self.mm, self.fut, self.view, self.buf, self.staging = mm, fut, view, buf, staging

    def _settle(self):
        try:
            return self.fut.result()          # re-raises the worker's AioError / CollectiveError
        finally:
            if self.staging is not None:
                self.mm.host_pool.give_back(self.staging)
                self.staging = None

    def result(self):
        try:
            marker = self._settle()
        except BaseException:
            self.mm.dev.give_back(self.buf)
            raise
        self.mm.dev.compute_waits(marker)
        self.mm.acct.count("tile_gathers")
        return self.view, self.buf

    def cancel(self) -> None:
        """Not needed after all (an error elsewhere): wait for the job, give back."""
        try:
            self._settle()
        except Exception as e:  # noqa: BLE001 - the error that made us cancel matters more
            log.debug("zero: a cancelled tile gather failed: %s", e)
        self.mm.dev.give_back(self.buf)


class _PendingQuantTile(_PendingTile):
    """A tile of a quantized group being gathered across ranks (Note [Quantized shards]):
    its payload spans' bytes in ``blob``, decoded into the tile once the job completed."""
    __slots__ = ("blob", "rr", "at")

    def __init__(self, mm, fut, view, buf, staging, blob, rr, at):
        super().__init__(mm, fut, view, buf, staging)
        self.blob, self.rr, self.at = blob, rr, at

    def result(self):
        try:
            out = super().result()            # (gives the tile back on an error)
            views = {k: self.blob[o:o + b - a] for (k, a, b), o in zip(self.rr.spans, self.at)}
        except BaseException:
            self.mm.dev.give_back(self.blob)
            raise
        try:
            self.rr.decode(views, self.buf[:self.rr.count])
        except BaseException:
            self.mm.dev.give_back(self.buf)
            raise
        finally:
            self.mm.dev.give_back(self.blob)
        return out

    def cancel(self) -> None:
        super().cancel()
        self.mm.dev.give_back(self.blob)


class PartitionedMemoryManager(QuantizedShards, MemoryManager):
    def __init__(self, groups: list[GroupRecord], *, comm: Comm, zeropp=None, **kw):
        super().__init__(groups, **kw)
        self.comm = comm
        self.zeropp = zeropp            # ZeRO++ qwZ/hpZ (infinity.zero.zeropp), or None
        if zeropp is not None:
            zeropp.attach_device(self.dev)
        self.part = Partition(comm.rank, comm.world_size)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"infinity-gather-r{comm.rank}")
        # device home: this rank's resident shard in device memory (on a zero-copy tier
        # the same tensor as host_buf), and the last refresh of it from the host mirror
        self._resident: dict[int, torch.Tensor] = {}
        self._refreshed: dict[int, object] = {}
        for g in groups:
            g.sharded = True

    def shard(self, g: GroupRecord) -> tuple[int, int]:
        return self.part.range(g.padded_numel)

    def _shard_bytes(self, g: GroupRecord) -> int:
        if g.quant is not None:               # Note [Quantized shards]
            return qshard_bytes(g, self.part.world_size)
        lo, hi = self.shard(g)
        return (hi - lo) * g.dtype.itemsize

    _staging_bytes = _shard_bytes          # a fetch stages only this rank's shard

    # ------------------------------------------------------------------ setup
    def place(self, g: GroupRecord, staging: torch.Tensor | None = None) -> None:
        if g.quant is not None:               # Note [Quantized shards]
            self._place_quantized(g)
            return
        lo, hi = self.shard(g)
        shard_bytes = self._shard_bytes(g)
        own = staging is None or staging.numel() < g.nbytes
        with contextlib.ExitStack() as scope:
            full = scope.enter_context(self.host_pool.scoped(g.nbytes, g.dtype)) if own \
                else staging.view(g.dtype)[: g.padded_numel]
            self._fill(g, full)
            if g.home == "device" and self.dev.zero_copy:
                # the shard lives in the device tier's memory (host memory on CPU)
                g.host_buf = self.device_pool.lease(shard_bytes, g.dtype)
                g.host_buf.copy_(full[lo:hi])
                self._resident[g.gid] = g.host_buf
            elif g.home == "device":
                # separate device memory: a host mirror for the CPU optimizer and the
                # resident device shard the all-gathers read
                g.host_buf = self.host_pool.lease(shard_bytes, g.dtype)
                g.host_buf.copy_(full[lo:hi])
                self._resident[g.gid] = self.device_pool.lease(shard_bytes, g.dtype)
                self._refresh(g)
            elif g.home == "cpu":
                g.host_buf = self.host_pool.lease(shard_bytes, g.dtype)
                g.host_buf.copy_(full[lo:hi])
            elif g.home == "nvme":
                if self.swap is None:
                    raise RuntimeError("memory: NVMe home requested but no swap space was opened")
                g.extent = self.swap.allocate(shard_bytes)
                t0 = time.perf_counter()
                self.swap.write(g.extent, full[lo:hi]).wait()
                self._link("nvme_write", shard_bytes, t0)
            else:
                raise ValueError(f"memory: unknown home {g.home!r}")
        g.set_home_state()

    # ------------------------------------------------------------------ fetch
    def paged(self, g: GroupRecord) -> bool:
        return True

    def fetch_async(self, g: GroupRecord, *, allow_overflow: bool) -> bool:
        if g.state in (Location.DEVICE, Location.READING, Location.TO_DEVICE):
            return True
        wait = self._home_busy.pop(g.gid, None)
        if wait is not None:
            wait()          # an overlapped step still writes its home shard (Note [Overlap safety])
        if g.quant is not None:               # Note [Quantized shards]
            return self._fetch_quantized_sharded(g, allow_overflow)
        buf = self._lease_device(g, allow_overflow)
        if buf is None:
            return False
        t0 = time.perf_counter()
        staging = None
        # Note [Shard cache]: a cached shard copy is the all-gather's input (no NVMe read)
        copy = g.host_buf if g.state is Location.CACHED else None
        try:
            if g.home == "nvme" and copy is None and not self.dev.zero_copy:
                staging = self.host_pool.lease(self._shard_bytes(g), g.dtype)
            f = Fetch(PendingGather(self._worker.submit(self._gather, g, buf, staging, copy),
                              staging), t0)
        except BaseException:
            if staging is not None:
                self.host_pool.give_back(staging)
            self.dev.give_back(buf)
            raise
        if g.state is Location.NVME:
            g.begin_read(buf, f)
        else:
            g.begin_to_device(buf, f)
        if copy is not None:
            self.acct.count("param_cache_gathers")
        self._inflight[g.gid] = g
        return True

    def _gather(self, g: GroupRecord, buf: torch.Tensor, staging, copy=None):
        """Worker thread: this rank's shard into its slot of ``buf``, then all-gather the
        others into ``buf`` on the device; returns the completion marker.  ``copy``: the
        cached clean copy of an NVMe-homed shard (Note [Shard cache]), read instead of NVMe."""
        lo, hi = self.shard(g)
        mine = buf[lo:hi]
        name = f"parameters of group {g.gid} ({g.name or '<root>'})"
        with self.dev.side_stream():
            if g.home == "device" or (g.home == "cpu" and self.dev.zero_copy) \
                    or copy is not None:
                # the resident shard (or a zero-copy host home, or a cached shard copy) is
                # the all-gather's input
                src = copy if copy is not None else self._resident.get(g.gid, g.host_buf)
                x = self._refreshed.get(g.gid)
                if x is not None:
                    x.wait_host()             # the last refresh from the mirror has landed
                self.dev.wait_free(buf)
                self._gather_params(g, buf, src, name)
                return self.dev.mark(buf)
            if g.home == "nvme":
                t0 = time.perf_counter()
                self.swap.read(g.extent, mine if staging is None else staging).wait()
                self._link("nvme_read", self._shard_bytes(g), t0)
                src = staging
            else:
                src = g.host_buf
            if src is not None:               # separate device memory: H2D of the shard
                x = self.dev.h2d(mine, src)
                x.wait_host()                 # (it also waited for compute's last use)
                self._link("h2d", x.nbytes, x.t0, x.t_end)
            else:
                self.dev.wait_free(buf)
            self._gather_params(g, buf, mine, name)   # in place
            return self.dev.mark(buf)

    def _gather_params(self, g: GroupRecord, buf: torch.Tensor, shard: torch.Tensor,
                       name: str) -> None:
        if not g.trainable:               # (compared with a quantized base's: Note [Quantized shards])
            self.acct.count("frozen_allgather_bytes", buf.numel() * buf.element_size())
        if self.zeropp is not None:
            self.zeropp.gather_params(g.gid, buf, shard, name)
        else:
            self.comm.all_gather_into(buf, shard, group="param", name=name)

    def _wait_resident(self, g: GroupRecord) -> None:
        self._progress()
        if g.state in (Location.READING, Location.TO_DEVICE):
            f = g.pending
            try:
                f.handle.wait()
            finally:
                self._drop_staging(f)
            self.dev.compute_waits(f.handle.marker)
            if f.qsrc is not None:            # Note [Quantized shards]: the gathered blob
                self._dequantize(g, f)
            if g.state is Location.READING:
                g.finish_read()
            else:
                g.finish_to_device()
        elif g.state is not Location.DEVICE:
            raise RuntimeError(f"memory: group {g.gid} ({g.name}) was not fetched "
                               f"(state {g.state.name})")
        self._inflight.pop(g.gid, None)
        if g.device_buf is not None:
            self._by_storage[g.device_buf.untyped_storage().data_ptr()] = g

    def _drop_staging(self, f) -> None:
        h = f.handle if isinstance(f, Fetch) else None
        if isinstance(h, PendingGather) and h.staging is not None and h.fut.done():
            staging, h.staging = h.staging, None
            self._give_back(self.host_pool, staging)

    def _forget_fetch(self, g: GroupRecord, err: BaseException | None = None) -> None:
        f = g.pending
        super()._forget_fetch(g, err)          # waits for the worker's job
        if f is not None:
            self._drop_staging(f)

    # ------------------------------------------------------------------ shard cache
    # Note [Shard cache]
    # ~~~~~~~~~~~~~~~~~~
    # The parameter cache (Note [Cache write-through] in infinity/memory/manager.py) at
    # ZeRO stage 3: what a rank keeps of a released NVMe-homed group is a clean host copy
    # of its own shard [lo, hi) -- g.host_buf, a shard-sized host-pool lease -- never the
    # gathered group (the gathered buffer goes back to the device tier as before).
    # * admitted at release (_admit): the gathered buffer's slice is copied out when the
    #   host pool can hold it without reclaiming anything; the group is then CACHED;
    # * a CACHED group's fetch all-gathers from the copy (fetch_async/_gather): no NVMe read,
    #   forward or backward;
    # * write-through: the optimizer step of the shard updates the copy in place and writes
    #   it to NVMe in the same pass (PartitionedOptimizer._item: StepItem.master_buf), so
    #   it reads no master either; it takes the master hand-off's place (the release
    #   offers no buffer); an overlapped group step pins the copy while it runs;
    # * the host pool's reclaimer (reclaim) evicts copies without a write; one a gather is
    #   still reading (TO_DEVICE) only as a last resort, after that gather ended, as does
    #   discard_cached; a checkpoint load releases every group, then drops every copy
    #   (drop_cache);
    # * a rolled-back window (Note [commit point]) discards the copies its steps updated
    #   in place (Engine._after_rollback -> discard_cached, whatever their state), and
    #   nothing is admitted while a failed window is abandoned (lenient_returns): a
    #   gathered buffer may then hold values of a step that was not committed, and a copy
    #   must always equal what NVMe holds.
    def _admit(self, g: GroupRecord, buf: torch.Tensor) -> bool:
        """Keep a clean copy of this rank's shard of ``g`` (just released, gathered in
        ``buf``) when the host pool can hold it without reclaiming; True when ``g`` has
        one (already, or now)."""
        if g.host_buf is not None:
            return True                       # the gather read from its cached copy
        if not self.cache_on or self._abandoning:
            return False
        n = self._shard_bytes(g)
        if not self.host_pool.can_lease(n):   # (then lease() neither reclaims nor raises)
            return False
        lo, hi = self.shard(g)
        copy = self.host_pool.lease(n, g.dtype)
        copy.copy_(buf[lo:hi])
        g.host_buf = copy
        self.acct.count("param_cache_admitted")
        return True

    def _evict(self, g: GroupRecord, wait: bool = False) -> int:
        """Forget ``g``'s cached shard copy (its buffer goes back to the host pool); returns
        the bytes freed.  A copy a gather is still reading is kept (0) unless ``wait``:
        then that gather is waited for first (its own error is raised by its wait)."""
        buf = g.host_buf
        if buf is None or g.home != "nvme":
            return 0
        if g.state is Location.CACHED:
            g.drop_host_copy()
        elif g.state is Location.DEVICE:
            g.forget_host_copy()              # gathered: the copy is not its compute buffer
        elif wait:
            self._settle_gather(g)
            g.forget_host_copy()
        else:
            return 0
        self.host_pool.give_back(buf)
        self.acct.count("param_cache_evicted")
        return leased_size(buf)

    def reclaim(self, need: int) -> int:
        """The base's; then, as a last resort, copies a gather is reading, once it ended
        (the gather worker never waits for this thread)."""
        need = super().reclaim(need)
        for g in reversed(self.groups):
            if need <= 0:
                break
            if self.cached(g) and g.gid not in self._pinned:
                need -= self._evict(g, wait=True)
        return need

    @staticmethod
    def _settle_gather(g: GroupRecord) -> None:
        f = g.pending
        if isinstance(f, Fetch) and isinstance(f.handle, PendingGather):
            try:
                f.handle.fut.exception()      # finished (its error is raised by its wait)
            except BaseException:  # noqa: BLE001 - cancelled: nothing in flight
                pass

    def discard_cached(self, gids) -> None:
        """Forget the cached shard copies of ``gids`` whatever their state (a rolled-back
        step updated them in place; their NVMe homes hold the committed values)."""
        for g in self.groups:
            if g.gid in gids and self.cached(g):
                self._pinned.discard(g.gid)
                self._evict(g, wait=True)

    # ------------------------------------------------------------------ tiles
    # Note [Tiles across ranks]: at stage 3 a tile's element range [lo, hi) of a group spans
    # the shards of one or more owners.  Every rank leases the tile on its device tier (and,
    # for an NVMe home, host staging for the aligned byte range of its own piece) on the
    # main thread, then hands a job to the gather worker - the thread that issues every
    # parameter collective, in the order the main thread submitted them, which is the same
    # on all ranks: the owner reads its piece from its home into the tile (host copy / H2D,
    # NVMe read through the staging), then each owner broadcasts its piece, in rank order.
    # read_range_start returns at once (Note [Tile prefetch] in infinity.runtime.tiling:
    # the next tile is gathered while the current one computes).  Bytes on the wire: each
    # piece once to every other rank, as the all-gather of an untiled group; the device
    # holds at most two tiles of a layer, never the group.
    def tile_owners(self, g: GroupRecord, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(rank, a, b)``: the pieces ``[a, b)`` of ``[lo, hi)`` each rank's shard holds."""
        s = self.part.shard_numel(g.padded_numel)
        return [(r, max(lo, r * s), min(hi, (r + 1) * s))
                for r in range(lo // s, min(self.part.world_size, -(-hi // s)))]

    def read_range(self, g: GroupRecord, lo: int, hi: int):
        return self.read_range_start(g, lo, hi).result()

    def read_range_start(self, g: GroupRecord, lo: int, hi: int):
        """Start gathering elements ``lo .. hi`` of ``g`` (the job runs on the gather worker,
        after the gathers and tiles started before it); ``.result()`` gives
        ``(tensor, lease)`` as :meth:`read_range`."""
        if g.state in (Location.READING, Location.TO_DEVICE):
            self.wait_resident(g)
        if g.state is Location.DEVICE and g.device_buf is not None:
            return ReadyTile(g.device_buf[lo:hi], None)   # gathered whole (on every rank)
        if g.quant is not None:               # Note [Quantized shards]: its payload spans
            return _PendingQuantTile(self, *self._quantized_tile_start(g, lo, hi))
        self.wait_home(g)
        isz = g.dtype.itemsize
        slo, _ = self.shard(g)
        pieces = self.tile_owners(g, lo, hi)
        buf = self.dev.lease_or_overflow((hi - lo) * isz, g.dtype, "a parameter tile", True)
        staging = None
        try:
            view = buf[: hi - lo]
            mine = [(a - slo, b - slo) for r, a, b in pieces if r == self.comm.rank]
            if mine and g.home == "nvme":         # the aligned range of this rank's piece
                (a, b), = mine
                a0 = (a * isz) // 4096 * 4096
                a1 = min(-(-(b * isz) // 4096) * 4096, g.extent.nbytes)
                staging = self.host_pool.lease(a1 - a0, torch.uint8)
            name = f"a tile of group {g.gid} ({g.name or '<root>'}) [{lo}, {hi})"
            fut = self._worker.submit(self._tile_job, g, buf, view, lo, pieces, staging, name)
        except BaseException:
            if staging is not None:
                self.host_pool.give_back(staging)
            self.dev.give_back(buf)
            raise
        return _PendingTile(self, fut, view, buf, staging)

    def _read_piece(self, g: GroupRecord, a: int, b: int, dst: torch.Tensor, staging) -> None:
        """Gather worker: this rank's home elements ``a .. b`` (shard-local) into ``dst``
        (device tier); an NVMe home through ``staging`` (host, the aligned byte range)."""
        isz = g.dtype.itemsize
        t0 = time.perf_counter()
        if g.home == "nvme":
            a0 = (a * isz) // 4096 * 4096
            raw = staging[: min(-(-(b * isz) // 4096) * 4096, g.extent.nbytes) - a0]
            self.swap.read(g.extent, raw, a0).wait()
            self._link("nvme_read", raw.numel(), t0)
            self._copy_in(dst, raw.view(g.dtype)[(a * isz - a0) // isz:][: b - a])
            return
        src = self._resident.get(g.gid, g.host_buf)
        if src is not g.host_buf and not self.dev.zero_copy:
            dst.copy_(src[a:b])                 # a resident device shard: device to device
            return
        self._copy_in(dst, g.host_buf[a:b])

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.dev.zero_copy:
            dst.copy_(src)
            return
        x = self.dev.h2d(dst, src)
        x.wait_host()
        self.dev.compute_waits(x)             # (this thread's stream: the broadcasts wait)
        self._link("h2d", x.nbytes, x.t0, x.t_end)

    def _tile_job(self, g: GroupRecord, buf: torch.Tensor, view: torch.Tensor, lo: int,
                  pieces, staging, name):
        """Gather worker: this rank's piece from its home into the tile, then each owner's
        piece to every rank, in rank order; returns the completion marker."""
        slo, _ = self.shard(g)
        with self.dev.side_stream():
            self.dev.wait_free(buf)           # compute's last use of a recycled buffer
            for r, a, b in pieces:
                if r == self.comm.rank:
                    self._read_piece(g, a - slo, b - slo, view[a - lo:b - lo], staging)
            for r, a, b in pieces:
                self.comm.broadcast(view[a - lo:b - lo], r, group="param", name=name)
            return self.dev.mark(buf)

    # ------------------------------------------------------------------ host updates
    def mirrored(self) -> list[GroupRecord]:
        return []                              # device homes are shards (refresh_resident)

    def _refresh(self, g: GroupRecord) -> None:
        x = self.dev.refresh(self._resident[g.gid], g.host_buf)
        self._refreshed[g.gid] = x
        self.dev.retire(x, lambda x=x: self._link("h2d", x.nbytes, x.t0, x.t_end))

    def refresh_resident(self, skip=()) -> None:
        """After the optimizer updated the host mirrors of device-homed shards (separate
        device memory): copy each to its resident device shard on the copy stream."""
        if self.dev.zero_copy:
            return
        for g in self.groups:
            if g.home == "device" and g.quant is None:
                self._refresh(g)

    def wait_host_reads(self) -> None:
        """No gather in flight still reads a home the optimizer is about to update (and
        the hpZ secondary shards, copies of the current values, are dropped)."""
        for g in list(self._inflight.values()):
            self._settle_gather(g)
        if self.zeropp is not None:
            self.zeropp.invalidate()
        super().wait_host_reads()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()                    # waits for every in-flight gather
        finally:
            if self.zeropp is not None:        # its secondary shards go back to the tier
                self.zeropp.close()
            self._worker.shutdown(wait=True)
            self._resident.clear()
            self._refreshed.clear()
