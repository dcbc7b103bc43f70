"""The gradient side of ZeRO stages 1, 2 and 3: the fp32 gradients each rank accumulates,
reduced across ranks (:class:`PartitionedGrads`, the collaborator
:class:`infinity.zero.partitioned_optimizer.PartitionedOptimizer` steps from, as
``opt.grads``).

* stage 1: the full fp32 gradient of each group is accumulated as at one process
  (:class:`infinity.grads.accumulate.GradAccumulation`) and all-reduced at the boundary
  (:meth:`PartitionedGrads.reduce_window`).
* stages 2, 3: during backward a group's gradients land in a transient full-size buffer
  (or in buckets on separate device memory, Note [Gradient buckets]); once every
  trainable parameter of the group has its gradient an asynchronous reduce-scatter leaves
  this rank only its averaged slice, accumulated in a persistent shard-sized buffer (or
  written to an NVMe extent when spilling), while backward goes on.  At the end of
  backward the outstanding reductions are waited for, and groups that received no
  gradient on this rank are reduced too, with zeros, in group order, so every rank issues
  the same collectives.

The global gradient norm sums the squared shard norms across ranks, so every rank takes
the same clipping and overflow decision.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.grads.accumulate import GradAccumulation
from infinity.grads.norm import squared_norm
from infinity.memory.pool import per_size_class
from infinity.memory.record import GroupRecord, ParamSlot
from infinity.zero.comm import Comm, CommHandle
from infinity.zero.grad_buckets import GradBuckets, land
from infinity.zero.partition import Partition

log = logging.getLogger("infinity.zero")

__all__ = ["PartitionedGrads", "MAX_INFLIGHT_REDUCTIONS"]

# at most this many group reductions in flight during backward (each holds a full-size
# fp32 buffer until it completes)
MAX_INFLIGHT_REDUCTIONS = 4


class PartitionedGrads(GradAccumulation):
    """This rank's gradients of the trainable ``groups`` at ZeRO ``stage`` over ``comm``."""

    def __init__(self, groups: list[GroupRecord], cfg, *, comm: Comm, stage: int, swap,
                 host_pool, acct, timeline=None, spill_grads: bool = False):
        super().__init__(groups, host_pool=host_pool, swap=swap, acct=acct, timeline=timeline)
        self.cfg = cfg
        self.comm = comm
        self.stage = stage
        self.part = Partition(comm.rank, comm.world_size)
        # the gradient reduction of stages 2-3 (ZeRO++ qgZ replaces it: ZeroSetup.optimizer)
        self.reduce_scatter_sum = comm.reduce_scatter_sum
        # stages 2, 3 on separate device memory (attach_device): each group's gradient is
        # assembled and reduce-scattered on the device; only the shard leaves it (D2H)
        self.dev = None
        self.on_device = False
        self._landing: deque = deque()   # shards on their way to the host accumulation
        self._adder: ThreadPoolExecutor | None = None
        self._buckets = None     # stages 2, 3 on separate device memory: GradBuckets
        # per-backward reduction state (stages 2, 3)
        self._full: dict[int, torch.Tensor] = {}        # gid -> transient full fp32 grads
        self._missing: dict[int, set] = {}              # gid -> slot indices still to come
        self._launched: set[int] = set()                # gids reduced in this backward
        self._inflight: list[CommHandle] = []
        self._flush_queued = False
        self._open_backward = False                     # a backward not yet reduced
        self._trainable_slots = {g.gid: {i for i, s in enumerate(g.slots) if s.trainable}
                                 for g in self.groups}
        # gradient spill (stages 2, 3): the averaged shard lives in an NVMe extent
        if spill_grads and (stage == 1 or swap is None):
            raise ValueError("spill_grads needs zero_stage >= 2 and an NVMe swap space")
        self.spill = bool(spill_grads)
        self._grad_ext: dict[int, object] = {}
        self._grad_valid: dict[int, bool] = {}
        # gradient_accumulation_dtype "bf16" (lossy): the partial sums between micro-steps
        # go to a bf16 extent per group (allocated at the first one), as at one process
        # (infinity/grads/nvme_store.py); the final sum is fp32
        self._partial_bf16 = self.spill and cfg.gradient_accumulation_dtype == "bf16"
        self._partial_ext: dict[int, object] = {}
        self._in_partial: set[int] = set()       # groups whose window sum is in bf16
        self._grad_sq: dict[int, float] = {}
        self._writes: list = []          # (io handle, buffers to give back)
        # Note [Streamed gradients] across ranks: final spilled shards kept for their
        # group's early step (the overlapped step sets grad_stream.keep)
        from infinity.zero.shard_stream import ShardStream
        self._shard_stream = ShardStream(self) if self.spill else None
        self._final_micro = True
        # Note [Overlap across ranks] (infinity/engine/overlap.py): called with ``g`` once
        # its averaged shard is final in ``g.grad_buf`` (the engine's OverlappedStep)
        self.on_shard_final = None
        # stages 2, 3 on host memory: groups whose shard accumulation holds nothing of
        # this window yet (their first reduction lands in it directly)
        self._fresh: set[int] = set()
        self._dropping = False           # abandon: landing reductions are dropped
        # spilled shards: a tiled group's rows summed on the host during backward, written
        # to its NVMe extent once its uses are done (tiled_final)
        self._tile_acc: dict[int, torch.Tensor] = {}

    def shard(self, g: GroupRecord) -> tuple[int, int]:
        return self.part.range(g.padded_numel)

    def alloc_grads(self, home: str = "host") -> None:
        """Stage 1: full-size fp32 accumulation buffers; stages 2, 3: this rank's shard
        only (the full model gradient is never allocated), on NVMe when spilling."""
        if self.stage == 1:
            return super().alloc_grads(home)
        for g in self.groups:
            lo, hi = self.shard(g)
            if self.spill:
                g.grad_buf = None
                self._grad_ext[g.gid] = self.swap.allocate((hi - lo) * 4)
                self._grad_valid[g.gid] = False
                self._grad_sq[g.gid] = 0.0
                continue
            g.grad_buf = self.host_pool.lease((hi - lo) * 4, torch.float32)
            g.grad_buf.zero_()
            self._fresh.add(g.gid)

    # ------------------------------------------------------------------ gradients
    def attach_device(self, device_tier, max_inflight_bytes: int | None = None) -> None:
        """Stage 1 (or a zero-copy tier): as the single-rank driver (stage 1 gradients
        leave the device per parameter and are all-reduced on the host at the boundary).
        Stages 2, 3 on separate device memory: gradients stay on the device until their
        group's reduce-scatter; only this rank's averaged shard is copied D2H."""
        self.dev = device_tier
        if self.stage == 1 or device_tier.zero_copy:
            return super().attach_device(device_tier, max_inflight_bytes)
        self.on_device = True
        if not self.spill:       # the fp32 adds into the host shard run off this thread
            self._adder = ThreadPoolExecutor(1, thread_name_prefix="infinity-grad-shard")
        bucket = int(self.cfg.reduce_bucket_mb * 1e6)    # (ZeroSetup.reduce_bucket_bytes)
        if bucket > 0 and self.reduce_scatter_sum == self.comm.reduce_scatter_sum:
            # Note [Gradient buckets] (qgZ quantizes whole groups: it keeps that path)
            self._buckets = GradBuckets(
                self.groups, comm=self.comm, dev=device_tier, host_pool=self.host_pool,
                acct=self.acct, bucket_bytes=bucket, on_final=self._bucket_final,
                shard_acc=None if self.spill else self._accumulation, inflight=self._inflight,
                max_inflight=MAX_INFLIGHT_REDUCTIONS, adder=self._adder,
                dropping=lambda: self._dropping)

    def staging_sizes(self) -> list[int]:
        """Stages 2, 3 on separate device memory: the averaged shards' D2H staging (at most
        ``MAX_INFLIGHT_REDUCTIONS`` landing at once), reserved at ``initialize``."""
        if not self.on_device:
            return super().staging_sizes()
        if self._buckets is not None:
            return per_size_class(self._buckets.owned_sizes(), MAX_INFLIGHT_REDUCTIONS)
        return per_size_class(((hi - lo) * 4 for lo, hi in map(self.shard, self.groups)),
                              MAX_INFLIGHT_REDUCTIONS)

    def _lease_full(self, g: GroupRecord, zero: bool = True) -> torch.Tensor:
        """A full-size fp32 gradient buffer (device tier or host pool), zeroed; with
        ``zero=False`` only outside the trainable slots (each slot's first gradient is
        copied in, a slot that got none is zeroed before the reduction: one pass over the
        buffer less per group and backward)."""
        if self.on_device:
            buf = self.dev.lease_or_overflow(g.padded_numel * 4, torch.float32,
                                             "gradients awaiting their reduce-scatter")
        else:
            buf = self.host_pool.lease(g.padded_numel * 4, torch.float32)
        if zero:
            return buf.zero_()
        pos = 0
        for s in g.slots:
            if s.trainable:
                if s.offset > pos:
                    buf[pos:s.offset].zero_()
                pos = max(pos, s.offset + s.numel)
        if pos < g.padded_numel:
            buf[pos:].zero_()
        return buf

    def _give_full(self, buf: torch.Tensor) -> None:
        (self.dev if self.on_device else self.host_pool).give_back(buf)

    def accumulate(self, g: GroupRecord, slot: ParamSlot, grad: torch.Tensor) -> None:
        if self.stage == 1:
            return super().accumulate(g, slot, grad)
        if self._buckets is not None:
            self._open_backward = True
            self._queue_flush()
            self._buckets.accumulate(g, slot, grad)
            self.poll_reductions()
            return
        full = self._full.get(g.gid)
        if full is None:
            full = self._lease_full(g, zero=False)
            self._full[g.gid] = full
            self._missing[g.gid] = set(self._trainable_slots[g.gid])
        missing = self._missing[g.gid]
        i = self._slot_index[id(slot)]
        dst = full[slot.offset:slot.offset + slot.numel]
        if i in missing:                   # the slot's first gradient in this backward
            dst.copy_(grad.reshape(-1))
            missing.discard(i)
        else:
            dst.add_(grad.reshape(-1))
        self._open_backward = True
        self._queue_flush()
        if not missing and g.gid not in self._launched:
            self._reduce(g)
        self.poll_reductions()

    # Note [Tile gradients across ranks]: memory-centric tiling (infinity.runtime.tiling)
    # hands a tiled group's gradient over by rows, one tile at a time, and the full group
    # gradient is never assembled.  At stages 2-3 each tile's rows are a flat range [a, b)
    # of the group; the part of it in rank r's shard is summed onto r (``Comm.reduce_sum``,
    # asynchronous, on the "grad" group from the main thread like the whole-group
    # reduce-scatters, so every rank issues the same reductions in the same order: tiles are
    # visited in the same order everywhere) and r adds it, averaged, into its shard
    # accumulation.  Bytes: each rank sends its piece to the owner once, as the untiled
    # reduce-scatter.  The shard is final once the group's last use ran its backward
    # (``tiled_final``, told by Tiling): then the overlapped step hears it (``_landed``).
    def accumulates_rows(self, g: GroupRecord) -> bool:
        if self.stage == 1:
            return super().accumulates_rows(g)
        return True

    def accumulate_rows(self, g: GroupRecord, slot: ParamSlot, start: int,
                        part: torch.Tensor | None, last: bool, numel: int | None = None) -> None:
        if self.stage == 1:
            return super().accumulate_rows(g, slot, start, part, last, numel)
        if part is None:
            part = torch.zeros(int(numel), dtype=torch.float32,
                               device=getattr(self.dev, "device", "cpu"))
        part = part.reshape(-1)
        if part.dtype != torch.float32:
            part = part.float()
        a = slot.offset + int(start)
        b = a + part.numel()
        lo, hi = self.shard(g)
        s = hi - lo
        ws, me = self.comm.world_size, self.comm.rank
        self._fresh.discard(g.gid)          # (fresh: zeros; tile sums are added to it)
        self._launched.add(g.gid)           # never reduced whole in this backward
        self._open_backward = True
        self._queue_flush()
        for r in range(a // s, min(ws, -(-b // s))):
            pa, pb = max(a, r * s), min(b, (r + 1) * s)
            piece = part[pa - a:pb - a]
            post = (lambda g=g, off=pa - lo, piece=piece: self._add_rows(g, off, piece)) \
                if r == me else None
            h = self.comm.reduce_sum(piece, r, async_op=True, post=post,
                                     name=f"gradient rows of group {g.gid} ({g.name or '<root>'})"
                                          f" [{pa}, {pb})")
            self._inflight.append(h)
            while len(self._inflight) > MAX_INFLIGHT_REDUCTIONS:
                self._inflight.pop(0).wait()
        self.poll_reductions()

    def _add_rows(self, g: GroupRecord, off: int, piece: torch.Tensor) -> None:
        """The summed piece of a tile's gradient that this rank owns: averaged into its
        shard accumulation (shard-local offset ``off``)."""
        if self._dropping:
            return
        piece.mul_(1.0 / self.comm.world_size)
        if self.spill:          # this backward's shard sum, written at tiled_final
            acc = self._tile_acc.get(g.gid)
            if acc is None:
                lo, hi = self.shard(g)
                acc = self._tile_acc[g.gid] = self.host_pool.lease((hi - lo) * 4,
                                                                   torch.float32).zero_()
            dst = acc[off:off + piece.numel()]
        else:
            dst = g.grad_buf[off:off + piece.numel()]
        if piece.device == dst.device:
            dst.add_(piece)
            return
        with self.host_pool.scoped(piece.numel() * 4, torch.float32) as host:
            x = self.dev.d2h(host[: piece.numel()], piece)
            x.wait_host()
            if self.acct is not None:
                self.acct.link("d2h", x.nbytes, x.seconds())
            dst.add_(host[: piece.numel()])

    def tiled_final(self, g: GroupRecord) -> None:
        """Every use of tiled ``g`` ran its backward: once its tile reductions landed, its
        shard is final (told to the overlapped step)."""
        if self.stage == 1:
            return
        while self._inflight:
            self._inflight.pop(0).wait()
        if not self.spill:
            self._landed(g)
            return
        acc = self._tile_acc.pop(g.gid, None)
        if acc is None:          # no row of this backward fell into this rank's shard
            lo, hi = self.shard(g)
            acc = self.host_pool.lease((hi - lo) * 4, torch.float32).zero_()
        self._spill(g, acc, [acc])
        while self._writes:      # (the next use of its extent reads it back)
            self._wait_write()

    def _drop_tile_acc(self) -> None:
        for acc in self._tile_acc.values():
            self.host_pool.give_back(acc)
        self._tile_acc.clear()

    def poll_reductions(self) -> None:
        """Without blocking: finish the reductions whose collective completed (their
        averaged shards go into the accumulation now, not when the window of
        ``MAX_INFLIGHT_REDUCTIONS`` forces a wait or backward ends), so a group's shard
        is final as early as the network allows (Note [Overlap across ranks])."""
        if self._inflight:
            for h in [h for h in self._inflight if h.done()]:
                self._inflight.remove(h)
                h.wait()                   # at once; raises a failed collective's error
        if self._landing:
            self._poll_landing()
        if self._buckets is not None:
            self._buckets.poll()

    def _accumulation(self, g: GroupRecord) -> torch.Tensor:
        self._fresh.discard(g.gid)        # (buckets are added into it)
        return g.grad_buf

    def _bucket_final(self, g: GroupRecord, acc: torch.Tensor | None) -> None:
        """Note [Gradient buckets]: ``g``'s shard is final (``acc``: the sum, spilling)."""
        if self.spill:
            return self._spill(g, acc, [acc])
        self._landed(g)

    def _landed(self, g: GroupRecord) -> None:
        """``g``'s averaged shard is in ``g.grad_buf`` (for this backward)."""
        cb = self.on_shard_final
        if cb is not None:
            cb(g)

    def _queue_flush(self) -> None:
        if self._flush_queued:
            return
        if torch._C._current_graph_task_id() == -1:
            return  # outside backward: flushed by finish_backward() / the step
        self._flush_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _reduce(self, g: GroupRecord) -> None:
        """Start the asynchronous reduce-scatter of ``g``'s full gradient into its shard."""
        self._launched.add(g.gid)
        full = self._full.pop(g.gid, None)
        missing = self._missing.pop(g.gid, ())
        if full is None:       # no gradient on this rank in this backward: contribute zeros
            full = self._lease_full(g)
        for i in missing:      # slots without a gradient in this backward (never written)
            s = g.slots[i]
            full[s.offset:s.offset + s.numel].zero_()
        lo, hi = self.shard(g)
        name = f"gradients of group {g.gid} ({g.name or '<root>'})"
        if self.on_device:
            out = self.dev.lease_or_overflow((hi - lo) * 4, torch.float32,
                                             "a reduced gradient shard")
        elif not self.spill and g.gid in self._fresh:
            # the window's first reduction of g: straight into its accumulation (nothing
            # to add to; nothing reads it before this lands)
            out = g.grad_buf
        else:
            out = self.host_pool.lease((hi - lo) * 4, torch.float32)
        self._fresh.discard(g.gid)
        bufs = [full] if out is g.grad_buf else [out, full]
        h = self.reduce_scatter_sum(
            out, full, async_op=True, name=name,
            post=lambda g=g, out=out, bufs=bufs: self._shard_done(g, out, bufs))
        self._inflight.append(h)
        while len(self._inflight) > MAX_INFLIGHT_REDUCTIONS:
            self._inflight.pop(0).wait()

    def _shard_done(self, g: GroupRecord, summed: torch.Tensor, bufs: list) -> None:
        """``summed``: this rank's slice of the gradient summed over ranks."""
        if self._dropping:                 # its window was abandoned: buffers back only
            for b in bufs:
                if b is not g.grad_buf:
                    self._give_full(b)
            return
        summed.mul_(1.0 / self.comm.world_size)
        if summed is g.grad_buf:           # landed where it accumulates (_reduce)
            for b in bufs:
                self.host_pool.give_back(b)
            self._landed(g)
            return
        if self.on_device:                 # only the averaged shard leaves the device
            for b in bufs:                 # the reduce-scatter's input is done with
                if b is not summed:
                    self.dev.give_back(b)
            bufs = [summed]
            host = self.host_pool.lease(summed.numel() * 4, torch.float32)
            x = self.dev.d2h(host, summed)
            if self._adder is not None:    # the worker waits for the copy and adds
                fut = self._adder.submit(self._add_shard, x, g, host)
                self._landing.append((fut, x, host, bufs, g))
                self._poll_landing()
                if len(self._landing) > MAX_INFLIGHT_REDUCTIONS:   # as the plan counts
                    self._poll_landing(oldest=True)
                return
            x.wait_host()
            if self.acct is not None:
                self.acct.link("d2h", x.nbytes, x.seconds())
            for b in bufs:
                self.dev.give_back(b)
            summed, bufs = host, [host]
        if not self.spill:
            g.grad_buf.add_(summed)
            for b in bufs:
                self.host_pool.give_back(b)
            self._landed(g)
            return
        self._spill(g, summed, bufs)

    def _spill(self, g: GroupRecord, summed: torch.Tensor, bufs: list) -> None:
        """Spilled shards: this backward's averaged ``summed`` (host) added to what earlier
        micro-steps left on NVMe and written back (async; ``summed`` back after the write),
        or, on the last micro-step, kept for its group's early step (Note [Streamed
        gradients])."""
        # the reduce-scatter's full-size input is done with: back now, not after the write
        for b in bufs:
            if b is not summed:
                self.host_pool.give_back(b)
        bufs = [summed]
        ext = self._grad_ext[g.gid]
        if g.gid in self._in_partial:     # accumulation: the bf16 partial sum so far
            with self.host_pool.scoped(summed.numel() * 2, torch.bfloat16) as tmp:
                self._read(self._partial_ext[g.gid], tmp)
                summed.add_(tmp)
        elif self._grad_valid[g.gid]:     # accumulation: add what earlier micro-steps left
            with self.host_pool.scoped(summed.numel() * 4, torch.float32) as tmp:
                self._read(ext, tmp)
                summed.add_(tmp)
        self._grad_sq[g.gid] = squared_norm(summed)
        st = self.grad_stream
        if self._final_micro and st.keep is not None and st.keep(g):
            # Note [Streamed gradients]: the final sum stays in memory for g's early step
            st.held[g.gid] = summed
            self._landed(g)
            return
        self._spill_write(g, summed, bufs)

    def _spill_write(self, g: GroupRecord, summed: torch.Tensor, bufs: list) -> None:
        """Write ``g``'s averaged (partial) sum to its NVMe extent, asynchronously; the
        buffers go back once the write completed."""
        t0 = time.perf_counter()
        if self._partial_bf16 and not self._final_micro:
            # lossy: a partial sum, in bf16 (half the bytes of each round trip)
            ext = self._partial_ext.get(g.gid)
            if ext is None:
                ext = self._partial_ext[g.gid] = self.swap.allocate(summed.numel() * 2)
            half = self.host_pool.lease(summed.numel() * 2, torch.bfloat16)
            half.copy_(summed)
            for b in bufs:
                self.host_pool.give_back(b)
            self._in_partial.add(g.gid)
            self._grad_valid[g.gid] = False
            self._writes.append((self.swap.write(ext, half), [half], summed.numel() * 2, t0))
        else:
            self._in_partial.discard(g.gid)
            self._grad_valid[g.gid] = True
            self._writes.append((self.swap.write(self._grad_ext[g.gid], summed), bufs,
                                 summed.numel() * 4, t0))
        while len(self._writes) > MAX_INFLIGHT_REDUCTIONS:
            self._wait_write()

    def _read(self, ext, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.swap.read(ext, buf).wait()
        if self.acct is not None:
            self.acct.link("nvme_read", buf.numel() * buf.element_size(),
                           time.perf_counter() - t0)

    @staticmethod
    def _add_shard(x, g: GroupRecord, host: torch.Tensor) -> None:
        """Worker: once the shard's D2H completed, add it into the fp32 accumulation."""
        x.wait_host()
        g.grad_buf.add_(host)

    def _poll_landing(self, wait: bool = False, oldest: bool = False) -> None:
        """Give back the buffers of shards already accumulated (all of them: ``wait``;
        the oldest one, waiting for it: ``oldest``)."""
        q = self._landing
        while q and (wait or oldest or q[0][0].done()):
            oldest = False
            fut, x, host, bufs, g = q.popleft()
            land(fut, x, host, bufs, acct=self.acct, host_pool=self.host_pool, dev=self.dev)
            self._landed(g)

    def _wait_write(self) -> None:
        h, bufs, nbytes, t0 = self._writes.pop(0)
        h.wait()
        if self.acct is not None:
            self.acct.link("nvme_write", nbytes, time.perf_counter() - t0)
        for b in bufs:
            self.host_pool.give_back(b)

    def before_backward(self, final_micro: bool) -> None:
        super().before_backward(final_micro)
        self._final_micro = bool(final_micro)
        self._open_backward = True        # every rank reduces every group once per backward

    def end_backward(self) -> None:
        super().end_backward()
        self.finish_backward()            # (a no-op when autograd's callback already did)

    def finish_backward(self) -> None:
        """Reduce what is left of this backward (group order) and wait for everything.
        Once per backward: a second call (the engine's end of backward, the step) finds
        nothing open and reduces nothing (it used to reduce every group again, with zeros)."""
        self._flush_queued = False
        if self.stage == 1 or not self._open_backward:
            return
        self._open_backward = False
        if self._buckets is not None:    # (tiled groups were reduced by rows)
            self._buckets.finish(skip=self._launched)
        else:
            for g in self.groups:
                if g.gid not in self._launched:
                    self._reduce(g)
        self._launched.clear()
        while self._inflight:
            self._inflight.pop(0).wait()
        self._poll_landing(wait=True)
        while self._writes:
            self._wait_write()

    def abandon(self) -> None:
        """The window is dropped (Note [window abort]): reductions still in flight are
        waited for and their shards thrown away (one may be writing into a shard
        accumulation, _reduce), so nothing of this window lands in the next one."""
        inflight = self._inflight[:]     # (cleared in place: GradBuckets shares the list)
        self._inflight.clear()
        self._dropping = True
        try:
            for h in inflight:
                try:
                    h.wait()
                except Exception as e:  # noqa: BLE001 - the window is dropped anyway
                    log.debug("zero: a reduction of the abandoned window failed: %s", e)
            if self._buckets is not None:
                self._buckets.reset()
        finally:
            self._dropping = False
        self._drop_tile_acc()

    def zero_grad(self) -> None:
        self._poll_landing(wait=True)       # nothing may land after the reset
        if self._buckets is not None:
            self._buckets.reset()
        for full in self._full.values():
            self._give_full(full)
        self._full.clear()
        self._missing.clear()
        self._drop_tile_acc()
        self._launched.clear()
        self._open_backward = False
        super().zero_grad()
        if self.grad_stream is not None:
            self.grad_stream.reset()
        if self.stage > 1:
            for g in self.groups:
                if self.spill:
                    self._grad_valid[g.gid] = False
                    self._in_partial.discard(g.gid)
                    self._grad_sq[g.gid] = 0.0
                elif g.gid in self._fresh:
                    continue               # nothing written since the last reset
                else:
                    g.grad_buf.zero_()
                    self._fresh.add(g.gid)

    @property
    def grad_buckets(self):
        """The bucketed gradient reduction (Note [Gradient buckets]), or None."""
        return self._buckets

    @property
    def grad_stream(self):
        """Spilled shards kept for their early step (Note [Streamed gradients]), or None."""
        return self._shard_stream

    def grad_in_hand(self, g: GroupRecord) -> torch.Tensor | None:
        """``g``'s final averaged shard in host memory: its accumulation, or (spilled) the
        kept final sum (Note [Streamed gradients]); None when it is on NVMe."""
        if self.spill:
            return self.grad_stream.held.get(g.gid)
        return super().grad_in_hand(g)

    def release_grad(self, g: GroupRecord, *, host: bool = True) -> None:
        if self.spill:
            self.grad_stream.release(g.gid)
        super().release_grad(g, host=host)

    def zero_unwritten(self, skip=()) -> None:
        # stages 2, 3: every group is reduced into its (zeroed) shard buffer each backward,
        # so there is nothing stale; the shard buffer is not indexed by slot offsets
        # (``skip``: groups stepped during backward, stage 3 only, kept their shards)
        if self.stage == 1:
            super().zero_unwritten(skip)

    def grad_norm(self, skip: dict[int, float] | None = None) -> float:
        """Global L2 norm of the averaged gradient (squared shard norms summed over ranks).
        ``skip`` (groups stepped during backward) is not needed: their shards are kept
        until the boundary, so every shard is summed here and the decision (clip, skip)
        is the same on every rank."""
        if self.spill:
            local = sum(self._grad_sq.values())
            return self.comm.all_reduce_scalar(local, name="squared gradient norm") ** 0.5
        local = 0.0
        for g in self.groups:
            lo, hi = self.shard(g)
            gb = g.grad_buf[lo:hi] if self.stage == 1 else g.grad_buf
            local += squared_norm(gb)
        return self.comm.all_reduce_scalar(local, name="squared gradient norm") ** 0.5

    def reduce_window(self) -> None:
        """At the accumulation boundary: stage 1 all-reduces the window's gradients (and
        averages them); stages 2, 3 finish what backward left to reduce."""
        if self.stage == 1:
            inv = 1.0 / self.comm.world_size
            for g in self.groups:
                self.comm.all_reduce_sum(g.grad_buf, name=f"gradients of group {g.gid}")
                g.grad_buf.mul_(inv)
        else:
            self.finish_backward()   # no-op when backward already flushed

    def grad_source(self, g: GroupRecord):
        """What the step reads as this rank's shard of ``g``'s gradient: its slice of the
        all-reduced buffer (stage 1), its shard accumulation, or (spilled) the kept final
        sum (Note [Streamed gradients]) or else its extent."""
        if self.spill:
            held = self.grad_stream.held.get(g.gid)
            return held if held is not None else self._grad_ext[g.gid]
        if self.stage == 1:
            lo, hi = self.shard(g)
            return g.grad_buf[lo:hi]
        return g.grad_buf

    def close(self) -> None:
        try:
            self._poll_landing(wait=True)
        except Exception as e:  # noqa: BLE001 - closing after an error: it was raised before
            log.debug("zero: a gradient shard failed to land during close: %s", e)
        finally:
            if self._adder is not None:
                self._adder.shutdown(wait=True)
            super().close()
