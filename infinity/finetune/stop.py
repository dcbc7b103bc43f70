"""Ctrl-C handling for the training loop.

First SIGINT (or SIGTERM, e.g. from a scheduler or torchrun): ask the loop to
stop at the next step boundary; the loop then saves (if asked) and closes the
engine. A second SIGINT aborts at once by raising ``KeyboardInterrupt`` where
the program is — the caller's ``finally``/``with`` still closes the engine, so
no swap files remain either way. Once the caller calls :meth:`GracefulStop.finish`
(the loop is over), signals are only logged until the context exits.

Under ``torch.distributed`` the stop decision is agreed across ranks
(all-reduce MAX) so that no rank is left waiting in a collective.
"""
import logging
import signal
import sys
import threading

log = logging.getLogger("infinity.finetune")


def collective_device():
    """Where tensors for a small collective must live for the current backend."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GracefulStop:
    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM)):
        self.requested = False
        self.aborted = False
        self.reason = None
        self._count = 0
        self._signals = signals
        self._previous = {}
        self._finished = False
        self._late_logged = False

    def _handler(self, signum, frame):
        self._count += 1
        name = signal.Signals(signum).name
        if self._finished:
            # the loop is over and the engine is closing or closed: nothing left to abort
            if not self._late_logged:
                self._late_logged = True
                log.warning("%s received while finishing: ignored, the run is ending", name)
            return
        if self._count == 1 and not self.requested:
            self.requested = True
            self.reason = name
            log.warning("%s received: stopping at the next step boundary "
                        "(press Ctrl-C again to abort now)", name)
            return
        log.warning("%s received again: aborting", name)
        self.aborted = True
        raise KeyboardInterrupt

    def finish(self):
        """The training loop is over: from now until ``__exit__`` a signal is only logged
        (aborting would only interrupt the close and the summary, and print a traceback
        from wherever it landed)."""
        self._finished = True

    def request(self, reason="requested"):
        """Ask for a stop from code (tests, callbacks)."""
        self.requested = True
        self.reason = self.reason or reason

    def _unraisable(self, info):
        # The abort's KeyboardInterrupt can land inside a __del__ or weakref callback, where
        # Python swallows it ("Exception ignored in ..."); check_abort() re-raises it at the
        # next safe point, so that message is noise: drop it, report anything else.
        if issubclass(info.exc_type, KeyboardInterrupt):
            return
        self._previous_unraisable(info)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self._signals:
                self._previous[s] = signal.signal(s, self._handler)
            self._previous_unraisable = sys.unraisablehook
            sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        if self._previous:
            sys.unraisablehook = self._previous_unraisable
        self._previous.clear()
        return False

    def check_abort(self):
        """Raise ``KeyboardInterrupt`` if a second signal asked to abort (even when the
        handler's own raise was swallowed)."""
        if self.aborted:
            raise KeyboardInterrupt

    def should_stop(self, dist_group=None):
        """True when this rank (or any rank, when distributed) asked to stop."""
        import torch.distributed as dist

        self.check_abort()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32,
                                device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist_group)
            if flag.item() and not self.requested:
                self.requested = True
                self.reason = "another rank stopped"
            return bool(flag.item())
        return self.requested
