"""InterruptGate (Note [held interrupts]): a signal arriving inside a hook body is held
until the body ends, then its original handler runs; outside bodies it runs at once."""
import os
import signal
import threading

import pytest

from infinity.runtime.interrupts import InterruptGate, never_raise_in


class Stop(Exception):
    pass


@pytest.fixture
def usr1():
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise Stop

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGUSR1, old)


def _raise_signal():
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(1000):          # Python runs the handler at the next bytecode boundary
        pass


def test_signal_inside_a_body_is_held_until_it_ends(usr1):
    gate = InterruptGate()
    steps = []
    with pytest.raises(Stop):
        with gate.open():
            with gate:
                _raise_signal()
                steps.append("after the signal")      # the body finishes its bookkeeping
                with gate:                            # nested bodies: held until the outermost
                    steps.append("nested")
                steps.append("end of body")
            steps.append("not reached")
    assert steps == ["after the signal", "nested", "end of body"]
    assert usr1 == [signal.SIGUSR1] and gate.held == 1
    assert signal.getsignal(signal.SIGUSR1) != gate._handler     # restored


def test_signal_outside_bodies_is_raised_at_once(usr1):
    gate = InterruptGate()
    steps = []
    with pytest.raises(Stop):
        with gate.open():
            _raise_signal()
            steps.append("not reached")
    assert steps == [] and gate.held == 0


def test_without_open_the_gate_holds_nothing(usr1):
    gate = InterruptGate()
    with pytest.raises(Stop):
        with gate:
            _raise_signal()
            pytest.fail("the handler was not wrapped: it raises where the signal lands")


def test_held_signal_survives_a_quiet_body_and_raises_at_close(usr1):
    gate = InterruptGate()
    with pytest.raises(Stop):
        with gate.open():
            with gate.quiet():
                _raise_signal()
            assert usr1 == []                       # a destructor's body never raises
    assert usr1 == [signal.SIGUSR1]


def test_signal_in_a_registered_destructor_frame_is_held(usr1):
    gate = InterruptGate()

    def fragile():
        _raise_signal()                          # not in the frame itself: raised
    def sheltered():
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):
            pass
        return "finished"
    never_raise_in(sheltered)
    with pytest.raises(Stop):
        with gate.open():
            assert sheltered() == "finished"
            assert usr1 == []
            with gate:
                pass                             # the next body's end delivers it
    assert usr1 == [signal.SIGUSR1]
    with pytest.raises(Stop):
        with gate.open():
            fragile()


def test_user_replacing_the_handler_meanwhile_is_left_alone(usr1):
    gate = InterruptGate()
    mine = lambda s, f: None  # noqa: E731
    with gate.open():
        signal.signal(signal.SIGUSR1, mine)
    assert signal.getsignal(signal.SIGUSR1) is mine


def test_other_threads_neither_hold_nor_raise(usr1):
    gate = InterruptGate()
    out = []

    def worker():
        with gate:
            out.append(gate._depth)
    with gate.open():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert out == [0]                            # the main thread's count is untouched


def _signal_at_with_exit(fn, *args):
    """Run ``fn(*args)`` (infinity's own code with one ``with lock:``) with the SIGUSR1
    handler run — as Python runs it for a pending signal — at the line event where the
    ``with`` statement leaves its block (its line seen the second time)."""
    import sys
    code = fn.__code__
    seen = []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return tracer if event == "call" and frame.f_code is code else None
        if event == "line":
            seen.append(frame.f_lineno)
            if len(seen) > 1 and frame.f_lineno == seen[0]:
                signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, frame)
        return tracer
    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return seen


def test_signal_leaving_a_with_block_in_allow_is_held_so_no_lock_stays_taken(usr1):
    """Inside allow() a signal in infinity's code raises at once, but not on a ``with``
    statement: raised where it leaves the block, the exception skips ``__exit__`` and the
    lock stays held (the next NVMe submit or link count deadlocked; Note [held
    interrupts]).  Held instead, it is raised when the call ends."""
    from infinity.memory.accounting import Accounting
    acct = Accounting()
    gate = InterruptGate()
    with pytest.raises(Stop):
        with gate.open():
            with gate.allow():
                seen = _signal_at_with_exit(Accounting.link, acct, "h2d", 8, 0.5)
                assert len(set(seen)) > 1 and usr1 == []   # the block ran; signal held
                assert not acct._lock.locked()
                acct.link("h2d", 8)                     # the lock is usable again
            assert usr1 == []
    assert usr1 == [signal.SIGUSR1] and acct.link_bytes["h2d"] == 16


def test_the_with_exit_line_is_where_an_exception_leaves_a_lock_taken():
    """Why the rule above exists (CPython 3.11+): an exception raised at the line event of
    a ``with`` statement's exit is not covered by its ``__exit__``."""
    import threading as th
    from infinity.memory.accounting import Accounting
    acct = Accounting()
    acct._lock = th.Lock()

    def boom(signum, frame):
        raise Stop
    old = signal.signal(signal.SIGUSR1, boom)
    try:
        with pytest.raises(Stop):
            _signal_at_with_exit(Accounting.link, acct, "h2d", 8, 0.5)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert acct._lock.locked()


def test_an_interrupt_while_opening_leaves_the_gate_closed(usr1):
    """Python's own handler runs until the gate has wrapped it: an interrupt landing on
    any line of open() before that must leave the gate closed (not counted open with
    nothing installed, so that every later call ran unguarded)."""
    import sys
    from infinity.runtime import interrupts
    gate = InterruptGate()
    code = interrupts._Open.__enter__.__code__
    for target in range(1, 8):
        seen = []

        def tracer(frame, event, arg):
            if frame.f_code is code and event == "line":
                seen.append(frame.f_lineno)
                if len(seen) == target:
                    signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, frame)
            return tracer
        usr1.clear()
        try:
            sys.settrace(tracer)
            try:
                with gate.open():
                    pass
            finally:
                sys.settrace(None)
        except Stop:
            pass
        assert gate._opened == 0, f"interrupt at line {seen[-1]}: the gate stayed counted open"
        assert signal.getsignal(signal.SIGUSR1) != gate._handler
        with pytest.raises(Stop):                 # and the next call is guarded again
            with gate.open():
                with gate:
                    _raise_signal()
                    assert usr1 == []
