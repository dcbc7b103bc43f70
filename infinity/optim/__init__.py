"""Optimizers: the SIMD CPU Adam (``adam_step``, ``CPUAdam``) and kernel controls.

Other modules of this package (``offload_step``, ``schedule``, ``param_groups``)
are imported by their full names; this file only exposes the CPU Adam.
"""
from .functional import (SIMD_LEVELS, SimdUnavailableError, adam_step, best_simd, cpu_supports,
                         default_num_threads, doctor_checks, get_num_threads, select_simd,
                         set_num_threads, simd_level)

__all__ = ["adam_step", "CPUAdam", "set_num_threads", "get_num_threads", "default_num_threads",
           "simd_level", "best_simd", "select_simd", "cpu_supports", "doctor_checks",
           "SimdUnavailableError", "SIMD_LEVELS"]


def __getattr__(name):
    # CPUAdam is loaded on first use so that `import infinity.optim` stays light.
    if name == "CPUAdam":
        from .cpu_adam import CPUAdam
        return CPUAdam
    raise AttributeError(f"module 'infinity.optim' has no attribute {name!r}")
