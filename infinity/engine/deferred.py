"""The engine's side of finishing a decided update in the next forward (Note [Finish in
the next forward] in infinity/optim/deferred_finish.py): whether it may, and the join.
"""
from __future__ import annotations

from infinity.engine.phase import Phase
from infinity.memory.record import Location
from infinity.optim.deferred_finish import DeferredFinish

__all__ = ["start", "join"]


def start(engine) -> bool:
    """``EngineOptimizer.defer_finish``: whether ``engine``'s decided update may be finished
    in the next forward, and if so start it (Note [Finish in the next forward])."""
    opt, mm = engine.opt, engine.mm
    u = opt.unfinished
    want = engine.defer_optimizer_finish
    if want is None:            # on the CPU the forward computes on the cores Adam needs
        want = not mm.dev.zero_copy
    if not want or u is None or engine.zero is not None \
            or engine.swap is not None or opt.store.swap is not None \
            or engine.tiling is not None:
        return False
    by_key = {opt.key(g): g for g in opt.groups}
    groups = [by_key[k] for k in u.keys]
    if not all(mm.paged(g) and g.state is Location.HOST and not g.users for g in groups):
        return False
    rank = {}
    for i, gid in enumerate(engine.coord.trace or engine.coord.recorded_uses()):
        rank.setdefault(gid, i)
    groups.sort(key=lambda g: (rank.get(g.gid, len(rank)), g.gid))
    try:
        opt.deferred = DeferredFinish(opt, groups, mm.mark_home_deferred)
    except Exception:  # noqa: BLE001 -- no thread to start: finished inside step() instead
        mm.clear_home_deferred()
        return False
    opt.last_step_seconds = opt.deferred.decision_s   # (the worker's time added at the join)
    return True


def join(engine) -> None:
    """Wait for the deferred finish and book it (main thread); raises the worker's error
    marked state-lost, the engine FAILED (before anything else is raised: an interrupt
    held while waiting comes after).  Nothing to do when none runs."""
    opt = engine.opt
    d = getattr(opt, "deferred", None) if opt is not None else None
    if d is None:
        return
    try:
        d.wait()
    finally:
        opt.deferred = None
        engine.mm.clear_home_deferred()
        try:
            opt.book_finished(d.done, deferred_seconds=d.decision_s + d.busy_s)
        finally:
            if d.error is not None:
                _failed(engine, d)


def _failed(engine, d) -> None:
    e = d.error
    try:
        e._infinity_state_lost = True
    except AttributeError:
        pass
    if engine.phase is not Phase.CLOSED:
        engine.phase = Phase.FAILED
        engine.fail_reason = (f"{type(e).__name__}: {e}"[:500] + "; the decided update "
                               "cannot be finished: reload a checkpoint")
    if not any("Finish in the next forward" in n for n in getattr(e, "__notes__", ())):
        e.add_note(f"infinity: finishing the decided update of global step {d.u.hp['step']} "
                   f"during the next forward failed after {len(d.done)} of "
                   f"{len(d.groups)} groups; host states were updated in place part-way: "
                   f"reload a checkpoint into a new engine (Note [Finish in the next forward])")
    raise e
