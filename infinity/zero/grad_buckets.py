"""Gradients at ZeRO stages 2-3 on separate device memory, reduced in bounded buckets.

Note [Gradient buckets]
~~~~~~~~~~~~~~~~~~~~~~~
Without buckets (``reduce_bucket_mb: 0``) a group's whole gradient is assembled in an
fp32 device buffer and reduce-scattered once every trainable slot has its gradient; with
``MAX_INFLIGHT_REDUCTIONS`` such reductions in flight, that reserves several copies of the
largest group on the device (10.5 GB each for a 1T model's layer).

With buckets each group's flat range is cut along the shard boundaries and then into
pieces of at most ``reduce_bucket_mb``, so every bucket ``[a, b)`` lies inside one rank's
shard (its *owner*).  A slot's gradient is copied into the buckets it overlaps, in the
working precision (the gradient's own dtype); a bucket is reduced to its owner
(``Comm.reduce_sum``, asynchronously) as soon as every trainable slot overlapping it has
arrived.  The owner copies the summed bucket to the host and adds it, divided by the
world size, into its fp32 shard accumulation, so accumulation over micro-steps stays fp32.
Bytes on the wire: each rank sends each bucket it does not own once, as the reduce-scatter
of the whole group; buckets no trainable slot overlaps (the alignment padding, frozen
slots) are never reduced.

The bound: at most ``MAX_INFLIGHT_REDUCTIONS`` buckets reducing or landing (copied to
the host) and ``MAX_OPEN_BUCKETS`` being filled: ``MAX_INFLIGHT_REDUCTIONS + MAX_OPEN_BUCKETS``
buckets on the device.  Gradients arrive slot by slot in backward order, so a
bucket across a slot boundary can wait for the other slot; when another bucket must be
opened and ``MAX_OPEN_BUCKETS`` are open already, the oldest is reduced with what it has (the rest of its
slots are zeros in it), and its late slots go into a fresh buffer reduced again later: the
reduction is a sum, so the owner adds both.  A slot whose gradient arrives twice in a
backward (reentrant checkpointing) is handled the same way while its group is not final yet
(after that, as on the whole-group path, a late arrival is not counted: post-accumulate
hooks fire once per parameter and backward).  Every rank sees the same
arrivals in the same order (the same model and graph), so every rank issues the same
reductions in the same order; what is still open at the end of backward is reduced in
group and bucket order (buckets nobody filled: zeros, as the whole-group path does).

A group's shard is final (the overlapped step hears it: ``on_final``) once every trainable
slot arrived, none of its buckets is open and every reduction this rank owns landed.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from infinity.memory.pool import ALIGN
from infinity.memory.record import GroupRecord, ParamSlot

log = logging.getLogger("infinity.zero")

__all__ = ["GradBuckets", "MAX_OPEN_BUCKETS", "bucket_numel", "bucket_ranges", "land"]

#: buckets being filled at once before the oldest is reduced with what it has
MAX_OPEN_BUCKETS = 3


def bucket_numel(bucket_bytes: int, itemsize: int) -> int:
    """Elements per bucket: ``bucket_bytes`` of the working precision, a whole number of
    alignment units (at least one)."""
    unit = max(1, ALIGN // itemsize)
    return max(unit, int(bucket_bytes) // itemsize // unit * unit)


def bucket_ranges(padded_numel: int, world_size: int, numel: int):
    """``(a, b, owner)`` for a group of ``padded_numel`` elements: every shard cut into
    pieces of at most ``numel`` elements."""
    s = padded_numel // world_size
    out = []
    for r in range(world_size):
        for a in range(r * s, (r + 1) * s, numel):
            out.append((a, min(a + numel, (r + 1) * s), r))
    return out


@dataclass(frozen=True)
class Bucket:
    """One range ``[a, b)`` of a group's flat gradient, inside rank ``owner``'s shard."""
    index: int
    a: int
    b: int
    owner: int
    slots: frozenset           # trainable slot indices overlapping it
    gaps: tuple                # bucket-local (start, end) ranges no trainable slot covers


class _Open:
    """A bucket's buffer being filled in this backward."""
    __slots__ = ("buf", "written", "missing")

    def __init__(self, buf, missing):
        self.buf = buf
        self.written: set = set()
        self.missing: set = missing


class GradBuckets:
    """The bucketed gradient path of :class:`~infinity.zero.partitioned_grads.
    PartitionedGrads` (Note [Gradient buckets]).

    ``shard_acc(g)``: the host fp32 tensor ``g``'s averaged shard is added into (main
    thread), or ``shard_acc=None``: a zeroed shard leased per group and backward;
    ``on_final(g, acc)``: ``g``'s shard is final for this backward (``acc``: that leased
    shard, the callee's now; None with ``shard_acc``); ``inflight``: the optimizer's list
    of in-flight collectives (bounded by ``max_inflight``); ``adder``: the worker that
    waits for a D2H copy and adds it."""

    def __init__(self, groups: list[GroupRecord], *, comm, dev, host_pool, acct,
                 bucket_bytes: int, shard_acc, on_final, inflight: list, max_inflight: int,
                 adder=None, dropping=lambda: False):
        self.comm, self.dev, self.host_pool, self.acct = comm, dev, host_pool, acct
        self.shard_acc, self.on_final = shard_acc, on_final
        self.inflight, self.max_inflight = inflight, max_inflight
        self.adder, self.dropping = adder, dropping
        self.world, self.rank = comm.world_size, comm.rank
        self.groups = [g for g in groups if any(s.trainable for s in g.slots)]
        self.bucket_bytes = int(bucket_bytes)
        self.buckets: dict[int, list[Bucket]] = {}
        self.of_slot: dict[tuple[int, int], list[Bucket]] = {}
        self.n_trainable: dict[int, int] = {}
        self._by_gid = {g.gid: g for g in self.groups}
        self._slot_index = {id(s): i for g in self.groups for i, s in enumerate(g.slots)}
        for g in self.groups:
            self._layout(g)
        # per backward
        self.open: OrderedDict = OrderedDict()       # (gid, index) -> _Open
        self.arrived: dict[int, set] = {}            # gid -> trainable slots arrived
        self.arrived_in: dict[tuple, set] = {}       # (gid, index) -> slots arrived
        self.reduced: set = set()                    # (gid, index) reduced complete
        self.pending: dict[int, int] = {}            # gid -> owned reductions not landed
        self.final: set = set()
        self.acc: dict[int, torch.Tensor] = {}       # gid -> leased shard (shard_acc None)
        self.landing: deque = deque()                # (future or None, x, host, buf, g)

    # ------------------------------------------------------------------ layout
    def _layout(self, g: GroupRecord) -> None:
        n = bucket_numel(self.bucket_bytes, g.dtype.itemsize)
        train = [(i, s.offset, s.offset + s.numel) for i, s in enumerate(g.slots)
                 if s.trainable]
        self.n_trainable[g.gid] = len(train)
        out = []
        for a, b, owner in bucket_ranges(g.padded_numel, self.world, n):
            slots = frozenset(i for i, sa, sb in train if sa < b and sb > a)
            if not slots:
                continue                         # nothing trainable: never reduced
            covered = sorted((max(sa, a) - a, min(sb, b) - a) for i, sa, sb in train
                             if i in slots)
            gaps, pos = [], 0
            for x, y in covered:
                if x > pos:
                    gaps.append((pos, x))
                pos = max(pos, y)
            if pos < b - a:
                gaps.append((pos, b - a))
            bk = Bucket(len(out), a, b, owner, slots, tuple(gaps))
            out.append(bk)
            for i in slots:
                self.of_slot.setdefault((g.gid, i), []).append(bk)
        self.buckets[g.gid] = out

    def owned_sizes(self) -> list[int]:
        """Bytes of every bucket this rank owns (its D2H staging)."""
        return [(bk.b - bk.a) * g.dtype.itemsize for g in self.groups
                for bk in self.buckets[g.gid] if bk.owner == self.rank]

    # ------------------------------------------------------------------ arrivals
    def accumulate(self, g: GroupRecord, slot: ParamSlot, grad: torch.Tensor) -> None:
        """``slot``'s gradient (device, working precision) into the buckets it overlaps;
        complete buckets are reduced."""
        i = self._slot_index[id(slot)]
        flat = grad.reshape(-1)
        self.arrived.setdefault(g.gid, set()).add(i)
        for bk in self.of_slot.get((g.gid, i), ()):
            key = (g.gid, bk.index)
            ent = self.open.get(key)
            if ent is None:
                while len(self.open) >= MAX_OPEN_BUCKETS:
                    self._reduce_oldest(last=False)
                done = self.arrived_in.setdefault(key, set())
                ent = _Open(self._lease(g, bk), set(bk.slots) - done)
                self.open[key] = ent
            pa, pb = max(bk.a, slot.offset), min(bk.b, slot.offset + slot.numel)
            dst = ent.buf[pa - bk.a:pb - bk.a]
            src = flat[pa - slot.offset:pb - slot.offset]
            if i in ent.written:
                dst.add_(src)
            else:
                dst.copy_(src)
                ent.written.add(i)
            self.arrived_in.setdefault(key, set()).add(i)
            ent.missing.discard(i)
            if not ent.missing:
                self._reduce(g, bk)
        self._check_final(g)

    def _reduce_oldest(self, last: bool) -> None:
        """Room for one more open bucket: the oldest is reduced with what it has (``last``:
        at the end of backward, where nothing more arrives for it)."""
        (gid, j), ent = next(iter(self.open.items()))
        if last:
            ent.missing.clear()
        elif self.acct is not None:
            self.acct.count("grad_bucket_early_reductions")
        self._reduce(self._by_gid[gid], self.buckets[gid][j])

    def _lease(self, g: GroupRecord, bk: Bucket) -> torch.Tensor:
        return self.dev.lease_or_overflow((bk.b - bk.a) * g.dtype.itemsize, g.dtype,
                                          "a gradient bucket awaiting its reduction")

    # ------------------------------------------------------------------ reductions
    def _reduce(self, g: GroupRecord, bk: Bucket) -> None:
        """Reduce ``bk``'s open buffer (a new zeroed one when none is open) to its owner."""
        key = (g.gid, bk.index)
        ent = self.open.pop(key, None)
        if ent is None:
            ent = _Open(self._lease(g, bk), set())
        buf = ent.buf
        for x, y in bk.gaps:
            buf[x:y].zero_()
        for i in bk.slots - ent.written:       # slots with nothing in this buffer
            s = g.slots[i]
            pa, pb = max(bk.a, s.offset), min(bk.b, s.offset + s.numel)
            buf[pa - bk.a:pb - bk.a].zero_()
        mine = bk.owner == self.rank
        if mine:      # before anything lands below: g is not final while this is pending
            self.pending[g.gid] = self.pending.get(g.gid, 0) + 1
        if not ent.missing:
            self.reduced.add(key)
        # at most max_inflight buckets reducing or landing (their buffers held)
        while len(self.inflight) + len(self.landing) >= self.max_inflight:
            if self.landing:
                self._land_oldest()
            elif self.inflight:
                self.inflight.pop(0).wait()
            else:
                break
        if self.acct is not None:
            self.acct.count("grad_buckets_reduced")
        h = self.comm.reduce_sum(
            buf, bk.owner, async_op=True,
            name=f"gradient bucket {bk.index} of group {g.gid} ({g.name or '<root>'}) "
                 f"[{bk.a}, {bk.b})",
            post=lambda g=g, bk=bk, buf=buf, mine=mine: self._reduced(g, bk, buf, mine))
        self.inflight.append(h)

    def _reduced(self, g: GroupRecord, bk: Bucket, buf: torch.Tensor, mine: bool) -> None:
        """A bucket's reduction completed: the owner copies the sum to the host and adds it
        (averaged) into its shard accumulation; the others give the buffer back."""
        if not mine or self.dropping():
            self.dev.give_back(buf)
            if mine:
                self.pending[g.gid] -= 1
            return
        lo = bk.owner * (g.padded_numel // self.world)
        dst = self._acc(g)[bk.a - lo:bk.b - lo]
        host = self.host_pool.lease(buf.numel() * buf.element_size(), buf.dtype)
        x = self.dev.d2h(host, buf)
        scale = 1.0 / self.world
        if self.adder is not None:
            fut = self.adder.submit(_add_landed, x, dst, host, scale)
            self.landing.append((fut, x, host, buf, g))
            self.poll()
            return
        _add_landed(x, dst, host, scale)
        self.landing.append((None, x, host, buf, g))
        self.poll()

    def _acc(self, g: GroupRecord) -> torch.Tensor:
        if self.shard_acc is not None:
            return self.shard_acc(g)
        acc = self.acc.get(g.gid)
        if acc is None:
            acc = self.acc[g.gid] = self._lease_shard(g)
        return acc

    def _lease_shard(self, g: GroupRecord) -> torch.Tensor:
        return self.host_pool.lease(g.padded_numel // self.world * 4, torch.float32).zero_()

    def _final(self, g: GroupRecord) -> None:
        self.final.add(g.gid)
        acc = None
        if self.shard_acc is None:
            acc = self.acc.pop(g.gid, None)
            if acc is None:               # nothing of this rank's shard had a gradient
                acc = self._lease_shard(g)
        self.on_final(g, acc)

    def poll(self, wait: bool = False) -> None:
        """Give back what landed (everything: ``wait``)."""
        while self.landing and (wait or self.landing[0][0] is None or self.landing[0][0].done()):
            self._land_oldest()

    def _land_oldest(self) -> None:
        fut, x, host, buf, g = self.landing.popleft()
        land(fut, x, host, (buf,), acct=self.acct, host_pool=self.host_pool, dev=self.dev)
        self.pending[g.gid] -= 1
        self._check_final(g)

    def _check_final(self, g: GroupRecord) -> None:
        gid = g.gid
        if gid in self.final or self.pending.get(gid, 0) or self.dropping():
            return
        if len(self.arrived.get(gid, ())) < self.n_trainable[gid]:
            return
        if any(k[0] == gid for k in self.open):
            return
        if any((gid, bk.index) not in self.reduced for bk in self.buckets[gid]):
            return
        self._final(g)

    # ------------------------------------------------------------------ backward's end
    def finish(self, skip=()) -> None:
        """End of backward: every bucket not reduced complete is reduced now (group and
        bucket order: the same collectives on every rank), then everything lands and every
        group's shard is final.  ``skip``: groups reduced another way (tiled: by rows)."""
        for g in self.groups:
            for bk in self.buckets[g.gid]:
                key = (g.gid, bk.index)
                if key not in self.reduced:
                    ent = self.open.get(key)
                    if ent is None and g.gid in skip:
                        continue                 # (reduced by rows; nothing arrived here)
                    if ent is not None:
                        ent.missing.clear()      # reduced with what it has
                    else:
                        while len(self.open) >= MAX_OPEN_BUCKETS:   # (the plan's bound)
                            self._reduce_oldest(last=True)
                        self.open[key] = _Open(self._lease(g, bk), set())
                    self._reduce(g, bk)
        while self.inflight:
            self.inflight.pop(0).wait()
        self.poll(wait=True)
        for g in self.groups:
            if g.gid not in skip and g.gid not in self.final and not self.dropping():
                self._final(g)
        self.reset()

    def reset(self) -> None:
        """Forget this backward (buffers still open go back; nothing may be in flight)."""
        self.poll(wait=True)
        for ent in self.open.values():
            self.dev.give_back(ent.buf)
        self.open.clear()
        for acc in self.acc.values():
            self.host_pool.give_back(acc)
        self.acc.clear()
        self.arrived.clear()
        self.arrived_in.clear()
        self.reduced.clear()
        self.pending.clear()
        self.final.clear()


def land(fut, x, host: torch.Tensor, bufs, *, acct, host_pool, dev) -> None:
    """A reduced gradient copied D2H (``x``) and added on the host (by the worker's
    ``fut``, or None: already added): wait for both, book the copy, give back the host
    staging and the device ``bufs``; re-raises the worker's error."""
    try:
        if fut is not None:
            fut.result()
    finally:
        x.wait_host()
        if acct is not None:
            acct.link("d2h", x.nbytes, x.seconds())
        host_pool.give_back(host)
        for b in bufs:
            dev.give_back(b)


def _add_landed(x, dst: torch.Tensor, host: torch.Tensor, scale: float) -> None:
    """Once the summed bucket is on the host: ``dst += host / world_size`` in fp32."""
    x.wait_host()
    dst.add_(host, alpha=scale)
