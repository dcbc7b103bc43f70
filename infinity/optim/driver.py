"""The step driver: the accumulation boundary, clipping, loss scaling, LR schedule and
the Adam step over the optimizer state store.  The fp32 gradient buffers it steps from
are its collaborator's, ``opt.grads`` (:class:`infinity.grads.accumulate.GradAccumulation`;
the partitioned optimizer's reduces across ranks), which the engine's gradient hooks feed.

One store partition per trainable parameter group (key ``"g<gid>"``).  In fp32 the
parameter home *is* the fp32 master (``external_master``); in bf16/fp16 the store holds
an fp32 master and writes the updated low-precision params back to the param home in
the same pass (``param_out`` for host/device homes, ``param_sink`` for NVMe homes).
Frozen parameters are in frozen groups (``infinity.runtime.groups``) that have no partition.

Per-parameter hyperparameters come from :mod:`infinity.optim.param_groups` (no-decay
rules, ``optimizer.param_groups``): each step item's segments carry the ``lr`` and
``weight_decay`` of the parameter's group and, when they differ from the top-level
``optimizer`` values, its ``(beta1, beta2, eps)``.
"""
from __future__ import annotations

import math
import time

import torch

from infinity.grads.accumulate import GradAccumulation
from infinity.memory.record import GroupRecord
from infinity.optim.loss_scaler import DynamicLossScaler, StaticLossScaler

__all__ = ["EngineOptimizer"]


class _ScheduleTarget(torch.optim.Optimizer):
    """A torch Optimizer whose only job is to carry per-group ``lr`` (and ``betas``, which
    momentum-cycling schedulers change) for torch LR schedulers
    (``initialize(..., lr_scheduler=factory)``); the real update is CPU Adam, which reads
    them back from here at every step."""

    def __init__(self, groups: list[dict]):
        super().__init__([{"params": g["params"], "lr": g["lr"], "betas": tuple(g["betas"]),
                           "eps": g["eps"], "weight_decay": g["weight_decay"]}
                          for g in groups],
                         {"lr": groups[0]["lr"] if groups else 0.0})

    @torch.no_grad()
    def step(self, closure=None):  # the engine applies the update itself
        return None


class _Unfinished:
    """A decided update not written yet (Note [roll forward]): the groups left, the
    hyperparameters it was decided with, and the engine's callbacks."""
    __slots__ = ("keys", "lrs", "wds", "overrides", "hp", "on_undo", "t0")

    def __init__(self, keys, lrs, wds, overrides, hp, on_undo, t0):
        self.keys, self.lrs, self.wds, self.overrides = set(keys), lrs, wds, overrides
        self.hp, self.on_undo, self.t0 = hp, on_undo, t0


class EngineOptimizer:
    def __init__(self, model, cfg, groups: list[GroupRecord], names: dict[int, str], *,
                 store, swap, host_pool, accounting, timeline=None, lr_scheduler=None,
                 lazy_grads: bool = False):
        from infinity.optim.param_groups import build_param_groups_for_model
        self.cfg = cfg
        self.store = store
        self.swap = swap
        self.acct = accounting
        self.timeline = timeline
        self.groups = [g for g in groups if g.trainable]
        self.adamw = cfg.optimizer.type == "adamw"
        self.beta1, self.beta2 = (float(b) for b in cfg.optimizer.betas)
        self.eps = float(cfg.optimizer.eps)
        self.base_lr = float(cfg.optimizer.lr)      # the top-level lr the schedule shapes
        self.clip = float(cfg.gradient_clipping)
        self.precision = cfg.precision
        self.scaler = DynamicLossScaler.from_config(cfg.fp16) if cfg.precision == "fp16" \
            else StaticLossScaler()
        # parameter groups (decay / no-decay, per optimizer.param_groups entry) -> per
        # parameter: group index -> (lr, weight decay, betas, eps)
        self.param_groups = build_param_groups_for_model(model, cfg.optimizer)
        self._pg_of: dict[int, int] = {}
        for i, pg in enumerate(self.param_groups):
            for p in pg["params"]:
                self._pg_of[id(p)] = i
        self.sched_target = _ScheduleTarget(self.param_groups)
        self.torch_sched = lr_scheduler(self.sched_target) if lr_scheduler is not None else None
        self._overrides: list = []    # per param group (beta1, beta2, eps) or None
        self._hp = None               # (lrs, wds) of the next applied step, once computed
        self.step_count = 0          # applied optimizer steps (bias correction)
        self.boundaries = 0          # accumulation boundaries reached (applied + skipped)
        self.last_grad_norm = 0.0
        self.last_step_seconds = 0.0
        self.nonfinite_steps = 0     # updates skipped for an inf/NaN gradient norm (fp32, bf16)
                                     # or an inf/NaN Adam result (every precision)
        self.last_nonfinite_groups: tuple = ()   # the groups of the last result skip
        self.host_pool = host_pool
        self.dev = None              # the device tier (attach_device)
        self.grads = self._make_grads(lazy_grads)

    def _make_grads(self, lazy_grads: bool) -> GradAccumulation:
        """The gradient accumulation this driver steps from (``opt.grads``)."""
        return GradAccumulation(self.groups, host_pool=self.host_pool, swap=self.swap,
                                acct=self.acct, timeline=self.timeline,
                                lazy_grads=lazy_grads)

    def attach_device(self, device_tier, max_inflight_bytes: int | None = None) -> None:
        """The device tier the parameters compute on; gradients computed in separate
        device memory leave it through ``grads`` (:meth:`GradAccumulation.attach_device`)."""
        self.dev = device_tier
        self.grads.attach_device(device_tier, max_inflight_bytes)

    # ------------------------------------------------------------------ registration
    def register(self, g: GroupRecord, init_fp32: torch.Tensor | None) -> None:
        """Create ``g``'s optimizer partition (after its param home exists)."""
        key = self.key(g)
        if self.precision == "fp32":
            master = {"device": self._device_home(g), "cpu": g.host_buf,
                      "nvme": g.extent}[g.home]
            self.store.add(key, g.padded_numel, external_master=master)
        else:
            self.store.add(key, g.padded_numel, init=init_fp32)

    @staticmethod
    def _device_home(g: GroupRecord) -> torch.Tensor:
        """What the CPU optimizer updates for a device-homed group: the resident buffer
        when the device tier is host memory, else its host mirror (the manager copies it
        to the device after the step)."""
        return g.host_buf if g.host_buf is not None else g.device_buf

    @staticmethod
    def key(g: GroupRecord) -> str:
        return f"g{g.gid}"

    # ------------------------------------------------------------------ window
    def abandon_window(self) -> None:
        """A step failed part-way (an overlapped group step raised): drop this window's
        gradients so a caller that goes on does not add the next window onto them."""
        self.grads.abandon()
        for g in self.groups:
            self.grads.release_grad(g)
        self.zero_grad()

    def zero_grad(self) -> None:
        self.grads.zero_grad()
        self._hp = None

    # ------------------------------------------------------------------ lr
    def lr_for_group(self, i: int) -> float:
        """Group ``i``'s lr for the next update.  The config schedule multiplies every
        group's lr by the factor it applies to the top-level ``optimizer.lr`` (what
        ``LambdaLR(opt, make_lambda(optimizer.lr, scheduler))`` does to each group's
        initial lr; ``min_lr`` scales in proportion)."""
        if self.torch_sched is not None:
            return float(self.sched_target.param_groups[i]["lr"])
        from infinity.optim.schedule import lr_at
        glr = float(self.param_groups[i]["lr"])
        if glr == self.base_lr:
            return float(lr_at(self.step_count, glr, self.cfg.scheduler))
        if self.base_lr > 0:
            return float(lr_at(self.step_count, self.base_lr, self.cfg.scheduler)) \
                * glr / self.base_lr
        return float(lr_at(self.step_count, glr, self.cfg.scheduler))  # min_lr is 0 here

    def _adam_overrides(self, i: int) -> tuple[float, float, float] | None:
        """Group ``i``'s ``(beta1, beta2, eps)`` when they differ from the top level."""
        src = self.sched_target.param_groups[i] if self.torch_sched is not None \
            else self.param_groups[i]
        hp = (float(src["betas"][0]), float(src["betas"][1]), float(src["eps"]))
        return None if hp == (self.beta1, self.beta2, self.eps) else hp

    @property
    def lr(self) -> float:
        return self.lr_for_group(0) if self.param_groups else 0.0

    # ------------------------------------------------------------------ the step
    def _next_hparams(self) -> tuple[list[float], list[float]]:
        """Per param group (lr, weight decay) of the next applied step (sets the Adam
        overrides); computed once per window, shared by overlapped group steps."""
        if self._hp is None:
            lrs = [self.lr_for_group(i) for i in range(len(self.param_groups))]
            wds = [float(pg["weight_decay"]) for pg in self.param_groups]
            self._overrides = [self._adam_overrides(i) for i in range(len(self.param_groups))]
            self._hp = (lrs, wds)
        return self._hp

    def early_item(self, g: GroupRecord, master_buf: torch.Tensor | None = None):
        """The step item and ``store.step`` keywords of ``g``'s update at the coming
        boundary (overlapped with backward: clip coefficient 1, speculative when clipping
        is on, Note [Speculative clipping]; loss scale 1).  ``master_buf``:
        a buffer holding ``g``'s current fp32 values (its master), updated in place
        instead of reading the master from NVMe (Note [Master hand-off] in
        infinity/engine/overlap.py)."""
        lrs, wds = self._next_hparams()
        kw = dict(step=self.step_count + 1, beta1=self.beta1, beta2=self.beta2,
                  eps=self.eps, adamw=self.adamw, bias_correction=True,
                  grad_scale=1.0 / float(self.scaler.scale))
        item = self._item(g, lrs, wds)
        if master_buf is not None:
            item.master_buf = master_buf
        return item, kw

    def count_master_in_hand(self, item) -> None:
        """Count the NVMe master read a step item skips because it carries its master
        (``master_buf``: a handed-off or cached parameter buffer)."""
        if item.master_buf is not None:
            self.acct.count("optimizer_master_read_bytes_saved",
                            self.store.master_io_bytes(item.key))

    # groups whose resident device copy the step already updated (ZeRO stages 1-2 gather
    # them on the device); the engine refreshes the others from their host mirrors
    gathered_on_device: frozenset = frozenset()

    def boundary_step(self, done: dict[int, float] | None = None, *, txn=None,
                      shield=None, on_commit=None, on_rollback=None, on_undo=None,
                      norms: dict[int, float] | None = None) -> bool:
        """Apply (or skip) one optimizer step over the accumulated gradients.
        ``done``: ``{gid: squared grad norm}`` of groups already stepped (overlapped with
        backward, :mod:`infinity.engine.overlap`) into ``txn``; only the others are stepped
        here.  ``norms``: ``{gid: squared grad norm}`` computed while backward ran (Note
        [Norms during backward]), not read again.  With ``txn`` (Note [commit point] in infinity.optim.step_txn) the
        update is all-or-nothing: the remaining groups are stepped into it, then
        committed — or, when the step is skipped (fp16 overflow, non-finite gradients),
        rolled back.  ``shield(fn)`` runs the state-changing part (Note [window abort] in
        infinity.engine.phase); ``on_commit(moved_extents)`` / ``on_rollback(keys)`` let
        the engine follow; ``on_undo(keys)``: the early steps of ``keys`` were rolled back
        to be redone clipped (Note [Speculative clipping]).  Returns True when the update
        was applied."""
        t0 = time.perf_counter()
        done = done or {}
        shield = shield or (lambda fn: fn())
        self.grads.zero_unwritten(skip=done)
        scale = float(self.scaler.scale)
        kw = {"known": norms} if norms else {}   # (one process only: ZeRO gives none)
        raw_norm = self.grads.grad_norm(skip=done, **kw) if done else self.grads.grad_norm(**kw)
        overflow = not math.isfinite(raw_norm)
        norm = raw_norm / scale
        self.last_nonfinite_groups = ()

        def skip(result_keys=()):
            # rolled back: a non-finite gradient norm, or (result_keys) a non-finite result
            # of the Adam step (Note [non-finite result] in infinity/optim/step_txn.py)
            if txn is not None:
                keys = set(txn.keys)
                self.store.rollback(txn)
                if on_rollback is not None:
                    on_rollback(keys)
            self.boundaries += 1
            self.last_grad_norm = norm
            if result_keys:
                self.nonfinite_steps += 1
                self.last_nonfinite_groups = self._group_names(result_keys)
            elif self.precision == "fp16":
                self.scaler.update(True)
            else:
                self.nonfinite_steps += 1
            self._hp = None
            for g in self.groups:
                self.grads.release_grad(g)
            self.zero_grad()
        if overflow:
            shield(skip)
            return False
        clip_coef = 1.0
        if self.clip > 0:
            clip_coef = min(1.0, self.clip / (norm + 1e-6))
        grad_scale = clip_coef / scale
        if done and grad_scale != 1.0 / scale:
            # Note [Speculative clipping] (infinity/engine/overlap.py): the groups stepped
            # during backward used coefficient 1 and the norm turned out above the clip:
            # their updates are rolled back and every group is stepped here, clipped
            if txn is None:
                raise RuntimeError("engine.step: groups were stepped during backward without a "
                                   "transaction although the step clips gradients (internal "
                                   "error: the overlap needs the commit point)")
            self.acct.count("optimizer_groups_redone", len(done))
            self.acct.count("optimizer_clip_redos")
            if self.redo_from_moments:
                self._redo_from_moments(done, txn, clip_coef, scale, shield, on_undo)
            else:
                keys = set(txn.keys)

                def undo():
                    self.store.rollback(txn)
                    if on_undo is not None:
                        on_undo(keys)
                shield(undo)
                done = {}
        if self.LOCAL_VOTE and txn is not None and txn.nonfinite:
            # an early (overlapped) step came out non-finite: rolled back before the
            # commit decision, like a non-finite gradient (Note [non-finite result])
            bad = set(txn.nonfinite)
            shield(lambda: skip(bad))
            return False
        lrs, wds = self._next_hparams()
        step = self.step_count + 1
        items = [self._item(g, lrs, wds) for g in self.groups if g.gid not in done]
        later = []          # Note [roll forward]: after the decision
        throttled = 0
        if txn is not None:
            now = []
            for it in items:
                if self.store.shadow_need(it.key) == 0 and self.store.host_state_bytes(it.key):
                    later.append(it)    # host states only: finished in place, no undo copy
                elif self.store.prepare(txn, it.key):
                    now.append(it)
                else:
                    later.append(it)    # beyond the shadow budget
                    throttled += 1
            items = now
            if self.LOCAL_VOTE and self.swap is None and self.store.swap is None:
                txn.finish_only()        # Note [finish only] (infinity/optim/step_txn.py)
        skipped = [False]

        def apply():
            bad = set()
            if items:
                bad |= self.store.step(items, step=step, beta1=self.beta1, beta2=self.beta2,
                                       eps=self.eps, adamw=self.adamw, bias_correction=True,
                                       grad_scale=grad_scale, txn=txn)
            if txn is not None:
                bad |= txn.nonfinite
            ok, finite = self.vote(True, not bad)
            if not ok:
                raise RuntimeError("engine.step: another rank failed its part of this step; "
                                   "the update was not applied on any rank")
            if not finite:                # Note [non-finite result]
                if txn is not None and txn.reversible:
                    skip(bad or ("another rank",))
                    skipped[0] = True
                    return
                self._lost_update(bad, step)
            # ---- commit: nothing below may fail half-way
            moved = self.store.commit(txn) if txn is not None else {}
            if on_commit is not None:
                on_commit(moved)
            self.boundaries += 1
            self.last_grad_norm = norm
            if self.precision == "fp16":
                self.scaler.update(False)
            if later:                 # Note [roll forward]: decided, to be finished
                self.unfinished = _Unfinished(
                    {it.key for it in later}, lrs, wds, list(self._overrides),
                    dict(step=step, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                         adamw=self.adamw, bias_correction=True, grad_scale=grad_scale),
                    on_undo, t0)
            self._hp = None
            self.step_count = step
            for it in items:
                self.count_master_in_hand(it)
            for g in self.groups:     # (groups stepped early kept theirs for a redo)
                if later and self.key(g) in self.unfinished.keys:
                    continue          # kept until their update is written
                self.grads.release_grad(g)
            if not later:
                self.zero_grad()
            if self.torch_sched is not None:
                self.sched_target.step()
                self.torch_sched.step()
            self.last_step_seconds = time.perf_counter() - t0
            if throttled:
                self.acct.count("optimizer_shadow_budget_throttled")
            if later and (self.defer_finish is None or not self.defer_finish()):
                self.finish_unfinished()    # (else: Note [Finish in the next forward])
        shield(apply)
        return not skipped[0]

    # ------------------------------------------------------------------ roll forward
    # Note [roll forward]
    # ~~~~~~~~~~~~~~~~~~~
    # The commit decision is the vote after the norm (and every early step) is known: from
    # there an update only has to be *finished*.  Groups whose shadows did not fit the
    # budget (Note [shadow budget] in infinity/optim/step_txn.py), and groups whose states
    # are all host-resident (nothing to shadow: updated in place, Note [finish only]), are
    # stepped after the decision, a batch at a time into a transaction of their own that
    # takes no undo copies, each batch committed (its extents swapped in) as soon as its writes
    # completed, so the shadows after the decision are a batch's, not the model's.  Their
    # gradients are kept until their batch is committed.  When a batch fails (an I/O
    # error), its shadows are dropped -- the homes still hold the last values -- and the
    # rest of the update stays pending (``unfinished``): the error is raised, and the next
    # engine call (or close()) finishes it before anything else reads or writes a home.
    # Only where that cannot work -- a host-resident state updated in place part-way (no
    # undo copy after the decision), a non-finite result, an error other than I/O --
    # does the engine enter FAILED.
    unfinished = None
    #: ``fn({old extent: new extent})``: owners of extent masters follow a batch's commit
    on_extents_moved = None
    #: ``fn() -> bool``: start finishing the decided update in the next forward (Note
    #: [Finish in the next forward], infinity/optim/deferred_finish.py); ``deferred`` is
    #: the running finish until the engine joins it
    defer_finish = None
    deferred = None

    def book_finished(self, done, *, deferred_seconds: float | None = None) -> None:
        """The main thread's part of finishing ``done`` (``(group, item)`` stepped and
        committed): gradients back, counts; the update is finished when no group is left.
        ``deferred_seconds``: the groups were stepped after step() returned (Note [Finish in
        the next forward]), and this is the step's time to report."""
        u = self.unfinished
        for g, it in done:
            self.count_master_in_hand(it)
            u.keys.discard(it.key)
            self.grads.release_grad(g)
        self.acct.count("optimizer_groups_after_decision", len(done))
        if deferred_seconds is not None:
            self.acct.count("optimizer_groups_finished_after_step", len(done))
        if not u.keys:
            self.unfinished = None
            self.zero_grad()
            self.last_step_seconds = time.perf_counter() - u.t0 if deferred_seconds is None \
                else deferred_seconds

    def finish_unfinished(self) -> None:
        """Step and commit the groups of the decided update not written yet (Note [roll
        forward]), a batch at a time within the shadow budget.  Raises what a batch
        raised; the groups not committed then stay pending (``unfinished``) unless it
        cannot be finished (``_infinity_state_lost`` on the error)."""
        from infinity.optim.step_txn import StepTxn
        u = self.unfinished
        if u is None:
            return
        by_key = {self.key(g): g for g in self.groups}
        while u.keys:
            mini = StepTxn(host_undo=False)   # host states: in place, no undo copy
            batch = []
            for key in sorted(u.keys, key=lambda k: by_key[k].gid):
                if not self.store.prepare(mini, key, force=not batch):
                    break
                batch.append(self._item(by_key[key], u.lrs, u.wds, u.overrides))
            try:
                bad = self.store.step(batch, txn=mini, **u.hp)
                if bad:
                    self._lost_update(bad, u.hp["step"])
                moved = self.store.commit(mini)
            except BaseException as e:
                keys = {it.key for it in batch}
                lost = getattr(e, "_infinity_state_lost", False) or mini.unrestorable \
                    or not isinstance(e, OSError)
                if not lost:                     # shadows only: the homes are intact
                    self.store.rollback(mini)
                    if u.on_undo is not None:
                        u.on_undo(keys)          # copies updated in hand are stale
                    e.add_note(f"infinity: the update of global step {u.hp['step']} was decided "
                               f"(every gradient finite, every rank agreed); "
                               f"{len(u.keys)} parameter group(s) are not written yet and keep "
                               f"their gradients: the next engine call (or close()) finishes "
                               f"it, nothing else changes meanwhile (Note [roll forward])")
                else:
                    try:
                        e._infinity_state_lost = True
                    except AttributeError:
                        pass
                    e.add_note(f"infinity: the decided update of global step {u.hp['step']} "
                               f"cannot be finished (host-resident states were updated in "
                               f"place part-way, or the result is not finite): reload a "
                               f"checkpoint (load_checkpoint) into a new engine")
                raise
            if moved and self.on_extents_moved is not None:
                self.on_extents_moved(moved)
            self.book_finished([(by_key[it.key], it) for it in batch])
        if self.unfinished is u and not u.keys:   # (nothing was left to step)
            self.book_finished([])

    def _group_names(self, keys) -> tuple:
        names = {self.key(g): g.name for g in self.groups}
        return tuple(sorted(names.get(k, k) for k in keys))

    def _lost_update(self, bad, step: int):
        """A non-finite result that cannot be rolled back (Note [non-finite result]): the
        host states were updated in place, so the NaN is in the weights already."""
        from infinity.optim.errors import NonFiniteUpdateError
        names = self._group_names(bad) if bad else ()
        where = f"parameter group(s) {', '.join(names)}" if names else "another rank's parameters"
        err = NonFiniteUpdateError(
            f"engine.step: the Adam update of global step {step} came out inf/NaN in {where} "
            f"(an overflow from finite gradients, e.g. a weight pushed beyond its low-precision "
            f"copy's range: fp16 above 65504); the optimizer states are updated "
            f"in place and cannot be restored, so the engine stops: load the last checkpoint "
            f"into a new engine, and lower the learning rate or clip gradients "
            f"(gradient_clipping)", groups=names, rolled_back=False)
        err._infinity_state_lost = True
        raise err

    @property
    def redo_from_moments(self) -> bool:
        """Note [Redo from moments] (infinity/optim/moment_redo.py): a speculative update
        is redone clipped from the moments (fp32 moments), so early-stepped gradients
        need not be kept."""
        return self.store.state_dtype == torch.float32

    def _redo_from_moments(self, done, txn, clip_coef: float, scale: float, shield,
                           on_undo) -> None:
        """Redo each early-stepped group of ``done`` clipped, one at a time, in ``txn``:
        its gradient (the host buffer when it was kept anyway, else recovered from its
        moments), its writes rolled back, stepped again with ``clip_coef``."""
        from infinity.optim.moment_redo import recover_grad
        lrs, wds = self._next_hparams()
        step = self.step_count + 1
        hp = dict(step=step, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                  adamw=self.adamw, bias_correction=True)
        by_gid = {g.gid: g for g in self.groups}
        for gid in done:
            g = by_gid[gid]
            key = self.key(g)
            kept = self._kept_for_redo(g)
            buf = kept if kept is not None else \
                self.host_pool.lease(self.store.numel(key) * 4, torch.float32)
            try:
                def undo_one(g=g, key=key, buf=buf, kept=kept):
                    if kept is None:
                        segs = self._item(g, lrs, wds).segments
                        recover_grad(self.store, txn, key, segs, self.beta1, buf)
                    self.store.rollback_key(txn, key)
                    if on_undo is not None:
                        on_undo({key})
                shield(undo_one)
                item = self._item(g, lrs, wds)   # (after on_undo: a cached master is gone)
                item.grad, item.grad_dtype = buf, torch.float32
                self.store.prepare(txn, key, force=True)   # (its spares, just returned)
                # a kept buffer holds the loss-scaled sum; a recovered one was unscaled
                gs = clip_coef / scale if kept is not None else clip_coef
                shield(lambda item=item, gs=gs: self.store.step([item], grad_scale=gs,
                                                                  txn=txn, **hp))
            finally:
                if kept is None:
                    self.host_pool.give_back(buf)

    def _kept_for_redo(self, g: GroupRecord):
        """``g``'s gradient still in host memory for a clipped redo (Note [Redo from
        moments]), or None (then it is recovered from the moments)."""
        return g.grad_buf if not self.grads.lazy_grads and not self.grads.on_nvme(g) else None

    #: the commit vote is this process's own (no other rank can fail the update)
    LOCAL_VOTE = True

    def vote(self, ok: bool, finite: bool = True) -> tuple[bool, bool]:
        """Whether every rank completed its part of the update, and whether every rank's
        result is finite (one process: its own)."""
        return ok, finite

    def _item(self, g: GroupRecord, lrs: list[float], wds: list[float], overrides=None):
        from infinity.optim.offload_step import StepItem
        overrides = self._overrides if overrides is None else overrides
        segs = []
        pos = 0
        for s in g.slots:
            if s.offset > pos:
                segs.append((pos, s.offset - pos, 0.0, 0.0))
            if s.trainable:
                pgi = self._pg_of.get(id(s.param))
                if pgi is None:  # tied duplicate dropped by param_groups: same tensor, first name
                    pgi = 0
                ov = overrides[pgi] if pgi < len(overrides) else None
                segs.append((s.offset, s.numel, lrs[pgi], wds[pgi], ov))
            else:
                segs.append((s.offset, s.numel, 0.0, 0.0))
            pos = s.offset + s.numel
        if pos < g.padded_numel:
            segs.append((pos, g.padded_numel - pos, 0.0, 0.0))
        param_out, sink = self._param_target(g)
        grad = self.grads.grad_source(g)
        # fp32 NVMe home with a cached host copy (MemoryManager.enable_cache): the copy is
        # the master in hand, updated in place and written through (Note [Cache
        # write-through] in infinity/memory/manager.py)
        master_buf = g.host_buf if self.precision == "fp32" and g.home == "nvme" else None
        return StepItem(self.key(g), grad, segs, param_out=param_out, param_sink=sink,
                        master_buf=master_buf)

    def _param_target(self, g: GroupRecord):
        """Where the step writes ``g``'s updated low-precision parameters (bf16/fp16; fp32:
        the master is the parameter): ``(param_out tensor, None)`` or ``(None, sink)`` for
        an NVMe home (``sink(key, elem_offset, tile)`` writes a tile, returns a handle)."""
        if self.precision == "fp32":
            return None, None
        if g.home == "device":
            return self._device_home(g), None
        if g.home == "cpu":
            return g.host_buf, None
        esize = g.device_buf.element_size() if g.device_buf is not None else \
            torch.empty((), dtype=g.dtype).element_size()
        ext = g.extent
        swap = self.swap

        def sink(key, elem_offset, tile, _ext=ext, _es=esize):
            return swap.write(_ext, tile, offset=elem_offset * _es)
        return None, sink

    def restore_params(self, keys) -> None:
        """After a rollback (Note [commit point]): the rolled-back steps of ``keys`` wrote
        their low-precision parameters in place; write them again from the restored fp32
        master (the same round-to-nearest-even the kernel applies)."""
        if self.precision == "fp32":
            return
        from infinity.io import aligned_empty
        for g in self.groups:
            key = self.key(g)
            if key not in keys:
                continue
            param_out, sink = self._param_target(g)
            n = self.store.numel(key)
            master = torch.empty(n, dtype=torch.float32)
            self.store.read_master(key, master)
            if param_out is not None:
                param_out.view(-1)[:n].copy_(master)
            elif sink is not None:
                lp = aligned_empty(n * torch.empty((), dtype=g.dtype).element_size(),
                                   torch.uint8).view(g.dtype)[:n]
                lp.copy_(master)
                h = sink(key, 0, lp)
                if h is not None:
                    h.wait()
