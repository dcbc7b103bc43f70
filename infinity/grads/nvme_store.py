"""Gradients homed on NVMe, for when the host cap cannot hold the fp32 accumulation buffers.

Each trainable group has an fp32 extent.  During backward a group's gradients are
assembled in one leased host staging buffer; when every trainable parameter of the group
has delivered its gradient (or at the end of backward) the buffer is written to the
extent and returned.  Across micro-steps of one accumulation window the extent holds the
partial sum: the next micro-step reads it back into the staging buffer first
(read-modify-write).  The squared norm is taken while the buffer is in memory on the last
micro-step, so clipping costs no extra NVMe pass.  The optimizer store reads the extents
tile-wise.

``partial_dtype=torch.bfloat16`` (``gradient_accumulation_dtype: "bf16"``, lossy, opt-in):
the partial sums between micro-steps are written to a second, bf16 extent (half the NVMe
bytes of each round trip); the sum is always formed in fp32 in the staging buffer, and the
last micro-step of the window writes the fp32 extent the optimizer reads.  A group that
got no gradient on the last micro-step is converted at :meth:`finish_window`.

Update as gradients arrive (Note [Streamed gradients] in infinity/engine/overlap.py): on
the last micro-step of a window, a group whose sum is complete is offered to ``keep``
(the overlapped step).  A kept buffer stays in memory (:attr:`held`) and the group's
early optimizer step reads it, so its final sum never goes to NVMe and is never read
back; the overlapped step counts its norm.  With clipping the overlapped step writes it
to the extent as well (:meth:`write_held`, on its worker) so that a rolled-back,
speculative update can be redone from it.  A kept group the overlap does not step after
all is flushed as usual (:meth:`flush_held`).
"""
from __future__ import annotations

import time

import torch

from typing import Callable

from infinity.grads.norm import squared_norm
from infinity.memory.record import GroupRecord

__all__ = ["NvmeGradStore"]


class NvmeGradStore:
    def __init__(self, groups: list[GroupRecord], swap, host_pool, accounting, timeline=None,
                 partial_dtype: torch.dtype = torch.float32):
        if partial_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"NvmeGradStore: partial sums in float32 or bfloat16, got "
                             f"{partial_dtype}")
        self.groups = {g.gid: g for g in groups}
        self.swap = swap
        self.pool = host_pool
        self.acct = accounting
        self.timeline = timeline
        self.extent = {g.gid: swap.allocate(g.padded_numel * 4) for g in groups}
        self.partial_dtype = partial_dtype
        # bf16 partial sums: their own extents (allocated at the first non-final flush)
        self.partial: dict[int, object] = {}
        self.in_partial: set[int] = set()     # groups whose window sum is in the bf16 extent
        self._need = {g.gid: {i for i, s in enumerate(g.slots) if s.trainable} for g in groups}
        self.staging: dict[int, torch.Tensor] = {}
        self.received: dict[int, set] = {}
        self.on_nvme: set[int] = set()        # extents holding this window's partial sums
        self.normed: set[int] = set()         # groups whose final sum entered sumsq
        self.sumsq = 0.0
        self.final_micro = True               # the coming backward ends a window (begin_backward)
        # Note [Streamed gradients]: keep(g) -> True takes g's complete final sum for an
        # early step (the overlapped step's keep_grad); held: gid -> that buffer; taken:
        # gids whose final sum the overlapped step owns (its norm counted there)
        self.keep: Callable[[GroupRecord], bool] | None = None
        self.held: dict[int, torch.Tensor] = {}
        self.taken: set[int] = set()

    # ------------------------------------------------------------------ I/O helpers
    def _io(self, op: str, gid: int, buf: torch.Tensor, ext=None) -> None:
        t0 = time.perf_counter()
        ext = self.extent[gid] if ext is None else ext
        (self.swap.write(ext, buf) if op == "write" else self.swap.read(ext, buf)).wait()
        link = "nvme_write" if op == "write" else "nvme_read"
        nbytes = buf.numel() * buf.element_size()
        self.acct.link(link, nbytes, time.perf_counter() - t0)
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.add(link, "grads", t0, time.perf_counter(), nbytes)

    def _stage(self, g: GroupRecord) -> torch.Tensor:
        buf = self.staging.get(g.gid)
        if buf is None:
            buf = self.pool.lease(g.padded_numel * 4, torch.float32)
            if g.gid in self.in_partial:
                self._read_partial(g, buf)
            elif g.gid in self.on_nvme:
                self._io("read", g.gid, buf)
            else:
                buf.zero_()
            self.staging[g.gid] = buf
            self.received[g.gid] = set()
        return buf

    # ------------------------------------------------------------------ API
    def begin_backward(self, final_micro: bool) -> None:
        """A backward starts; ``final_micro``: it is the last micro-step of its window
        (its sums are final: written in fp32 and normed)."""
        self.final_micro = bool(final_micro)

    def accumulate(self, g: GroupRecord, index: int, grad: torch.Tensor) -> None:
        s = g.slots[index]
        buf = self._stage(g)
        buf[s.offset:s.offset + s.numel].add_(grad.reshape(-1))
        self.received[g.gid].add(index)
        if self.received[g.gid] >= self._need[g.gid]:
            if self.final_micro and self.keep is not None and g.gid not in self.taken \
                    and self.keep(g):
                self.held[g.gid] = self.staging.pop(g.gid)     # (owned: Note [held interrupts])
                self.received.pop(g.gid, None)
                self.taken.add(g.gid)
                self.normed.add(g.gid)          # the overlapped step counts its norm
                return
            self._flush(g.gid)

    # ------------------------------------------------------------------ streamed
    def flush_held(self, gid: int) -> None:
        """A kept group is not stepped early after all: write it to its extent as if it had
        never been kept (norm counted here)."""
        buf = self.held.pop(gid, None)
        if buf is None:
            return
        self.taken.discard(gid)
        self.normed.discard(gid)
        self.staging[gid] = buf
        self._flush(gid)

    def will_write(self, gid: int) -> None:
        """(main thread) The kept buffer of ``gid`` is going to be written to its extent by
        :meth:`write_held` (clipping: a redo reads it there)."""
        self.on_nvme.add(gid)

    def write_held(self, gid: int, buf: torch.Tensor) -> None:
        """Write ``gid``'s kept final sum to its extent (any thread: no pool access)."""
        self._io("write", gid, buf)

    def release(self, gid: int) -> None:
        """(main thread) ``gid``'s early step ended: its kept buffer goes back."""
        buf = self.held.pop(gid, None)
        if buf is not None:
            self.pool.give_back(buf)

    def grad_of(self, gid: int):
        """What the optimizer reads as ``gid``'s gradient: the kept buffer, else the extent."""
        buf = self.held.get(gid)
        return buf if buf is not None else self.extent[gid]

    def _read_partial(self, g: GroupRecord, buf: torch.Tensor) -> None:
        """The bf16 partial sum of ``g`` into the fp32 ``buf``."""
        with self.pool.scoped(g.padded_numel * 2, torch.bfloat16) as tmp:
            self._io("read", g.gid, tmp, self.partial[g.gid])
            buf.copy_(tmp)
        self.in_partial.discard(g.gid)

    def _flush(self, gid: int) -> None:
        buf = self.staging.pop(gid)
        self.received.pop(gid, None)
        try:
            if not self.final_micro and self.partial_dtype == torch.bfloat16:
                self._write_partial(gid, buf)      # lossy: a partial sum, in bf16
                return
            if self.final_micro:
                self.sumsq += squared_norm(buf)
                self.normed.add(gid)
            self._io("write", gid, buf)
            self.on_nvme.add(gid)
        finally:
            self.pool.give_back(buf)

    def _write_partial(self, gid: int, buf: torch.Tensor) -> None:
        ext = self.partial.get(gid)
        if ext is None:
            ext = self.partial[gid] = self.swap.allocate(buf.numel() * 2)
        with self.pool.scoped(buf.numel() * 2, torch.bfloat16) as tmp:
            tmp.copy_(buf)
            self._io("write", gid, tmp, ext)
        self.in_partial.add(gid)
        self.on_nvme.discard(gid)

    def end_backward(self) -> None:
        for gid in list(self.staging):
            self._flush(gid)

    def finish_window(self) -> float:
        """Before the optimizer step: zero extents that got no gradient in this window,
        add the norms of groups not seen on the last micro-step; returns the squared norm."""
        self.end_backward()
        for gid, g in self.groups.items():
            if gid in self.taken:               # stepped early (or in hand): nothing to do
                continue
            if gid in self.in_partial:          # no gradient on the last micro-step: fp32 now
                buf = self.pool.lease(g.padded_numel * 4, torch.float32)
                try:
                    self._read_partial(g, buf)
                    self.sumsq += squared_norm(buf)
                    self._io("write", gid, buf)
                finally:
                    self.pool.give_back(buf)
                self.on_nvme.add(gid)
                self.normed.add(gid)
            elif gid not in self.on_nvme:
                buf = self.pool.lease(g.padded_numel * 4, torch.float32)
                buf.zero_()
                self._io("write", gid, buf)
                self.pool.give_back(buf)
                self.on_nvme.add(gid)
            elif gid not in self.normed:
                buf = self.pool.lease(g.padded_numel * 4, torch.float32)
                self._io("read", gid, buf)
                self.sumsq += squared_norm(buf)
                self.pool.give_back(buf)
        return self.sumsq

    def reset(self) -> None:
        """After the step (or a skipped step, or a dropped window): the next window starts
        from zero; buffers still out (a window dropped mid-backward) go back."""
        bufs = list(self.held.values()) + list(self.staging.values())
        self.held, self.staging, self.received = {}, {}, {}   # forgotten before given back
        for buf in bufs:
            self.pool.give_back(buf)
        self.taken.clear()
        self.on_nvme.clear()
        self.in_partial.clear()
        self.normed.clear()
        self.sumsq = 0.0
