"""Flatten a model's parameters into per-module groups (one group per module's direct params).

A parameter shared by several modules (tied weights) belongs to the first module that
owns it in ``named_modules()`` order; every module that owns it *uses* that group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from infinity.memory.pool import round_up
from infinity.memory.record import GroupRecord, ParamSlot

__all__ = ["GroupPlan", "build_groups"]

# each parameter starts at a multiple of this many bytes inside its group
_PARAM_ALIGN_BYTES = 64
# groups are padded so that their byte size is a multiple of this (aligned I/O)
_GROUP_ALIGN_BYTES = 4096


@dataclass
class GroupPlan:
    groups: list[GroupRecord]
    module_groups: dict[nn.Module, list[GroupRecord]]   # groups each module uses
    param_group: dict[int, GroupRecord]                 # id(param) -> group
    names: dict[int, str]                               # id(param) -> first qualified name


def build_groups(model: nn.Module, dtype: torch.dtype, home: str, *,
                 world_size: int = 1) -> GroupPlan:
    esize = torch.empty((), dtype=dtype).element_size()
    palign = max(1, _PARAM_ALIGN_BYTES // esize)
    galign = max(1, _GROUP_ALIGN_BYTES // esize) * world_size
    groups: list[GroupRecord] = []
    module_groups: dict[nn.Module, list[GroupRecord]] = {}
    param_group: dict[int, GroupRecord] = {}
    names: dict[int, str] = {}
    for mname, mod in model.named_modules():
        used: list[GroupRecord] = []
        slots: list[ParamSlot] = []
        off = 0
        for pname, p in mod.named_parameters(recurse=False):
            if p is None:
                continue
            qn = f"{mname}.{pname}" if mname else pname
            g = param_group.get(id(p))
            if g is not None:
                if g not in used:
                    used.append(g)
                continue
            if not p.is_floating_point():
                raise TypeError(f"initialize: parameter {qn} has dtype {p.dtype}; only "
                                f"floating-point parameters can be managed")
            off = round_up(off, palign)
            slots.append(ParamSlot(qn, p, off, p.numel(), p.shape, bool(p.requires_grad)))
            names[id(p)] = qn
            off += p.numel()
        if slots:
            g = GroupRecord(gid=len(groups), name=mname, slots=slots, numel=off,
                            padded_numel=round_up(max(off, 1), galign), dtype=dtype, home=home)
            groups.append(g)
            for s in slots:
                param_group[id(s.param)] = g
            used.insert(0, g)
        if used:
            module_groups[mod] = used
    return GroupPlan(groups, module_groups, param_group, names)
