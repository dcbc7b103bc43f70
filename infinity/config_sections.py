"""The sections of the typed configuration (``offload``, ``prefetch``, ``aio``,
``optimizer``, ``scheduler``, ``fp16``, ``curriculum_learning``, ...) and the value checkers they share, below both
:mod:`infinity.config` (:class:`InfinityConfig`, loading) and
:mod:`infinity.config_deepspeed` (the DeepSpeed translation), so neither imports the other
for them.  Every name here is re-exported by :mod:`infinity.config`.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (1, 2, 3)
OFFLOAD_HOMES = ("none", "cpu", "nvme")
AIO_ENGINES = ("auto", "uring", "posix")
OPTIMIZER_TYPES = ("adamw", "adam")
SCHEDULER_TYPES = ("constant", "linear", "cosine")
ACTIVATION_SCOPES = ("checkpoints", "all")
GRAD_ACCUM_DTYPES = ("fp32", "bf16")
STATE_DTYPES = ("fp32", "bf16")
# offload.frozen_weights.dtype (None: the working precision); the formats of
# infinity.quant.quantize_weight
FROZEN_WEIGHT_DTYPES = ("nf4", "int8", "int4")
GB = 10**9

# Upper bounds of the counts and sizes (a value past them is a typo or a unit mix-up, not a
# configuration: ``prefetch.depth: 1e9`` would be accepted and then mean nothing sane).
MAX_PREFETCH_DEPTH = 1024        # parameter groups fetched ahead of compute
MAX_STEPS = 10**9                # scheduler.warmup_steps / total_steps, fp16.growth_interval
MAX_HPZ_PARTITION = 1 << 16      # ranks in one hpZ block
MAX_DIST_TIMEOUT_S = 7 * 86400   # one week
MAX_GB = 10**6                   # any *_gb size: one petabyte


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


# --------------------------------------------------------------------------------------
# value checkers: each takes the dotted key, returns the normalised value or raises
# --------------------------------------------------------------------------------------

def fmt_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def parse_choice(key: str, value: Any, choices: tuple, *, lower: bool = True) -> Any:
    if lower and isinstance(value, str):
        value = value.strip().lower()
    if value not in choices or isinstance(value, bool):
        opts = ", ".join(fmt_value(c) for c in choices)
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            if close:
                hint = f" (did you mean {fmt_value(close[0])}?)"
        raise ConfigError(f"{key}: expected one of {opts}, got {fmt_value(value)}{hint}")
    return value


def parse_int(key: str, value: Any, *, lo: int | None = None, hi: int | None = None,
              what: str = "", example: int | None = None) -> int:
    """``example``: the value the hint suggests (the default; else the lower bound if > 0,
    else 1) -- never a value that silently turns a feature off, such as a depth of 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if example is None:
            example = lo if lo else 1
        raise ConfigError(f"{key}: expected an integer, got {fmt_value(value)} "
                          f"({type(value).__name__}); write a plain number such as {example}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {fmt_value(value)}; "
                              f"use a whole number")
        value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = what or (f"in [{lo}, {hi}]" if lo is not None and hi is not None
                       else f">= {lo}" if lo is not None else f"<= {hi}")
        raise ConfigError(f"{key}: expected an integer {rng}, got {fmt_value(value)}")
    return value


def parse_float(key: str, value: Any, *, lo: float | None = None, lo_open: bool = False,
                hi: float | None = None, hi_open: bool = False, what: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {fmt_value(value)} "
                          f"({type(value).__name__}); write it without quotes, e.g. 1e-3")
    value = float(value)
    bad = not math.isfinite(value)
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        if not what:
            parts = []
            if lo is not None:
                parts.append(f"{'>' if lo_open else '>='} {lo:g}")
            if hi is not None:
                parts.append(f"{'<' if hi_open else '<='} {hi:g}")
            what = " and ".join(parts) if parts else "finite"
        raise ConfigError(f"{key}: expected a number {what}, got {fmt_value(value)}")
    return value


def _opt_positive_float(key: str, value: Any) -> float | None:
    """A size in 10^9 bytes: > 0 and <= :data:`MAX_GB`, or None (automatic)."""
    if value is None:
        return None
    return parse_float(key, value, lo=0.0, lo_open=True, hi=MAX_GB,
                       what=f"> 0 and <= {MAX_GB} (one petabyte; or null to size it automatically)")


def _path_list(key: str, value: Any) -> list[str]:
    """Directories (``offload.nvme_paths``): non-empty, no NUL byte, no directory twice
    (compared after ``~`` expansion and normalisation: "a", "./a/" and the absolute path of
    "a" are one directory)."""
    paths = _str_list(key, value, allow_str=True, allow_empty=False)
    seen: dict[str, int] = {}
    for i, v in enumerate(paths):
        if "\x00" in v:
            raise ConfigError(f"{key}[{i}]: the path {v!r} contains a NUL byte, which no file "
                              f"system path can hold; write the directory's name without it")
        norm = os.path.normpath(os.path.abspath(os.path.expanduser(v)))
        if norm in seen:
            j = seen[norm]
            raise ConfigError(f"{key}[{i}]: {fmt_value(v)} is the same directory as {key}[{j}] "
                              f"({fmt_value(paths[j])}, both {norm}); list each directory once (several "
                              f"entries stripe the swap over several drives)")
        seen[norm] = i
    return paths


def _str_list(key: str, value: Any, *, allow_str: bool, allow_empty: bool) -> list[str]:
    if isinstance(value, (str, os.PathLike)) and allow_str:
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list of strings, got {fmt_value(value)} "
                          f"({type(value).__name__})")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, os.PathLike):
            v = os.fspath(v)
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{key}[{i}]: expected a non-empty string, got {fmt_value(v)}")
        out.append(v)
    if not out and not allow_empty:
        raise ConfigError(f"{key}: expected at least one entry, got an empty list")
    return out


def check_unknown_keys(prefix: str, d: Mapping, known: list[str]) -> None:
    for k in d:
        if k not in known:
            where = f"{prefix}{k}"
            close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.5)
            hint = (f"did you mean {prefix}{close[0]!s}?" if close
                    else f"valid keys here: {', '.join(prefix + x for x in known)}")
            raise ConfigError(f"{where}: unknown key; {hint}")


def parse_section(cls, prefix: str, value: Any):
    """Turn a dict (or an instance) into a validated section dataclass."""
    if isinstance(value, cls):
        return value  # already validated by its __post_init__ / validate()
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{prefix.rstrip('.')}: expected a mapping (dict) of keys, got "
                          f"{fmt_value(value)} ({type(value).__name__})")
    names = [f.name for f in dataclasses.fields(cls)]
    check_unknown_keys(prefix, value, names)
    return cls(**dict(value))


# --------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------

@dataclass
class FrozenWeightsConfig:
    """``offload.frozen_weights``: frozen (``requires_grad`` False) ``nn.Linear``, GPT-2
    ``Conv1D`` and ``nn.Embedding`` weights stored blockwise-quantized at their home
    (QLoRA-style; :mod:`infinity.memory.frozen_quant`) and dequantized to the working
    precision just before use.  ``dtype`` None (the default) keeps the working precision;
    ``group_size``: elements per block (one scale each; even for nf4); ``double_quant``:
    quantize the block scales too (QLoRA's double quantization)."""
    dtype: str | None = None
    group_size: int = 64
    double_quant: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "offload.frozen_weights."
        self.dtype = parse_choice(p + "dtype", self.dtype, (None,) + FROZEN_WEIGHT_DTYPES)
        self.group_size = parse_int(p + "group_size", self.group_size, lo=1, hi=65536,
                                    what=">= 1 and <= 65536 (elements per quantization block)",
                                    example=FrozenWeightsConfig.group_size)
        if self.dtype == "nf4" and self.group_size % 2:
            raise ConfigError(f"{p}group_size: nf4 stores two codes per byte, so the block "
                              f"size must be even, got {self.group_size}")
        if not isinstance(self.double_quant, bool):
            raise ConfigError(f"{p}double_quant: expected true or false, got "
                              f"{fmt_value(self.double_quant)}")


@dataclass
class OffloadConfig:
    """Home tier of each kind of state and the host/device budgets."""
    params: str = "none"
    optimizer: str = "none"
    nvme_paths: list[str] = field(default_factory=lambda: ["./infinity-swap"])
    host_memory_gb: float | None = None
    device_memory_gb: float | None = None
    # Note [shadow budget]: NVMe beyond the homes an all-or-nothing update may take (per
    # rank, 10^9 bytes); None: automatic from free space; 0: no speculative steps
    commit_shadow_gb: float | None = None
    frozen_weights: FrozenWeightsConfig = field(default_factory=FrozenWeightsConfig)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "offload."
        self.frozen_weights = parse_section(FrozenWeightsConfig, p + "frozen_weights.",
                                            self.frozen_weights)
        self.params = parse_choice(p + "params", self.params, OFFLOAD_HOMES)
        self.optimizer = parse_choice(p + "optimizer", self.optimizer, OFFLOAD_HOMES)
        self.nvme_paths = _path_list(p + "nvme_paths", self.nvme_paths)
        self.host_memory_gb = _opt_positive_float(p + "host_memory_gb", self.host_memory_gb)
        self.device_memory_gb = _opt_positive_float(p + "device_memory_gb",
                                                    self.device_memory_gb)
        if self.commit_shadow_gb is not None:
            self.commit_shadow_gb = parse_float(
                p + "commit_shadow_gb", self.commit_shadow_gb, lo=0.0, hi=MAX_GB,
                what=f">= 0 and <= {MAX_GB} (GB of NVMe for commit shadows per rank; 0: none "
                     f"beyond one group's; or null to size it from the free space)")


@dataclass
class ActivationOffloadConfig:
    """Where autograd's saved activations live between forward and backward
    (:mod:`infinity.runtime.activations`): ``home`` "none" (the device, no offload),
    "cpu" (host memory) or "nvme" (the swap files); ``scope`` "checkpoints" (only the
    inputs saved at activation-checkpoint boundaries: ``torch.utils.checkpoint``, Hugging
    Face ``gradient_checkpointing_enable()``) or "all" (every tensor autograd saves)."""
    home: str = "none"
    scope: str = "checkpoints"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "activation_offload."
        self.home = parse_choice(p + "home", self.home, OFFLOAD_HOMES)
        self.scope = parse_choice(p + "scope", self.scope, ACTIVATION_SCOPES)


@dataclass
class ZeroPPConfig:
    """ZeRO++ (:mod:`infinity.zero.zeropp`): ``quantized_weights`` (qwZ: int8 block-quantized
    parameter all-gathers), ``hpz_partition_size`` (hpZ: a secondary copy of the
    parameters partitioned over groups of that many consecutive ranks, so backward's
    all-gathers stay within them; 1 = off), ``quantized_gradients`` (qgZ: the gradient
    reduce-scatter becomes a hierarchical all-to-all of int4 block-quantized gradients).
    The stage requirements are checked by :class:`infinity.config.InfinityConfig`; that
    ``hpz_partition_size`` divides the world size, at ``initialize``."""
    quantized_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "zero_pp."
        for k in ("quantized_weights", "quantized_gradients"):
            v = getattr(self, k)
            if not isinstance(v, bool):
                raise ConfigError(f"{p}{k}: expected true or false, got {fmt_value(v)}")
        self.hpz_partition_size = parse_int(p + "hpz_partition_size", self.hpz_partition_size,
                                            lo=1, hi=MAX_HPZ_PARTITION,
                                            what=f">= 1 and <= {MAX_HPZ_PARTITION} (1 turns hpZ "
                                            f"off; N: groups of N consecutive ranks, typically the "
                                            f"ranks per node)", example=1)

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1


@dataclass
class PrefetchConfig:
    """How many parameter groups to fetch ahead of compute, and how many bytes of released
    groups stay resident for their next use in the same micro-step (``reuse_gb``: ZeRO
    stage 3 across ranks, where a re-fetch is an all-gather; DeepSpeed's
    ``max_reuse_distance`` / ``max_live_parameters``).  ``reuse_gb`` None: automatic (the
    device budget when there is one, kept groups evicted when it is needed; else
    :data:`infinity.runtime.prefetch.DEFAULT_REUSE_BYTES`); 0 turns it off."""
    depth: int = 2
    reuse_gb: float | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        self.depth = parse_int("prefetch.depth", self.depth, lo=0, hi=MAX_PREFETCH_DEPTH,
                               what=f">= 0 and <= {MAX_PREFETCH_DEPTH} (groups fetched ahead of "
                               f"compute; 0: on demand only)", example=PrefetchConfig.depth)
        if self.reuse_gb is not None:
            self.reuse_gb = parse_float("prefetch.reuse_gb", self.reuse_gb, lo=0.0, hi=MAX_GB,
                                        what=f">= 0 and <= {MAX_GB} (0: off; null: automatic)")


@dataclass
class TilingConfig:
    """Memory-centric tiling (:mod:`infinity.runtime.tiling`): a parameter group larger than
    ``max_group_gb`` (None: ``offload.device_memory_gb / (prefetch.depth + 2)``, no limit
    without a device budget) whose module can be tiled is never fetched whole; its rows are
    fetched one tile at a time in forward and backward."""
    max_group_gb: float | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        self.max_group_gb = _opt_positive_float("tiling.max_group_gb", self.max_group_gb)


MAX_AIO_BLOCK = 1 << 30          # the I/O engine's own bound (infinity.io.AioEngine)
MAX_ACCUMULATION_STEPS = 1 << 20
NONFINITE_POLICIES = ("skip", "raise")
# how collectives between ranks of one machine travel (infinity.zero.shm_transport)
INTRA_NODE_TRANSPORTS = ("auto", "process_group")


def max_aio_threads() -> int:
    """``aio.threads`` upper bound: 4 per CPU this process may run on, and the engine's 256."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return min(256, 4 * max(1, n))


@dataclass
class AioConfig:
    """Asynchronous I/O engine settings (see infinity.io.AioEngine)."""
    engine: str = "auto"
    block_size: int = 1048576
    queue_depth: int = 32
    threads: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "aio."
        self.engine = parse_choice(p + "engine", self.engine, AIO_ENGINES)
        bs = parse_int(p + "block_size", self.block_size, lo=4096, hi=MAX_AIO_BLOCK,
                       what=f"that is a power of two >= 4096 and <= {MAX_AIO_BLOCK} (1 GiB)",
                       example=AioConfig.block_size)
        if bs & (bs - 1):
            lower = 1 << (bs.bit_length() - 1)
            raise ConfigError(f"{p}block_size: expected a power of two >= 4096, got {bs}; "
                              f"use {lower} or {lower * 2}")
        self.block_size = bs
        self.queue_depth = parse_int(p + "queue_depth", self.queue_depth, lo=1, hi=1024,
                                     example=AioConfig.queue_depth)
        hi = max_aio_threads()
        self.threads = parse_int(p + "threads", self.threads, lo=1, hi=hi,
                                 what=f">= 1 and <= {hi} (4 per CPU this process may use, at most 256)")


PARAM_GROUP_KEYS = ("params", "lr", "weight_decay", "betas", "eps")


def _betas(key: str, b: Any) -> tuple[float, float]:
    if not isinstance(b, (list, tuple)) or len(b) != 2:
        raise ConfigError(f"{key}: expected a list of two numbers in [0, 1), "
                          f"e.g. [0.9, 0.999], got {fmt_value(b)}")
    return (parse_float(key + "[0]", b[0], lo=0.0, hi=1.0, hi_open=True),
            parse_float(key + "[1]", b[1], lo=0.0, hi=1.0, hi_open=True))


def _param_groups(key: str, value: Any) -> list[dict]:
    """``optimizer.param_groups``: a list of ``{"params": [patterns], "lr", "weight_decay",
    "betas", "eps"}`` (all but ``params`` optional); returns normalised copies holding only
    the keys that were given (``betas`` as a list)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list of groups such as "
                          f'[{{"params": ["*lora_*"], "lr": 1e-3}}], got {fmt_value(value)} '
                          f"({type(value).__name__})")
    out = []
    for i, g in enumerate(value):
        k = f"{key}[{i}]"
        if not isinstance(g, Mapping):
            raise ConfigError(f"{k}: expected a mapping with a \"params\" list of name "
                              f"patterns, got {fmt_value(g)} ({type(g).__name__})")
        check_unknown_keys(k + ".", g, list(PARAM_GROUP_KEYS))
        if "params" not in g:
            raise ConfigError(f"{k}.params: missing; list the name patterns of the parameters "
                              f"in this group, e.g. [\"*lora_*\"]")
        d: dict = {"params": _str_list(k + ".params", g["params"], allow_str=True,
                                       allow_empty=False)}
        if "lr" in g:
            d["lr"] = parse_float(k + ".lr", g["lr"], lo=0.0)
        if "weight_decay" in g:
            d["weight_decay"] = parse_float(k + ".weight_decay", g["weight_decay"], lo=0.0)
        if "betas" in g:
            d["betas"] = list(_betas(k + ".betas", g["betas"]))
        if "eps" in g:
            d["eps"] = parse_float(k + ".eps", g["eps"], lo=0.0, lo_open=True)
        out.append(d)
    return out


@dataclass
class OptimizerConfig:
    """Adam/AdamW hyperparameters, the no-decay name patterns, per-group overrides and
    the dtype the Adam moments are stored in (``state_dtype``: "bf16" halves their bytes in
    every home; the fp32 master is never compact)."""
    type: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: list[str] = field(default_factory=lambda: ["bias", "norm"])
    param_groups: list[dict] = field(default_factory=list)
    state_dtype: str = "fp32"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "optimizer."
        self.type = parse_choice(p + "type", self.type, OPTIMIZER_TYPES)
        self.lr = parse_float(p + "lr", self.lr, lo=0.0)
        self.betas = _betas(p + "betas", self.betas)
        self.eps = parse_float(p + "eps", self.eps, lo=0.0, lo_open=True)
        self.weight_decay = parse_float(p + "weight_decay", self.weight_decay, lo=0.0)
        self.no_decay = _str_list(p + "no_decay", self.no_decay,
                                  allow_str=False, allow_empty=True)
        self.param_groups = _param_groups(p + "param_groups", self.param_groups)
        self.state_dtype = parse_choice(p + "state_dtype", self.state_dtype, STATE_DTYPES)


@dataclass
class SchedulerConfig:
    """Learning-rate schedule (see infinity.optim.schedule)."""
    type: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "scheduler."
        self.type = parse_choice(p + "type", self.type, SCHEDULER_TYPES)
        self.warmup_steps = parse_int(p + "warmup_steps", self.warmup_steps, lo=0, hi=MAX_STEPS,
                                      what=f">= 0 and <= {MAX_STEPS} (optimizer updates)")
        if self.total_steps is not None:
            self.total_steps = parse_int(p + "total_steps", self.total_steps, lo=1, hi=MAX_STEPS,
                                         what=f">= 1 and <= {MAX_STEPS} (optimizer updates)")
        self.min_lr = parse_float(p + "min_lr", self.min_lr, lo=0.0)
        if self.type in ("linear", "cosine"):
            if self.total_steps is None:
                raise ConfigError(
                    f"{p}total_steps: required for scheduler.type {fmt_value(self.type)} (the step "
                    f"at which the lr reaches min_lr); set it to the number of optimizer "
                    f"updates of the run, or use scheduler.type \"constant\"")
            if self.total_steps <= self.warmup_steps:
                raise ConfigError(
                    f"{p}total_steps: must be greater than scheduler.warmup_steps "
                    f"({self.warmup_steps}) for a {self.type} schedule, got {self.total_steps}; "
                    f"increase total_steps or reduce warmup_steps")


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for precision "fp16" (an addition to DESIGN §3.5).

    The scale starts at ``initial_scale``; on an overflow (inf/nan gradient) the
    step is skipped and the scale multiplied by ``backoff_factor`` (never below
    ``min_scale``); after ``growth_interval`` clean steps it is multiplied by
    ``growth_factor``.
    """
    initial_scale: float = 65536.0
    growth_interval: int = 1000
    backoff_factor: float = 0.5
    growth_factor: float = 2.0
    min_scale: float = 1.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "fp16."
        self.initial_scale = parse_float(p + "initial_scale", self.initial_scale,
                                         lo=0.0, lo_open=True)
        self.growth_interval = parse_int(p + "growth_interval", self.growth_interval, lo=1,
                                         hi=MAX_STEPS, what=f">= 1 and <= {MAX_STEPS} (updates)")
        self.backoff_factor = parse_float(p + "backoff_factor", self.backoff_factor,
                                          lo=0.0, lo_open=True, hi=1.0, hi_open=True)
        self.growth_factor = parse_float(p + "growth_factor", self.growth_factor,
                                         lo=1.0, lo_open=True)
        self.min_scale = parse_float(p + "min_scale", self.min_scale, lo=0.0, lo_open=True)
        if self.min_scale > self.initial_scale:
            raise ConfigError(f"fp16.min_scale: must be <= fp16.initial_scale "
                              f"({self.initial_scale:g}), got {self.min_scale:g}")


# --------------------------------------------------------------------------------------
# curriculum_learning: DeepSpeed's legacy sequence-length curriculum (infinity.curriculum)
# --------------------------------------------------------------------------------------

CURRICULUM_TYPES = ("seqlen",)
CURRICULUM_SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete")
CURRICULUM_SCHEDULE_KEYS = ("total_curriculum_step", "difficulty_step", "root_degree",
                            "difficulty", "max_step")
MAX_SEQLEN = 1 << 24             # a sequence length past 16M tokens is a typo
MAX_ROOT_DEGREE = 1000


def _curriculum_int_list(key: str, value: Any, *, lo: int, hi: int, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{key}: expected a non-empty list of integers ({what}), got "
                          f"{fmt_value(value)}")
    return [parse_int(f"{key}[{i}]", v, lo=lo, hi=hi) for i, v in enumerate(value)]


@dataclass
class CurriculumConfig:
    """DeepSpeed's legacy ``curriculum_learning`` block, same keys and meanings: with
    ``enabled``, every training batch is truncated to a sequence length ("difficulty") that
    grows with the optimizer step from ``min_difficulty`` to ``max_difficulty``
    (:mod:`infinity.curriculum` computes it and truncates).  ``schedule_type``
    "fixed_linear" / "fixed_root" need ``schedule_config.total_curriculum_step`` and
    ``difficulty_step`` (every length below the maximum is a multiple of it), "fixed_root"
    also ``root_degree``; "fixed_discrete" needs the lists ``difficulty`` and ``max_step``
    (one element fewer).  The keys are checked when ``enabled`` is true (values given while
    it is false are still type-checked)."""
    enabled: bool = False
    curriculum_type: str = "seqlen"
    min_difficulty: int | None = None
    max_difficulty: int | None = None
    schedule_type: str = "fixed_linear"
    schedule_config: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        p = "curriculum_learning."
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{p}enabled: expected true or false, got {fmt_value(self.enabled)}")
        self.curriculum_type = parse_choice(p + "curriculum_type", self.curriculum_type,
                                            CURRICULUM_TYPES)
        self.schedule_type = parse_choice(p + "schedule_type", self.schedule_type,
                                          CURRICULUM_SCHEDULES)
        on = self.enabled
        for k in ("min_difficulty", "max_difficulty"):
            v = getattr(self, k)
            if v is None:
                if on:
                    raise ConfigError(f"{p}{k}: required when curriculum_learning.enabled is true "
                                      f"(the {'first' if k == 'min_difficulty' else 'final'} "
                                      f"sequence length, in tokens), e.g. "
                                      f"{64 if k == 'min_difficulty' else 1024}")
                continue
            setattr(self, k, parse_int(p + k, v, lo=1, hi=MAX_SEQLEN,
                                       what=f">= 1 and <= {MAX_SEQLEN} (a sequence length in tokens)"))
        if on and self.max_difficulty < self.min_difficulty:
            raise ConfigError(f"{p}max_difficulty: must be >= curriculum_learning.min_difficulty "
                              f"({self.min_difficulty}), got {self.max_difficulty}; the schedule "
                              f"grows from min_difficulty to max_difficulty")
        self.schedule_config = self._schedule_config(p + "schedule_config.", on)

    def _schedule_config(self, p: str, on: bool) -> dict:
        sc = self.schedule_config
        if sc is None:
            sc = {}
        if not isinstance(sc, Mapping):
            raise ConfigError(f"{p.rstrip('.')}: expected a mapping (dict) of keys, got "
                              f"{fmt_value(sc)} ({type(sc).__name__})")
        check_unknown_keys(p, sc, list(CURRICULUM_SCHEDULE_KEYS))
        out: dict = {}
        if "total_curriculum_step" in sc:
            out["total_curriculum_step"] = parse_int(
                p + "total_curriculum_step", sc["total_curriculum_step"], lo=1, hi=MAX_STEPS,
                what=f">= 1 and <= {MAX_STEPS} (optimizer steps from min_difficulty to "
                f"max_difficulty)")
        if "difficulty_step" in sc:
            out["difficulty_step"] = parse_int(
                p + "difficulty_step", sc["difficulty_step"], lo=1, hi=MAX_SEQLEN,
                what=f">= 1 and <= {MAX_SEQLEN} (every length is a multiple of it; 8 suits "
                f"fp16/bf16 tensor cores)", example=8)
        if "root_degree" in sc:
            out["root_degree"] = parse_int(p + "root_degree", sc["root_degree"], lo=1,
                                           hi=MAX_ROOT_DEGREE,
                                           what=f">= 1 and <= {MAX_ROOT_DEGREE} (2: square root; "
                                           f"1: linear)", example=2)
        if "difficulty" in sc:
            out["difficulty"] = _curriculum_int_list(p + "difficulty", sc["difficulty"], lo=1,
                                                     hi=MAX_SEQLEN, what="the lengths in order")
        if "max_step" in sc:
            out["max_step"] = _curriculum_int_list(p + "max_step", sc["max_step"], lo=1,
                                                   hi=MAX_STEPS,
                                                   what="the last step of each length but the "
                                                   "last")
        if on:
            self._check_enabled(p, out)
        return out

    def _check_enabled(self, p: str, sc: dict) -> None:
        """The keys the schedule type needs, and their consistency (only when enabled)."""
        typ = self.schedule_type
        if typ in ("fixed_linear", "fixed_root"):
            need = ("total_curriculum_step", "difficulty_step") + \
                (("root_degree",) if typ == "fixed_root" else ())
            for k in need:
                if k not in sc:
                    raise ConfigError(f"{p}{k}: required for curriculum_learning.schedule_type "
                                      f"{fmt_value(typ)} (schedule_config needs "
                                      f"{', '.join(need)})")
            step = sc["difficulty_step"]
            if self.min_difficulty % step:
                lo = self.min_difficulty - self.min_difficulty % step
                hint = f"{lo} or {lo + step}" if lo else f"{step}"
                raise ConfigError(
                    f"curriculum_learning.min_difficulty: must be a multiple of "
                    f"schedule_config.difficulty_step ({step}), got {self.min_difficulty}: "
                    f"DeepSpeed's formula rounds every length down to a multiple of "
                    f"difficulty_step, so the first length would be "
                    f"{lo} instead of {self.min_difficulty}; use {hint}")
            return
        for k in ("difficulty", "max_step"):
            if k not in sc:
                raise ConfigError(f"{p}{k}: required for curriculum_learning.schedule_type "
                                  f"\"fixed_discrete\" (schedule_config needs the lists "
                                  f"difficulty and max_step, e.g. {{\"difficulty\": [64, 128, "
                                  f"256], \"max_step\": [100, 200]}})")
        diff, steps = sc["difficulty"], sc["max_step"]
        if len(diff) != len(steps) + 1:
            raise ConfigError(f"{p}max_step: expected one element fewer than "
                              f"schedule_config.difficulty ({len(diff)} elements: the last "
                              f"difficulty holds for every later step), got {len(steps)}")
        for i in range(1, len(steps)):
            if steps[i] <= steps[i - 1]:
                raise ConfigError(f"{p}max_step[{i}]: must be greater than max_step[{i - 1}] "
                                  f"({steps[i - 1]}), got {steps[i]}; the steps are in "
                                  f"increasing order")
        for i, d in enumerate(diff):
            if i and d < diff[i - 1]:
                raise ConfigError(f"{p}difficulty[{i}]: must be >= difficulty[{i - 1}] "
                                  f"({diff[i - 1]}), got {d}; a curriculum's lengths only grow")
            if d > self.max_difficulty:
                raise ConfigError(f"{p}difficulty[{i}]: must be <= "
                                  f"curriculum_learning.max_difficulty ({self.max_difficulty}), "
                                  f"got {d}")
