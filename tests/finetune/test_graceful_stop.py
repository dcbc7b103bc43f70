"""GracefulStop: first signal requests a stop, second aborts, after finish() signals are
only logged; handlers are restored on exit."""
import os
import signal

import pytest

from infinity.finetune.stop import GracefulStop


def _raise_sigint():
    os.kill(os.getpid(), signal.SIGINT)


def test_first_requests_second_aborts_and_handler_is_restored():
    before = signal.getsignal(signal.SIGINT)
    stop = GracefulStop()
    with stop:
        _raise_sigint()
        assert stop.requested and not stop.aborted and stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            _raise_sigint()
        assert stop.aborted
        with pytest.raises(KeyboardInterrupt):
            stop.check_abort()
    assert signal.getsignal(signal.SIGINT) is before


def test_after_finish_signals_are_logged_not_raised(caplog):
    stop = GracefulStop()
    with stop:
        _raise_sigint()
        assert stop.requested
        stop.finish()
        with caplog.at_level("WARNING", logger="infinity.finetune"):
            _raise_sigint()  # would abort before finish()
            _raise_sigint()
        assert not stop.aborted
        stop.check_abort()
    late = [r for r in caplog.records if "while finishing" in r.getMessage()]
    assert len(late) == 1  # logged once, not once per signal
