"""The tile pipeline behind ``OptimizerStateStore.step``.

One Python thread orchestrates; the I/O engine moves bytes asynchronously and
``adam_step`` releases the GIL, so with ``depth`` ring slots the loop is::

    read tile i+1  ||  adam_step on tile i  ||  write tile i-1 (and i-2 ...)

A slot is reused for tile ``i + depth`` only after the writes of tile ``i``
have completed. The reads of tile i+1 are always issued before tile i is
computed (so the device has work queued during compute); with ``depth > 3``
tiles further ahead (up to i+depth-2) are read too, but only into slots whose
writes have already landed. Tiles of all keys of one step flow through the
same pipeline, so small partitions do not drain it.

Everything here is private to :mod:`infinity.optim.offload_step`; the public
contract lives there.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

log = logging.getLogger("infinity.optim")

ALIGN = 4096
ROLES = ("master", "exp_avg", "exp_avg_sq")


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def extent_nbytes(ext) -> int:
    """Capacity in bytes of an ``infinity.io`` Extent."""
    for name in ("nbytes", "length", "size"):
        v = getattr(ext, name, None)
        if isinstance(v, int):
            return v
    raise TypeError(f"cannot tell the size of extent {ext!r}: expected an infinity.io Extent with .nbytes")


class LinkMeter:
    """Feeds ``Accounting.link`` and the timeline with I/O intervals.

    Overlapping intervals of the same link are counted once (busy time, not
    the sum of latencies), so bytes / seconds is a bandwidth.
    """

    def __init__(self, accounting, timeline):
        self.accounting = accounting
        self.timeline = timeline if (timeline is not None and getattr(timeline, "enabled", False)) else None
        self._last_end = {}

    def io(self, link: str, name: str, nbytes: int, t0: float, t1: float) -> None:
        if nbytes <= 0:
            return
        last = self._last_end.get(link, 0.0)
        seconds = max(0.0, t1 - max(t0, last))
        self._last_end[link] = max(last, t1)
        if self.accounting is not None:
            self.accounting.link(link, nbytes, seconds)
        if self.timeline is not None:
            self.timeline.add(link, name, t0, t1, nbytes)

    def span(self, lane: str, name: str, t0: float, t1: float, nbytes: int = 0) -> None:
        if self.timeline is not None:
            self.timeline.add(lane, name, t0, t1, nbytes)


@dataclass
class TileTask:
    """One tile of one partition in one step."""
    part: Any                      # offload_step._Partition
    item: Any                      # offload_step.StepItem
    index: int                     # tile index inside the partition
    start: int                     # first element (partition coordinates)
    numel: int
    # (offset in tile, numel, lr, weight_decay, (beta1, beta2, eps) overrides or None)
    segs: List[tuple]
    grad: Any = None               # flat host tensor or Extent
    param_out: Optional[torch.Tensor] = None   # flat, or None
    # flat fp32 holding the master (no read), or None: Note [Master hand-off] in
    # infinity/engine/overlap.py, Note [Cache write-through] in infinity/memory/manager.py
    master_buf: Optional[torch.Tensor] = None


@dataclass
class Slot:
    """One stage of the ring: fixed buffers plus what is in flight on them."""
    bufs: dict                                     # role -> aligned flat tensor (tile_numel elements)
    views: dict = field(default_factory=dict)      # role -> tensor view used by compute
    zero: set = field(default_factory=set)         # roles to zero-fill (never written on NVMe)
    reads: list = field(default_factory=list)      # handles
    read_bytes: int = 0
    read_t0: float = 0.0
    writes: list = field(default_factory=list)     # handles (ours and the param sink's)
    write_bytes: int = 0
    write_t0: float = 0.0
    sink_bytes: int = 0                            # bytes the param sink wrote for this tile
    sink_t0: float = 0.0
    mark_valid: list = field(default_factory=list)  # (backing, tile) made valid once writes land
    task: Optional[TileTask] = None


def _bytes_from(flat: torch.Tensor, start: int) -> torch.Tensor:
    """A uint8 view of ``flat``'s storage from element ``start`` to the storage's end (the
    4096-rounded tail of the last tile lies past ``flat.numel()`` but inside its storage)."""
    off = (flat.storage_offset() + start) * flat.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(flat.untyped_storage(), off,
                                                  (flat.untyped_storage().nbytes() - off,))


def drain(handles: list) -> Optional[BaseException]:
    """Wait for every handle; return the first error (after waiting for all)."""
    first = None
    for h in handles:
        try:
            h.wait()
        except BaseException as e:  # noqa: BLE001 - we re-raise the first one
            if first is None:
                first = e
    handles.clear()
    return first


class TilePipeline:
    """Runs one optimizer step over a list of :class:`TileTask`."""

    def __init__(self, store, slots: List[Slot], meter: LinkMeter, adam_step: Callable, txn=None):
        self.store = store
        self.txn = txn                 # step_txn.StepTxn or None (Note [commit point])
        self.slots = slots
        self.meter = meter
        self.adam_step = adam_step
        self.current: Optional[TileTask] = None   # the tile being worked on (error context)
        self.nonfinite: set = set()    # keys with a non-finite result (Note [non-finite result])

    # -- stages -----------------------------------------------------------
    def issue_reads(self, task: TileTask, slot: Slot) -> None:
        store = self.store
        part = task.part
        slot.task = task
        slot.views.clear()
        slot.zero.clear()
        slot.read_t0 = time.perf_counter()
        slot.read_bytes = 0
        lo, n = task.start, task.numel
        for role in ROLES:
            b = part.backing[role]
            if b.host is not None:
                slot.views[role] = b.host[lo:lo + n]
                continue
            if role == "master" and task.master_buf is not None:
                slot.views[role] = task.master_buf[lo:lo + n]     # current values in hand
                continue
            buf = slot.bufs[role]
            slot.views[role] = buf[:n]
            if not b.valid[task.index]:
                slot.zero.add(role)
                continue
            slot.reads.append(store._read_tile(b, task.index, buf, n))
            slot.read_bytes += b.io_bytes_at(task.index, store.tile_numel, n)
        g = task.grad
        if isinstance(g, torch.Tensor):
            gv = g[lo:lo + n]
            if gv.device.type != "cpu":
                # gradients leave the device before the step (infinity.grads): a device
                # tensor here would need a synchronous copy per tile
                raise ValueError(f"optimizer step of {task.item.key!r}: its gradient is on "
                                 f"{gv.device}; the CPU optimizer reads host gradients only")
            slot.views["grad"] = gv
        else:
            gdt = task.item.grad_dtype
            esz = torch.empty((), dtype=gdt).element_size()
            gbuf = slot.bufs["grad"].view(torch.uint8).view(gdt)
            off = lo * esz
            nbytes = min(round_up(n * esz), extent_nbytes(g) - off)
            h = store.swap.read(g, gbuf.view(torch.uint8)[:nbytes], offset=off)
            slot.reads.append(h)
            slot.read_bytes += nbytes
            slot.views["grad"] = gbuf[:n]

    def wait_reads(self, slot: Slot) -> None:
        if not slot.reads:
            return
        tw = time.perf_counter()
        err = drain(slot.reads)
        t1 = time.perf_counter()
        if err is not None:
            raise err
        key = slot.task.part.key
        self.meter.io("nvme_read", key, slot.read_bytes, slot.read_t0, t1)
        if t1 - tw > 1e-4:
            self.meter.span("wait", "optimizer:nvme_read", tw, t1)

    def compute(self, task: TileTask, slot: Slot, hp: dict) -> None:
        t0 = time.perf_counter()
        v = slot.views
        for role in slot.zero:
            v[role].zero_()
        item = task.item
        store = self.store
        n = task.numel
        po_full = None
        sink_buf = None
        if item.param_sink is not None and store.sink_dtype is not None:
            sink_buf = slot.bufs["sink"][:n]
        if task.param_out is not None:
            po_full = task.param_out[task.start:task.start + n]
        # Where adam_step writes the low-precision copy in the same pass.
        fused_out = sink_buf
        if fused_out is None and po_full is not None and po_full.device.type == "cpu":
            fused_out = po_full
        master, grad, m, s = v["master"], v["grad"], v["exp_avg"], v["exp_avg_sq"]
        if self.txn is not None:       # host tensors updated in place: undo copies first
            for role in ROLES:
                if task.part.backing[role].host is not None:
                    self.txn.save(v[role], task.part.key)
        finite = True
        for off, k, lr, wd, ov in task.segs:
            e = off + k
            shp = hp if ov is None else {**hp, "beta1": ov[0], "beta2": ov[1], "eps": ov[2]}
            finite &= self.adam_step(master[off:e], grad[off:e], m[off:e], s[off:e],
                                     lr=lr, weight_decay=wd,
                                     param_out=None if fused_out is None else fused_out[off:e],
                                     **shp) is not False
        if po_full is not None and fused_out is not po_full:
            # A second output (or a device tensor): copy the rounded values, bit-identical
            # to the fused ones when the dtypes match, else rounded from the fp32 master.
            same = sink_buf is not None and sink_buf.dtype == po_full.dtype
            if not same and po_full.dtype == torch.float16 and finite:
                finite = not bool((master.abs() >= 65520.0).any())   # rounds to inf in fp16
            po_full.copy_(sink_buf if same else master)
        if not finite:
            self.nonfinite.add(task.part.key)
        t1 = time.perf_counter()
        self.meter.span("optimizer", task.part.key, t0, t1, n * 4)
        if item.param_sink is not None:
            tile = sink_buf if sink_buf is not None else master
            ts = time.perf_counter()
            h = item.param_sink(task.part.key, task.start, tile)
            if h is not None:
                slot.writes.append(h)
                # the sink's write is NVMe traffic too: counted with this tile's writes
                nb = getattr(h, "nbytes", None)
                slot.sink_bytes = nb if isinstance(nb, int) else tile.numel() * tile.element_size()
                slot.sink_t0 = ts

    def issue_writes(self, task: TileTask, slot: Slot) -> None:
        store = self.store
        part = task.part
        slot.write_t0 = slot.sink_t0 if slot.sink_bytes else time.perf_counter()
        slot.write_bytes = slot.sink_bytes
        slot.sink_bytes = 0
        for role in ROLES:
            b = part.backing[role]
            if b.host is not None:
                continue
            src = slot.bufs[role]
            if role == "master" and task.master_buf is not None:
                src = _bytes_from(task.master_buf, task.start)
            if self.txn is not None:   # the shadow, committed later (Note [commit point])
                entry = self.txn.writes[id(b)]
                slot.writes.append(store._write_tile(b, task.index, src, task.numel, extent=entry[1]))
                slot.mark_valid.append((entry[2], task.index))
            else:
                slot.writes.append(store._write_tile(b, task.index, src, task.numel))
                slot.mark_valid.append((b, task.index))
            slot.write_bytes += b.io_bytes_at(task.index, store.tile_numel, task.numel)

    def drain_writes(self, slot: Slot) -> None:
        if not slot.writes:
            slot.mark_valid.clear()
            return
        err = drain(slot.writes)
        t1 = time.perf_counter()
        if err is not None:
            slot.mark_valid.clear()
            raise err
        for b, i in slot.mark_valid:
            if isinstance(b, set):     # a transaction's written tiles
                b.add(i)
            else:
                b.valid[i] = True
        slot.mark_valid.clear()
        if slot.task is not None:
            self.meter.io("nvme_write", slot.task.part.key, slot.write_bytes, slot.write_t0, t1)

    def abort(self) -> None:
        """Wait for everything still in flight (errors ignored: the caller is already raising)."""
        for s in self.slots:
            drain(s.reads)
            drain(s.writes)
            s.mark_valid.clear()

    # -- the loop -----------------------------------------------------------
    @staticmethod
    def writes_done(slot: Slot) -> bool:
        """True when every write on the slot has landed (without blocking)."""
        for h in slot.writes:
            done = getattr(h, "done", None)
            if done is None or not done():
                return False
        return True

    def run(self, tasks: List[TileTask], hp: dict) -> None:
        """Before computing tile i, the reads of tile i+1 are issued (waiting, if need be,
        for the writes of tile i+1-depth to leave its slot) so the device always has
        reads and writes queued while the CPU computes; with depth > 3, tiles up to
        i+depth-2 are read ahead too, but only into slots whose writes have landed."""
        if not tasks:
            return
        slots = self.slots
        depth = len(slots)
        ahead = max(1, depth - 2)
        total = len(tasks)
        nxt = 0                      # next tile whose reads are not issued yet
        try:
            for i, task in enumerate(tasks):
                while nxt < total and nxt <= i + ahead:
                    slot = slots[nxt % depth]
                    if nxt > i + 1 and not self.writes_done(slot):
                        break                        # never block for the extra read-ahead
                    self.current = slot.task
                    self.drain_writes(slot)          # tile nxt-depth leaves the slot
                    self.current = tasks[nxt]
                    self.issue_reads(tasks[nxt], slot)
                    nxt += 1
                slot = slots[i % depth]
                self.current = task
                self.wait_reads(slot)
                self.compute(task, slot, hp)
                self.issue_writes(task, slot)
            for k in range(total, total + depth):
                self.current = slots[k % depth].task
                self.drain_writes(slots[k % depth])
        except BaseException:
            self.abort()
            raise
