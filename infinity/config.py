"""Typed, validated configuration for infinity (DESIGN.md §3.5).

Every key is optional; unknown keys, wrong types and out-of-range values raise
:class:`ConfigError` naming the full dotted key, the bad value and the fix.

    cfg = InfinityConfig.load({"offload": {"optimizer": "nvme"}})   # dict
    cfg = InfinityConfig.load("train.yaml")                          # JSON/YAML path
    cfg = InfinityConfig.from_deepspeed("ds_config.json")            # DeepSpeed translation

The DeepSpeed translation behind :meth:`InfinityConfig.from_deepspeed` lives in
:mod:`infinity.config_deepspeed`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from infinity.config_sections import (  # noqa: F401 (re-exported)
    ACTIVATION_SCOPES, AIO_ENGINES, GB, GRAD_ACCUM_DTYPES, ActivationOffloadConfig, OFFLOAD_HOMES, OPTIMIZER_TYPES, PARAM_GROUP_KEYS, PRECISIONS,
    SCHEDULER_TYPES, STATE_DTYPES, ZERO_STAGES, AioConfig, ConfigError, LossScaleConfig, OffloadConfig,
    OptimizerConfig, PrefetchConfig, SchedulerConfig, TilingConfig, check_unknown_keys, parse_choice,
    parse_float, fmt_value, parse_int, parse_section, MAX_ACCUMULATION_STEPS, MAX_AIO_BLOCK, NONFINITE_POLICIES,
    INTRA_NODE_TRANSPORTS, MAX_DIST_TIMEOUT_S, MAX_GB, MAX_HPZ_PARTITION, MAX_PREFETCH_DEPTH,
    MAX_STEPS,
    max_aio_threads, ZeroPPConfig, CURRICULUM_SCHEDULES, CURRICULUM_TYPES, CurriculumConfig,
    FROZEN_WEIGHT_DTYPES, FrozenWeightsConfig)

__all__ = [
    "ConfigError", "OffloadConfig", "PrefetchConfig", "AioConfig", "OptimizerConfig",
    "SchedulerConfig", "LossScaleConfig", "ActivationOffloadConfig", "TilingConfig",
    "InfinityConfig", "ZeroPPConfig", "CurriculumConfig", "FrozenWeightsConfig", "load_config",
]

_SECTIONS = {
    "offload": OffloadConfig,
    "prefetch": PrefetchConfig,
    "aio": AioConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "fp16": LossScaleConfig,
    "activation_offload": ActivationOffloadConfig,
    "zero_pp": ZeroPPConfig,
    "tiling": TilingConfig,
    "curriculum_learning": CurriculumConfig,
}


@dataclass
class InfinityConfig:
    """The whole configuration. Build it with :meth:`load` (or construct directly)."""
    precision: str = "fp32"
    zero_stage: int = 3
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fp16: LossScaleConfig = field(default_factory=LossScaleConfig)
    gradient_clipping: float = 0.0
    gradient_accumulation_steps: int = 1
    dist_timeout_s: float = 600
    intra_node_transport: str = "auto"
    reduce_bucket_mb: float = 128.0
    nonfinite_grads: str = "skip"
    activation_offload: ActivationOffloadConfig = field(default_factory=ActivationOffloadConfig)
    gradient_accumulation_dtype: str = "fp32"
    zero_pp: ZeroPPConfig = field(default_factory=ZeroPPConfig)
    tiling: TilingConfig = field(default_factory=TilingConfig)
    curriculum_learning: CurriculumConfig = field(default_factory=CurriculumConfig)

    def __post_init__(self):
        self.validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check (and normalise) every value; raise :class:`ConfigError` on the first problem."""
        for name, cls in _SECTIONS.items():
            sec = getattr(self, name)
            if isinstance(sec, cls):
                sec.validate()
            else:
                setattr(self, name, parse_section(cls, name + ".", sec))
        self.precision = parse_choice("precision", self.precision, PRECISIONS)
        self.zero_stage = parse_choice("zero_stage", parse_int("zero_stage", self.zero_stage),
                                       ZERO_STAGES, lower=False)
        self.gradient_clipping = parse_float("gradient_clipping", self.gradient_clipping, lo=0.0,
                                             what=">= 0 (0 turns clipping off)")
        self.gradient_accumulation_steps = parse_int("gradient_accumulation_steps",
                                                     self.gradient_accumulation_steps, lo=1,
                                                     hi=MAX_ACCUMULATION_STEPS,
                                                     what=f">= 1 and <= {MAX_ACCUMULATION_STEPS}")
        self.nonfinite_grads = parse_choice("nonfinite_grads", self.nonfinite_grads, NONFINITE_POLICIES)
        self.gradient_accumulation_dtype = parse_choice(
            "gradient_accumulation_dtype", self.gradient_accumulation_dtype, GRAD_ACCUM_DTYPES)
        self.dist_timeout_s = parse_float("dist_timeout_s", self.dist_timeout_s,
                                          lo=0.0, lo_open=True, hi=MAX_DIST_TIMEOUT_S,
                                          what=f"> 0 and <= {MAX_DIST_TIMEOUT_S} (seconds; one week)")
        self.intra_node_transport = parse_choice("intra_node_transport", self.intra_node_transport,
                                                 INTRA_NODE_TRANSPORTS)
        self.reduce_bucket_mb = parse_float(
            "reduce_bucket_mb", self.reduce_bucket_mb, lo=0.0, hi=MAX_GB * 1024,
            what=">= 0 (MB of gradients per device bucket at zero_stage 2-3; 0: whole groups)")
        if self.offload.params != "none" and self.zero_stage != 3:
            raise ConfigError(
                f"offload.params: {fmt_value(self.offload.params)} needs zero_stage 3 (parameters "
                f"are only partitioned, and so only offloadable, at stage 3), got zero_stage "
                f"{self.zero_stage}; set zero_stage to 3 or offload.params to \"none\"")
        zpp = self.zero_pp
        if (zpp.quantized_weights or zpp.hpz_partition_size > 1) and self.zero_stage != 3:
            key = "zero_pp.quantized_weights" if zpp.quantized_weights \
                else "zero_pp.hpz_partition_size"
            raise ConfigError(f"{key}: qwZ and hpZ change the parameter all-gathers, which "
                              f"only zero_stage 3 has; got zero_stage {self.zero_stage}: set "
                              f"zero_stage to 3 or turn {key} off")
        if zpp.quantized_gradients and self.zero_stage < 2:
            raise ConfigError(f"zero_pp.quantized_gradients: qgZ replaces the gradient "
                              f"reduce-scatter of zero_stage 2 and 3; got zero_stage "
                              f"{self.zero_stage}: set zero_stage to 2 or 3 or turn it off")
        if self.scheduler.min_lr > self.optimizer.lr:
            raise ConfigError(
                f"scheduler.min_lr: must be <= optimizer.lr ({self.optimizer.lr:g}), got "
                f"{self.scheduler.min_lr:g}; min_lr is the absolute floor the schedule decays to")

    # ---------------------------------------------------------------- derived
    @property
    def host_memory_bytes(self) -> int | None:
        gb = self.offload.host_memory_gb
        return None if gb is None else int(round(gb * GB))

    @property
    def device_memory_bytes(self) -> int | None:
        gb = self.offload.device_memory_gb
        return None if gb is None else int(round(gb * GB))

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, d: Mapping | None) -> "InfinityConfig":
        """Build from a plain mapping (as in DESIGN §3.5); missing keys take defaults."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ConfigError(f"config: expected a mapping (dict) at the top level, got "
                              f"{type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        check_unknown_keys("", d, names)
        kwargs = {}
        for k, v in d.items():
            if k in _SECTIONS:
                v = parse_section(_SECTIONS[k], k + ".", v)
            kwargs[k] = v
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """A plain JSON-able dict that round-trips through :meth:`from_dict`
        (``optimizer.param_groups`` is left out while it is empty, and
        ``curriculum_learning`` and ``offload.frozen_weights`` while they are all defaults:
        their defaults)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "curriculum_learning" and v == CurriculumConfig():
                continue
            if dataclasses.is_dataclass(v):
                sub = {}
                for sf in dataclasses.fields(v):
                    sv = getattr(v, sf.name)
                    if sf.name == "frozen_weights":
                        if sv != FrozenWeightsConfig():
                            sub[sf.name] = dataclasses.asdict(sv)
                        continue
                    if sf.name == "param_groups":
                        if sv:
                            sub[sf.name] = copy.deepcopy(sv)
                        continue
                    sub[sf.name] = list(sv) if isinstance(sv, (list, tuple)) else \
                        copy.deepcopy(sv) if isinstance(sv, dict) else sv
                v = sub
            out[f.name] = v
        return out

    @classmethod
    def load(cls, obj: Any = None) -> "InfinityConfig":
        """dict | path to .json/.yaml/.yml | InfinityConfig (copied) | None (defaults)."""
        if obj is None:
            return cls()
        if isinstance(obj, InfinityConfig):
            cfg = copy.deepcopy(obj)
            cfg.validate()
            return cfg
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if isinstance(obj, (str, os.PathLike)):
            return cls.from_dict(_read_file(os.fspath(obj)))
        raise ConfigError(f"config: expected a dict, a path to a .json/.yaml file, an "
                          f"InfinityConfig or None, got {type(obj).__name__}")

    @classmethod
    def from_deepspeed(cls, ds: Mapping | str | os.PathLike, *,
                       approximate_schedules: bool = False, training_args=None,
                       num_training_steps: int | None = None, model=None) -> "InfinityConfig":
        """Translate a DeepSpeed config (dict or JSON/YAML path).

        Keys infinity honours are mapped; tuning-only keys are ignored (one info log
        lists them); anything whose semantics infinity cannot reproduce raises
        :class:`ConfigError` naming the DeepSpeed key.  ``approximate_schedules=True``
        also translates DeepSpeed's "log" warmup (as linear) and WarmupCosineLR (whose
        cosine phase is one step ahead of infinity's), with a warning.
        ``training_args`` (Hugging Face ``TrainingArguments``) fills every ``"auto"`` the
        Hugging Face DeepSpeed integration fills (``num_training_steps`` and ``model`` for
        the keys that need them) and rejects explicit values contradicting them; without
        it ``"auto"`` is an error.  See docs/migrating-from-deepspeed.md, docs/trainers.md.
        """
        if isinstance(ds, (str, os.PathLike)):
            ds = _read_file(os.fspath(ds))
        from infinity.config_deepspeed import deepspeed_to_dict, fill_auto
        if training_args is not None:
            ds, _ = fill_auto(ds, training_args, num_training_steps=num_training_steps,
                              model=model)
        d, origin = deepspeed_to_dict(ds, approximate_schedules=approximate_schedules)
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            key = str(e).split(":", 1)[0]
            src = origin.get(key) or origin.get(key.split("[", 1)[0])
            if src:
                raise ConfigError(f"{e} [translated from DeepSpeed key {src}]") from None
            raise


def load_config(obj: Any = None) -> InfinityConfig:
    """Alias of :meth:`InfinityConfig.load`."""
    return InfinityConfig.load(obj)


# --------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------

def _yaml_loader():
    import yaml

    class _Loader(yaml.SafeLoader):
        """SafeLoader that also reads 1e-3 / 5e8 as floats (YAML 1.1 wants a dot)."""

    _Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."))
    return _Loader


def _read_file(path: str) -> Any:
    if "\x00" in path:
        raise ConfigError(f"config file {path!r}: the path contains a NUL byte, which no file "
                          f"system path can hold; pass the file's name without it")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path!r}: unsupported extension {ext!r}; "
                          f"use .json, .yaml or .yml")
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ConfigError(f"config file {path!r}: cannot read it ({e.strerror or e}); "
                          f"check the path") from e
    try:
        if ext == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (SafeLoader subclass)
    except Exception as e:  # json.JSONDecodeError / yaml.YAMLError
        raise ConfigError(f"config file {path!r}: not valid {ext[1:].upper()}: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path!r}: the top level must be a mapping, got "
                          f"{type(data).__name__}")
    return data
