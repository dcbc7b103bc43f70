"""The calibration activations of layer-by-layer distillation, paged through the tiers.

LKD keeps, for the block being distilled, the calibration batch's activations entering it
(``X``) and the 16-bit block's output (``Y``, the target, which then enters the next block):
two tensors of ``sequences x tokens x hidden``, which for a large model and a real
calibration set exceed host memory.  They are held here in *chunks* of a few sequences
(what one forward/backward of the block sees at a time): in host memory while the chunks
held there stay under ``host_bytes``, the rest in extents of a private NVMe swap space
(:class:`infinity.io.SwapSpace` under ``swap_path``: unlinked files, removed on close),
written and read back as whole chunks through page-aligned staging.  Reading a chunk
starts the read of the next one of the same set (one chunk read ahead).

:class:`CalibrationPages` owns the swap space and the host budget; each
:class:`ChunkSet` (``X`` or ``Y`` of one block) is filled with ``put`` and read with
``get``; ``free`` returns its host bytes and extents.  ``stats`` counts the bytes that
went to and came back from NVMe and the peak host bytes held.
"""
from __future__ import annotations

import logging

import torch

from infinity.memory.pool import ALIGN, round_up

from .errors import CheckpointError

log = logging.getLogger("infinity.checkpoint")

__all__ = ["CalibrationPages", "ChunkSet"]


class CalibrationPages:
    """See the module doc.  ``host_bytes``: chunks held in host memory at most (0: every
    chunk on NVMe); ``swap_path``: directory of the NVMe swap space (needed once a chunk
    does not fit ``host_bytes``)."""

    def __init__(self, *, host_bytes: int, swap_path=None, aio=None):
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
            raise CheckpointError(f"LKD host_bytes must be a non-negative integer, got {host_bytes!r}")
        self.host_bytes = host_bytes
        self.swap_path = swap_path
        self._aio_cfg = aio
        self._aio = self._swap = None
        self.host_used = 0
        self.stats = {"nvme_write_bytes": 0, "nvme_read_bytes": 0, "peak_host_bytes": 0,
                      "chunks_on_nvme": 0, "chunks_in_host": 0}

    def new_set(self) -> "ChunkSet":
        return ChunkSet(self)

    @property
    def swap(self):
        if self._swap is None:
            if self.swap_path is None:
                raise CheckpointError(
                    f"LKD: the calibration activations exceed the host budget of {self.host_bytes} "
                    f"bytes and no NVMe path was given for the rest: pass --lkd-swap PATH (or "
                    f"more host memory with --lkd-host-mb)")
            from infinity.io import AioEngine, SwapSpace
            a = self._aio_cfg or {}
            self._aio = AioEngine(a.get("block_size", 1 << 20), a.get("queue_depth", 32),
                                  a.get("threads", 1), a.get("engine", "auto"))
            try:
                self._swap = SwapSpace([str(self.swap_path)], self._aio)
            except BaseException:
                self._aio.close()
                self._aio = None
                raise
            log.info("LKD: calibration activations beyond %d host bytes are paged to %s",
                     self.host_bytes, self.swap_path)
        return self._swap

    def _host_take(self, n: int) -> bool:
        if self.host_used + n > self.host_bytes:
            return False
        self.host_used += n
        self.stats["peak_host_bytes"] = max(self.stats["peak_host_bytes"], self.host_used)
        return True

    def close(self) -> None:
        if self._swap is not None:
            self._swap.close()
            self._swap = None
        if self._aio is not None:
            self._aio.close()
            self._aio = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _OnNvme:
    __slots__ = ("extent", "shape", "dtype", "nbytes")

    def __init__(self, extent, shape, dtype, nbytes):
        self.extent, self.shape, self.dtype, self.nbytes = extent, shape, dtype, nbytes


class ChunkSet:
    """Chunks ``0..n-1`` of one activation tensor (see the module doc)."""

    def __init__(self, pages: CalibrationPages):
        self.pages = pages
        self._chunks: dict[int, object] = {}
        self._ahead = None          # (index, staging, handle) of the read started ahead

    def __len__(self) -> int:
        return len(self._chunks)

    def put(self, j: int, t: torch.Tensor) -> None:
        if j in self._chunks:
            raise CheckpointError(f"LKD: activation chunk {j} stored twice")
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        p = self.pages
        if p._host_take(n):
            self._chunks[j] = t.clone() if t._base is not None else t
            p.stats["chunks_in_host"] += 1
            return
        swap = p.swap
        span = round_up(max(n, 1), ALIGN)
        ext = swap.allocate(span)
        try:
            staging = _staging(span)
            staging[:n].copy_(t.reshape(-1).view(torch.uint8))
            swap.write(ext, staging).wait()
        except BaseException:
            swap.free(ext)
            raise
        self._chunks[j] = _OnNvme(ext, tuple(t.shape), t.dtype, n)
        p.stats["nvme_write_bytes"] += span
        p.stats["chunks_on_nvme"] += 1

    def get(self, j: int) -> torch.Tensor:
        c = self._chunks.get(j)
        if c is None:
            raise CheckpointError(f"LKD: activation chunk {j} was never stored")
        if isinstance(c, torch.Tensor):
            out = c
        else:
            if self._ahead is not None and self._ahead[0] == j:
                _, staging, h = self._ahead
                self._ahead = None
            else:
                self._drain_ahead()
                staging, h = self._read(c)
            h.wait()
            out = staging[:c.nbytes].view(c.dtype).view(c.shape)
        nxt = self._chunks.get(j + 1)
        if isinstance(nxt, _OnNvme) and self._ahead is None:
            self._ahead = (j + 1, *self._read(nxt))        # the next chunk is read meanwhile
        return out

    def _read(self, c: _OnNvme):
        span = round_up(max(c.nbytes, 1), ALIGN)
        staging = _staging(span)
        self.pages.stats["nvme_read_bytes"] += span
        return staging, self.pages.swap.read(c.extent, staging)

    def _drain_ahead(self) -> None:
        if self._ahead is not None:
            _, _, h = self._ahead
            self._ahead = None
            h.wait()

    def free(self) -> None:
        self._drain_ahead()
        p = self.pages
        for c in self._chunks.values():
            if isinstance(c, torch.Tensor):
                p.host_used -= c.numel() * c.element_size()
            elif p._swap is not None:
                p._swap.free(c.extent)
        self._chunks.clear()


def _staging(nbytes: int) -> torch.Tensor:
    from infinity.io import aligned_empty
    return aligned_empty(nbytes, torch.uint8, lock=False)
