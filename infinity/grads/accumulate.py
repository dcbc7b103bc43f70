"""Gradient accumulation: each parameter's gradient, once it left the device, is copied
(first micro-step of a window) or added in fp32 into its group's host buffer — leased up
front, or lazily while the parameter cache lends the host pool out — or goes through
:class:`~infinity.grads.d2h.GradD2H` (separate device memory: one D2H per group, the adds
on its worker thread) or to the NVMe gradient
home (:class:`~infinity.grads.nvme_store.NvmeGradStore`); at the boundary the global norm
is taken over whatever holds them.

:class:`GradAccumulation` is the gradient half of the step driver: a collaborator the
driver (:class:`infinity.optim.driver.EngineOptimizer`) owns as ``opt.grads`` and the
engine feeds (``opt.grads.accumulate`` from the gradient hooks).  Across ranks the
partitioned optimizer of :mod:`infinity.zero` owns its subclass
(:class:`infinity.zero.partitioned_grads.PartitionedGrads`), which reduces as it
accumulates.
"""
from __future__ import annotations

import math

import torch

from infinity.grads.norm import squared_norm
from infinity.memory.record import GroupRecord, ParamSlot

__all__ = ["GradAccumulation"]


class GradAccumulation:
    """The fp32 gradients of the trainable ``groups`` over an accumulation window."""

    def __init__(self, groups: list[GroupRecord], *, host_pool, swap, acct, timeline=None,
                 lazy_grads: bool = False):
        self.groups = groups
        self.host_pool = host_pool
        self.swap = swap
        self.acct = acct
        self.timeline = timeline
        self._written: set[int] = set()     # id(slot) with a gradient since the last step
        self.nvme_grads = None              # NvmeGradStore when grads are homed on NVMe
        self.grad_d2h = None                # GradD2H when the device tier is not host memory
        self._slot_index = {id(s): i for g in self.groups for i, s in enumerate(g.slots)}
        # lazy_grads (the engine's choice with the parameter cache): a group's fp32 gradient
        # buffer is leased at its first gradient of a window and given back once stepped,
        # so the host pool lends the memory to cached parameter copies in between
        self.lazy_grads = bool(lazy_grads)

    def alloc_grads(self, home: str = "host", *, host_gids=frozenset(),
                    partial_dtype: torch.dtype = torch.float32) -> None:
        """Lease the fp32 gradient accumulation buffers (after the params were placed, so
        the model's original tensors are already gone); ``home="nvme"``: one extent per
        group instead, assembled in leased staging buffers — except the groups in
        ``host_gids``, whose fp32 buffers fit in the host cap (lossless, no NVMe round
        trip); ``partial_dtype``: the NVMe partial sums' dtype (bf16: lossy, opt-in)."""
        groups = self.groups
        if home == "nvme":
            from infinity.grads.nvme_store import NvmeGradStore
            self.nvme_grads = NvmeGradStore([g for g in groups if g.gid not in host_gids],
                                            self.swap, self.host_pool, self.acct,
                                            self.timeline, partial_dtype=partial_dtype)
            groups = [g for g in groups if g.gid in host_gids]
        elif self.lazy_grads:
            return
        for g in groups:
            g.grad_buf = self.host_pool.lease(g.padded_numel * 4, torch.float32)
            g.grad_buf.zero_()

    def _grad_buf(self, g: GroupRecord) -> torch.Tensor:
        """``g``'s gradient buffer, leased now if it has none (lazy_grads): what no slot
        writes (alignment gaps, the tail) is zeroed; slots are written (first gradient:
        copied) or zeroed at the boundary."""
        buf = g.grad_buf
        if buf is not None:
            return buf
        buf = self.host_pool.lease(g.padded_numel * 4, torch.float32)
        pos = 0
        for s in g.slots:
            if s.offset > pos:
                buf[pos:s.offset].zero_()
            pos = s.offset + s.numel
        if pos < g.padded_numel:
            buf[pos:].zero_()
        g.grad_buf = buf
        return buf

    @property
    def grad_stream(self):
        """The NVMe gradient home whose final sums the overlapped step may keep in memory
        (Note [Streamed gradients] in infinity/engine/overlap.py), or None."""
        return self.nvme_grads

    def release_grad(self, g: GroupRecord, *, host: bool = True) -> None:
        """``g`` was stepped: a kept NVMe-homed gradient (Note [Streamed gradients]) and,
        with lazy_grads and ``host``, its host gradient buffer go back to the pool."""
        if self.nvme_grads is not None:
            self.nvme_grads.release(g.gid)
        if host and self.lazy_grads and g.grad_buf is not None:
            buf, g.grad_buf = g.grad_buf, None
            for s in g.slots:
                self._written.discard(id(s))
            self.host_pool.give_back(buf)

    def attach_device(self, device_tier, max_inflight_bytes: int | None = None) -> None:
        """Gradients computed in separate device memory leave it by D2H copies on the
        device tier's copy stream and are accumulated on the host once each copy is done
        (at most ``max_inflight_bytes`` of pinned staging outstanding)."""
        if not device_tier.zero_copy:
            from infinity.grads.d2h import GradD2H
            # the fp32 adds run on GradD2H's worker unless the sink leases from pools
            # (NVMe gradient home, lazily leased buffers): pools are not thread-safe
            threaded = self.nvme_grads is None and not self.lazy_grads
            self.grad_d2h = GradD2H(device_tier, self.host_pool, self._accumulate_host,
                                    max_inflight_bytes, threaded=threaded)

    def staging_sizes(self) -> list[int]:
        """Pinned host staging the gradients leaving a separate device lease (reserved at
        ``initialize``); nothing on a zero-copy tier."""
        return self.grad_d2h.staging_sizes(self.groups) if self.grad_d2h is not None else []

    def accumulate(self, g: GroupRecord, slot: ParamSlot, grad: torch.Tensor) -> None:
        if self.grad_d2h is not None:
            self.grad_d2h.push(g, slot, grad)
            return
        self._accumulate_host(g, slot, grad)

    def _accumulate_host(self, g: GroupRecord, slot: ParamSlot, grad: torch.Tensor) -> None:
        """First gradient of a slot since the last step: copy (no zeroing pass needed);
        later micro-steps: add, in fp32."""
        if self.on_nvme(g):
            self.nvme_grads.accumulate(g, self._slot_index[id(slot)], grad)
            return
        dst = self._grad_buf(g)[slot.offset:slot.offset + slot.numel]
        if id(slot) in self._written:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            self._written.add(id(slot))

    def accumulates_rows(self, g: GroupRecord) -> bool:
        """Whether :meth:`accumulate_rows` can take ``g``'s gradient piece by piece (a host
        buffer on a zero-copy tier; the D2H route and the NVMe gradient home take whole
        slots)."""
        return self.grad_d2h is None and not self.on_nvme(g)

    def accumulate_rows(self, g: GroupRecord, slot: ParamSlot, start: int,
                        part: torch.Tensor | None, last: bool, numel: int | None = None) -> None:
        """Part of a slot's gradient (memory-centric tiling, :mod:`infinity.runtime.tiling`):
        elements ``start .. start + part.numel()`` of the flattened slot (``part`` None:
        ``numel`` zeros, e.g. embedding rows no index touched).  Within one use the parts of
        a slot cover it once; ``last`` marks its final part, after which the slot counts as
        written (later uses of the window add, as :meth:`_accumulate_host`)."""
        if not self.accumulates_rows(g):
            raise RuntimeError(f"gradients of group {g.gid} ({g.name}) cannot be accumulated by "
                               "rows (D2H route or NVMe gradient home): use accumulate()")
        n = part.numel() if part is not None else int(numel)
        lo = slot.offset + start
        written = id(slot) in self._written
        if part is None and written:
            return                        # adding zeros
        dst = self._grad_buf(g)[lo:lo + n]
        if part is None:
            dst.zero_()
        elif written:
            dst.add_(part.reshape(-1))
        else:
            dst.copy_(part.reshape(-1))
        if last and not written:
            self._written.add(id(slot))

    def grad_in_hand(self, g: GroupRecord) -> torch.Tensor | None:
        """``g``'s final gradient in host memory: its host buffer, or the kept buffer of an
        NVMe-homed group (Note [Streamed gradients]); None when it is on NVMe."""
        if self.on_nvme(g):
            return self.nvme_grads.held.get(g.gid)
        return g.grad_buf

    def host_grad_buffer(self, g: GroupRecord) -> torch.Tensor | None:
        """``g``'s host gradient buffer, the one :meth:`grad_norm` reads; None when its
        gradient is homed on NVMe (or none was accumulated yet)."""
        return None if self.on_nvme(g) else g.grad_buf

    def grad_source(self, g: GroupRecord):
        """What the optimizer step reads as ``g``'s gradient: a host buffer or an extent."""
        return self.nvme_grads.grad_of(g.gid) if self.on_nvme(g) else g.grad_buf

    def on_nvme(self, g: GroupRecord) -> bool:
        """Whether ``g``'s gradient is homed on NVMe."""
        return self.nvme_grads is not None and g.gid in self.nvme_grads.extent

    def before_backward(self, final_micro: bool) -> None:
        if self.nvme_grads is not None:
            self.nvme_grads.begin_backward(final_micro)

    def end_backward(self) -> None:
        if self.grad_d2h is not None:
            self.grad_d2h.drain()
        if self.nvme_grads is not None:
            self.nvme_grads.end_backward()

    def zero_grad(self) -> None:
        """The window's gradients are done with (stepped or dropped): the next window's
        first gradient of each slot is copied, not added."""
        if self.grad_d2h is not None:
            self.grad_d2h.drain()     # nothing of this window may land after the reset
        self._written.clear()
        if self.nvme_grads is not None:
            self.nvme_grads.reset()

    def abandon(self) -> None:
        """The window is dropped (Note [window abort]): what is still on its way is
        discarded (one process: nothing is; the driver then releases and resets)."""

    def close(self) -> None:
        if self.grad_d2h is not None:
            self.grad_d2h.close()

    def zero_unwritten(self, skip=()) -> None:
        """Slots that got no gradient in this window hold stale values: zero them
        (``skip``: groups already stepped during backward)."""
        for g in self.groups:
            if g.gid in skip or self.on_nvme(g):
                continue
            for s in g.slots:
                if s.trainable and id(s) not in self._written:
                    self._grad_buf(g)[s.offset:s.offset + s.numel].zero_()

    def grad_norm(self, skip: dict[int, float] | None = None,
                  known: dict[int, float] | None = None) -> float:
        """``skip``: ``{gid: squared norm}`` already computed (groups stepped early);
        ``known``: squared norms of host gradient buffers computed while backward ran
        (Note [Norms during backward] in infinity/engine/overlap.py)."""
        skip = skip or {}
        known = known or {}
        total = sum(skip.values())
        if self.nvme_grads is not None:
            total += self.nvme_grads.finish_window()
        for g in self.groups:
            if g.gid in skip or self.on_nvme(g):
                continue
            if g.gid in known:
                total += known[g.gid]
                continue
            total += squared_norm(g.grad_buf)
        return math.sqrt(total)
