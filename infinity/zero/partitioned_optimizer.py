"""The engine's optimizer side across data-parallel ranks (ZeRO stages 1, 2 and 3).

Every rank owns the shard ``[lo, hi)`` of each flat group (:mod:`infinity.zero.partition`)
and keeps the fp32 master, ``exp_avg`` and ``exp_avg_sq`` of that shard only (key
``"g<gid>"`` in the optimizer state store, ``hi - lo`` elements).

* stage 1: every rank accumulates the full fp32 gradient of each group over its
  micro-batches; at the accumulation boundary the gradients are summed across ranks
  (all-reduce, divided by the world size), each rank updates its shard, and the updated
  parameters are all-gathered back into every rank's full (replicated) parameter buffer.
* stage 2: the gradient is partitioned too.  During backward a group's gradients land in
  a transient full-size buffer; as soon as every trainable parameter of the group has its
  gradient, an *asynchronous* reduce-scatter leaves this rank only its averaged slice,
  accumulated in a persistent shard-sized buffer (the window's first reduction lands in it
  directly, later micro-steps' are added), while backward continues with
  the next groups.  At the end of backward the outstanding reductions are waited for
  (and groups that received no gradient on this rank are reduced too, with zeros, in
  group order, so every rank issues the same collectives).  After the step the updated
  parameters are all-gathered as in stage 1.
* stage 3: as stage 2, but the parameter home itself is partitioned
  (:class:`infinity.zero.partitioned_memory.PartitionedMemoryManager`): the shard the
  optimizer updates *is* this rank's home shard, so nothing is gathered after the step.
* gradient spill (``spill_grads``, stages 2 and 3): the averaged shard is written to an NVMe extent
  (asynchronously, as each group's reduction completes; read-added-written on later
  micro-steps) instead of a host buffer, and the optimizer reads it tile by tile.  Its
  squared norm is taken before the write, so clipping needs no extra pass.  On the last
  micro-step of a window a shard may instead be kept in memory and stepped as it lands
  (Note [Streamed gradients] in infinity/engine/overlap.py; :mod:`infinity.zero.shard_stream`):
  its final sum is never written to NVMe nor read back.

Averaging: each rank's loss is the mean over its own micro-batch; dividing the summed
gradients by the world size gives the gradient of the mean loss over the global batch.
The gradient norm used for clipping and fp16 overflow checks is the global one (the
squared shard norms are summed across ranks), so every rank takes the same decision.

This module is the step over the shards; the gradient side described above (accumulation,
reductions, spill) is its collaborator ``opt.grads``
(:class:`infinity.zero.partitioned_grads.PartitionedGrads`).
"""
from __future__ import annotations

import math

import torch

from infinity.optim.driver import EngineOptimizer
from infinity.memory.record import GroupRecord
from infinity.zero.comm import Comm
from infinity.zero.partition import clip_segments
from infinity.zero.partitioned_grads import PartitionedGrads

__all__ = ["PartitionedOptimizer"]


class PartitionedOptimizer(EngineOptimizer):
    """The step over this rank's shards; its gradients (``grads``) are a
    :class:`~infinity.zero.partitioned_grads.PartitionedGrads`."""

    # Note [Redo from moments] across ranks too (fp32 moments): each rank redoes its own
    # shards of the early-stepped groups, from the shard still in host memory or
    # recovered from its moments; a streamed (spilled) shard need not be written for it

    def _kept_for_redo(self, g: GroupRecord):
        """This rank's shard of ``g``'s averaged gradient in host memory (stages 2-3: the
        shard accumulation; spilled: the kept final sum, gone once stepped), or None."""
        if self.stage == 1:
            return None
        return self.grads.grad_in_hand(g)

    def __init__(self, model, cfg, groups: list[GroupRecord], names: dict[int, str], *,
                 comm: Comm, stage: int, store, swap, host_pool, accounting, timeline=None,
                 lr_scheduler=None, spill_grads: bool = False):
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {stage!r}")
        self.comm = comm
        self.stage = stage
        self._spill_grads = bool(spill_grads)     # (for _make_grads)
        # stages 1, 2 on separate device memory: groups the last step all-gathered on the
        # device (the engine does not refresh them from their mirrors)
        self.gathered_on_device: set[int] = set()
        super().__init__(model, cfg, groups, names, store=store, swap=swap,
                         host_pool=host_pool, accounting=accounting, timeline=timeline,
                         lr_scheduler=lr_scheduler)

    def _make_grads(self, lazy_grads: bool) -> PartitionedGrads:
        return PartitionedGrads(self.groups, self.cfg, comm=self.comm, stage=self.stage,
                                swap=self.swap, host_pool=self.host_pool, acct=self.acct,
                                timeline=self.timeline, spill_grads=self._spill_grads)

    # ------------------------------------------------------------------ shards
    def shard(self, g: GroupRecord) -> tuple[int, int]:
        return self.grads.shard(g)

    def _param_shard(self, g: GroupRecord):
        """The low-precision or fp32 parameter values this rank updates in place."""
        lo, hi = self.shard(g)
        if self.stage == 3:
            # a device home's shard: its host mirror (separate device memory) or the shard
            # itself (zero-copy tier); refreshed to the device after the step
            return g.extent if g.home == "nvme" else g.host_buf
        if g.home != "device":
            raise ValueError(f"zero_stage {self.stage}: parameters must stay on the device "
                             f"(offload.params 'none'); group {g.name!r} has home {g.home!r}. "
                             f"Use zero_stage 3 to offload parameters")
        # separate device memory: the host mirror (the device copy is refreshed from it)
        return (g.host_buf if g.host_buf is not None else g.device_buf)[lo:hi]

    # ------------------------------------------------------------------ registration
    def register(self, g: GroupRecord, init_fp32: torch.Tensor | None) -> None:
        key = self.key(g)
        lo, hi = self.shard(g)
        if self.precision == "fp32":
            self.store.add(key, hi - lo, external_master=self._param_shard(g))
        else:
            self.store.add(key, hi - lo, init=init_fp32[lo:hi] if init_fp32 is not None else None)

    # ------------------------------------------------------------------ the step
    LOCAL_VOTE = False

    #: a rank's vote: 1 when its part completed, plus _NONFINITE when its result is not
    #: finite; the sum says how many of each (world sizes below _NONFINITE)
    _NONFINITE = 65536.0

    def vote(self, ok: bool, finite: bool = True) -> tuple[bool, bool]:
        """Every rank completed its part of the update; every rank's result is finite."""
        s = self.comm.all_reduce_scalar((1.0 if ok else 0.0) + (0.0 if finite else self._NONFINITE),
                                        name="step commit vote")
        bad = math.floor(s / self._NONFINITE)
        return s - bad * self._NONFINITE >= self.comm.world_size - 0.5, bad == 0

    def boundary_step(self, done=None, **kw) -> bool:
        self.grads.reduce_window()
        self.gathered_on_device = set()
        self._in_boundary = True
        try:
            applied = super().boundary_step(done, **kw)
        finally:
            self._in_boundary = False
        if applied:
            self._publish()
        return applied

    def finish_unfinished(self) -> None:
        """Note [roll forward]: finishing the decided update ends as the step would have:
        stages 1-2 gather the updated parameters (the other ranks wait in that gather)."""
        pending = self.unfinished is not None
        super().finish_unfinished()
        if pending and not self._in_boundary:
            self._publish()

    _in_boundary = False

    def _publish(self) -> None:
        """Stages 1-2: every rank's updated shard to every rank."""
        if self.stage in (1, 2):
            for g in self.groups:
                lo, hi = self.shard(g)
                if self._separate_mirror(g):
                    self._gather_on_device(g, lo, hi)
                    continue
                # in place, into the buffer the optimizer updated (zero-copy tier: the
                # parameters themselves; a frozen group's mirror: unchanged values)
                buf = g.host_buf if g.host_buf is not None else g.device_buf
                self.comm.all_gather_into(buf, buf[lo:hi], group="default",
                                          name=f"updated parameters of group {g.gid}")

    def _separate_mirror(self, g: GroupRecord) -> bool:
        """A trainable group resident on separate device memory, updated on its host mirror."""
        return (self.dev is not None and not self.dev.zero_copy and g.trainable
                and g.home == "device" and g.host_buf is not None and g.device_buf is not None)

    def _gather_on_device(self, g: GroupRecord, lo: int, hi: int) -> None:
        """Stages 1, 2 on separate device memory (as DeepSpeed's offloaded ZeRO): only this
        rank's updated shard goes H2D, the all-gather runs on the device (NCCL on a GPU),
        and the rest of the host mirror is brought up to date by D2H copies on the copy
        stream that nothing waits for until a host reader or writer of the mirror does
        (``wait_host_reads`` drains them).  The engine skips these groups' full refresh."""
        dst, mirror = g.device_buf, g.host_buf
        x = self.dev.refresh(dst[lo:hi], mirror[lo:hi])   # after compute's last use of dst
        self.dev.retire(x, lambda x=x: self._link_done(x))
        self.comm.all_gather_into(dst, dst[lo:hi], group="default",
                                  name=f"updated parameters of group {g.gid}")
        for a, b in ((0, lo), (hi, g.padded_numel)):
            if b > a:
                y = self.dev.d2h(mirror[a:b], dst[a:b])
                self.dev.retire(y, lambda y=y: self._link_done(y))
        self.gathered_on_device.add(g.gid)

    def _link_done(self, x) -> None:
        if self.acct is not None:
            self.acct.link(x.link, x.nbytes, x.seconds())

    def _param_target(self, g: GroupRecord):
        """This rank's shard of ``g``'s low-precision parameters (the driver's targets,
        shard-relative)."""
        if self.precision == "fp32":
            return None, None
        if self.stage == 3 and g.home == "nvme":
            return super()._param_target(g)   # the sink writes shard-relative offsets to g.extent
        return self._param_shard(g), None

    def _item(self, g: GroupRecord, lrs: list[float], wds: list[float], overrides=None):
        from infinity.optim.offload_step import StepItem
        it = super()._item(g, lrs, wds, overrides)
        lo, hi = self.shard(g)
        segs = clip_segments(it.segments, lo, hi)
        grad = it.grad                  # (this rank's shard: PartitionedGrads.grad_source)
        param_out, sink = it.param_out, it.param_sink
        # fp32 NVMe-homed shard with a cached clean copy (Note [Shard cache] in
        # infinity/zero/partitioned_memory.py): the copy is the master in hand, updated in
        # place and written through
        master = g.host_buf if self.precision == "fp32" and self.stage == 3 \
            and g.home == "nvme" else None
        return StepItem(it.key, grad, segs, param_out=param_out, param_sink=sink,
                        master_buf=master)
