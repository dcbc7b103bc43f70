"""Where a parameter's values were read from: a safetensors file and the key in it.

Note [Base by reference]
~~~~~~~~~~~~~~~~~~~~~~~~
A LoRA run over a large frozen base would write the whole base into every checkpoint, though
the base never changes and its pretrained files are still on disk.  So the loaders that stream
a pretrained checkpoint into a model (:func:`infinity.zero.init.load_safetensors`,
``infinity.finetune.model.load_pretrained``) record here, for each parameter they fill, the
file and key its values came from.  A checkpoint then names a quantized frozen group's
tensors by that reference: the files with their SHA-256 and sizes, the keys, the
quantization settings (``infinity/checkpoint/base_source.py``).  It never stores the
quantized base itself.  Loading re-reads and re-quantizes them: the same input through the
same code gives the same bytes.  A missing or changed file is refused, by name, before
anything is loaded.

The registry is weak (a parameter that is gone takes its entry with it) and holds one entry
per parameter: nothing is attached to ``nn.Parameter``.  Only parameters whose values are
still what was read may keep an entry: frozen ones (a trainable parameter changes at the
first step, so the checkpoint path never uses its entry).  A frozen parameter changed in
place after the read (``load_state_dict``, a merged adapter: its version counter moved)
loses its entry, so the checkpoint stores it.
"""
from __future__ import annotations

import os
import weakref

import torch

__all__ = ["record_source", "source_of", "forget_source"]

_SOURCES: dict[int, tuple] = {}      # id(param) -> (weakref, (path, key), version)


def record_source(param: torch.Tensor, path, key: str) -> None:
    """``param`` holds the values of tensor ``key`` of safetensors file ``path``."""
    pid = id(param)
    ref = weakref.ref(param, lambda _r, pid=pid: _drop(pid, _r))
    _SOURCES[pid] = (ref, (os.path.realpath(os.fspath(path)), str(key)), param._version)


def _drop(pid: int, ref) -> None:
    ent = _SOURCES.get(pid)
    if ent is not None and ent[0] is ref:
        del _SOURCES[pid]


def source_of(param: torch.Tensor) -> tuple[str, str] | None:
    """``(real path, key)`` ``param`` was read from, or None (also when its values were
    changed in place since: ``load_state_dict``, a merged adapter, an edit)."""
    ent = _SOURCES.get(id(param))
    if ent is None or ent[0]() is not param or param._version != ent[2]:
        return None
    return ent[1]


def forget_source(param: torch.Tensor) -> None:
    ent = _SOURCES.get(id(param))
    if ent is not None and ent[0]() is param:
        del _SOURCES[id(param)]
