"""The sequence-length curriculum under the Hugging Face ``Trainer``.

:class:`CurriculumCallback` holds a :class:`infinity.curriculum.SeqlenSchedule`.
``InfinityTrainer`` adds one by itself when its ``infinity_config`` (an infinity config or a
DeepSpeed config) has an enabled ``curriculum_learning`` block, truncates every training
micro-batch in ``training_step`` to the length of the current optimizer step
(``state.global_step``: the updates already applied, so every micro-batch of one update has
the same length) and logs that length as ``curriculum_seqlen`` beside ``loss``.

Truncating in ``training_step`` rather than in the data collator keeps the length right
with ``dataloader_num_workers > 0`` (workers collate batches ahead of the step).  The
schedule is a pure function of the step, so ``resume_from_checkpoint`` continues it from
the restored ``global_step``; the callback's state (its block and the step) is also
written to ``trainer_state.json`` (``stateful_callbacks``) with every checkpoint.
"""
from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from infinity.curriculum import SeqlenSchedule, config_dict

log = logging.getLogger("infinity.integrations")

__all__ = ["CurriculumCallback", "LOG_KEY"]

#: the key of the current length in the Trainer's logs
LOG_KEY = "curriculum_seqlen"


class CurriculumCallback(TrainerCallback, ExportableState):
    """``CurriculumCallback(config)``: ``config`` a ``curriculum_learning`` block (dict or
    :class:`~infinity.config.CurriculumConfig`), an ``InfinityConfig`` holding one, or a
    :class:`SeqlenSchedule`.  :meth:`truncate` cuts a batch to the length of a step;
    ``last_length`` is the length of the latest truncated batch (None before the first)."""

    def __init__(self, config: Any):
        self.schedule = config if isinstance(config, SeqlenSchedule) \
            else SeqlenSchedule.from_config(config)
        self.last_length: int | None = None
        self.global_step = 0

    def truncate(self, batch: Any, global_step: int) -> Any:
        """``batch`` cut to ``schedule.length(global_step)`` (``global_step``: updates
        already applied)."""
        self.global_step = int(global_step)
        self.last_length = self.schedule.length(self.global_step)
        return self.schedule.truncate(batch, self.global_step)

    def on_train_begin(self, args, state, control, **kwargs):
        self.global_step = int(state.global_step)
        if state.is_world_process_zero:
            log.info("InfinityTrainer: %s (length %d at step %d)", self.schedule.describe(),
                     self.schedule.length(self.global_step), self.global_step)

    def state(self) -> dict:
        """For ``trainer_state.json``: ``args`` rebuild the callback, ``attributes`` the step
        and length it was at (the length follows from the step on resume)."""
        return {"args": {"config": config_dict(self.schedule.config)},
                "attributes": {"global_step": self.global_step, "last_length": self.last_length}}
