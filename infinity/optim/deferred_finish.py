"""Finish a decided update while the next forward runs (Note [Finish in the next forward]).

:class:`DeferredFinish` steps the groups of a decided update (``EngineOptimizer.unfinished``)
one at a time on its own worker thread, in the order the last forward used them; the
engine decides when it may and joins it (:mod:`infinity.engine.deferred`).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["DeferredFinish"]

# Note [Finish in the next forward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When no group was stepped during backward (the last update was clipped: clipping at 1.0
# clips every step early in training; Note [Speculative clipping]), the whole Adam step
# runs after backward while the accelerator waits (a 3B model on an H200: 0.77 s of a
# 1.70 s step).  Once the update is decided -- the norm known, every gradient finite, every
# rank agreed (Note [roll forward]) -- it only has to be finished, and a group's new values
# are first read when the next forward fetches it.  So where nothing but memory is
# written -- one process, no NVMe anywhere (states and params in host memory: Note [finish
# only]), every remaining group paged and back at its host home, no tiling --
# ``engine.step()`` returns after the decision and one worker thread steps the groups one
# at a time, in the order the last forward first used them, while the next forward runs.
# A fetch of a group waits for its step first (MemoryManager.mark_home_deferred): that is
# the only read of a home a forward makes.  The forward's end joins the worker -- also when
# the forward raised, before its window is dropped -- and so does every other engine call
# before it reads or writes anything (Engine._enter, close).  The join does the main-thread
# bookkeeping a synchronous finish does (gradient buffers back to their pool, counts,
# zero_grad).  A group step that fails (a non-finite result, anything else) leaves host
# states updated in place part-way: the join raises it marked state-lost and the engine
# goes FAILED, as a synchronous finish would.  stats()["optimizer_groups_finished_after_step"]
# counts the groups stepped this way.  By default only on a separate device tier (a GPU):
# on a CPU-only engine the forward computes on the very cores the Adam step needs, so
# overlapping them gains nothing; ``engine.defer_optimizer_finish`` True does it there too,
# False never (identical results either way: tests/engine/test_deferred_finish.py).


class DeferredFinish:
    """The worker stepping ``groups`` (in that order) of ``opt.unfinished``."""

    def __init__(self, opt, groups, mark):
        self.opt = opt
        self.u = opt.unfinished
        self.groups = list(groups)
        self._events = {g.gid: threading.Event() for g in self.groups}
        self._ended = threading.Event()
        self.done: list = []              # (group, item) stepped and committed, in order
        self._done_gids: set = set()
        self.error: BaseException | None = None
        # the step's time as stats() reports it: up to the decision, then the worker's own
        self.decision_s = time.perf_counter() - self.u.t0
        self.busy_s = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infinity-finish")
        self._future = self._pool.submit(self._run)
        # (marked after the worker started -- nothing fetches before step() returns -- so a
        # failed start leaves no mark behind that a fetch would wait on for ever)
        for g in self.groups:
            mark(g.gid, self._waiter(g.gid))

    def _waiter(self, gid: int):
        ev = self._events[gid]

        def wait() -> None:
            while not ev.wait(0.05):      # short waits: a signal is seen between them
                pass
            if self.error is not None and gid not in self._done_gids:
                raise RuntimeError(
                    f"infinity: the decided update could not be finished for this parameter "
                    f"group (gid {gid}): its step failed during the next forward "
                    f"({type(self.error).__name__}: {self.error}); the engine fails at the "
                    f"join: reload a checkpoint (Note [Finish in the next forward])")
        return wait

    def _run(self) -> None:
        from infinity.optim.step_txn import StepTxn
        opt, u = self.opt, self.u
        t0 = time.perf_counter()
        try:
            for g in self.groups:
                key = opt.key(g)
                mini = StepTxn(host_undo=False)   # host states: in place, no undo copy
                opt.store.prepare(mini, key, force=True)
                item = opt._item(g, u.lrs, u.wds, u.overrides)
                bad = opt.store.step([item], txn=mini, **u.hp)
                if bad:
                    opt._lost_update(bad, u.hp["step"])   # raises, marked state-lost
                opt.store.commit(mini)
                self.done.append((g, item))
                self._done_gids.add(g.gid)
                self._events[g.gid].set()
        except BaseException as e:  # noqa: BLE001 -- raised on the main thread by join()
            self.error = e
        finally:
            self.busy_s = time.perf_counter() - t0
            for ev in self._events.values():
                ev.set()
            self._ended.set()

    def wait(self) -> None:
        """Block until the worker ended; a KeyboardInterrupt meanwhile is held until then
        and re-raised (the worker writes host states in place: it is never abandoned)."""
        interrupted = None
        while not self._future.done():
            try:
                self._ended.wait(0.05)    # short waits: a signal lands between them
            except KeyboardInterrupt as e:
                interrupted = e
        self._pool.shutdown(wait=True)
        if interrupted is not None:
            raise interrupted
