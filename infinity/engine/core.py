"""``infinity.initialize(model, config) -> Engine``: forward, backward, step, stats, close.

The engine's parts are built by :func:`infinity.engine.build.assemble` (groups and
hooks from :mod:`infinity.runtime`, the tiered memory manager from :mod:`infinity.memory`,
the gradient route from :mod:`infinity.grads`, the step driver from
:mod:`infinity.optim.driver`, their ZeRO counterparts from :mod:`infinity.zero`).  Weights
out (``state_dict``/``save_pretrained``) live in :mod:`infinity.engine.weights`,
checkpoints in :mod:`infinity.engine.checkpoint_state`, the step overlapped with backward
in :mod:`infinity.engine.overlap`.
"""
from __future__ import annotations

import contextlib

import logging
import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.engine.build import assemble
from infinity.engine.phase import Phase, PhaseError, run_shielded
from infinity.memory.accounting import STATS_COUNTERS, Accounting
from infinity.memory.device import choose_device
from infinity.memory.plan import remove_if_empty
from infinity.engine.deferred import join as join_deferred

log = logging.getLogger("infinity.engine")

__all__ = ["Engine", "initialize"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def initialize(model: nn.Module, config=None, *, lr_scheduler=None, timeline=None) -> "Engine":
    """Wrap ``model`` for offloaded training. ``config``: dict, JSON/YAML path,
    :class:`InfinityConfig` or None.  ``lr_scheduler``: optional factory
    ``f(optimizer) -> torch LR scheduler`` (replaces the config ``scheduler``)."""
    return Engine(model, config, lr_scheduler=lr_scheduler, timeline=timeline)


def _refuse_placeholders(model: nn.Module) -> None:
    """A model whose engine was closed holds NaN placeholders instead of weights (the
    weights lived in the engine's tiers): training it would train NaN."""
    from infinity.memory.record import is_placeholder
    from infinity.zero.init import is_managed   # built under infinity.Init: not a leftover
    bad = [n for n, p in model.named_parameters() if is_placeholder(p) and not is_managed(p)]
    if bad:
        raise ValueError(
            f"initialize: {len(bad)} parameter(s) of this model (e.g. {bad[0]!r}) are placeholders "
            f"left by a closed infinity engine, not weights: the trained values lived in that "
            f"engine. Save them before closing (engine.save_pretrained(dir) or "
            f"engine.save_checkpoint(dir)) and load them into a freshly built model, or pass the "
            f"model to initialize() before closing its engine")


class Engine:
    def __init__(self, model: nn.Module, config=None, *, lr_scheduler=None, timeline=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"initialize: expected a torch.nn.Module, got {type(model).__name__}")
        _refuse_placeholders(model)
        from infinity.engine.frozen import refuse_bitsandbytes
        refuse_bitsandbytes(model)
        self.cfg = cfg = InfinityConfig.load(config)
        self.module = model
        if timeline is None:
            from infinity.profile import Timeline
            timeline = Timeline(enabled=False)      # every call a no-op until profile()
        self.timeline = timeline
        self.dtype = _DTYPES[cfg.precision]
        self.gas = cfg.gradient_accumulation_steps
        self.acct = Accounting()
        self.micro_steps, self._closed, self.phase = 0, False, Phase.IDLE
        self._has_grads = False           # a backward ran since the last step()
        # Note [foreign backward]: gradients enter the engine only inside engine.backward;
        # ones that reach its hooks from another backward (a plain loss.backward()) are
        # dropped, and the next forward/backward/step raises saying so
        self._accepting_grads, self._foreign_grads = False, 0
        self._rank_failure: str | None = None   # several ranks: why every call refuses
        self._txn = None                  # the window's StepTxn (Note [commit point])
        self._worker = None               # runs commits shielded from signals
        self._warned, self._nonfinite_warned_at = set(), -1.0
        self.curriculum_seqlen = None     # set_curriculum_length (infinity.curriculum)
        # the parts build.assemble sets, in data-path order (None until built, so close()
        # frees whatever a failure part-way left built)
        self.aio = self.swap = None
        self.mm = self.opt = self.hooks = self.zero = None
        self.store = self.host_pool = self.grouping = self.placement = self.coord = None
        self.overlap = self.tiling = None
        self.device_budget = self.undo_budget = None     # bytes (int) once planned
        self.created_dirs: list = []
        self._last_on_demand = self._od_at_last_step = 0   # on-demand fetches: last step / so far
        # overlap each group's optimizer update with backward where that cannot change
        # results (infinity.engine.overlap); set False to always step at the boundary
        self.overlap_optimizer_step = True
        # finish a decided update during the next forward (Note [Finish in the next forward]):
        # None on a separate device (a GPU) only, True also on the CPU, False inside step()
        self.defer_optimizer_finish = None
        # Note [commit point]: updates are transactions (all-or-nothing); False restores
        # the in-place updates for A/B benchmarks only (tools/bench_e2e.py --no-commit-point)
        self.commit_point = True
        self.orig_dtypes: dict[int, torch.dtype] = {}
        self.device_tier_to_own = None
        # signals are held across the hooks' bookkeeping (Note [held interrupts])
        from infinity.runtime.interrupts import InterruptGate
        self.gate = InterruptGate()
        self.device = self._choose_device(model)
        self._move_buffers(model)
        if self.device.type == "cuda":
            # host buffers are pinned from here on, as the pools and the optimizer's tile
            # ring allocate them during initialize (a CPU model never touches CUDA)
            from infinity.io.buffers import enable_cuda_pinning
            enable_cuda_pinning()
        try:
            assemble(self, lr_scheduler)
        except BaseException:
            self.close()
            raise
        from infinity.memory.record import register_holder
        register_holder(self)          # Note [held parameters]

    # ------------------------------------------------------------------ device
    @staticmethod
    def _choose_device(model: nn.Module) -> torch.device:
        """cpu, the one CUDA device holding every parameter, or (world size > 1, CUDA
        available) ``cuda:LOCAL_RANK``; see :func:`infinity.memory.device.choose_device`."""
        import torch.distributed as dist
        from infinity.zero.comm import env_world_size, local_rank
        ws = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
            else env_world_size()
        return choose_device([p.device for p in model.parameters()],
                             cuda_available=torch.cuda.is_available(), world_size=ws,
                             local_rank=local_rank())

    def _move_buffers(self, model: nn.Module) -> None:
        """Buffers live where compute runs (a CPU buffer of a CUDA model moves there)."""
        if self.device.type == "cpu":
            return                        # the CPU path leaves buffers as they are
        for mod in model.modules():
            for k, b in mod._buffers.items():
                if b is not None and b.device != self.device:
                    mod._buffers[k] = b.to(self.device)

    def _to_device(self, x):
        if isinstance(x, torch.Tensor) and x.device != self.device:
            return x.to(self.device, non_blocking=x.is_pinned())
        return x

    # ------------------------------------------------------------------ training API
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # ------------------------------------------------------------------ phases
    def shard_source(self):
        """What reading parameter values across ranks needs (infinity.zero.distributed)."""
        from infinity.zero.distributed import ShardSource
        return ShardSource(groups=self.grouping.groups, param_group=self.grouping.param_group,
                           zero=self.zero, swap=self.swap, state_dict=self.state_dict,
                           read_master=lambda g, out: self.store.read_master(self.opt.key(g), out))

    def check_call(self, what: str) -> None:
        """What a public entry point of a collaborator (weights out) checks first: the
        engine is idle, a decided update is finished (Note [window abort])."""
        self._enter(what)

    def _enter(self, what: str, accepts=(Phase.IDLE,)) -> None:
        """Check the phase a public method needs (Note [window abort])."""
        ph = self.phase
        if ph in accepts:
            if self.opt is not None and self.opt.unfinished is not None and \
                    not (what == "forward" and self.opt.deferred is not None):
                self._roll_forward()          # Note [roll forward]; a forward joins at its end
            return
        if ph is Phase.CLOSED:
            raise PhaseError(f"engine.{what}: the engine is closed; create a new one with "
                             f"infinity.initialize (stats() still answers)")
        if ph is Phase.FAILED:
            if self._rank_failure is not None:
                raise PhaseError(f"engine.{what}: {self._rank_failure}")
            raise PhaseError(f"engine.{what}: the engine failed to roll back an earlier error "
                             f"({self.fail_reason}); its state is undefined: close it and load a "
                             f"checkpoint into a new engine")
        raise PhaseError(f"engine.{what}: called while the engine is in {ph.value} (re-entrant "
                         f"call from a hook or another thread?); call it after that returns")

    def grad_gate(self, sink):
        """``sink`` (a gradient sink of the hooks or of tiling), dropping what arrives outside
        engine.backward (Note [foreign backward])."""
        def gated(*args, **kwargs):
            if not self._accepting_grads:
                self._foreign_grads += 1
                return None
            return sink(*args, **kwargs)
        return gated

    def _refuse_foreign(self, what: str) -> None:
        if self._foreign_grads:
            n, self._foreign_grads = self._foreign_grads, 0
            raise RuntimeError(
                f"engine.{what}: a backward outside engine.backward(loss) reached this engine "
                f"(a plain loss.backward()?): its {n} gradient(s) were dropped and no update will "
                f"use them; call engine.backward(loss) instead of loss.backward(), then "
                f"engine.step()")

    def micro_step_to_feed(self) -> int:
        """The micro-batch to feed next (Note [missed step]; ``stats()["micro_step"]``)."""
        m = self.micro_steps
        return m if not self._has_grads else m + 1 if (m + 1) % self.gas else m + 1 - self.gas

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _drop_open_window(self, why: str) -> None:
        """``why`` needs the parameters while optimizer steps of the window are held in
        its transaction (backward of the last micro-batch ran, step() not yet): the window
        is dropped so everything reads the last completed update (and no home is read while
        an overlapped step writes it: Note [Overlap safety] in infinity/engine/overlap.py)."""
        # Note [missed step]: no step() after a backward (an interrupt between the two): a
        # micro-step before the window's last is counted now (step() only counts it), after
        # the last the window is dropped: as stats()["micro_step"] said (micro_step_to_feed)
        if self._has_grads and (self.micro_steps + 1) % self.gas:
            self.micro_steps, self._has_grads = self.micro_steps + 1, False
        again = why == "backward" and self._has_grads and (self.micro_steps + 1) % self.gas == 0
        if not again and not self._txn and not (self.overlap is not None and self.overlap.busy):
            return                        # nothing was stepped early: nothing to drop
        self._warn_once("drop-" + why,
                        "infinity: %s before step(): the accumulation window's gradients and the "
                        "optimizer steps taken for it during backward are dropped (call step() "
                        "after the last backward of a window to keep them)", why)
        self._abort_window(None)

    def _abort_window(self, exc: BaseException | None) -> None:
        """Note [window abort]: drop the window, restore the last completed update.  The
        hooks are reset here (saved-tensor hooks are thread-local); the rest runs
        shielded from signals on the commit worker.  ``exc``: the error propagating (an
        interrupt arriving meanwhile is folded into it), or None (then errors raise)."""
        join_deferred(self)                   # (the worker reads the gradients dropped here)
        if exc is not None:
            try:
                exc._infinity_window_dropped = True       # Note [one exit]
            except AttributeError:
                pass
        if exc is not None and self.zero is not None:
            from infinity.zero.comm import CollectiveError
            if not isinstance(exc, CollectiveError):
                self.zero.comm.report_failure(exc)   # the other ranks' errors name this one
        try:
            # a signal arriving meanwhile is held until the rollback ended (Note [held
            # interrupts]), then raised here
            with self.gate.open(), self.gate:
                if self.hooks is not None:
                    self.hooks.reset()
                if self.tiling is not None:
                    self.tiling.reset()
                self._shield(self._rollback_window)
        except KeyboardInterrupt as ki:
            if self.phase is not Phase.IDLE:    # the rollback did not finish
                self._mark_failed(exc, ki)
            if exc is None:
                raise
        except BaseException as e:
            self._mark_failed(exc, e)
            if exc is None:
                raise
        if exc is not None and self.zero is not None and self.phase is Phase.IDLE:
            self._fail_across_ranks(exc)

    def _fail_across_ranks(self, exc) -> None:
        """Several ranks: an error dropped this rank's window and the other ranks abandon
        their collectives (Note [failures in seconds] in infinity/zero/comm.py), so the
        process groups are out of step for good: the rollback is complete (weights and
        states as after the last update), but every call but stats()/close() now refuses,
        naming the failed rank and the way out."""
        from infinity.zero.comm import RESTART, CollectiveError
        failed = self.zero.comm.failed or (self.zero.comm.reported_failures()
                                           if isinstance(exc, CollectiveError) else None)
        me = self.zero.comm.rank
        who = (f"rank {failed[0][0]} failed ({failed[0][1]})" if failed else
               f"rank {me} failed (this rank: {type(exc).__name__}: {exc})"[:600])
        self.phase = Phase.FAILED
        self.fail_reason = who
        self._rank_failure = (f"{who}; this rank rolled back to its last completed update "
                              f"(global step {self.global_steps}), but {RESTART}")
        try:
            exc.add_note(f"infinity: {self._rank_failure}")
        except AttributeError:
            pass

    def _mark_failed(self, exc, err) -> None:
        self.phase = Phase.FAILED
        self.fail_reason = f"{type(err).__name__}: {err}"
        log.error("infinity: rolling back after %r failed: %r", exc, err)
        if exc is not None:
            exc.add_note(f"infinity: the rollback after this error failed too ({err!r}); the "
                         f"engine is unusable: reload a checkpoint")

    def _rollback_window(self) -> None:
        with self.mm.lenient_returns():    # buffers in flight between owners
            if self.overlap is not None:
                self.overlap.abandon()
            txn, self._txn = self._txn, None
            if txn is not None:
                keys = set(txn.keys)
                self.store.rollback(txn)
                self._after_rollback(keys)
            self.opt.abandon_window()
            self.mm.abandon_all()
        self.micro_steps = self.opt.boundaries * self.gas
        self._has_grads = False
        self.phase = Phase.IDLE

    def _after_rollback(self, keys) -> None:
        """Groups stepped (in place) into a rolled-back transaction: cached copies and
        low-precision homes were written from the new values; take them back from the
        (restored) master."""
        if not keys:
            return
        by_key = {self.opt.key(g): g for g in self.opt.groups}
        groups = [by_key[k] for k in keys if k in by_key]
        self.mm.discard_cached({g.gid for g in groups})   # Note [Cache write-through]
        # (fp32: the master IS the parameter, restored with it)
        self.opt.restore_params(set(keys))

    def _after_commit(self, moved) -> None:
        """The transaction's shadows are the state now: NVMe-homed fp32 parameters (their
        home is the master) follow their extents; device mirrors are refreshed."""
        self.follow_extents(moved)
        self.micro_steps += 1
        self._has_grads = False

    def follow_extents(self, moved) -> None:
        for g in self.mm.groups if moved else ():
            if g.extent is not None and g.extent in moved:
                g.extent = moved[g.extent]

    def _roll_forward(self) -> None:
        """Note [roll forward] (infinity/optim/driver.py): finish the decided update before
        anything reads or writes a home; signals are held meanwhile."""
        try:
            with self.gate.open(), self.gate:
                join_deferred(self)           # Note [Finish in the next forward]
                if self.opt.unfinished is None:
                    return
                self._shield(self.opt.finish_unfinished)
        except BaseException as e:
            if getattr(e, "_infinity_state_lost", False) and self.phase is not Phase.CLOSED:
                self.phase = Phase.FAILED
                self.fail_reason = (f"{type(e).__name__}: {e}"[:500] + "; the decided update "
                                     "cannot be finished: reload a checkpoint")
            raise
        self.mm.refresh_resident(skip=self.opt.gathered_on_device)

    def _shield(self, fn):
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinity-commit")
        # (the hand-over holds signals: Note [held interrupts]; delivered at the call's end)
        return run_shielded(self._worker, fn, hold=self.gate.quiet())

    def _new_txn(self):
        """A transaction for the coming window when anything the step writes can fail
        half-way or be rolled back (an overlapped step; NVMe I/O)."""
        from infinity.optim.offload_step import StepTxn
        io = self.swap is not None
        host_undo = io and (self.undo_budget is None or
                            sum(self.store.host_state_bytes(self.opt.key(g)) for g in self.opt.groups)
                            <= self.undo_budget)
        return StepTxn(host_undo=host_undo or self.overlap is not None)

    # ------------------------------------------------------------------ training API
    # Note [one exit]: an exception leaves a public call (forward, backward, step) through
    # one ``except`` that covers the whole call, the gate's opening and closing included
    # (Note [held interrupts]), and nothing else.  The core's own ``except`` drops the window
    # for what it raises (marking the exception); any other exception (raised before the
    # core: a phase or misuse error, a signal in the call's bookkeeping or while the gate
    # installs its handlers; or a signal held inside the call, delivered as the gate closes)
    # goes to ``late(exc)``: forward and backward drop the window, step only when its update
    # did not commit, none when the engine is busy (a re-entrant call from a hook: the outer
    # call owns the window), failed or closed.  So a Ctrl-C landing as the model's forward
    # returns leaves the window dropped (micro_step at its start) as one a moment earlier.
    @staticmethod
    def _left(exc, late) -> None:
        if not getattr(exc, "_infinity_window_dropped", False):
            late(exc)

    def _late_abort(self, exc) -> None:
        if self.phase is Phase.IDLE:
            self._abort_window(exc)

    def forward(self, *args, **kwargs):
        try:                                  # Note [one exit]
            with self.gate.open():
                self._enter("forward")
                self._refuse_foreign("forward")
                self._drop_open_window("forward")   # Note [Overlap safety]: no home being updated
                if self.device.type != "cpu":     # inputs follow the parameters (top-level tensors)
                    args = tuple(self._to_device(a) for a in args)
                    kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
                if self.dtype != torch.float32:
                    args = tuple(self._cast(a) for a in args)
                    kwargs = {k: self._cast(v) for k, v in kwargs.items()}
                try:
                    self.phase = Phase.FORWARD
                    with self.timeline.span("forward", "forward"):
                        out = self.module(*args, **kwargs)
                    self.phase = Phase.IDLE
                except BaseException as e:
                    join_deferred(self)       # (joined before the window drops)
                    self._abort_window(e)
                    raise
                join_deferred(self)           # Note [Finish in the next forward]
        except BaseException as e:
            self._left(e, self._late_abort)
            raise
        return out

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Scale ``loss`` by 1/gradient_accumulation_steps (and the fp16 loss scale) and
        run backward; gradients accumulate in fp32 at their home.  Any exception drops
        the accumulation window (Note [window abort])."""
        try:                                  # Note [one exit]
            with self.gate.open():
                self._enter("backward")
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    shape = tuple(getattr(loss, 'shape', ()))
                    raise ValueError(f"engine.backward: expected a scalar loss tensor, got "
                                     f"{type(loss).__name__}{shape}; reduce it first "
                                     f"(e.g. loss.mean())")
                if not loss.requires_grad or loss.grad_fn is None:
                    raise ValueError("engine.backward: the loss has no autograd graph (computed "
                                     "under torch.no_grad(), in eval-only code, or detached); "
                                     "compute it from engine(...)'s output with gradients "
                                     "enabled")
                self._refuse_foreign("backward")
                self._drop_open_window("backward")
                scale = self.opt.scaler.scale / self.gas
                if scale != 1.0:
                    loss = loss.float() * scale      # fp32: an fp16 loss times 65536 overflows
                final = (self.micro_steps + 1) % self.gas == 0
                try:
                    self.phase = Phase.BACKWARD
                    self.opt.grads.before_backward(final)
                    if final:
                        self._txn = self._new_txn() if self.commit_point and \
                            (self.swap is not None or self.overlap is not None) else None
                    ov = self.overlap
                    if ov is not None and final and self.overlap_optimizer_step \
                            and not retain_graph:
                        ov.begin(self._txn)
                    with self.timeline.span("backward", "backward"):
                        try:
                            self._accepting_grads = True      # Note [foreign backward]
                            try:
                                loss.backward(retain_graph=retain_graph)
                            finally:
                                self._accepting_grads = False
                            if ov is not None:
                                ov.land()       # separate device: the last D2H copies land
                        finally:
                            if ov is not None:
                                ov.end()
                        self.hooks.finish_backward()
                        if self.tiling is not None:   # a use whose output never reached a
                            self.tiling.reset()       # backward does not hold its group back
                        self.opt.grads.end_backward()
                    self._has_grads = True
                    self.phase = Phase.IDLE
                except BaseException as e:
                    self._abort_window(e)
                    raise
        except BaseException as e:
            self._left(e, self._late_abort)
            raise

    def step(self) -> bool:
        """Call after every micro-batch; applies the optimizer at accumulation boundaries.
        Returns True when an update was applied at this call; False between boundaries,
        when the update was skipped (fp16 overflow, non-finite gradients) and when no
        backward ran since the previous step() (a no-op, warned once)."""
        committed = [False]

        def late(exc):                        # Note [one exit]: the update is in, or not
            if not committed[0]:
                self._late_abort(exc)
        try:                                  # Note [one exit]
            with self.gate.open():
                self._enter("step")
                self._refuse_foreign("step")
                if not self._has_grads:
                    self._warn_once("step-without-backward",
                                    "infinity: engine.step() without a backward since the previous "
                                    "step(): nothing to do (no micro-step is counted)")
                    return False
                if (self.micro_steps + 1) % self.gas:
                    self.micro_steps += 1
                    self._has_grads = False
                    return False
                busy = [g.name for g in self.mm.groups if g.users]
                if busy:
                    raise RuntimeError(f"engine.step: called while modules are still executing "
                                       f"(groups in use: {busy[:4]}); call it after backward")
                od = self.acct.counters.get("on_demand_fetches", 0)

                try:
                    self.phase = Phase.STEPPING
                    self.coord.release_kept()      # Note [Reuse within a micro-step]
                    self.mm.wait_host_reads()      # no copy may still read a home being updated
                    with self.timeline.span("optimizer", "step"):
                        # Note [Overlap safety]: every early step ended before homes are read
                        done = self.overlap.finish() if self.overlap is not None else None
                        norms = self.overlap.take_norms() if self.overlap is not None else None
                        txn = self._txn

                        def on_commit(moved):
                            self._after_commit(moved)
                            committed[0] = True

                        def on_rollback(keys):
                            self._after_rollback(keys)
                            self.micro_steps += 1      # the window is consumed (skipped)
                            self._has_grads = False
                            committed[0] = True

                        with self.gate.allow():    # interruptible: rolls back, commits shielded
                            applied = self.opt.boundary_step(done or None, txn=txn,
                                                             shield=self._shield,
                                                             on_commit=on_commit,
                                                             on_rollback=on_rollback,
                                                             on_undo=self._after_rollback,
                                                             norms=norms or None)
                        if not applied and txn is None:
                            on_rollback(())
                        self._txn = None
                    if applied:
                        # separate device: resident copies from mirrors (not those the
                        # step gathered on the device)
                        self.mm.refresh_resident(skip=self.opt.gathered_on_device)
                    self.timeline.mark_step(self.opt.boundaries)
                    self._last_on_demand = od - self._od_at_last_step
                    self._od_at_last_step = od
                    self.phase = Phase.IDLE
                except BaseException as e:
                    if committed[0]:   # decided: only the signal, or a roll-forward remains
                        self._txn = None
                        self.phase = Phase.FAILED if getattr(e, "_infinity_state_lost", False) \
                            else Phase.IDLE
                        self.fail_reason = (f"{type(e).__name__}: {e}"[:500] + "; the decided "
                                             "update cannot be finished: reload a checkpoint")
                    else:
                        self._abort_window(e)
                        if getattr(e, "_infinity_state_lost", False) and \
                                self.phase is not Phase.FAILED:
                            # Note [non-finite result]: the window is dropped, but the
                            # host states keep the NaN: nothing may train on them
                            self.phase = Phase.FAILED
                            self.fail_reason = f"{type(e).__name__}: {e}"[:600]
                    raise
        except BaseException as e:
            self._left(e, late)
            raise
        if not applied and (self.dtype != torch.float16 or self.opt.last_nonfinite_groups):
            self._nonfinite(self.opt.boundaries)
        return applied

    def _nonfinite(self, boundary: int) -> None:
        """An update skipped for inf/NaN gradients (fp32/bf16) or rolled back for an inf/NaN
        Adam result (Note [non-finite result]): warn (rate-limited) or raise."""
        import time as _time
        from infinity.engine.phase import nonfinite_report
        err, warning = nonfinite_report(self.opt, boundary)
        if self.cfg.nonfinite_grads == "raise":
            raise err
        now = _time.monotonic()
        if now - self._nonfinite_warned_at >= 60.0:
            self._nonfinite_warned_at = now
            log.warning("%s", warning)

    def set_curriculum_length(self, length: int | None) -> None:
        """The sequence length a curriculum (:mod:`infinity.curriculum`) truncates the
        current update's batches to; ``stats()["curriculum_seqlen"]`` reports it (None: no
        curriculum).  The finetune loop and ``InfinityTrainer``'s callback call this."""
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or length < 1):
            raise ValueError(f"set_curriculum_length: expected a positive int or None, "
                             f"got {length!r}")
        self.curriculum_seqlen = length

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Declare that ``module``'s forward uses ``param`` although another module owns it
        (like DeepSpeed's ``register_external_parameter``); otherwise ``param`` is released
        (a NaN placeholder) while ``module`` runs."""
        self._enter("register_external_parameter")
        g = self.grouping.param_group.get(id(param))
        if g is None:
            raise KeyError("register_external_parameter: that parameter is not part of the "
                           "model given to initialize")
        if not any(m is module for m in self.module.modules()):
            raise ValueError("register_external_parameter: module is not part of the model")
        self.hooks.add_external(module, g)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    @property
    def lr(self) -> float:
        return self.opt.lr

    @property
    def global_steps(self) -> int:
        return self.opt.step_count

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    # ------------------------------------------------------------------ facts
    def stats(self) -> dict:
        d = self.acct.as_dict()
        for k in STATS_COUNTERS:
            d.setdefault(k, 0)
        d.update({
            "step": self.opt.step_count, "micro_step": self.micro_step_to_feed(),
            "lr": self.opt.lr,
            "loss_scale": float(self.opt.scaler.scale),
            "skipped_steps": int(self.opt.scaler.skipped_steps) + int(self.opt.nonfinite_steps),
            "nonfinite_steps": int(self.opt.nonfinite_steps),
            "curriculum_seqlen": self.curriculum_seqlen,
            "phase": self.phase.value,
            # FAILED: why, and the way out (a rank failure, or a failed rollback)
            "failure": (self._rank_failure or getattr(self, "fail_reason", None))
            if self.phase is Phase.FAILED else None,
            "grad_norm": float(self.opt.last_grad_norm),
            "optimizer_step_seconds": float(self.opt.last_step_seconds),
            "on_demand_fetches_last_step": int(self._last_on_demand),
            "host_cap_bytes": self.cfg.host_memory_bytes or 0,
            "device_cap_bytes": self.device_budget or 0,
            "groups": len(self.mm.groups),
            # Note [shadow budget]: NVMe beyond the homes an update may take, the most it took
            "commit_shadow_budget_bytes": int(self.store.shadow_budget if self.store.shadow_budget
                                              is not None else self.store.shadow_bytes()),
            "commit_shadow_peak_bytes": int(getattr(self.store, "shadow_peak", 0)),
            "unfinished_update": getattr(self.opt, "unfinished", None) is not None
            and getattr(self.opt, "deferred", None) is None,
        })
        return d

    # ------------------------------------------------------------------ profile
    def profile(self, directory=None, **kw):
        """``with engine.profile("prof/"):`` records the timeline (I/O, forward, backward,
        optimizer, waits) and writes the Chrome trace, summary and plots on exit."""
        from infinity.profile.session import ProfileSession
        return ProfileSession(self.timeline, directory, stats_fn=self.stats, **kw)

    # ------------------------------------------------------------------ weights out
    # ------------------------------------------------------------------ held parameters
    def holds(self, p) -> bool:
        """Whether ``p`` is one of this open engine's parameters (Note [held parameters])."""
        g = getattr(self, "grouping", None)
        return not self._closed and g is not None and id(p) in g.param_group

    def read_held(self, p) -> torch.Tensor:
        """``p``'s current value read from its home (what ``state_dict()[name]`` gives;
        collective at world size > 1): for ``infinity.GatheredParameters``."""
        from infinity.engine.weights import read_param
        self._enter("GatheredParameters")
        self._drop_open_window("GatheredParameters")
        return read_param(self, p)

    def write_held(self, values) -> None:
        """Store new values into parameters this engine holds (``values``: ``[(param,
        full tensor)]``, the same values on every rank; collective at world size > 1): the
        fp32 masters and the homes, Adam moments kept. For ``infinity.GatheredParameters``
        with ``modifier_rank`` (Note [held parameters])."""
        from infinity.engine.checkpoint_state import EngineCheckpoint
        from infinity.engine.weights import slot_of
        self._enter("GatheredParameters")
        self._drop_open_window("GatheredParameters")
        named = {}
        for p, v in values:
            _g, s = slot_of(self, p)
            if tuple(v.shape) != tuple(s.shape):
                raise ValueError(
                    f"GatheredParameters: parameter {s.name} of shape {tuple(s.shape)} held by "
                    f"an infinity engine was given shape {tuple(v.shape)}; an engine's layout is "
                    f"fixed at initialize: change shapes (resize_token_embeddings) before "
                    f"infinity.initialize, under infinity.Init")
            if not v.dtype.is_floating_point or not bool(torch.isfinite(v).all()):
                raise ValueError(f"GatheredParameters: new value of {s.name} is not finite "
                                 f"floating point ({v.dtype}); nothing was stored")
            named[s.name] = v.detach().to("cpu")
        EngineCheckpoint(self).write_param_values(named)

    def state_dict(self):
        from infinity.engine.weights import StreamedStateDict
        self._enter("state_dict")
        self._drop_open_window("state_dict")
        return StreamedStateDict(self)

    def save_pretrained(self, directory, *, max_shard_bytes: int = 2 * 10 ** 9,
                        quantize: str | None = None, group_size: int = 128,
                        quantize_lm_head: bool = False) -> list[str]:
        """Hugging Face directory of the current weights; ``quantize="int8"|"int4"``:
        group-wise symmetric weight-only quantization of the Linear layers in the
        compressed-tensors format (docs/checkpoints.md)."""
        from infinity.engine.weights import save_pretrained, save_pretrained_quantized
        self._enter("save_pretrained")
        self._drop_open_window("save_pretrained")
        if quantize is not None:
            return save_pretrained_quantized(self, directory, quantize=quantize,
                                             group_size=group_size, max_shard_bytes=max_shard_bytes,
                                             quantize_lm_head=quantize_lm_head)
        return save_pretrained(self, directory, max_shard_bytes=max_shard_bytes)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory, tag=None, **kw):
        """Atomic sharded checkpoint ``directory/<tag>`` (default ``step-<N>``); see
        ``infinity.checkpoint.save_checkpoint`` for ``kw`` (async_, shard_bytes, ...).
        At world size > 1 every rank calls it and writes its own shard."""
        from infinity.engine.checkpoint_state import save_engine_checkpoint
        self._enter("save_checkpoint")
        self._drop_open_window("save_checkpoint")
        return save_engine_checkpoint(self, directory, tag, **kw)

    def load_checkpoint(self, directory, tag=None, **kw):
        """Verify then load ``directory/<tag>`` (default: ``latest``); returns its meta.
        Any world size or offload configuration may have written it; at world size > 1
        every rank calls it."""
        from infinity.engine.checkpoint_state import load_engine_checkpoint
        self._enter("load_checkpoint")
        self._drop_open_window("load_checkpoint")
        return load_engine_checkpoint(self, directory, tag, **kw)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Idempotent: remove hooks, free buffers, close the swap space (files removed)."""
        if self._closed:
            return
        self._closed = True
        self.phase = Phase.CLOSED
        from infinity.memory.record import unregister_holder
        unregister_holder(self)
        errors = []
        if self.opt is not None and self.opt.unfinished is not None:
            try:                              # Note [roll forward]: finished before anything
                self._roll_forward()          # is freed (the homes keep the last update)
            except Exception as e:
                log.error("engine.close: finishing the decided update failed: %s", e)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for what, fn in (("overlapped step", getattr(self.overlap, "close", None)),
                         ("hooks", getattr(self.hooks, "remove", None)),
                         ("tiling", getattr(self.tiling, "remove", None)),
                         ("memory", getattr(self.mm, "close", None)),
                         ("device", getattr(self.device_tier_to_own, "close", None)),
                         ("gradients", getattr(getattr(self.opt, "grads", None), "close", None)),
                         ("optimizer", getattr(self.store, "close", None)),
                         ("swap", getattr(self.swap, "close", None)),
                         ("aio", getattr(self.aio, "close", None))):
            if fn is None:
                continue
            try:
                fn()
            except Exception as e:  # keep closing the rest; report the first failure
                errors.append((what, e))
                log.error("engine.close: closing %s failed: %s", what, e)
        if self.host_pool is not None:
            self.host_pool.close()
        if self.zero is not None:
            try:
                self.zero.close()
            except Exception as e:
                errors.append(("zero", e))
        remove_if_empty(self.created_dirs)
        if errors:
            what, e = errors[0]
            raise RuntimeError(f"engine.close: closing {what} failed: {e}") from e

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.cfg
        return (f"Engine(precision={c.precision}, params={c.offload.params}, "
                f"optimizer={c.offload.optimizer}, groups={len(self.grouping.groups)}, "
                f"closed={self._closed})")
