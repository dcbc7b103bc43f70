"""Note [Redo from moments]: a speculative update redone clipped without its gradient.

The overlapped step updates a group as soon as its gradient is final, with clip
coefficient 1 (Note [Speculative clipping] in infinity/engine/overlap.py); the global norm
is known only when backward ended.  When it is above the clip, the group's update must be
redone with its gradient scaled by ``c = clip / norm``.  Keeping every early-stepped
gradient until then costs memory (host buffers that the parameter cache would use) or
NVMe writes (gradients homed on NVMe).  With fp32 moments the gradient need not be kept:
the commit point (Note [commit point] in infinity/optim/step_txn.py) still holds the
committed first moment ``m`` (the home extent, or the host undo copy) next to the
speculative ``m' = b1*m + (1-b1)*g`` (the shadow, or the host tensor), so
``g = (m' - b1*m) / (1-b1)`` is recovered exactly up to fp32 rounding (an absolute error
of about ``ulp(m') / (1-b1)``, far inside the 1e-5 parity of the tests), and the group is
rolled back and stepped again with ``g`` and coefficient ``c``.  Costs arise only in
clipped windows: ``m'`` and ``m`` read (8 B/param on NVMe) and one group-sized fp32 buffer
at a time.  With bf16 moments ``m'`` is rounded to 8 bits: the recovered gradient would
be noise, so those keep the gradients as before.  Across ranks (ZeRO) each rank redoes its
own shards the same way (the clip decision is the global norm's, the same on every rank).
"""
from __future__ import annotations

import torch

__all__ = ["recover_grad"]


def recover_grad(store, txn, key: str, segments, beta1: float, out: torch.Tensor) -> torch.Tensor:
    """Note [Redo from moments]: the gradient ``key`` was stepped with in ``txn``, from
    its first moment before (committed) and after (in ``txn``) that step:
    ``g = (m' - beta1 * m) / (1 - beta1)`` (per segment, its own beta1), in fp32, into
    ``out`` (the partition's numel).  The gradient is the one the step saw, scaled by
    its ``grad_scale``.  Tile by tile: two tiles of fp32 scratch besides ``out``.
    fp32 moments only (bf16 moments round ``m'``: the difference would be noise)."""
    with store._lock:
        part = store._part(key)
        b = part.backing["exp_avg"]
        if b.dtype != torch.float32:
            raise RuntimeError(f"OptimizerStateStore.recover_grad({key!r}): the moments are "
                               f"{b.dtype}; a gradient is recovered from fp32 moments only")
        if out.numel() != part.numel or out.dtype != torch.float32:
            raise ValueError(f"OptimizerStateStore.recover_grad({key!r}): out must be "
                             f"{part.numel} fp32 elements, got {out.numel()} {out.dtype}")
        if b.host is not None:
            committed = b.host.clone()      # in place: m'; the undo copies hold m
            for view, saved, k in txn.undo:
                if k == key and view.untyped_storage().data_ptr() == \
                        b.host.untyped_storage().data_ptr():
                    off = (view.data_ptr() - b.host.data_ptr()) // 4
                    committed[off:off + view.numel()].copy_(saved)
            out.copy_(b.host)
            _recover(out, committed, segments, beta1)
            return out
        entry = txn.writes.get(id(b))
        if entry is None or len(entry[2]) != part.ntiles:
            raise RuntimeError(f"OptimizerStateStore.recover_grad({key!r}): the partition "
                               f"was not stepped in this transaction")
        from infinity.io import aligned_empty
        tn = store.tile_numel
        spec, cur = aligned_empty(tn, torch.float32), aligned_empty(tn, torch.float32)
        for t in range(part.ntiles):
            lo = t * tn
            n = min(part.numel, lo + tn) - lo
            nb = b.io_bytes_at(t, tn, n)
            h = store.swap.read(entry[1], spec.view(torch.uint8)[:nb], offset=b.offset(t, tn))
            store._wait(h, "nvme_read", key, nb)
            if b.valid[t]:
                h = store.swap.read(b.extent, cur.view(torch.uint8)[:nb], offset=b.offset(t, tn))
                store._wait(h, "nvme_read", key, nb)
            else:
                cur[:n].zero_()             # never committed: the moments start at zero
            out[lo:lo + n].copy_(spec[:n])
            _recover(out[lo:lo + n], cur[:n], _segments_of(segments, lo, n), beta1)
        return out


def _recover(out: torch.Tensor, committed: torch.Tensor, segments, beta1: float) -> None:
    """``out`` (m' in, g out) = (m' - b1 * m) / (1 - b1), per segment's beta1."""
    for seg in segments:
        a, k = seg[0], seg[1]
        ov = seg[4] if len(seg) > 4 else None
        b1 = beta1 if ov is None else ov[0]
        o = out[a:a + k]
        o.sub_(committed[a:a + k], alpha=b1).div_(1.0 - b1)


def _segments_of(segments, lo: int, n: int) -> list:
    """The parts of ``segments`` (``(start, numel, ...)``, partition offsets) inside
    ``[lo, lo + n)``, with offsets relative to ``lo``."""
    out = []
    for seg in segments:
        a, b = max(seg[0], lo), min(seg[0] + seg[1], lo + n)
        if a < b:
            out.append((a - lo, b - a) + tuple(seg[2:]))
    return out
