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
