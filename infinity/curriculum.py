"""Sequence-length curriculum learning: short sequences first, growing to full length.

DeepSpeed's legacy ``curriculum_learning`` block (config section
:class:`infinity.config.CurriculumConfig`, same keys and meanings) as a schedule over
optimizer steps, applied by **truncating** each batch (``input_ids``, ``labels``,
``attention_mask`` and every other per-token tensor alike) to the current length::

    from infinity.curriculum import SeqlenSchedule
    cur = SeqlenSchedule(64, 1024, total_steps=2000, schedule="fixed_root")
    for step, batch in enumerate(loader):            # step: optimizer updates already applied
        batch = cur.truncate(batch, engine.global_steps)
        ...

``step`` is always the number of optimizer updates already applied (``engine.global_steps``,
the Trainer's ``state.global_step``; 0 for the first batch), so every micro-batch of one
update has the same length and the schedule is a pure function of the step: resuming a
checkpoint at step ``s`` continues the schedule exactly (:meth:`SeqlenSchedule.state_dict`
records it all the same).  DeepSpeed evaluates its formula at ``global_steps + 1`` before
each forward; :meth:`SeqlenSchedule.length` does the same, so the lengths are DeepSpeed's,
step by step:

* ``fixed_linear``: ``floor((s / T) * (max - min) + min)`` rounded down to a multiple of
  ``difficulty_step``, capped at ``max`` (``s = step + 1``, ``T = total_curriculum_step``);
* ``fixed_root``: the same with ``(s / T) ** (1 / root_degree)``;
* ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, the
  last difficulty after ``max_step[-1]``.

The ways in: ``infinity finetune --curriculum seqlen:START:STEPS[:linear|root|discrete]``
(:func:`cli_block` builds the block), :class:`infinity.integrations.curriculum.CurriculumCallback`
(used by ``InfinityTrainer`` when its config has the block), and this helper in plain loops.
"""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from infinity.config_sections import CURRICULUM_SCHEDULES, ConfigError, CurriculumConfig

log = logging.getLogger("infinity.curriculum")

__all__ = ["SeqlenSchedule", "schedule_from_config", "truncate_batch", "cli_block",
           "SCHEDULE_ALIASES", "STATE_KEY"]

#: the short schedule names (``--curriculum seqlen:64:1000:root``) and DeepSpeed's names
SCHEDULE_ALIASES = {"linear": "fixed_linear", "root": "fixed_root", "discrete": "fixed_discrete",
                    **{s: s for s in CURRICULUM_SCHEDULES}}
#: where the schedule's state is stored (checkpoint meta, the Trainer's state)
STATE_KEY = "curriculum"
#: the per-token tensors a batch mapping is measured by (the first one present)
REFERENCE_KEYS = ("input_ids", "labels", "attention_mask", "inputs_embeds")
#: difficulty_step of ``--curriculum`` and of the helper (DeepSpeed's tutorial value:
#: fp16/bf16 tensor cores want multiples of 8); 1 when START is not a multiple of it
DEFAULT_DIFFICULTY_STEP = 8
#: the root degree of ``--curriculum ...:root`` (DeepSpeed's tutorial: square root)
DEFAULT_ROOT_DEGREE = 2


class SeqlenSchedule:
    """The sequence length at each optimizer step, and batch truncation to it.

    ``min_length`` / ``max_length``: DeepSpeed's ``min_difficulty`` / ``max_difficulty``;
    ``total_steps``: ``total_curriculum_step`` (linear and root); ``schedule``: "fixed_linear"
    (or "linear"), "fixed_root" ("root"), "fixed_discrete" ("discrete"); ``difficulty_step``:
    every length below ``max_length`` is a multiple of it (``min_length`` must be one);
    ``root_degree``: 2 is a square root; ``difficulty`` / ``max_step``: the lists of
    "fixed_discrete".  Invalid values raise :class:`~infinity.config.ConfigError` naming the
    ``curriculum_learning`` key.  :meth:`from_config` builds one from a config block."""

    def __init__(self, min_length: int, max_length: int, total_steps: int | None = None, *,
                 schedule: str = "fixed_linear", difficulty_step: int = DEFAULT_DIFFICULTY_STEP,
                 root_degree: int = DEFAULT_ROOT_DEGREE, difficulty: list | None = None,
                 max_step: list | None = None):
        typ = SCHEDULE_ALIASES.get(schedule.strip().lower(), schedule) \
            if isinstance(schedule, str) else schedule
        sc: dict = {}
        if typ == "fixed_discrete":
            sc = {"difficulty": difficulty, "max_step": max_step}
        else:
            sc = {"total_curriculum_step": total_steps, "difficulty_step": difficulty_step}
            if typ == "fixed_root":
                sc["root_degree"] = root_degree
        sc = {k: v for k, v in sc.items() if v is not None}
        self.config = CurriculumConfig(enabled=True, curriculum_type="seqlen",
                                       min_difficulty=min_length, max_difficulty=max_length,
                                       schedule_type=typ, schedule_config=sc)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: Any) -> "SeqlenSchedule":
        """From a :class:`CurriculumConfig`, an ``InfinityConfig`` or the block as a dict.
        The block must be enabled (:func:`schedule_from_config` returns None otherwise)."""
        block = _block(cfg)
        if not block.enabled:
            raise ConfigError("curriculum_learning.enabled: the block is disabled; set "
                              "\"enabled\": true to build a schedule from it")
        self = cls.__new__(cls)
        self.config = copy.deepcopy(block)
        return self

    # ------------------------------------------------------------------ the schedule
    @property
    def min_length(self) -> int:
        return self.config.min_difficulty

    @property
    def max_length(self) -> int:
        return self.config.max_difficulty

    @property
    def schedule_type(self) -> str:
        return self.config.schedule_type

    def length(self, step: int) -> int:
        """The sequence length of the batches of the update after ``step`` updates
        (``step`` >= 0: ``engine.global_steps``, the Trainer's ``state.global_step``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"curriculum step: expected an integer >= 0 (optimizer updates "
                             f"already applied), got {step!r}")
        c = self.config
        if c.max_difficulty <= c.min_difficulty:
            return c.min_difficulty   # DeepSpeed never updates a difficulty already at max
        return _difficulty(c, step + 1)

    def lengths(self, steps: int) -> list[int]:
        """``[length(0), ..., length(steps - 1)]``."""
        return [self.length(s) for s in range(steps)]

    def truncate(self, batch: Any, step: int) -> Any:
        """``batch`` with every per-token tensor cut to ``length(step)`` positions
        (:func:`truncate_batch`)."""
        return truncate_batch(batch, self.length(step))

    # ------------------------------------------------------------------ state
    def state_dict(self, step: int) -> dict:
        """What a checkpoint records: the block, the step and the length at it."""
        return {"config": config_dict(self.config), "global_step": int(step),
                "seqlen": self.length(step)}

    def load_state_dict(self, state: Mapping) -> int:
        """Check a recorded state against this schedule; returns its ``global_step``.
        The length is recomputed from the step; a schedule that changed since the state
        was recorded is logged (the new one applies from the resumed step on)."""
        if not isinstance(state, Mapping) or "global_step" not in state:
            raise ValueError(f"curriculum state: expected a mapping with global_step, got "
                             f"{state!r}")
        step = int(state["global_step"])
        saved = state.get("config")
        if saved is not None and saved != config_dict(self.config):
            log.warning("curriculum_learning changed since the checkpoint (saved %s, now %s): "
                        "the new schedule applies from step %d (length %d)", saved,
                        config_dict(self.config), step, self.length(step))
        return step

    def describe(self) -> str:
        """One line: ``seqlen curriculum fixed_root 64 -> 1024 by step 2000 (difficulty_step
        8, root_degree 2)``."""
        c, sc = self.config, self.config.schedule_config
        if c.schedule_type == "fixed_discrete":
            parts = [f"{d} to step {s}" for d, s in zip(sc["difficulty"], sc["max_step"])]
            return (f"seqlen curriculum fixed_discrete: {', '.join(parts)}, then "
                    f"{sc['difficulty'][-1]} (max {c.max_difficulty})")
        extra = f", root_degree {sc['root_degree']}" if c.schedule_type == "fixed_root" else ""
        return (f"seqlen curriculum {c.schedule_type} {c.min_difficulty} -> {c.max_difficulty} "
                f"over {sc['total_curriculum_step']} steps (difficulty_step "
                f"{sc['difficulty_step']}{extra})")

    def __repr__(self) -> str:
        return f"SeqlenSchedule({self.describe()})"


def schedule_from_config(cfg: Any) -> SeqlenSchedule | None:
    """The schedule of an ``InfinityConfig`` / :class:`CurriculumConfig` / block dict, or
    None when there is no block or it is disabled."""
    if cfg is None:
        return None
    block = _block(cfg)
    return SeqlenSchedule.from_config(block) if block.enabled else None


def _block(cfg: Any) -> CurriculumConfig:
    if isinstance(cfg, CurriculumConfig):
        return cfg
    inner = getattr(cfg, "curriculum_learning", None)
    if isinstance(inner, CurriculumConfig):
        return inner
    if isinstance(cfg, Mapping):
        if "curriculum_learning" in cfg:
            cfg = cfg["curriculum_learning"]
        from infinity.config_sections import parse_section
        return parse_section(CurriculumConfig, "curriculum_learning.", cfg)
    raise ConfigError(f"curriculum_learning: expected a CurriculumConfig, an InfinityConfig or "
                      f"a mapping, got {type(cfg).__name__}")


def config_dict(c: CurriculumConfig) -> dict:
    return {"enabled": c.enabled, "curriculum_type": c.curriculum_type,
            "min_difficulty": c.min_difficulty, "max_difficulty": c.max_difficulty,
            "schedule_type": c.schedule_type, "schedule_config": copy.deepcopy(c.schedule_config)}


def _difficulty(c: CurriculumConfig, s: int) -> int:
    """DeepSpeed's difficulty at its ``global_steps`` argument ``s`` (our step + 1)."""
    sc = c.schedule_config
    if c.schedule_type == "fixed_discrete":
        for d, last in zip(sc["difficulty"], sc["max_step"]):
            if s <= last:
                return d
        return sc["difficulty"][-1]
    degree = sc["root_degree"] if c.schedule_type == "fixed_root" else 1
    frac = (float(s) / sc["total_curriculum_step"]) ** (1.0 / degree)
    d = math.floor(frac * (c.max_difficulty - c.min_difficulty) + c.min_difficulty)
    d -= d % sc["difficulty_step"]
    return min(d, c.max_difficulty)


# --------------------------------------------------------------------------------------
# truncation
# --------------------------------------------------------------------------------------

_warned_left_padding = False


def _seq_len(batch: Any) -> int | None:
    """The sequence length of a batch: dim 1 of its reference tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[1] if batch.dim() >= 2 else None
    if isinstance(batch, Mapping):
        for k in REFERENCE_KEYS:
            v = batch.get(k)
            if isinstance(v, torch.Tensor) and v.dim() >= 2:
                return v.shape[1]
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for v in items:
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return v.shape[1]
    return None


def _cut(t: Any, seq: int, length: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return t
    if t.dim() == 4 and t.shape[-1] == seq and t.shape[-2] == seq:
        return t[..., :length, :length]          # a 4-D (batch, heads, query, key) mask
    if t.shape[1] == seq:
        return t[:, :length]
    return t


def _check_padding_side(batch: Any) -> None:
    """Warn once when the attention mask says the batch is left-padded: truncation keeps the
    first positions, which are then padding."""
    global _warned_left_padding
    if _warned_left_padding or not isinstance(batch, Mapping):
        return
    m = batch.get("attention_mask")
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[1] < 2:
        return
    if bool(((m[:, 0] == 0) & (m[:, -1] != 0)).any()):
        _warned_left_padding = True
        log.warning("curriculum: the batch is left-padded (attention_mask starts with 0s): "
                    "truncation keeps the first positions of each row, the padding, and cuts "
                    "the tokens; pad on the right (tokenizer.padding_side = \"right\")")


def truncate_batch(batch: Any, length: int) -> Any:
    """``batch`` (a tensor ``(batch, seq, ...)``, a mapping such as a collator's dict or a
    ``BatchEncoding``, or a tuple/list of tensors) with every tensor whose dim 1 is the
    sequence length cut to its first ``length`` positions; 4-D ``(batch, heads, seq, seq)``
    masks are cut on both sequence dims.  The sequence length is dim 1 of ``input_ids``
    (else ``labels``, ``attention_mask``, ``inputs_embeds``, else the first tensor of 2 or
    more dims).  Other values pass through; a batch no longer than ``length`` is returned
    as is.  Padding stays where it is (right padding: shorter rows keep their padding up to
    ``length``); the slices are views, nothing is copied."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"curriculum: the length to truncate to must be an integer >= 1, got "
                         f"{length!r}")
    seq = _seq_len(batch)
    if seq is None or seq <= length:
        return batch
    _check_padding_side(batch)
    if isinstance(batch, torch.Tensor):
        return _cut(batch, seq, length)
    if isinstance(batch, Mapping):
        out = copy.copy(batch)   # dict, BatchEncoding (UserDict): a new mapping, same type
        for k, v in batch.items():
            out[k] = _cut(v, seq, length)
        return out
    return type(batch)(_cut(v, seq, length) for v in batch)


# --------------------------------------------------------------------------------------
# --curriculum seqlen:START:STEPS[:linear|root|discrete]
# --------------------------------------------------------------------------------------

def parse_cli_spec(spec: str) -> tuple[int, int, str]:
    """``"seqlen:64:1000:root"`` -> ``(64, 1000, "fixed_root")``; ValueError says what the
    form is."""
    form = "seqlen:START:STEPS[:linear|root|discrete], e.g. seqlen:64:1000"
    parts = str(spec).strip().split(":")
    if len(parts) not in (3, 4) or parts[0].strip().lower() != "seqlen":
        raise ValueError(f"--curriculum {spec!r}: expected {form} (only the sequence-length "
                         f"curriculum exists)")
    try:
        start, steps = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"--curriculum {spec!r}: START and STEPS must be whole numbers "
                         f"({form})") from None
    if start < 1 or steps < 1:
        raise ValueError(f"--curriculum {spec!r}: START (the first sequence length) and STEPS "
                         f"(optimizer steps to reach the full length) must be >= 1")
    kind = parts[3].strip().lower() if len(parts) == 4 else "linear"
    if kind not in ("linear", "root", "discrete"):
        raise ValueError(f"--curriculum {spec!r}: the schedule must be linear, root or "
                         f"discrete, got {kind!r}")
    return start, steps, SCHEDULE_ALIASES[kind]


def cli_block(spec: str, max_length: int) -> dict:
    """The ``curriculum_learning`` block of ``--curriculum spec`` for a run of sequence length
    ``max_length``.  linear / root (square root): ``difficulty_step`` 8 when START is a
    multiple of 8, else 1.  discrete: START, 2·START, 4·START, ... below ``max_length``, then
    ``max_length``, each held for an equal share of STEPS."""
    start, steps, typ = parse_cli_spec(spec)
    if start > max_length:
        raise ValueError(f"--curriculum {spec!r}: START {start} is longer than the run's "
                         f"sequence length {max_length}")
    block: dict = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": start,
                   "max_difficulty": max_length, "schedule_type": typ}
    if typ == "fixed_discrete":
        diff = [start]
        while diff[-1] * 2 < max_length:
            diff.append(diff[-1] * 2)
        if diff[-1] < max_length:
            diff.append(max_length)
        n = len(diff)
        if n == 1:                       # START is the full length: nothing to grow
            block["schedule_config"] = {"difficulty": [start, start], "max_step": [steps]}
        else:
            if steps < n:
                raise ValueError(f"--curriculum {spec!r}: {n} lengths ({diff}) need STEPS >= "
                                 f"{n} (one share of the steps each)")
            block["schedule_config"] = {"difficulty": diff,
                                        "max_step": [steps * i // n for i in range(1, n)]}
    else:
        step = DEFAULT_DIFFICULTY_STEP if start % DEFAULT_DIFFICULTY_STEP == 0 else 1
        block["schedule_config"] = {"total_curriculum_step": steps, "difficulty_step": step}
        if typ == "fixed_root":
            block["schedule_config"]["root_degree"] = DEFAULT_ROOT_DEGREE
    return block


def describe_block(block: Mapping) -> str:
    """:meth:`SeqlenSchedule.describe` of a block dict (for the run's info line)."""
    return SeqlenSchedule.from_config(block).describe()

