"""infinity: heterogeneous memory offload runtime for PyTorch.

Public API (see docs/architecture.md)::

    import infinity
    engine = infinity.initialize(model, config)
    with infinity.Init(config): model = build()
    with infinity.GatheredParameters(params, modifier_rank=0): edit(params)
    infinity.estimate(...)
"""
import logging as _logging

__version__ = "0.1.0"

_logging.getLogger("infinity").addHandler(_logging.NullHandler())

_LAZY = {
    "initialize": ("infinity.engine", "initialize"),
    "Engine": ("infinity.engine", "Engine"),
    "InfinityConfig": ("infinity.config", "InfinityConfig"),
    "Init": ("infinity.zero.init", "Init"),
    "GatheredParameters": ("infinity.zero.gathered", "GatheredParameters"),
    "estimate": ("infinity.estimate", "estimate"),
    "NonFiniteGradientError": ("infinity.engine.phase", "NonFiniteGradientError"),
    "NonFiniteUpdateError": ("infinity.optim.errors", "NonFiniteUpdateError"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'infinity' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
