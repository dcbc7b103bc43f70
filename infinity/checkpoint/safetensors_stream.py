"""Streaming writer and careful header reader for safetensors files.

safetensors layout: 8-byte little-endian header length N, N bytes of JSON header
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [b, e]}}``,
offsets relative to the first byte after the header, regions contiguous, no gaps),
then the raw little-endian, C-ordered tensor bytes. The header may be padded with
trailing spaces.

The Python ``safetensors`` API needs all tensors in one dict; we want to stream
tensors one by one. So the writer reserves ``header_reserve`` bytes (a multiple of
4096, so tensor data starts page aligned) for the header, writes each tensor's
bytes as it arrives, and writes the (space-padded) header into the reserved region
when the file is closed. A shard is full when either its data budget or its header
space is used up (``fits``). Files are readable by ``safetensors.safe_open``.

The header region is hashed with SHA-256, and the data region with one SHA-256 per
``hash_block_bytes`` block (64 MiB by default), while they are written (no re-read);
block digests let a reader verify one file on several cores.
"""
import hashlib
import json
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import dtypes
from .errors import CheckpointError
from .fsutil import fsync_fd, open_private_file, write_all

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same bound as the reference implementation
_OVERLAP_MIN = 1 << 20
HASH_BLOCK_BYTES = 64 << 20
_POOL = None
_POOL_LOCK = threading.Lock()


def _hash_pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="infinity-ckpt-hash")
        return _POOL

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("infinity.checkpoint supports little-endian hosts only")


def tensor_bytes(t):
    """A uint8 memoryview over a CPU contiguous copy/view of ``t`` (any dtype)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def _entry_json(key, entry):
    return json.dumps(key) + ":" + json.dumps(entry, separators=(",", ":"))


def header_reserve_for(entries):
    """A ``header_reserve`` that holds the header of these tensors: ``entries`` are
    ``(name, safetensors dtype string, shape)``; offsets counted at up to 20 digits each,
    plus the metadata; a multiple of 4096."""
    n = 64
    for name, st, shape in entries:
        n += len(json.dumps(name)) + len(json.dumps(list(shape))) + len(st) + 80
    return (n + 8 + 4095) // 4096 * 4096


class SafetensorsStreamWriter:
    """Write one safetensors file tensor by tensor. Not thread safe."""

    def __init__(self, path, *, header_reserve=256 * 1024, metadata=None,
                 hash_block_bytes=HASH_BLOCK_BYTES):
        if hash_block_bytes < 4096:
            raise ValueError(f"hash_block_bytes must be >= 4096, got {hash_block_bytes}")
        if header_reserve % 4096 or header_reserve < 4096:
            raise ValueError(f"header_reserve must be a positive multiple of 4096, got {header_reserve}")
        self.path = path
        self.data_start = header_reserve
        self._meta_part = _entry_json("__metadata__", {str(k): str(v) for k, v in (metadata or {}).items()})
        self._parts = [self._meta_part]
        self._header_len = 2 + len(self._meta_part)  # braces + parts + commas
        self._data_bytes = 0
        self._keys = set()
        self.hash_block_bytes = int(hash_block_bytes)
        self._blocks = []
        self._cur_hash = hashlib.sha256()
        self._cur_fill = 0
        self.header_sha256 = None
        self.size = None
        self._fd = open_private_file(path)
        try:
            os.lseek(self._fd, self.data_start, os.SEEK_SET)
        except OSError as e:
            self.abort()
            raise CheckpointError(f"seek in {path} failed: {e}") from e

    @property
    def data_bytes(self):
        return self._data_bytes

    def _entry(self, key, st_dtype, shape, nbytes):
        e = {"dtype": st_dtype, "shape": [int(s) for s in shape],
             "data_offsets": [self._data_bytes, self._data_bytes + nbytes]}
        return _entry_json(key, e)

    def fits(self, key, tensor):
        """Would the header still fit in the reserved region after adding this tensor?"""
        nbytes = tensor.numel() * tensor.element_size()
        probe = self._entry(key, dtypes.to_st(tensor.dtype), tensor.shape, nbytes)
        return self._header_len + 1 + len(probe) <= self.data_start - 8

    def add(self, key, tensor, shape=None):
        """Append ``tensor``'s bytes under ``key``; returns the absolute byte range in the file."""
        if self._fd is None:
            raise CheckpointError(f"{self.path}: writer is closed")
        if key in self._keys or key == "__metadata__":
            raise CheckpointError(f"{self.path}: duplicate tensor name {key!r}")
        st = dtypes.to_st(tensor.dtype, what=f"tensor {key!r}: ")
        shape = tuple(tensor.shape) if shape is None else tuple(shape)
        mv = tensor_bytes(tensor)
        nbytes = len(mv)
        part = self._entry(key, st, shape, nbytes)
        if self._header_len + 1 + len(part) > self.data_start - 8:
            raise CheckpointError(f"{self.path}: header space ({self.data_start} bytes) exhausted "
                                  f"by tensor {key!r}; use a larger header_reserve")
        begin = self.data_start + self._data_bytes
        if nbytes >= _OVERLAP_MIN:
            # hash on a helper thread while this one writes (both release the GIL)
            fut = _hash_pool().submit(self._hash_data, mv)
            try:
                write_all(self._fd, mv, self.path)
            finally:
                fut.result()
        else:
            write_all(self._fd, mv, self.path)
            self._hash_data(mv)
        self._parts.append(part)
        self._header_len += 1 + len(part)
        self._keys.add(key)
        self._data_bytes += nbytes
        return begin, begin + nbytes

    def _hash_data(self, mv):
        """SHA-256 per ``hash_block_bytes`` block of the data region (blocks verify in
        parallel; the last block may be short)."""
        while len(mv):
            take = min(len(mv), self.hash_block_bytes - self._cur_fill)
            self._cur_hash.update(mv[:take])
            self._cur_fill += take
            mv = mv[take:]
            if self._cur_fill == self.hash_block_bytes:
                self._blocks.append(self._cur_hash.hexdigest())
                self._cur_hash, self._cur_fill = hashlib.sha256(), 0

    def close(self):
        """Write the header, fsync, close. Returns a dict describing the file."""
        header = ("{" + ",".join(self._parts) + "}").encode("ascii")
        room = self.data_start - 8
        if len(header) > room:  # cannot happen: add() checks
            raise CheckpointError(f"{self.path}: header of {len(header)} bytes exceeds reserve")
        region = struct.pack("<Q", room) + header + b" " * (room - len(header))
        try:
            n = os.pwrite(self._fd, region, 0)
            if n != len(region):
                raise OSError(0, f"short header write {n}/{len(region)}")
        except OSError as e:
            self.abort()
            raise CheckpointError(f"writing the header of {self.path} failed: {e}") from e
        try:
            fsync_fd(self._fd, self.path)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = None
        self.header_sha256 = hashlib.sha256(region).hexdigest()
        if self._cur_fill:
            self._blocks.append(self._cur_hash.hexdigest())
        self.size = self.data_start + self._data_bytes
        return {"size": self.size, "data_start": self.data_start,
                "header_sha256": self.header_sha256, "hash_block_bytes": self.hash_block_bytes,
                "data_sha256_blocks": list(self._blocks)}

    def abort(self):
        """Close without finishing (the caller removes the temp directory)."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def read_header(fd, path, file_size):
    """Parse and sanity-check a safetensors header from an open fd (untrusted input).

    Returns (data_start, {key: (dtype_str, shape, (begin_abs, end_abs))}, metadata).
    """
    if file_size < 8:
        raise CheckpointError(f"{path}: file too short ({file_size} bytes) to be safetensors")
    raw = os.pread(fd, 8, 0)
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CheckpointError(f"{path}: header length {n} is invalid for a file of {file_size} bytes")
    hb = os.pread(fd, n, 8)
    if len(hb) != n:
        raise CheckpointError(f"{path}: short read of header ({len(hb)}/{n} bytes)")
    try:
        header = json.loads(hb.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for key, e in header.items():
        if not isinstance(e, dict):
            raise CheckpointError(f"{path}: entry {key!r} is not an object")
        dt = dtypes.to_torch(e.get("dtype"), where=f"{path}: tensor {key!r}: ")
        shape = e.get("shape")
        offs = e.get("data_offsets")
        if (not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)
                or not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int and o >= 0 for o in offs) or offs[0] > offs[1]):
            raise CheckpointError(f"{path}: tensor {key!r} has a malformed shape/data_offsets")
        numel = 1
        for s in shape:
            numel *= s
        if offs[1] - offs[0] != numel * dtypes.itemsize(dt):
            raise CheckpointError(f"{path}: tensor {key!r}: byte range {offs} does not match "
                                  f"shape {shape} of {e['dtype']}")
        if data_start + offs[1] > file_size:
            raise CheckpointError(f"{path}: tensor {key!r} extends past the end of the file "
                                  f"({data_start + offs[1]} > {file_size}); the file is truncated")
        out[key] = (e["dtype"], shape, (data_start + offs[0], data_start + offs[1]))
    return data_start, out, meta
