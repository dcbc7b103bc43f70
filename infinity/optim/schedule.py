"""Learning-rate schedules: constant, linear and cosine, each with linear warmup.

``step`` is the number of optimizer updates already done (0-based): ``lr_at(step, ...)``
is the learning rate used by update number ``step + 1``.  With ``min_lr == 0`` the
trajectories are exactly those of Hugging Face ``transformers``'
``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup`` and
``get_cosine_schedule_with_warmup`` (num_cycles 0.5); for cosine with ``min_lr > 0`` they
equal ``get_cosine_with_min_lr_schedule_with_warmup(min_lr=...)`` up to ``total_steps``.

    warmup   (step < warmup_steps):  lr = base_lr * step / warmup_steps    (starts at 0)
    constant (after warmup):         lr = base_lr
    linear   (warmup <= step):       p = (step - warmup) / (total - warmup), clamped to [0, 1]
                                     lr = min_lr + (base_lr - min_lr) * (1 - p)
    cosine   (warmup <= step):       lr = min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * p))

After ``total_steps`` the linear and cosine schedules stay at ``min_lr``.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable

from infinity.config import ConfigError, SchedulerConfig

__all__ = ["lr_at", "make_lambda", "lr_trajectory"]


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"lr schedule: step must be an int (number of updates done), "
                        f"got {step!r} ({type(step).__name__})")
    if step < 0:
        raise ValueError(f"lr schedule: step must be >= 0, got {step}")
    return int(step)


def lr_at(step: int, base_lr: float, cfg: SchedulerConfig | None) -> float:
    """Learning rate for update number ``step + 1`` (``step`` updates already done)."""
    step = _check_step(step)
    if cfg is None:
        cfg = SchedulerConfig()
    if not isinstance(cfg, SchedulerConfig):
        raise TypeError(f"lr schedule: cfg must be an infinity.config.SchedulerConfig, got "
                        f"{type(cfg).__name__}; use InfinityConfig.load(...).scheduler")
    base_lr = float(base_lr)
    if cfg.min_lr > base_lr:
        raise ConfigError(f"scheduler.min_lr: must be <= the base lr ({base_lr:g}), got "
                          f"{cfg.min_lr:g}")
    warm = cfg.warmup_steps
    if step < warm:
        return base_lr * step / warm
    if cfg.type == "constant":
        return base_lr
    total = cfg.total_steps
    if total is None or total <= warm:  # SchedulerConfig.validate forbids this
        raise ConfigError(f"scheduler.total_steps: a {cfg.type} schedule needs total_steps > "
                          f"warmup_steps ({warm}), got {total}")
    p = min(1.0, (step - warm) / (total - warm))
    if cfg.type == "linear":
        factor = 1.0 - p
    elif cfg.type == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * p))
    else:  # validated config cannot get here
        raise ConfigError(f"scheduler.type: unknown schedule {cfg.type!r}")
    return cfg.min_lr + (base_lr - cfg.min_lr) * factor


def make_lambda(base_lr: float, cfg: SchedulerConfig | None) -> Callable[[int], float]:
    """A multiplier function for ``torch.optim.lr_scheduler.LambdaLR``.

    ``LambdaLR`` calls it with its epoch counter, which counts ``scheduler.step()`` calls,
    i.e. updates done, so ``lambda(step) * base_lr == lr_at(step, base_lr, cfg)``.
    Give the optimizer (every group) ``base_lr`` as its lr.  With ``base_lr == 0`` the
    multiplier is 0.
    """
    base_lr = float(base_lr)
    if cfg is None:
        cfg = SchedulerConfig()
    lr_at(0, base_lr, cfg)  # validate eagerly

    def multiplier(step: int) -> float:
        if base_lr == 0.0:
            return 0.0
        return lr_at(step, base_lr, cfg) / base_lr

    return multiplier


def lr_trajectory(n_steps: int, base_lr: float, cfg: SchedulerConfig | None) -> list[float]:
    """``[lr_at(0), ..., lr_at(n_steps - 1)]`` (for plots and tests)."""
    return [lr_at(s, base_lr, cfg) for s in range(n_steps)]
