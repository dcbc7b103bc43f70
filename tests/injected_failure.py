"""An autograd function whose backward raises on demand: a failure inside backward, as an
out-of-memory error or an interrupt would raise it (shared by engine and ZeRO tests)."""
import torch


def boom_function(message: str, exc: type = RuntimeError) -> type:
    """A fresh identity ``torch.autograd.Function`` whose backward raises ``exc(message)``
    while its ``armed`` is true (``armed``/``exc`` are class attributes a test sets)."""

    class Boom(torch.autograd.Function):
        armed = False

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if Boom.armed:
                raise Boom.exc(message)
            return g

    Boom.exc = exc
    return Boom
