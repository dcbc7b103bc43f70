"""Torch-style parameter groups: weight decay for most parameters, none for biases and norms.

Rules (documented in docs/configuration.md, ``optimizer.no_decay``):

* Parameters with ``requires_grad == False`` are left out.
* A parameter gets **no weight decay** if any ``no_decay`` pattern is a case-insensitive
  substring of its dotted name (``"bias"`` matches ``transformer.h.0.attn.c_attn.bias``;
  ``"norm"`` matches ``model.layers.0.input_layernorm.weight``).
* With :func:`build_param_groups_for_model` (or an explicit ``module_of`` map) the pattern
  ``"norm"`` also matches every parameter owned by a normalisation module: an instance of
  ``torch.nn.LayerNorm``/``GroupNorm``/``RMSNorm``/``LocalResponseNorm``/batch or instance
  norm, or any class whose name contains ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``).  This
  catches GPT-2's ``ln_1.weight`` / ``ln_f.weight``, whose names do not contain "norm".
* A tensor that appears twice (tied weights) is kept once, under its first name.
* Empty groups are dropped.  Order within a group follows the input order.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

import torch
from torch import nn

from infinity.config import InfinityConfig, OptimizerConfig

log = logging.getLogger("infinity.optim")

__all__ = ["build_param_groups", "build_param_groups_for_model", "is_norm_module",
           "owner_modules"]

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
    """Split ``named_parameters`` into a decay group and a no-decay group.

    ``module_of`` optionally maps a parameter name to the module that owns it, enabling
    the norm-module rule.  Returns a list of dicts with keys ``params``, ``names``, ``lr``,
    ``weight_decay``, ``betas``, ``eps`` (decay group first; empty groups dropped).
    """
    opt = _opt_cfg(opt)
    patterns = [p.lower() for p in opt.no_decay]
    norm_rule = "norm" in patterns
    decay = {"params": [], "names": []}
    no_decay = {"params": [], "names": []}
    seen: dict[int, str] = {}
    for item in named_parameters:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"param groups: expected (name, parameter) pairs, e.g. "
                            f"model.named_parameters(); got {item!r:.80}")
        name, p = item
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError(f"param groups: expected (str, torch.Tensor), got "
                            f"({type(name).__name__}, {type(p).__name__}) for {name!r}")
        if not p.requires_grad:
            continue
        if id(p) in seen:
            log.debug("parameter %s is the same tensor as %s (tied); kept once", name, seen[id(p)])
            continue
        seen[id(p)] = name
        lname = name.lower()
        skip = any(pat in lname for pat in patterns)
        if not skip and norm_rule and module_of is not None:
            mod = module_of.get(name)
            skip = mod is not None and is_norm_module(mod)
        target = no_decay if skip else decay
        target["params"].append(p)
        target["names"].append(name)
    groups = []
    for g, wd in ((decay, opt.weight_decay), (no_decay, 0.0)):
        if g["params"]:
            groups.append({"params": g["params"], "names": g["names"], "lr": opt.lr,
                           "weight_decay": wd, "betas": tuple(opt.betas), "eps": opt.eps})
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
