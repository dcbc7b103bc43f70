"""A frozen base named by reference in a checkpoint (Note [Base by reference] in
infinity/memory/sources.py): the manifest's ``meta["frozen_base"]`` entry, written by the
engine for quantized frozen groups whose every tensor came from a pretrained safetensors
file, and read back from those files.

The entry::

    {"version": 1,
     "quantization": {"dtype": "nf4", "group_size": 64, "double_quant": false},
     "working_dtype": "bf16",
     "files": {"/abs/model-00001.safetensors": {"sha256": "...", "bytes": 123}, ...},
     "tensors": {"model.layers.0.mlp.up_proj.weight":
                     {"file": "/abs/...", "key": "...", "shape": [...], "quantized": true}, ...}}

Reading checks every named file before a value is used: a regular file, the recorded size
and SHA-256; a missing or changed file raises :class:`CheckpointError` naming it, the
checkpoint and what to do.  ``read_slice(..., as_trained=True)`` gives the values the run
computed with (quantized and dequantized again, as the engine's home held them: what an
export merges adapters into); ``as_trained=False`` the file's values (what a load
re-quantizes, bit-identical to the first time).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading

import torch

from .errors import CheckpointError

log = logging.getLogger("infinity.checkpoint")

__all__ = ["BaseSource", "file_sha256", "base_entry"]

VERSION = 1
_CHUNK = 8 << 20
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_hash_cache: dict = {}
_hash_lock = threading.Lock()


def file_sha256(path: str) -> tuple[str, int]:
    """``(sha256 hex, size)`` of ``path``, computed once per (file, size, mtime) in this
    process (a base of many GB is hashed at the first checkpoint, not at every one)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    with _hash_lock:
        hit = _hash_cache.get(key)
    if hit is not None:
        return hit
    if st.st_size > 1 << 30:
        log.info("checkpoint: hashing the base file %s (%.1f GB) once", path, st.st_size / 1e9)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    out = (h.hexdigest(), st.st_size)
    with _hash_lock:
        _hash_cache[key] = out
    return out


def base_entry(refs, quantization: dict, working_dtype: str) -> dict:
    """The ``meta["frozen_base"]`` entry for ``refs``: ``[(name, (path, key), shape,
    quantized)]``, hashing each file named (once per process)."""
    files, tensors = {}, {}
    for name, (path, key), shape, quantized in refs:
        if path not in files:
            digest, size = file_sha256(path)
            files[path] = {"sha256": digest, "bytes": size}
        tensors[name] = {"file": path, "key": key, "shape": [int(x) for x in shape],
                         "quantized": bool(quantized)}
    return {"version": VERSION, "quantization": dict(quantization),
            "working_dtype": working_dtype, "files": files, "tensors": tensors}


class BaseSource:
    """The tensors ``meta["frozen_base"]`` names, read from their files (checked first)."""

    def __init__(self, entry, where: str):
        self.where = where
        try:
            if entry.get("version") != VERSION:
                raise ValueError(f"version {entry.get('version')!r}, expected {VERSION}")
            q = entry["quantization"]
            self.qdtype, self.group_size = str(q["dtype"]), int(q["group_size"])
            self.double_quant = bool(q["double_quant"])
            self.working = _DTYPES[entry["working_dtype"]]
            self.files = {str(p): (str(v["sha256"]), int(v["bytes"]))
                          for p, v in entry["files"].items()}
            self.tensors = {str(n): (str(t["file"]), str(t["key"]),
                                     tuple(int(x) for x in t["shape"]), bool(t["quantized"]))
                            for n, t in entry["tensors"].items()}
            if any(f not in self.files for f, *_ in self.tensors.values()):
                raise ValueError("a tensor names a file the entry does not list")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{where}: meta['frozen_base'] is malformed ({e}); the "
                                  f"checkpoint was not written by this version of infinity") \
                from None
        self.verified = False
        self._dtype: dict[str, torch.dtype] = {}

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def verify(self) -> None:
        """Every named file present, regular, of the recorded size and SHA-256; else a
        CheckpointError naming the first bad one."""
        if self.verified:
            return
        for path, (digest, size) in sorted(self.files.items()):
            what = (f"checkpoint {self.where} keeps its frozen base by reference to {path} "
                    f"({size} bytes, sha256 {digest[:16]}...)")
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise CheckpointError(f"{what}, which is missing: put the base model's file "
                                      f"back at that path (the same bytes) to load or export "
                                      f"this checkpoint") from None
            except OSError as e:
                raise CheckpointError(f"{what}, which cannot be read: "
                                      f"{os.strerror(e.errno)}") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{what}, which is not a regular file")
            got, n = file_sha256(path)
            if n != size or got != digest:
                raise CheckpointError(
                    f"{what}, which has changed ({n} bytes, sha256 {got[:16]}...): the "
                    f"checkpoint's adapters were trained on the old base; restore the base "
                    f"file the run used (the same revision of the model)")
        self.verified = True

    def info(self, name: str):
        """(shape, dtype) as the engine expects the tensor: the file's dtype."""
        path, key, shape, _ = self.tensors[name]
        dt = self._dtype.get(name)
        if dt is None:
            with self._open(path) as f:
                dt = self._dtype[name] = _st_dtype(f.get_slice(key).get_dtype())
        return shape, dt

    def _open(self, path):
        from safetensors import safe_open
        self.verify()
        try:
            return safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own types
            raise CheckpointError(f"checkpoint {self.where}: cannot open the base file "
                                  f"{path}: {e}") from None

    def read_slice(self, name: str, start: int, numel: int, *, as_trained: bool) -> torch.Tensor:
        """Flat elements ``[start, start + numel)`` of ``name``: the file's values, or
        ``as_trained`` the values the run computed with (the working dtype, quantized and
        dequantized as the engine's home held them)."""
        path, key, shape, quantized = self.tensors[name]
        with self._open(path) as f:
            t = f.get_tensor(key)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"checkpoint {self.where}: {key} in {path} has shape "
                                  f"{tuple(t.shape)}, the checkpoint recorded {shape}")
        if as_trained:
            t = t.to(self.working)
            if quantized:
                from infinity.quant import quantize_weight
                t = quantize_weight(t, self.qdtype, self.group_size,
                                    double_quant=self.double_quant,
                                    name=name).dequantize(self.working)
        return t.reshape(-1)[start:start + numel]


def _st_dtype(d) -> torch.dtype:
    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F64": torch.float64}
    if isinstance(d, torch.dtype):
        return d
    try:
        return table[str(d)]
    except KeyError:
        raise CheckpointError(f"a base tensor has dtype {d}, not a floating point one") \
            from None
