"""Flatten a model's parameters into per-module groups.

Each module's direct parameters form at most two groups: its trainable parameters
(``requires_grad=True``) and its frozen ones.  Only trainable groups get gradient
buffers, an fp32 master and Adam states, and only they are written back by the
optimizer step; a frozen group is paged in for compute and never written.  A module
whose parameters are all trainable (or all frozen) has one group.

A parameter shared by several modules (tied weights) belongs to the first module that
owns it in ``named_modules()`` order; every module that owns it *uses* that group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from infinity.memory.pool import round_up
from infinity.memory.record import GroupRecord, ParamSlot

__all__ = ["Grouping", "build_groups"]

# each parameter starts at a multiple of this many bytes inside its group
_PARAM_ALIGN_BYTES = 64
# groups are padded so that their byte size is a multiple of this (aligned I/O)
_GROUP_ALIGN_BYTES = 4096


@dataclass
class Grouping:
    groups: list[GroupRecord]
    module_groups: dict[nn.Module, list[GroupRecord]]   # groups each module uses
    param_group: dict[int, GroupRecord]                 # id(param) -> group
    names: dict[int, str]                               # id(param) -> first qualified name


def build_groups(model: nn.Module, dtype: torch.dtype, home: str, *,
                 world_size: int = 1) -> Grouping:
    esize = torch.empty((), dtype=dtype).element_size()
    palign = max(1, _PARAM_ALIGN_BYTES // esize)
    galign = max(1, _GROUP_ALIGN_BYTES // esize) * world_size
    groups: list[GroupRecord] = []
    module_groups: dict[nn.Module, list[GroupRecord]] = {}
    param_group: dict[int, GroupRecord] = {}
    names: dict[int, str] = {}
    for mname, mod in model.named_modules():
        used: list[GroupRecord] = []
        slots: dict[bool, list[ParamSlot]] = {True: [], False: []}   # trainable -> slots
        end: dict[bool, int] = {True: 0, False: 0}
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
            t = bool(p.requires_grad)
            off = round_up(end[t], palign)
            slots[t].append(ParamSlot(qn, p, off, p.numel(), p.shape, t))
            names[id(p)] = qn
            end[t] = off + p.numel()
        own: list[GroupRecord] = []
        for t in (True, False):           # trainable group first, then the frozen one
            if not slots[t]:
                continue
            g = GroupRecord(gid=len(groups), name=mname, slots=slots[t], numel=end[t],
                            padded_numel=round_up(max(end[t], 1), galign), dtype=dtype,
                            home=home)
            groups.append(g)
            for s in slots[t]:
                param_group[id(s.param)] = g
            own.append(g)
        used[:0] = own
        if used:
            module_groups[mod] = used
    return Grouping(groups, module_groups, param_group, names)
