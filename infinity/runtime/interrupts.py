"""Signals held across the hooks' bookkeeping, so an interrupt never splits a hand-off.

Python runs a signal's handler (``KeyboardInterrupt`` for Ctrl-C, or a user's handler
that raises, e.g. a timeout on ``SIGALRM``) on the main thread between two bytecodes,
anywhere.  Inside a hook that moves a buffer between two owners (the manager releasing
a group, the overlapped step taking a buffer over, a gradient arriving) an exception
raised half-way leaves the buffer with both owners or with neither.  The window abort
(Note [window abort] in :mod:`infinity.engine.phase`) can roll back any state an
exception leaves *between* hooks, not every state inside one.

Note [held interrupts]
~~~~~~~~~~~~~~~~~~~~~~
While the engine runs a public call (forward, backward, step, the rollback) on the main
thread, :meth:`InterruptGate.open` wraps the Python handlers of the signals that commonly
stop or time out a run (:data:`GATED_SIGNALS`, only those with a Python-level handler).
A gated signal is *held* when it lands in infinity's own code: inside a hook body
(``with gate:``), or where the innermost frame that is neither torch's nor the standard
library's is infinity's (the engine's bookkeeping between hooks, an ``except`` clause
about to roll back).  Its original handler then runs at the next safe point: the end of
the outermost hook body, or the gate's closing at the end of the call.  So the interrupt
surfaces microseconds to milliseconds later, where the window abort can undo everything.
A signal landing in the user's code (the model's forward, a custom backward) runs its
handler at once, so a model stuck in its own code stays interruptible; so does one
inside :meth:`allow` (the engine's long boundary step, which rolls back by itself) —
except on a ``with`` statement of infinity's own code: Python calls ``__exit__`` only for
an exception raised *inside* the block, so one raised while the statement enters or
leaves it (after ``lock.acquire``, before ``lock.release``) would leave a lock held for
good and the next use of it (the next NVMe submit, the next link count) would deadlock;
such a signal is held until the call ends.  A
body entered from a destructor (:meth:`quiet`) never raises: its held signal waits for
the next safe point; so does a signal landing in a destructor's own frame
(:func:`never_raise_in`), where Python would drop the exception.  Off the main thread
(where Python never runs signal handlers) and without a Python-level handler the gate
does nothing.
"""
from __future__ import annotations

import linecache
import os
import signal
import sys
import sysconfig
import threading

__all__ = ["InterruptGate", "GATED_SIGNALS", "never_raise_in", "in_own_code"]

GATED_SIGNALS = tuple(getattr(signal, n) for n in
                      ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGVTALRM", "SIGUSR1", "SIGUSR2")
                      if hasattr(signal, n))


# code objects where a raised signal would be lost (destructors: Python prints and drops
# their exceptions): a signal landing in one is held like one inside a hook body
_NO_RAISE: set = set()


def never_raise_in(fn) -> None:
    """Hold a signal that lands in ``fn``'s own frame (a ``__del__``) instead of raising it
    there, where Python would drop it."""
    _NO_RAISE.add(fn.__code__)


def _lower_layers() -> None:
    """Multi-statement updates of the layers below (they cannot import this module): a
    signal landing in them is held like one in a destructor."""
    from infinity.io.extents import ExtentAllocator
    for name in ExtentAllocator.UNSPLIT:
        never_raise_in(getattr(ExtentAllocator, name))


_lower_layers()


_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # infinity/


def _library_dirs() -> tuple[str, tuple[str, ...]]:
    """(torch's package dir, the standard library's dirs)."""
    import torch
    std = [os.path.abspath(p) + os.sep for p in
           (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")) if p]
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, tuple(dict.fromkeys(std))


_LIBRARY = None


def in_own_code(frame) -> bool:
    """Whether the innermost frame that is neither torch's nor the standard library's
    (those run on behalf of their caller) belongs to infinity."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library_dirs()
    torch_dir, std = _LIBRARY
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn.startswith(_OWN):
            return True
        library = fn.startswith("<") or fn.startswith(torch_dir) or \
            (fn.startswith(std) and "-packages" not in fn)   # (site-packages: the user's)
        if not library:
            return False                  # the user's code: interruptible
        frame = frame.f_back
    return False


def _at_with_statement(frame) -> bool:
    """Whether ``frame`` (infinity's own) stands on a ``with`` statement: entering or
    leaving its block (Note [held interrupts])."""
    fn = frame.f_code.co_filename
    if not fn.startswith(_OWN):
        return False
    line = linecache.getline(fn, frame.f_lineno).lstrip()
    return line.startswith(("with ", "async with "))


class InterruptGate:
    """See Note [held interrupts].  ``with gate:`` marks a hook body; ``with gate.open():``
    an engine call during which the gated handlers are wrapped."""

    def __init__(self):
        self._main = threading.main_thread().ident
        self._depth = 0                   # hook bodies being run (nested)
        self._quiet = 0                   # ... of which entered from a destructor
        self._allow = 0                   # inside allow(): infinity's own frames raise too
        self._opened = 0                  # nested open() calls
        self._saved: dict[int, object] = {}   # signal -> the handler we wrapped
        self._pending: tuple | None = None    # (signum, frame) of the first held signal
        self.held = 0                     # signals held so far (tests, stats)

    # ------------------------------------------------------------------ hook bodies
    # (only the main thread counts: Python runs handlers there, and a hook body on an
    # autograd worker thread must neither hold nor raise the main thread's signal)
    def __enter__(self) -> "InterruptGate":
        if threading.get_ident() == self._main:
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != self._main:
            return
        self._depth -= 1
        if self._depth == 0 and self._pending is not None and not self._quiet:
            self._deliver()

    def quiet(self) -> "_Quiet":
        """A hook body run from a destructor: a held signal is not raised at its end."""
        return _Quiet(self)

    # ------------------------------------------------------------------ engine calls
    def open(self) -> "_Open":
        return _Open(self)

    def _install(self) -> None:
        if threading.get_ident() != self._main:
            return
        for sig in GATED_SIGNALS:
            h = signal.getsignal(sig)
            if callable(h) and h != self._handler:
                self._saved[sig] = h
                signal.signal(sig, self._handler)

    def _uninstall(self) -> None:
        handlers = dict(self._saved)
        for sig in list(self._saved):
            # restored before forgotten: a signal arriving in between finds the original
            # either way (and an interrupted uninstall is finished by the next one)
            if signal.getsignal(sig) == self._handler:   # (left alone if the user replaced it)
                signal.signal(sig, self._saved[sig])
            del self._saved[sig]
        if self._pending is not None:
            self._deliver(handlers)

    def allow(self) -> "_Allow":
        """Code of infinity's that is safe to interrupt anywhere (it rolls back by itself):
        outside hook bodies, a signal there runs its handler at once."""
        return _Allow(self)

    def _holds(self, frame) -> bool:
        if self._depth > 0 or frame is None:
            return self._depth > 0
        if frame.f_code in _NO_RAISE:
            return True
        if self._allow:                   # interruptible, but never between acquire/release
            return _at_with_statement(frame)
        return in_own_code(frame)

    def _handler(self, signum, frame) -> None:
        if self._holds(frame):
            if self._pending is None:
                self._pending = (signum, frame)
            self.held += 1
            return
        self._call(signum, frame, self._saved)

    def _deliver(self, handlers=None) -> None:
        signum, frame = self._pending
        self._pending = None
        self._call(signum, frame, self._saved if handlers is None else handlers)

    @staticmethod
    def _call(signum, frame, handlers) -> None:
        h = handlers.get(signum)
        if h is None:
            h = signal.getsignal(signum)
        if callable(h) and not (getattr(h, "__func__", None) is InterruptGate._handler):
            h(signum, frame)
        elif signum == getattr(signal, "SIGINT", None):
            raise KeyboardInterrupt


class _Quiet:
    __slots__ = ("g",)

    def __init__(self, g: InterruptGate):
        self.g = g

    def __enter__(self):
        if threading.get_ident() == self.g._main:
            self.g._quiet += 1
            self.g._depth += 1

    def __exit__(self, *exc):
        if threading.get_ident() == self.g._main:
            self.g._depth -= 1
            self.g._quiet -= 1


class _Allow:
    __slots__ = ("g",)

    def __init__(self, g: InterruptGate):
        self.g = g

    def __enter__(self):
        if threading.get_ident() == self.g._main:
            self.g._allow += 1
            if self.g._pending is not None and self.g._depth == 0 and not self.g._quiet:
                self.g._deliver()             # held until here: raise it now

    def __exit__(self, *exc):
        if threading.get_ident() == self.g._main:
            self.g._allow -= 1


class _Open:
    __slots__ = ("g",)

    def __init__(self, g: InterruptGate):
        self.g = g

    def __enter__(self):
        g = self.g
        # installed before counted: until the handlers are wrapped Python's own handler
        # raises anywhere, and a KeyboardInterrupt between the count and the install left
        # the gate counted open with nothing installed (every later call ran unguarded)
        if g._opened == 0:
            g._allow = 0                  # (an earlier call interrupted inside allow())
            try:
                g._install()
            except BaseException:     # a signal raised by a handler wrapped already
                g._uninstall()
                raise
        g._opened += 1                    # (a signal landing here is held: installed)

    def __exit__(self, *exc):
        g = self.g
        g._opened -= 1
        if g._opened == 0:
            g._uninstall()
