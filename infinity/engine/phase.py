"""The engine's phase machine and the shielded commit (failure semantics).

Note [window abort]
-------------------
Every update is all-or-nothing.  An exception of any kind (``KeyboardInterrupt`` and
``SystemExit`` included) raised in ``forward``, ``backward`` or ``step`` drops the
whole accumulation window: the optimizer steps already taken for it during backward
are rolled back (Note [commit point] in :class:`infinity.optim.step_txn.StepTxn`),
its gradients are discarded, ``micro_steps`` goes back to the window's start, every
group is released to its home and the hooks forget what was executing.  Parameters,
fp32 masters, Adam moments, ``global_steps``, the LR schedule and the loss scale are
then exactly as after the last completed update; the original exception propagates
unchanged and the next forward/backward/step works.  If the rollback itself fails
the engine enters ``FAILED`` and every method but ``stats()``/``close()`` says to
reload a checkpoint.

The commit of an update (state swap, counters, schedule) runs on a worker thread
while the main thread waits (:func:`run_shielded`): Python delivers signals to the
main thread only, so a ``KeyboardInterrupt`` raised by a signal handler during the
commit is held until the commit has ended, then re-raised.
"""
from __future__ import annotations

import contextlib

import _thread
import enum
from concurrent.futures import ThreadPoolExecutor

from infinity.optim.errors import NonFiniteUpdateError  # noqa: F401 (re-exported)

__all__ = ["Phase", "NonFiniteGradientError", "NonFiniteUpdateError", "run_shielded", "wait_done",
           "PhaseError"]


class Phase(enum.Enum):
    IDLE = "idle"              # between calls (a window may be accumulating)
    FORWARD = "forward"
    BACKWARD = "backward"
    STEPPING = "stepping"
    FAILED = "failed"          # a rollback failed: only stats() and close() work
    CLOSED = "closed"


class PhaseError(RuntimeError):
    """A public engine method was called in a phase that does not accept it."""


class NonFiniteGradientError(FloatingPointError):
    """The global gradient norm of an update was inf or NaN (``nonfinite_grads: "raise"``);
    the update was rolled back (nothing changed)."""


def wait_done(fut) -> None:
    """Block until ``fut`` is done.  Waits on a bare C lock released by the future's done
    callback, not in ``Future.result()``: a ``KeyboardInterrupt`` raised by a signal handler
    inside ``threading.Condition.wait`` can leave its lock half-released ("cannot release
    un-acquired lock"), while an interrupted ``lock.acquire()`` holds nothing."""
    if fut.done():
        return
    gate = _thread.allocate_lock()
    gate.acquire()
    fut.add_done_callback(lambda _f: gate.release())
    gate.acquire()


def run_shielded(executor: ThreadPoolExecutor, fn, *args, hold=None):
    """Run ``fn(*args)`` on ``executor``'s worker and wait for it; a ``KeyboardInterrupt``
    raised in this (main) thread while waiting is held until ``fn`` has returned, then
    re-raised (``fn``'s own exception wins, chained to it).  ``hold``: a context that holds
    signals while the task is handed over (an interrupt inside ``submit`` -- its worker
    thread starting -- would otherwise leave ``fn`` running unwaited for)."""
    with (hold if hold is not None else contextlib.nullcontext()):
        fut = executor.submit(fn, *args)
    interrupted = None
    while True:
        try:
            wait_done(fut)
            break
        except KeyboardInterrupt as e:     # a signal: wait for the worker, then raise it
            interrupted = e
    err = fut.exception()                  # done: returns at once
    if err is not None:
        if interrupted is not None:
            raise err from interrupted
        raise err
    if interrupted is not None:
        raise interrupted
    return fut.result()


def nonfinite_report(opt, boundary: int):
    """``(error, warning)`` for an update skipped for inf/NaN gradients or rolled back for
    an inf/NaN Adam result (Note [non-finite result]), from the step driver ``opt``."""
    groups = opt.last_nonfinite_groups
    if groups:
        what = (f"the Adam result of update {boundary} (global step {opt.step_count + 1}) "
                f"came out inf/NaN in parameter group(s) {', '.join(groups)} (an overflow from "
                f"finite gradients)")
        err = NonFiniteUpdateError(
            f"engine.step: {what}; the update was rolled back (weights, optimizer states, "
            f"global_steps and the LR schedule are unchanged). Lower the learning rate or "
            f"clip gradients (gradient_clipping); nonfinite_grads: \"skip\" skips such "
            f"updates instead", groups=groups, rolled_back=True)
        warning = (f"infinity: {what}; rolled back: weights and optimizer states unchanged "
                   f"({opt.nonfinite_steps} skipped updates so far)")
        return err, warning
    err = NonFiniteGradientError(
        f"engine.step: the gradient norm of update {boundary} (global step "
        f"{opt.step_count + 1}) is {opt.last_grad_norm}; the update was not "
        f"applied (weights, optimizer states, global_steps and the LR schedule are "
        f"unchanged). Set nonfinite_grads: \"skip\" to skip such updates instead")
    warning = (f"infinity: update {boundary} skipped: the gradient norm is "
               f"{opt.last_grad_norm} (inf/NaN); weights and optimizer states "
               f"unchanged ({opt.nonfinite_steps} such updates so far)")
    return err, warning

