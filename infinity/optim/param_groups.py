"""Torch-style parameter groups: weight decay for most parameters, none for biases and norms,
and per-group hyperparameters from ``optimizer.param_groups``.

Rules (documented in docs/configuration.md, ``optimizer.no_decay`` and
``optimizer.param_groups``):

* Parameters with ``requires_grad == False`` are left out.
* A parameter belongs to the first ``optimizer.param_groups`` entry with a pattern that
  matches its dotted name (see :func:`name_matches`); that entry's ``lr``, ``betas``,
  ``eps`` and ``weight_decay`` replace the top-level ``optimizer`` values it sets.
  Unmatched parameters use the top-level values.  A pattern matching no parameter of
  the model (trainable or frozen) is a :class:`~infinity.config.ConfigError`.
* Inside an entry that sets ``weight_decay`` that value applies to **all** its
  parameters (the entry overrides ``no_decay``); otherwise ``no_decay`` applies as below.
* A parameter gets **no weight decay** if any ``no_decay`` pattern is a case-insensitive
  substring of its dotted name (``"bias"`` matches ``transformer.h.0.attn.c_attn.bias``;
  ``"norm"`` matches ``model.layers.0.input_layernorm.weight``).
* With :func:`build_param_groups_for_model` (or an explicit ``module_of`` map) the pattern
  ``"norm"`` also matches every parameter owned by a normalisation module: an instance of
  ``torch.nn.LayerNorm``/``GroupNorm``/``RMSNorm``/``LocalResponseNorm``/batch or instance
  norm, or any class whose name contains ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``).  This
  catches GPT-2's ``ln_1.weight`` / ``ln_f.weight``, whose names do not contain "norm".
* A tensor that appears twice (tied weights) is kept once, under its first name.
* Empty groups are dropped.  Order: the top-level decay group, the top-level no-decay
  group, then for each ``param_groups`` entry its decay and no-decay groups.  Order
  within a group follows the input order.
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Iterable, Mapping

import torch
from torch import nn

from infinity.config import ConfigError, InfinityConfig, OptimizerConfig

log = logging.getLogger("infinity.optim")

__all__ = ["build_param_groups", "build_param_groups_for_model", "is_norm_module",
           "name_matches", "owner_modules"]

_GLOB_CHARS = frozenset("*?[")


def name_matches(pattern: str, name: str) -> bool:
    """``optimizer.param_groups`` pattern test, case-insensitive: a pattern with a glob
    character (``*``, ``?``, ``[``) is an ``fnmatch`` pattern over the whole dotted name
    (``"*lora_*"``, ``"layers.[01].*"``); a plain pattern matches as a substring, like
    ``no_decay`` (``"lora_"`` matches ``layers.0.attn.lora_a``)."""
    p, n = pattern.lower(), name.lower()
    if _GLOB_CHARS.isdisjoint(p):
        return p in n
    return fnmatch.fnmatchcase(n, p)

_NORM_TYPES: tuple[type, ...] = tuple(
    t for t in (
        getattr(nn, "LayerNorm", None), getattr(nn, "GroupNorm", None),
        getattr(nn, "RMSNorm", None), getattr(nn, "LocalResponseNorm", None),
        getattr(getattr(nn.modules, "batchnorm", None), "_NormBase", None),
    ) if isinstance(t, type))


def is_norm_module(module: nn.Module) -> bool:
    """True for torch normalisation layers and any class whose name contains "Norm"."""
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def _opt_cfg(opt) -> OptimizerConfig:
    if opt is None:
        return OptimizerConfig()
    if isinstance(opt, InfinityConfig):
        return opt.optimizer
    if isinstance(opt, OptimizerConfig):
        return opt
    if isinstance(opt, Mapping):
        return InfinityConfig.from_dict({"optimizer": dict(opt)}).optimizer
    raise TypeError(f"param groups: expected an OptimizerConfig (or InfinityConfig / dict), got "
                    f"{type(opt).__name__}")


def build_param_groups(named_parameters: Iterable[tuple[str, torch.Tensor]],
                       opt: OptimizerConfig | None = None, *,
                       module_of: Mapping[str, nn.Module] | None = None) -> list[dict]:
    """Split ``named_parameters`` into decay / no-decay groups, per ``param_groups`` entry.

    ``module_of`` optionally maps a parameter name to the module that owns it, enabling
    the norm-module rule.  Returns a list of dicts with keys ``params``, ``names``, ``lr``,
    ``weight_decay``, ``betas``, ``eps`` (see the module docstring for the order; empty
    groups dropped).
    """
    opt = _opt_cfg(opt)
    patterns = [p.lower() for p in opt.no_decay]
    norm_rule = "norm" in patterns
    entries = opt.param_groups
    # bucket (entry index, -1 = top level; no-decay?) -> params / names
    buckets: dict[tuple[int, bool], dict] = {}
    matched = [[False] * len(e["params"]) for e in entries]
    all_names: list[str] = []
    seen: dict[int, str] = {}
    for item in named_parameters:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"param groups: expected (name, parameter) pairs, e.g. "
                            f"model.named_parameters(); got {item!r:.80}")
        name, p = item
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError(f"param groups: expected (str, torch.Tensor), got "
                            f"({type(name).__name__}, {type(p).__name__}) for {name!r}")
        all_names.append(name)
        entry = -1
        for ei, e in enumerate(entries):
            hits = [name_matches(pat, name) for pat in e["params"]]
            for j, h in enumerate(hits):
                matched[ei][j] |= h
            if entry < 0 and any(hits):
                entry = ei
        if not p.requires_grad:
            continue
        if id(p) in seen:
            log.debug("parameter %s is the same tensor as %s (tied); kept once", name, seen[id(p)])
            continue
        seen[id(p)] = name
        if entry >= 0 and "weight_decay" in entries[entry]:
            skip = False                  # the entry's weight_decay overrides no_decay
        else:
            lname = name.lower()
            skip = any(pat in lname for pat in patterns)
            if not skip and norm_rule and module_of is not None:
                mod = module_of.get(name)
                skip = mod is not None and is_norm_module(mod)
        b = buckets.setdefault((entry, skip), {"params": [], "names": []})
        b["params"].append(p)
        b["names"].append(name)
    for ei, e in enumerate(entries):
        for j, pat in enumerate(e["params"]):
            if not matched[ei][j]:
                raise ConfigError(
                    f"optimizer.param_groups[{ei}].params[{j}]: pattern {pat!r} matches no "
                    f"parameter of the model ({len(all_names)} parameters, e.g. "
                    f"{', '.join(all_names[:3])}); patterns are case-insensitive substrings, "
                    f"or fnmatch globs over the whole dotted name when they contain * ? [")
    groups = []
    for ei in range(-1, len(entries)):
        e = entries[ei] if ei >= 0 else {}
        for skip in (False, True):
            b = buckets.get((ei, skip))
            if b is None:
                continue
            wd = 0.0 if skip else float(e.get("weight_decay", opt.weight_decay))
            groups.append({"params": b["params"], "names": b["names"],
                           "lr": float(e.get("lr", opt.lr)), "weight_decay": wd,
                           "betas": tuple(e.get("betas", opt.betas)),
                           "eps": float(e.get("eps", opt.eps))})
    return groups


def owner_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{parameter name: module that directly owns it}`` for ``model.named_parameters()``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"param groups: expected a torch.nn.Module, got {type(model).__name__}")
    out: dict[str, nn.Module] = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = mod
    return out


def build_param_groups_for_model(model: nn.Module,
                                 opt: OptimizerConfig | InfinityConfig | None = None) -> list[dict]:
    """:func:`build_param_groups` over ``model.named_parameters()`` with the norm-module rule."""
    groups = build_param_groups(model.named_parameters(), opt, module_of=owner_modules(model))
    if not groups:
        raise ValueError(f"param groups: {type(model).__name__} has no trainable parameters "
                          f"(all have requires_grad=False); unfreeze some before training")
    return groups
