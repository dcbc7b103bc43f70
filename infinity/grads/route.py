"""Where a parameter's gradient goes when autograd produced it: the hooks
(:mod:`infinity.runtime.hooks`) call one ``on_grad(group, slot, grad)``; it accumulates
the gradient at its home (:meth:`infinity.grads.accumulate.GradAccumulation.accumulate`: host
buffer, D2H staging or the NVMe home) and then tells an optional listener which slot of
the group is final (the overlapped step, :mod:`infinity.engine.overlap`)."""
from __future__ import annotations

from typing import Callable

__all__ = ["grad_sink"]


def grad_sink(accumulate: Callable, groups, *, after: Callable | None = None) -> Callable:
    """``on_grad(g, slot, grad)``: ``accumulate(g, slot, grad)`` then, when given,
    ``after(g, slot_index)`` (the slot's index in ``g.slots``)."""
    if after is None:
        return accumulate
    slot_index = {id(s): i for g in groups for i, s in enumerate(g.slots)}

    def on_grad(g, slot, grad):
        accumulate(g, slot, grad)
        after(g, slot_index[id(slot)])
    return on_grad
