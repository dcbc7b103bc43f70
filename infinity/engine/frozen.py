"""``offload.frozen_weights`` at ``initialize``: which groups keep their frozen weights
quantized at their home (:mod:`infinity.memory.frozen_quant`, Note [Quantized homes]),
and what is refused (with the key to change)."""
from __future__ import annotations

import logging

from infinity.config_sections import ConfigError
from infinity.memory.frozen_quant import QuantSpec, layout_for, quantizable_weights

log = logging.getLogger("infinity.engine")

__all__ = ["refuse_bitsandbytes", "plan_frozen_weights"]

_BNB_CLASSES = ("Linear4bit", "Linear8bitLt", "LinearNF4", "LinearFP4", "Params4bit",
                "Int8Params")


def refuse_bitsandbytes(model) -> None:
    """A model already holding bitsandbytes quantized layers: its weights are GPU-kernel
    formats the tiers cannot page or dequantize; the base must be given in its working
    precision and quantized by ``offload.frozen_weights``."""
    for name, mod in model.named_modules():
        t = type(mod)
        if t.__module__.split(".")[0] == "bitsandbytes" or (
                t.__name__ in _BNB_CLASSES and "bitsandbytes" in t.__module__):
            raise ConfigError(
                f"initialize: module {name or '<root>'} is a bitsandbytes {t.__name__}; "
                f"infinity keeps a quantized frozen base itself, on any home (device, host "
                f"memory or NVMe): load the base model in its working precision (no "
                f"load_in_4bit / load_in_8bit / BitsAndBytesConfig, no "
                f"prepare_model_for_kbit_training) and set offload.frozen_weights.dtype to "
                f"\"nf4\", \"int8\" or \"int4\" instead")


def plan_frozen_weights(engine, grouping) -> int:
    """Attach a payload layout to every frozen group holding a quantizable weight when
    ``offload.frozen_weights.dtype`` is set; returns how many groups were given one.
    A model built under ``infinity.Init`` is quantized group by group as ``initialize``
    adopts it (one group's working-precision values in memory at a time).  Across ranks
    the payloads are replicated at stages 1-2 (device homes) and sharded by bytes at stage
    3 (Note [Quantized shards] in infinity/zero/quantized_shards.py)."""
    cfg = engine.cfg
    fw = cfg.offload.frozen_weights
    if fw.dtype is None:
        return 0
    spec = QuantSpec(fw.dtype, fw.group_size, fw.double_quant)
    qids = quantizable_weights(engine.module)
    n = full = packed = 0
    for g in grouping.groups:
        g.quant = layout_for(g, spec, qids)
        if g.quant is not None:
            n += 1
            full += g.nbytes
            packed += g.home_nbytes
    if n:
        log.info("offload.frozen_weights: %d frozen group(s) stored as %s (group_size %d%s): "
                 "%.1f MB at their home instead of %.1f MB", n, fw.dtype, fw.group_size,
                 ", double_quant" if fw.double_quant else "", packed / 1e6, full / 1e6)
    else:
        log.warning("offload.frozen_weights.dtype is %r but the model has no frozen "
                    "nn.Linear / Conv1D / nn.Embedding weight: nothing is quantized", fw.dtype)
    return n
