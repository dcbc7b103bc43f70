"""The one writer of Hugging Face sharded safetensors directories, used by every export
(``export_model``, the quantized export, ``engine.save_pretrained`` with or without
``quantize``).

Output: ``OUT/model.safetensors``, or when the tensors exceed ``max_shard_bytes``
``OUT/model-00001-of-0000N.safetensors`` ... plus ``OUT/model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map"}``).  The shards are planned up front from the
declared entries (so the header space is reserved exactly), then filled one source tensor
at a time: ``produce(name)`` returns the stored tensors of source ``name`` (one, or several
for a quantized Linear), each checked against what was declared.  Each file is written under
a temp name and renamed, the directory fsynced; an index left by an earlier sharded export
is removed when the new one is a single file.  ``write=False`` runs every ``produce`` in
order and writes nothing (the other ranks of a collective export: their reads are the
gathers rank 0's reads need).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from . import dtypes
from .errors import CheckpointError
from .fsutil import atomic_write_text, fsync_dir, remove_tree
from .safetensors_stream import SafetensorsStreamWriter, header_reserve_for

INDEX_NAME = "model.safetensors.index.json"

__all__ = ["INDEX_NAME", "Entry", "write_hf_shards"]


@dataclass(frozen=True)
class Entry:
    """One stored tensor: its key in the file, dtype and shape."""
    key: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = dtypes.itemsize(self.dtype)
        for s in self.shape:
            n *= int(s)
        return n


def shard_file_names(k: int) -> list[str]:
    return (["model.safetensors"] if k == 1 else
            [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)])


def plan_shards(sources, max_shard_bytes: int):
    """``sources``: ``[(name, [Entry, ...])]`` in write order -> list of shards (lists of
    the same pairs), a source's entries never split across files."""
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards, cur, cur_bytes = [], [], 0
    for name, ents in sources:
        nb = sum(e.nbytes for e in ents)
        if cur and cur_bytes + nb > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, ents))
        cur_bytes += nb
    shards.append(cur)
    return shards


def write_hf_shards(out_dir, sources, produce, *, max_shard_bytes: int, metadata=None,
                    write: bool = True) -> tuple[list[str], int]:
    """Write ``sources`` (``[(name, [Entry, ...])]``) to ``out_dir`` (which exists);
    ``produce(name) -> {key: tensor}`` is called once per source, in order.  Returns (paths
    written, bytes of tensor data); with ``write=False``, (the paths that would be
    written, bytes) and nothing on disk."""
    shards = plan_shards(sources, max_shard_bytes)
    fnames = shard_file_names(len(shards))
    weight_map, total, written = {}, 0, []
    for fname, group in zip(fnames, shards):
        final = os.path.join(out_dir, fname)
        tmp = os.path.join(out_dir, f".{fname}.tmp-{os.getpid()}")
        w = None
        if write:
            remove_tree(tmp)
            reserve = header_reserve_for([(e.key, dtypes.to_st(e.dtype), e.shape)
                                          for _, ents in group for e in ents])
            w = SafetensorsStreamWriter(tmp, header_reserve=reserve,
                                        metadata=metadata or {"format": "pt"})
        try:
            for name, ents in group:
                outs = produce(name)
                if w is None:           # write=False: the reads happened, nothing to store
                    total += sum(e.nbytes for e in ents)
                    weight_map.update((e.key, fname) for e in ents)
                    del outs
                    continue
                for e in ents:
                    t = outs.get(e.key)
                    if t is None:
                        raise CheckpointError(f"{name}: {e.key} was planned but not produced")
                    t = t.detach().contiguous()
                    if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                        raise CheckpointError(f"{name}: produced {e.key} {t.dtype} "
                                              f"{list(t.shape)}, planned {e.dtype} {list(e.shape)}")
                    w.add(e.key, t)
                    total += t.numel() * t.element_size()
                    weight_map[e.key] = fname
                del outs
            if w is not None:
                w.close()
                os.rename(tmp, final)
        except BaseException:
            if w is not None:
                w.abort()
                remove_tree(tmp)
            raise
        written.append(final)
    index = os.path.join(out_dir, INDEX_NAME)
    if not write:
        return written + ([index] if len(shards) > 1 else []), total
    fsync_dir(out_dir)
    if len(shards) > 1:
        atomic_write_text(index, json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=2) + "\n")
        written.append(index)
    elif os.path.exists(index):
        os.unlink(index)   # a stale index from an earlier sharded export would mislead loaders
    return written, total
