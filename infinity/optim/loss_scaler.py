"""Dynamic loss scaling for fp16 training.

The loss is multiplied by ``scale`` before backward; gradients are unscaled inside the
optimizer step (fused into CPU Adam's gradient multiplier).  An inf/NaN gradient means
the step is skipped and the scale multiplied by ``backoff_factor`` (floored at
``min_scale``); after ``growth_interval`` consecutive clean steps the scale grows by
``growth_factor``.
"""
from __future__ import annotations

import logging
import math

log = logging.getLogger("infinity.optim")

__all__ = ["DynamicLossScaler", "StaticLossScaler"]


class StaticLossScaler:
    """Scale 1, never skips (fp32 / bf16)."""
    scale = 1.0
    skipped_steps = 0

    def update(self, overflow: bool) -> bool:
        return not overflow

    def state_dict(self) -> dict:
        return {"scale": 1.0, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, d: dict) -> None:
        self.skipped_steps = int(d.get("skipped_steps", 0))


class DynamicLossScaler:
    def __init__(self, initial_scale: float = 65536.0, growth_interval: int = 1000,
                 backoff_factor: float = 0.5, growth_factor: float = 2.0,
                 min_scale: float = 1.0):
        if not (initial_scale > 0 and math.isfinite(initial_scale)):
            raise ValueError(f"loss scaler: initial_scale must be a finite positive number, "
                             f"got {initial_scale}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"loss scaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_factor <= 1:
            raise ValueError(f"loss scaler: growth_factor must be > 1, got {growth_factor}")
        if growth_interval < 1:
            raise ValueError(f"loss scaler: growth_interval must be >= 1, got {growth_interval}")
        self.scale = float(initial_scale)
        self.growth_interval = int(growth_interval)
        self.backoff_factor = float(backoff_factor)
        self.growth_factor = float(growth_factor)
        self.min_scale = float(min_scale)
        self.clean_steps = 0
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, cfg) -> "DynamicLossScaler":
        return cls(cfg.initial_scale, cfg.growth_interval, cfg.backoff_factor,
                   cfg.growth_factor, cfg.min_scale)

    def update(self, overflow: bool) -> bool:
        """Record one optimizer boundary; returns True when the step should be applied."""
        if overflow:
            old = self.scale
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            self.skipped_steps += 1
            log.info("fp16: gradient overflow, step skipped; loss scale %g -> %g", old, self.scale)
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self.clean_steps = int(d.get("clean_steps", 0))
        self.skipped_steps = int(d.get("skipped_steps", 0))
