"""Errors of the optimizer step that reach the user through ``engine.step()``."""
from __future__ import annotations

__all__ = ["NonFiniteUpdateError"]


class NonFiniteUpdateError(FloatingPointError):
    """An update's result was inf/NaN from finite gradients (an overflow in Adam: Note
    [non-finite result] in infinity/optim/step_txn.py).  ``rolled_back``: True when
    the update was rolled back (``nonfinite_grads: "raise"``; nothing changed), False when
    it could not be (host states updated in place): the engine is then ``FAILED`` and a
    checkpoint must be reloaded.  ``groups``: the parameter groups concerned."""

    def __init__(self, msg: str, *, groups=(), rolled_back: bool = True):
        super().__init__(msg)
        self.groups = tuple(groups)
        self.rolled_back = rolled_back
