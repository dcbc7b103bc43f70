"""Who owns what when the Hugging Face ``Trainer`` drives an infinity engine.

``TrainingArguments`` own the training recipe: lr, Adam betas/eps, weight decay (with the
Trainer's own no-decay rule), the lr schedule and warmup, accumulation, ``max_grad_norm``,
bf16/fp16 and the seed.  ``infinity_config`` owns the offload layout (ZeRO stage, homes,
NVMe paths, budgets, prefetch, aio).  An explicit value in ``infinity_config`` that
contradicts the arguments is an error naming both; a DeepSpeed config's ``"auto"`` values
are filled from the arguments (:func:`infinity.config_deepspeed.fill_auto`).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
from typing import Any, Mapping

from infinity.config import ConfigError, InfinityConfig

log = logging.getLogger("infinity.integrations")

__all__ = ["resolve_trainer_config", "ADAMW_OPTIMS", "ds_schedule_lambda"]

# TrainingArguments.optim values that are (decoupled weight decay) AdamW, which CPU Adam is
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision")
_DEFAULTS = InfinityConfig().to_dict()


def read_config_file(path: str) -> Mapping:
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"infinity_config {path!r}: unsupported extension {ext!r}; use .json, "
                          f".yaml or .yml")
    try:
        with open(path, encoding="utf-8") as f:
            if ext == ".json":
                data = json.load(f)
            else:
                import yaml
                data = yaml.safe_load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"infinity_config {path!r}: cannot read it: {e}") from e
    return data or {}


def _precision(args) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def _explicit_from_config(cfg: InfinityConfig) -> dict:
    """The non-default values of an InfinityConfig instance (what its author set)."""
    d = cfg.to_dict()
    out: dict = {}
    for k, v in d.items():
        dv = _DEFAULTS.get(k)
        if isinstance(v, dict):
            sub = {sk: sv for sk, sv in v.items() if dv is None or dv.get(sk) != sv}
            if sub:
                out[k] = sub
        elif v != dv:
            out[k] = v
    return out


def _get(d: Mapping, dotted: str):
    node: Any = d
    for p in dotted.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return None
        node = node[p]
    return node


def _set(d: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    return a == b


def check_optim(args) -> None:
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW_OPTIMS:
        raise ConfigError(f"TrainingArguments optim={optim!r}: infinity's optimizer is CPU AdamW "
                          f"(fp32 master and moments at their offload home); use one of "
                          f"{', '.join(ADAMW_OPTIMS)} (all the same AdamW update)")
    if getattr(args, "optim_args", None):
        raise ConfigError(f"TrainingArguments optim_args={args.optim_args!r}: not supported with "
                          f"infinity (the AdamW hyperparameters come from learning_rate, "
                          f"adam_beta1/2, adam_epsilon and weight_decay)")


def resolve_trainer_config(infinity_config, args, *, num_training_steps: int | None = None,
                           model=None, ignored: list | None = None
                           ) -> tuple[InfinityConfig, dict | None]:
    """``(InfinityConfig, DeepSpeed scheduler section or None)`` for a Trainer run.

    ``infinity_config``: dict, JSON/YAML path, :class:`InfinityConfig`, or a DeepSpeed
    config (recognised by its ``zero_optimization`` key).  The Trainer-owned values are
    taken from ``args``; an explicit contradicting value raises :class:`ConfigError`
    naming both.  When a DeepSpeed config has a ``scheduler`` it is returned (``"auto"``
    filled later, with the step count) and used instead of the Trainer's
    ``lr_scheduler_type``, as with DeepSpeed.  ``ignored`` (a list), when given, receives
    the DeepSpeed keys accepted but ignored."""
    check_optim(args)
    raw = infinity_config
    if isinstance(raw, (str, os.PathLike)):
        raw = read_config_file(os.fspath(raw))
    ds_sched = None
    if isinstance(raw, InfinityConfig):
        explicit, origin = _explicit_from_config(raw), {}
        source = "infinity_config"
    elif raw is None or isinstance(raw, Mapping):
        raw = dict(raw or {})
        if "zero_optimization" in raw:
            from infinity.config_deepspeed import deepspeed_to_dict, fill_auto
            ds_sched = raw.pop("scheduler", None)   # filled when the step count is known
            ds, _ = fill_auto(raw, args, num_training_steps=num_training_steps, model=model)
            explicit, origin = deepspeed_to_dict(ds, ignored_out=ignored)
            source = "DeepSpeed config"
        else:
            explicit, origin = copy.deepcopy(raw), {}
            source = "infinity_config"
    else:
        raise ConfigError(f"infinity_config: expected a dict, a path to a .json/.yaml file, an "
                          f"InfinityConfig or a DeepSpeed config dict, got {type(raw).__name__}")

    owned = {
        "optimizer.lr": (float(args.learning_rate), "learning_rate"),
        "optimizer.betas": ([float(args.adam_beta1), float(args.adam_beta2)],
                            "adam_beta1+adam_beta2"),
        "optimizer.eps": (float(args.adam_epsilon), "adam_epsilon"),
        "optimizer.weight_decay": (float(args.weight_decay), "weight_decay"),
        "optimizer.type": ("adamw", f"optim={getattr(args.optim, 'value', args.optim)}"),
        "gradient_accumulation_steps": (int(args.gradient_accumulation_steps),
                                        "gradient_accumulation_steps"),
        "gradient_clipping": (float(args.max_grad_norm or 0.0), "max_grad_norm"),
        "precision": (_precision(args), "bf16/fp16"),
    }
    sched_name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    bad = []
    for key, (hf_val, hf_name) in owned.items():
        v = _get(explicit, key)
        if v is not None and not _same(v, hf_val):
            name = origin.get(key, key)
            bad.append(f"- {source} {name}={v!r} vs TrainingArguments {hf_name}={hf_val!r}")
    for key, why in (("optimizer.no_decay", "the Trainer's no-decay rule "
                      "(get_decay_parameter_names: biases and norms)"),
                     ("optimizer.param_groups", "the Trainer's two parameter groups (decay / "
                      "no decay)"),
                     ("scheduler", f"lr_scheduler_type={sched_name!r}, warmup_steps/"
                      f"warmup_ratio")):
        v = _get(explicit, key)
        if v:
            bad.append(f"- {source} {key}={v!r} vs TrainingArguments {why}")
    if bad:
        raise ConfigError("infinity_config contradicts the TrainingArguments, which own the "
                          "training recipe (see docs/trainers.md):\n" + "\n".join(bad) +
                          "\nremove these keys from infinity_config (or make them equal)")
    d = copy.deepcopy(explicit)
    d.pop("scheduler", None)
    for key, (hf_val, _) in owned.items():
        _set(d, key, hf_val)
    opt = d.setdefault("optimizer", {})
    opt["no_decay"] = []               # the Trainer's rule is applied as an explicit group
    opt.pop("param_groups", None)
    if model is not None:
        nd = no_decay_names(model, args)
        if nd:
            opt["param_groups"] = [{"params": [_exact(n) for n in nd], "weight_decay": 0.0}]
    try:
        cfg = InfinityConfig.from_dict(d)
    except ConfigError as e:
        key = str(e).split(":", 1)[0]
        src = origin.get(key)
        raise ConfigError(f"{e} [from {source} key {src}]" if src else str(e)) from None
    return cfg, ds_sched


def _exact(name: str) -> str:
    """An ``optimizer.param_groups`` pattern matching exactly ``name`` (a glob whose dots
    are bracketed, so it is matched over the whole name)."""
    import re
    return re.sub(r"([.*?\[\]])", r"[\1]", name)


def no_decay_names(model, args=None) -> list[str]:
    """Trainable parameters the Trainer's rule (``Trainer.get_decay_parameter_names``)
    exempts from weight decay, each once (tied parameters under their first name)."""
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))
    out, seen = [], set()
    for n, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if n not in decay:
            out.append(n)
    return out


def ds_schedule_lambda(sched: Mapping, lr: float):
    """The lr factor (times ``lr``) per optimizer step of DeepSpeed's ``WarmupLR``,
    ``WarmupDecayLR`` and ``WarmupCosineLR`` (``log`` or ``linear`` warmup), transcribed
    from deepspeed/runtime/lr_schedules.py: the exact DeepSpeed schedule, for a
    DeepSpeed config given to the Trainer."""
    typ = sched.get("type")
    p = dict(sched.get("params") or {})
    known = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    if typ not in known:
        raise ConfigError(f"DeepSpeed scheduler.type: {typ!r} is not supported with the Trainer; "
                          f"use one of {sorted(known)} or remove the scheduler section (the "
                          f"Trainer's lr_scheduler_type is then used)")
    warm = max(2, int(p.get("warmup_num_steps", 1000)))
    wtype = p.get("warmup_type", "log")
    if wtype not in ("log", "linear"):
        raise ConfigError(f"DeepSpeed scheduler.params.warmup_type: expected \"log\" or "
                          f"\"linear\", got {wtype!r}")
    inv_log = 1.0 / math.log(warm)

    def warm_gamma(it):
        return inv_log * math.log(it + 1) if wtype == "log" else it / warm

    if typ == "WarmupCosineLR":
        total = int(p["total_num_steps"])
        wmin = float(p.get("warmup_min_ratio", 0.0))
        cmin = float(p.get("cos_min_ratio", 0.0001))

        def factor(it):
            if it < warm:
                return wmin + (1.0 - wmin) * warm_gamma(it)
            real = it - warm + 1
            ratio = (1 + math.cos(math.pi * real / max(1, total - warm))) / 2
            return max(0.0, cmin + (1.0 - cmin) * ratio)
        return factor
    wmin = float(p.get("warmup_min_lr", 0.0))
    wmax = float(p.get("warmup_max_lr", lr))
    total = int(p["total_num_steps"]) if typ == "WarmupDecayLR" else None
    if lr <= 0:
        return lambda it: 0.0

    def factor(it):
        if it < warm:
            g = warm_gamma(it)
        elif total is None:
            g = 1.0
        else:
            g = max(0.0, (total - it) / max(1.0, total - warm))
        return (wmin + (wmax - wmin) * g) / lr
    return factor
