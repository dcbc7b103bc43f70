"""Throughput measurement of the I/O engine (used by `infinity bench-io`).

Writes then reads `size_bytes` through a `SwapSpace` on one path (so exactly
what training does: private directory, anonymous preallocated swap file,
O_DIRECT, aligned buffers) and reports GB/s (10^9 bytes per second).
"""
import logging
import statistics
import time

import torch

from .buffers import aligned_empty
from .engine import AioEngine
from .swap import SwapSpace

log = logging.getLogger("infinity.io")

MAX_BUFFER = 256 << 20  # host buffer reused for every piece of the file


def _timed(submit_all):
    t0 = time.perf_counter()
    handles = submit_all()
    for h in handles:
        h.wait()
    return time.perf_counter() - t0


def measure(path, size_bytes, *, block_size=1 << 20, queue_depth=32, threads=1, engine="auto",
            repeats=3, progress=None):
    """Median read/write GB/s over `repeats` write-then-read rounds.

    Returns a dict: engine, direct, read_gbps, write_gbps, block_size, queue_depth,
    threads, size_bytes, repeats, read_gbps_all, write_gbps_all, verified, path.
    """
    if size_bytes <= 0 or size_bytes % 4096:
        raise ValueError(f"size must be a positive multiple of 4096 bytes, got {size_bytes}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    piece = min(size_bytes, MAX_BUFFER)
    piece -= piece % 4096
    buf = aligned_empty(piece)
    g = torch.Generator().manual_seed(1234)
    buf.copy_(torch.randint(0, 256, (piece,), dtype=torch.uint8, generator=g))
    head, tail = buf[:65536].clone(), buf[-65536:].clone()
    offsets = list(range(0, size_bytes, piece))
    reads, writes, verified = [], [], True
    with AioEngine(block_size=block_size, queue_depth=queue_depth, threads=threads, engine=engine) as eng:
        with SwapSpace(path, eng) as swap:
            swap.reserve(size_bytes)
            ext = swap.allocate(size_bytes)
            direct = all(not f.direct_refused for f in swap._state.files) and eng.direct

            def pieces(op):
                out = []
                for off in offsets:
                    n = min(piece, size_bytes - off)
                    out.append(op(ext, buf[:n], off))
                return out

            for r in range(repeats):
                tw = _timed(lambda: pieces(swap.write))
                buf.zero_()
                tr = _timed(lambda: pieces(swap.read))
                last = offsets[-1]
                n_last = min(piece, size_bytes - last)
                ok = torch.equal(buf[:65536], head) and (n_last < piece or torch.equal(buf[-65536:], tail))
                verified = verified and ok
                if not ok:
                    log.error("bench-io: data read back differs from data written (round %d)", r + 1)
                buf[:65536].copy_(head)
                buf[-65536:].copy_(tail)
                writes.append(size_bytes / tw / 1e9)
                reads.append(size_bytes / tr / 1e9)
                if progress:
                    progress(r + 1, repeats, reads[-1], writes[-1])
            kind = eng.kind
    return {"engine": kind, "direct": bool(direct),
            "read_gbps": round(statistics.median(reads), 4),
            "write_gbps": round(statistics.median(writes), 4),
            "block_size": block_size, "queue_depth": queue_depth, "threads": threads,
            "size_bytes": size_bytes, "repeats": repeats,
            "read_gbps_all": [round(x, 4) for x in reads], "write_gbps_all": [round(x, 4) for x in writes],
            "verified": verified, "path": str(path)}
