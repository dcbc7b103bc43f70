"""Value checks of tensors while :meth:`CheckpointReader.verify` hashes them.

A checkpoint whose checksums all pass can still hold values no loader should accept: a
NaN in an fp32 master or an Adam moment (the next update writes NaN weights), or a
negative second moment (``exp_avg_sq`` is a running mean of squared gradients, so a
negative value means the file is corrupt or ``exp_avg`` and ``exp_avg_sq`` were swapped).
The loader names the tensors to check (:class:`ValueCheck`); :class:`ValueScanner` then
checks them in the buffers ``verify()`` has just read for hashing, so the checks cost one
``aminmax`` over bytes already in memory, not another read of the checkpoint, and they
fail before anything is loaded.

Each element is checked by the chunk that holds its first byte; an element cut by a chunk
boundary is completed with a read of its few missing bytes.
"""
from __future__ import annotations

import bisect
import os
from typing import NamedTuple

import torch

from . import dtypes
from .errors import CheckpointError

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class ValueCheck(NamedTuple):
    """What the values of one tensor must satisfy.

    ``what`` names the tensor's role in the error ("the fp32 master weight");
    ``finite``: no NaN or inf; ``nonneg``: every value >= 0 (-0.0 included);
    ``hint`` / ``nonneg_hint``: what a failure of either means, for the error."""
    what: str
    finite: bool = True
    nonneg: bool = False
    hint: str = ""
    nonneg_hint: str = ""


class _Span(NamedTuple):
    begin: int          # absolute byte range of the piece in its file
    end: int
    name: str
    dtype: torch.dtype
    isz: int
    start: int          # the piece's first flat element in the tensor
    check: ValueCheck


class ValueScanner:
    """Checks the values named in ``checks`` (tensor name -> :class:`ValueCheck`) in the
    byte ranges of the files of ``manifest`` handed to :meth:`scan`. Floating-point
    tensors only; a name that is not in the manifest or not floating point is skipped
    (the loader's other checks report those)."""

    def __init__(self, manifest, checks, file_path):
        self._file_path = file_path
        spans: dict[str, list[_Span]] = {}
        for name, chk in checks.items():
            t = manifest["tensors"].get(name)
            if t is None:
                continue
            dt = dtypes.ST_TO_TORCH.get(t["dtype"])
            if dt not in _FLOATS:
                continue
            isz = dtypes.itemsize(dt)
            for p in t["pieces"]:
                b, e = p["offsets"]
                if e > b:
                    spans.setdefault(p["file"], []).append(
                        _Span(b, e, name, dt, isz, p["start"], chk))
        for lst in spans.values():
            lst.sort()
        self._spans = spans
        self._begins = {f: [s.begin for s in lst] for f, lst in spans.items()}

    def __bool__(self):
        return bool(self._spans)

    def scan(self, fname, fd, pos, buf):
        """Check the elements whose first byte lies in ``buf`` (the bytes of ``fname`` at
        ``[pos, pos + len(buf))``, a writable buffer); ``fd`` completes an element the
        buffer cuts. Raises :class:`CheckpointError` naming the first bad element."""
        spans = self._spans.get(fname)
        if not spans:
            return
        end = pos + len(buf)
        # pieces do not overlap (manifest.validate): start at the last one beginning <= pos
        i = max(0, bisect.bisect_right(self._begins[fname], pos) - 1)
        for s in spans[i:]:
            if s.begin >= end:
                break
            if s.end <= pos:
                continue
            first = max(0, -(-(pos - s.begin) // s.isz))          # first element starting here
            stop = -(-(min(s.end, end) - s.begin) // s.isz)        # elements starting before end
            if stop <= first:
                continue
            whole = (min(s.end, end) - s.begin) // s.isz           # ... ending inside buf
            if whole > first:
                off = s.begin + first * s.isz - pos
                t = torch.frombuffer(buf, dtype=s.dtype, count=whole - first, offset=off)
                self._check(fname, s, t, first)
            if stop > whole:                                       # cut by the buffer's end
                at = s.begin + whole * s.isz
                raw = bytearray(os.pread(fd, s.isz, at))
                if len(raw) != s.isz:
                    raise CheckpointError(f"checkpoint file {self._file_path(fname)}: short read "
                                          f"at {at}; the file is truncated")
                self._check(fname, s, torch.frombuffer(raw, dtype=s.dtype), whole)

    def _check(self, fname, s, t, first):
        lo, hi = torch.aminmax(t)         # NaN propagates into both
        lo, hi = float(lo), float(hi)
        bad = None
        if s.check.finite and not (abs(lo) < float("inf") and abs(hi) < float("inf")):
            mask, bad, hint = ~torch.isfinite(t), "a non-finite value", s.check.hint
        elif s.check.nonneg and lo < 0:
            mask, bad, hint = t < 0, "a negative value", s.check.nonneg_hint
        if bad is None:
            return
        k = int(mask.nonzero()[0, 0])
        v = float(t[k])
        elem = s.start + first + k
        hint = f" ({hint})" if hint else ""
        raise CheckpointError(
            f"checkpoint file {self._file_path(fname)}: tensor {s.name!r} ({s.check.what}) holds "
            f"{bad} ({v!r}) at flat element {elem}{hint}; the checkpoint passed its checksums "
            f"but its values are corrupt: refusing to load it, load another tag")
