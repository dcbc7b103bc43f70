"""Overlap the optimizer step with backward (final micro-step of a window; world size 1
and ZeRO stage 3 across ranks, Note [Overlap across ranks]).

As soon as a trainable parameter group's gradient is final during the backward of the
last micro-step of an accumulation window, its Adam update (``store.step([item])``, the
same hyperparameters and step count the boundary step uses) is handed to ONE background
worker thread while backward continues.  ``engine.step()`` then waits for those updates,
steps the remaining groups and does the bookkeeping once
(:meth:`infinity.optim.driver.EngineOptimizer.boundary_step` with ``done=``).

Only when it cannot change results (:func:`eligible`): no ZeRO partitioning or stage 3,
fp32 or bf16 (fp16's loss scaler needs the global overflow check), on any device tier (on
a separate one a gradient is final when its D2H copy landed in the host accumulation,
``GradD2H.landed``; across ranks when its reduced shard landed).  Gradients homed on NVMe
(one process) or spilled gradient shards (ZeRO stage 3) are stepped from memory as they arrive
(Note [Streamed gradients]); with clipping the early steps are speculative (Note
[Speculative clipping]).  A group is stepped early only when nothing can read
its parameters again in this backward (:meth:`OverlappedStep.grad_arrived`): paged home
(cpu / NVMe), used by exactly one module call in this forward (no tied weights, reused
modules or external registrations), not recomputed (activation checkpointing), every
trainable slot got its gradient in this backward, no saved view of it is still alive, it
is not in use, prefetched or being read, and the prefetch trace does not need it again.
Every other group waits for the boundary as before.  When nothing is stepped early
(the last update was clipped, speculation is off or stopped) the squared gradient norm
of each group is still computed as soon as its gradient is final (Note [Norms during
backward]), so the boundary step starts from the clip decision.

Master hand-off (fp32, NVMe-homed params): the fp32 parameter buffer IS the master, and
backward just read it from NVMe.  When such a group is released during the boundary
backward while its early step is still to come, the manager hands the buffer over
(:meth:`on_release`, the manager's listener) instead of taking it back; the worker's Adam then
updates it in place and writes the master tiles from it (``StepItem.master_buf``), so the
master is not read from NVMe a second time (one parameter-size read less per step).  At
most :data:`MAX_HANDOFF` buffers are held at once (held + being stepped); beyond that, or
with a device budget that could not spare them, groups are released as before and their
step reads the master.  Buffers go back to the device pool on the main thread as soon as
their step finished (polled at every release and gradient).
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from infinity.grads.norm import squared_norm
from infinity.memory.plan import STREAM_GRAD_WINDOW
from infinity.memory.record import GroupRecord, Location

log = logging.getLogger("infinity.engine")

# Note [Overlap safety]
# ~~~~~~~~~~~~~~~~~~~~~
# A group's early Adam step updates its home (and a cached copy) in place on a worker
# thread while backward goes on.  That is exact only if nothing reads those values until
# the step ended: (1) the configuration cannot make the update depend on other groups
# (eligible(): no ZeRO but stage 3, no fp16 loss scale; clipping is speculative, Note
# [Speculative clipping]; a gradient counts once it is in host memory); (2) the group is released and nothing can fetch it again in this
# backward (_safe(): not in use, prefetched, being read or holding saved views, and the
# prefetch trace does not use it again, PrefetchCoordinator.may_use_again); (3) anything
# that reads homes outside backward waits for the worker first: engine.step() through
# OverlappedStep.finish; forward, backward, weights out and checkpoints before step()
# through Engine._drop_open_window (the window is dropped, OverlappedStep.abandon waits);
# a fetch of a group whose step still runs calls the wait MemoryManager.mark_home_busy
# registered (the trace was wrong about it).
#
# Note [Streamed gradients]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# When the host cap cannot hold the fp32 gradients (NvmeGradStore), the group whose final
# sum is complete on the last micro-step is kept in its staging buffer (keep_grad) instead
# of being written to NVMe, stepped early from it, and the buffer goes back when the step
# ended (_reap): the gradient never makes the NVMe round trip (4 + 4 B/param per step less)
# and the group's master/m/v stream through CPU Adam while backward goes on.  Memory stays
# bounded: at most grad_window kept buffers at once (PlacementPlan.stream_window: up to
# GRAD_WINDOW, what the host cap leaves room for; 0: no streaming).  Beyond that backward
# waits for the oldest group step (the step is disk-bound: waiting is the disk's speed,
# spilling would add I/O); when every kept buffer still waits for its group's release the
# gradient is written to NVMe as before.  A kept group not stepped early (unsafe, clip
# reached, no undo room) is flushed to NVMe (NvmeGradStore.flush_held) and stepped at the
# boundary.  On a separate device tier the final sum is complete once the group's D2H has
# landed (GradD2H.landed; OverlappedStep.land lets the copies still in flight when
# autograd ends land while the overlap is open).  Across ranks (ZeRO stage 3, the fp32
# shards spilled to NVMe: infinity/zero/shard_stream.py) the same holds for the averaged
# shard when its reduce-scatter landed on the last micro-step: kept in the buffer it landed
# in, stepped early, never written nor read back (with clipping and bf16 moments it is
# written after its step: their redo rolls the whole window back and re-reads every shard;
# with fp32 moments each rank redoes its own shards from the moments, Note [Redo from
# moments]).
#
# Note [Speculative clipping]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The clip coefficient needs the global norm, known when backward ended.  Early steps use
# coefficient 1 into the window's transaction (Note [commit point]); when the norm turns
# out above the clip, EngineOptimizer.boundary_step redoes every early-stepped group
# clipped.  With fp32 moments nothing is kept for that: each group's gradient is
# recovered from its committed and speculative first moments, its writes rolled back and
# it is stepped again (Note [Redo from moments] in infinity/optim/moment_redo.py), so
# gradient buffers go back as soon as their group was stepped, as without clipping.  With
# bf16 moments the gradients of early-stepped groups are kept (host buffers until the
# boundary, NVMe-homed ones written to their extent by the worker after the step), and
# the whole transaction is rolled back and every group stepped with the clipped
# gradients.  Two rules limit wasted work: no speculation in a window when the
# previous update's norm was above the clip (norms are correlated from step to step), and
# speculation stops as soon as the running norm of the groups stepped so far exceeds it
# (the norm only grows).  Results equal the unclipped-then-clipped boundary step: exactly when
# the gradients were kept, within fp32 rounding when they were recovered from the moments.
#
# Note [Overlap across ranks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At ZeRO stage 3 a rank steps only its shard of a group, and the shard's gradient is
# final when the group's reduce-scatter has landed and been added into the shard's fp32
# accumulation (PartitionedGrads._landed, polled without blocking at every gradient
# and release, PartitionedGrads.poll_reductions): grad_final(g) then submits the group
# like grad_arrived does at world size 1, under the same safety rules (its home shard is
# not gathered again in this backward; a fetch that does waits, mark_home_busy).  Each
# rank decides alone which groups it steps early: nothing of the early steps is seen by
# another rank before the boundary.  The boundary is where ranks agree: the global norm
# is summed over every shard (kept until then), so the clip decision and a redo (Note
# [Speculative clipping]; a rank's running norm of its own shards only underestimates
# the global one, so stopping on it is safe) are the same everywhere, and the commit
# vote (PartitionedOptimizer.vote) lets no rank commit its window's transaction unless
# every rank finished its part — a rank whose early step failed never votes, the others'
# collectives fail (naming it, Comm.report_failure) and every rank rolls back.
# Stages 1-2 keep a full replica of every parameter that stays in use through backward:
# nothing is paged, so nothing is stepped early (_safe), as before.
#
# Note [Master hand-off]
# ~~~~~~~~~~~~~~~~~~~~~~
# In fp32 an NVMe-homed group's parameter buffer IS its master, and backward just read
# it.  MemoryManager.release offers the buffer (on_release) instead of giving it back;
# the early step passes it as StepItem.master_buf, so the tile pipeline updates it in
# place and writes the master tiles from it instead of reading them again.  A group with
# a cached copy needs none: the copy is its master (Note [Cache write-through] in
# infinity/memory/manager.py).  At most MAX_HANDOFF buffers are held at once.  Across
# ranks (ZeRO stage 3, zero-copy tier) the released buffer holds the gathered group and
# this rank's slice [lo, hi) of it is its shard's master, just read from NVMe: the same.

#
# Note [Norms during backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The boundary step starts with the global gradient norm (the clip coefficient, the
# non-finite check): one read of every fp32 gradient, which on a GPU node (3B parameters,
# 12 GB, an H200 host) took longer than the rest of backward's tail -- the CPU idle all
# backward while the GPU computes.  When no group is stepped early in a window (the last
# update was clipped, commit_shadow_gb 0, or speculation stopped part-way) the same
# rule that makes a group steppable makes its gradient final: used by one module call in
# this forward and every trainable slot arrived in this backward (on a separate device:
# its D2H landed).  Its squared norm is then computed on the worker thread from its host
# buffer while backward goes on (norms_on, _submit_norm), and boundary_step takes those
# values instead of reading the buffers again (GradAccumulation.grad_norm(known=)): the
# same function over the same unchanged values, so the same norm.  Not across ranks
# (the partitioned norm is a collective over shards) nor for gradients homed on NVMe
# (their norms are taken as they stream, NvmeGradStore.finish_window).

__all__ = ["OverlappedStep", "eligible", "MAX_HANDOFF", "GRAD_WINDOW"]

MAX_HANDOFF = 3      # released parameter buffers held for their group's step at once
# kept NVMe-homed gradients (Note [Streamed gradients]) at most at once; the plan reserves
# what the cap can hold (PlacementPlan.stream_window)
GRAD_WINDOW = STREAM_GRAD_WINDOW


def _wait_quietly(fut: Future) -> None:
    """Wait for a group step before its home is read (its error surfaces at step())."""
    # (not concurrent.futures.wait or Future.result: a KeyboardInterrupt raised inside
    # them, on the main thread, can leave a lock held or half-released; see wait_done)
    from infinity.engine.phase import wait_done
    wait_done(fut)


def eligible(engine) -> bool:
    """Whether the engine's configuration allows overlapping the step at all (Note
    [Overlap safety])."""
    cfg = engine.cfg
    zero = engine.zero
    if zero is not None:                   # Note [Overlap across ranks]
        return zero.stage == 3 and cfg.precision in ("fp32", "bf16")
    # (a separate device tier: a group's gradient is final when its D2H landed in the host
    # accumulation, GradD2H.landed)
    return cfg.precision in ("fp32", "bf16")


class OverlappedStep:
    _undo_planned = 0
    _throttle_logged = False
    speculate = True      # False: offload.commit_shadow_gb 0, nothing is stepped early

    def __init__(self, opt, mm, coord, accounting, *, undo_budget: int | None = None,
                 grad_window: int = GRAD_WINDOW, sharded: bool = False):
        self.opt = opt
        self.grads = opt.grads           # the gradients the steps read (opt.grads)
        self.mm = mm
        self.coord = coord
        self.acct = accounting
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self.active = False               # inside the backward of a boundary micro-step
        self._pending: dict[int, set[int]] = {}
        self._single_use: set[int] = set()
        self.done: dict[int, float] = {}  # gid -> squared grad norm, stepped early
        # Note [Norms during backward]: gid -> squared norm (a Future while it runs)
        self.norms: dict[int, Future | float] = {}
        self.norms_on = False
        self._norm_pending: dict[int, set[int]] = {}
        # ZeRO stage 3 (Note [Overlap across ranks]): a group's gradient is final when its
        # reduced shard landed (grad_final), not per slot (grad_arrived)
        self.sharded = sharded
        if sharded:
            opt.grads.on_shard_final = self.grad_final
        # master hand-off (fp32 NVMe params): gid -> released buffer awaiting its step;
        # across ranks this rank's slice of the gathered buffer is its shard's master
        # (on a zero-copy tier: the CPU optimizer cannot update device memory)
        self.handoff = opt.precision == "fp32" and bool(mm.dev.zero_copy)
        self._held: dict[int, torch.Tensor] = {}
        # (future, group, handed-off buffer or None) of every submitted group step
        self._stepping: list[tuple[Future, GroupRecord, torch.Tensor | None]] = []
        # the window's transaction (Note [commit point]): early steps write shadows and
        # undo copies; the engine commits or rolls back at the boundary
        self.txn = None
        self.undo_budget = undo_budget   # host bytes of undo copies allowed (None: any)
        # Note [Speculative clipping]: early steps are speculative; their gradients are kept
        # for a redo unless it recovers them from the moments (Note [Redo from moments])
        self.clip = float(opt.clip)
        self.keep_grads = self.clip > 0 and not opt.redo_from_moments
        # skip speculation after a clipped update (False: always speculate; tests, A/B runs)
        self.predict = True
        self.grad_window = grad_window     # kept NVMe-homed gradients at once
        if opt.grads.grad_stream is not None and grad_window > 0:   # Note [Streamed gradients]
            opt.grads.grad_stream.keep = self.keep_grad
        mm.attach_listener(self)          # on_release, reclaim_blocked
        # one process on a separate device tier: gradients reach the host accumulation by
        # D2H copies; a slot is final when its copy landed (GradD2H.landed), not when
        # autograd produced it
        self._d2h = None if sharded else opt.grads.grad_d2h
        if self._d2h is not None:
            self._slot_index = {id(s): i for g in opt.groups for i, s in enumerate(g.slots)}
            self._d2h.landed = self._landed

    # ------------------------------------------------------------------ backward
    def begin(self, txn) -> None:
        """The boundary micro-step's backward starts: the groups used by exactly one
        module call in this forward may be stepped as soon as their gradient is final,
        into ``txn`` (committed or rolled back by the engine, Note [commit point])."""
        self.txn = txn
        self.active = False
        if not self.coord.in_pass:
            return
        uses = Counter(self.coord.recorded_uses())   # this forward's uses per group
        self._single_use = {gid for gid, n in uses.items() if n == 1}
        pending = {g.gid: {i for i, s in enumerate(g.slots) if s.trainable}
                   for g in self.opt.groups if g.gid in self._single_use}
        if txn is not None and not self.speculate:
            self._norms_from(pending)
            return
        if self.clip > 0 and (txn is None or (self.predict and self.opt.boundaries and not
                                               self.opt.last_grad_norm + 1e-6 <= self.clip)):
            # Note [Speculative clipping]: the last update was clipped (or nothing could
            # roll a speculative step back): no speculation in this window
            self.acct.count("optimizer_speculation_skipped")
            self._norms_from(pending)
            return
        self._pending = pending
        self._undo_planned = 0
        self.active = True

    def _landed(self, g: GroupRecord, slots) -> None:
        """Separate device: ``slots`` of ``g`` reached the host accumulation (GradD2H)."""
        for s in slots:
            self.grad_arrived(g, self._slot_index[id(s)])

    def land(self) -> None:
        """Backward completed: on a separate device the gradients still on their way land
        now, while early steps may still start (their groups stream too)."""
        if (self.active or self.norms_on) and self._d2h is not None:
            self._d2h.drain()

    def end(self) -> None:
        """Backward ended: groups not submitted are stepped at the boundary (reading their
        master), so their held buffers go back now."""
        self.active = False
        self._pending = {}
        self.norms_on = False
        self._norm_pending = {}
        held, self._held = self._held, {}     # forgotten before returned: Note [held interrupts]
        for buf in held.values():
            self.mm.give_back_device(buf)
        nv = self.grads.grad_stream
        if nv is not None:                     # kept but not stepped: to NVMe as before
            for gid in [gid for gid in nv.held if gid not in self.done]:
                nv.flush_held(gid)
        self._reap()

    def reclaim_blocked(self) -> None:
        """The host pool needs memory only cached copies a running step updates hold: wait
        for those steps (the manager's listener protocol)."""
        self.wait()

    def on_release(self, g: GroupRecord, buf: torch.Tensor | None) -> bool:
        """The manager released NVMe-homed ``g`` (``buf`` None: it stayed cached); take
        the buffer over when it can serve as the master of ``g``'s early step (Note
        [Master hand-off]).  Also submits ``g`` if its gradient was already final."""
        if not self.active:
            if self.norms_on and self._d2h is not None:
                self._d2h.poll()            # landed meanwhile: their norms can start
            return False
        if self.sharded:
            self.grads.poll_reductions()      # shards that landed meanwhile (grad_final)
        elif self._d2h is not None:
            self._d2h.poll()                # D2H copies that landed meanwhile (_landed)
        self._reap()
        pend = self._pending.get(g.gid)
        if pend is None:
            return False
        pool = self.mm.device_pool
        take = buf is not None and self.handoff and g.gid not in self._held \
            and len(self._held) + self._handed_off() < MAX_HANDOFF \
            and (pool.budget is None or pool.can_lease(2 * g.nbytes))
        if take:
            self._held[g.gid] = buf
        if not pend and self._safe(g):      # the gradient was final before the release
            del self._pending[g.gid]
            self._submit(g)
        return take

    def _handed_off(self) -> int:
        return sum(1 for _, _, b in self._stepping if b is not None)

    def _reap(self) -> None:
        """After each finished group step (main thread: the pools are not shared): its
        handed-off buffer back to the device pool, its gradient buffer back to the host
        pool (lazy gradients), its cached copy unpinned."""
        if not self._stepping:
            return
        finished = [e for e in self._stepping if e[0].done()]
        if not finished:
            return
        # forgotten before their buffers are returned (never returned twice)
        gone = {id(e) for e in finished}
        self._stepping = [e for e in self._stepping if id(e) not in gone]
        for f, g, buf in finished:
            if buf is not None:
                self.mm.give_back_device(buf)
            self.mm.unpin(g.gid)
            if f.exception() is None:       # (speculative: the host gradient stays)
                self.grads.release_grad(g, host=not self.keep_grads)

    def grad_arrived(self, g: GroupRecord, slot_index: int) -> None:
        """Called after slot ``slot_index`` of ``g`` accumulated its gradient."""
        if not self.active:
            if self.norms_on:
                self._norm_arrived(g, slot_index)
            return
        pend = self._pending.get(g.gid)
        if pend is None:
            return
        pend.discard(slot_index)
        self._reap()
        if pend or not self._safe(g):
            return
        del self._pending[g.gid]
        self._submit(g)

    def grad_final(self, g: GroupRecord) -> None:
        """ZeRO stage 3: ``g``'s reduced gradient shard landed in its accumulation (Note
        [Overlap across ranks]); stepped now if released and not needed again, else when
        released (``on_release``)."""
        if not self.active:
            return
        pend = self._pending.get(g.gid)
        if pend is None:
            return
        pend.clear()
        self._reap()
        if not self._safe(g):
            return
        del self._pending[g.gid]
        self._submit(g)

    def keep_grad(self, g: GroupRecord) -> bool:
        """The NVMe gradient home asks whether to keep ``g``'s complete final sum in memory
        for its early step (Note [Streamed gradients]); waits for the oldest group step
        when ``grad_window`` buffers are kept."""
        if not self.active or g.gid not in self._pending:
            return False
        held = self.grads.grad_stream.held
        while len(held) >= self.grad_window:
            oldest = next((e for e in self._stepping if e[1].gid in held), None)
            if oldest is None:
                return False               # the kept ones wait for their release
            if not oldest[0].done():
                self.acct.count("optimizer_stream_waits")
                _wait_quietly(oldest[0])
            self._reap()
            if oldest[0].exception() is not None:
                return False               # (the error surfaces at step())
        return True

    def _not_early(self, g: GroupRecord, buf, counter: str) -> None:
        """``g`` is not stepped early after all (no room for its undo copies or shadows):
        its handed-off buffer goes back, ``counter`` counts it, a kept gradient goes to NVMe."""
        if buf is not None:
            self.mm.give_back_device(buf)
        self.acct.count(counter)
        self._decline(g)

    def _decline(self, g: GroupRecord) -> None:
        """``g`` is not stepped early after all: a kept gradient goes to NVMe now."""
        nv = self.grads.grad_stream
        if nv is not None and g.gid in nv.held and g.gid not in self.done:
            nv.flush_held(g.gid)

    def _safe(self, g: GroupRecord) -> bool:
        """Nothing reads ``g``'s home or values again in this backward (Note [Overlap
        safety])."""
        if not self.mm.paged(g) or g.users or g.saved_refs or g.hold_until_backward_end \
                or g.prefetched or self.mm.fetch_pending(g) \
                or g.state not in (Location.NVME, Location.HOST, Location.CACHED):
            return False                    # still resident or being read: not released
        # the order changed (be conservative), or the trace still needs it (prefetch would
        # read it)
        return not self.coord.may_use_again(g)

    def _submit(self, g: GroupRecord) -> None:
        grad = self.grads.grad_in_hand(g)
        if grad is None:                     # (its gradient went to NVMe: the boundary steps it)
            buf = self._held.pop(g.gid, None)
            if buf is not None:
                self.mm.give_back_device(buf)
            return
        n2 = squared_norm(grad)              # (the boundary's own function: one norm)
        if self.clip > 0 and math.sqrt(sum(self.done.values()) + n2) + 1e-6 > self.clip:
            # Note [Speculative clipping]: this update clips; stop speculating
            self.acct.count("optimizer_speculation_stopped")
            self._decline(g)
            rest = self._pending
            self.end()
            if not self.sharded and self.grads.host_grad_buffer(g) is grad:
                self.norms[g.gid] = n2      # Note [Norms during backward]: the rest's too
            self._norms_from(rest)
            return
        buf = self._held.pop(g.gid, None)
        if buf is not None and self.mm.cached(g):   # Note [Master hand-off]
            # released twice in this backward, cached the second time: the cached copy is
            # what the next forward uses, so it must be the one updated
            self.mm.give_back_device(buf)
            buf = None
        master = buf
        if buf is not None and self.sharded:  # this rank's shard of the gathered values
            lo, hi = self.opt.shard(g)
            master = buf[lo:hi]
        item, kw = self.opt.early_item(g, master_buf=master)   # a cached copy: its own
        store = self.opt.store
        undo = store.host_state_bytes(item.key, master_in_hand=item.master_buf is not None)
        if self.txn is not None and undo and self.undo_budget is not None \
                and self._undo_planned + undo > self.undo_budget:
            # no room for the undo copies within the host cap: stepped at the boundary
            return self._not_early(g, buf, "optimizer_groups_not_overlapped_undo")
        if self.txn is not None:        # (None: Engine.commit_point off, benchmarks only)
            if not store.prepare(self.txn, item.key):
                # Note [shadow budget]: the speculative shadows are used up; this group
                # waits for the decision (stepped at the boundary, or after it)
                if not self._throttle_logged:
                    self._throttle_logged = True
                    log.info("infinity: offload.commit_shadow_gb (%.2f GB) covers the shadows "
                             "of only part of the optimizer states: the other groups wait "
                             "for the commit decision instead of overlapping backward "
                             "(stats(): optimizer_groups_not_overlapped_shadow)",
                             (store.shadow_budget or 0) / 1e9)
                return self._not_early(g, buf, "optimizer_groups_not_overlapped_shadow")
            self._undo_planned += undo
            kw["txn"] = self.txn
        self.done[g.gid] = n2
        if item.master_buf is not None and buf is None:
            # a cached copy the step updates in place (Note [Cache write-through])
            self.mm.pin(g.gid)
        nv = self.grads.grad_stream
        if self.keep_grads and nv is not None and g.gid in nv.held:
            nv.will_write(g.gid)             # Note [Speculative clipping]: kept for a redo

            def run(item=item, kw=kw, gid=g.gid, grad=grad):
                self.opt.store.step([item], **kw)
                nv.write_held(gid, grad)
            fut = self._worker().submit(run)
        else:
            fut = self._worker().submit(self.opt.store.step, [item], **kw)
        self.mm.mark_home_busy(g.gid, lambda f=fut: _wait_quietly(f))   # Note [Overlap safety]
        self._futures.append(fut)
        self._stepping.append((fut, g, buf))
        self.acct.count("optimizer_groups_overlapped")
        if buf is not None:
            self.acct.count("optimizer_master_handoffs")
        self.opt.count_master_in_hand(item)

    def _worker(self) -> ThreadPoolExecutor:
        """The one thread early steps and norms run on (created on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinity-step")
        return self._pool

    # ------------------------------------------------------------------ norms
    def _norms_from(self, pending: dict[int, set[int]]) -> None:
        """Nothing more is stepped early in this window: compute each pending group's
        squared gradient norm once its gradient is final (Note [Norms during backward])."""
        if self.sharded or not pending:
            return
        self._norm_pending = {gid: set(p) for gid, p in pending.items()}
        self.norms_on = True
        by_gid = {g.gid: g for g in self.opt.groups}
        for gid in [gid for gid, p in pending.items() if not p]:   # final already
            del self._norm_pending[gid]
            self._submit_norm(by_gid[gid])

    def _norm_arrived(self, g: GroupRecord, slot_index: int) -> None:
        pend = self._norm_pending.get(g.gid)
        if pend is None:
            return
        pend.discard(slot_index)
        if not pend:
            del self._norm_pending[g.gid]
            self._submit_norm(g)

    def _submit_norm(self, g: GroupRecord) -> None:
        grad = self.grads.host_grad_buffer(g)
        if grad is None or g.gid in self.norms:   # (NVMe-homed: taken as it streams)
            return
        self.norms[g.gid] = self._worker().submit(squared_norm, grad)
        self.acct.count("optimizer_norms_during_backward")

    def take_norms(self) -> dict[int, float]:
        """``{gid: squared gradient norm}`` of the groups whose norm was computed while
        backward ran (Note [Norms during backward]), waited for and forgotten; a norm that
        failed is left out (the boundary computes it)."""
        norms, self.norms = self.norms, {}
        out = {}
        for gid, v in norms.items():
            if isinstance(v, Future):
                _wait_quietly(v)
                if v.exception() is not None:
                    continue
                v = v.result()
            out[gid] = v
        return out

    def _drop_norms(self) -> None:
        """The window is dropped: wait for the norms still running (they read gradient
        buffers about to be released) and forget them."""
        from concurrent.futures import wait
        futs = [v for v in self.norms.values() if isinstance(v, Future)]
        if futs:
            wait(futs)
        self.norms = {}

    # ------------------------------------------------------------------ boundary
    def finish(self) -> dict[int, float]:
        """Wait for every submitted group step; returns ``{gid: squared grad norm}`` of
        the groups already stepped and forgets them.  The first worker error is
        re-raised (after all submitted steps ended)."""
        self.end()
        try:
            self.wait()
        finally:
            done, self.done = self.done, {}
        return done

    def wait(self) -> None:
        """Block until no submitted group step runs, then re-raise the first worker error
        unchanged (with a note).  A ``KeyboardInterrupt`` that arrives while waiting is
        held until every step ended (their buffers are in use), then re-raised."""
        futures, self._futures = self._futures, []
        done = self.done
        err = interrupted = None
        from infinity.engine.phase import wait_done
        for f in futures:
            while True:
                try:
                    wait_done(f)
                except KeyboardInterrupt as e:
                    interrupted = e       # a signal in this thread: keep waiting
                    continue
                break
            e = f.exception()             # done: returns at once
            if e is not None:             # wait for the rest before raising
                err = err or e
        self.mm.clear_home_busy()
        self._reap()                    # every step ended: all buffers go back
        if err is not None:
            err.add_note(f"infinity: an optimizer group step overlapped with backward failed "
                         f"({len(done)} groups were submitted); the window is rolled back "
                         f"(Note [window abort])")
            raise err
        if interrupted is not None:
            raise interrupted

    def abandon(self) -> None:
        """The window failed (Note [window abort]): wait for every submitted step (their
        buffers are in use; errors are dropped with the window) and forget the window."""
        self.end()
        futures, self._futures = self._futures, []
        if futures:
            from concurrent.futures import wait
            wait(futures)
        if self._pool is not None:     # a barrier: a step submitted but not yet recorded
            self._pool.submit(int).result()   # (interrupted in between) has ended too
        self.mm.clear_home_busy()
        self._reap()
        for _, g, buf in self._stepping:     # (all done) nothing may stay held
            if buf is not None:
                self.mm.give_back_device(buf)
            self.mm.unpin(g.gid)
        self._stepping = []
        self.done = {}
        self._drop_norms()
        self.txn = None

    @property
    def busy(self) -> bool:
        return bool(self._futures)

    def close(self) -> None:
        try:
            for f in self._futures:
                try:
                    f.result()
                except BaseException as e:
                    log.error("engine.close: an overlapped optimizer step failed: %s", e)
        finally:
            self._futures = []
            self.end()
            self._drop_norms()
            self.mm.detach_listener(self)
            if self.sharded and self.grads.on_shard_final == self.grad_final:
                self.grads.on_shard_final = None
            if self._d2h is not None and self._d2h.landed == self._landed:
                self._d2h.landed = None
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
