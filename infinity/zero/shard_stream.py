"""Streamed gradient shards across ranks (Note [Streamed gradients] in
infinity/engine/overlap.py) for the gradient spill of
:class:`infinity.zero.partitioned_grads.PartitionedGrads`.

With the fp32 gradient shards homed on NVMe (``spill_grads``), the last micro-step of a
window offers each group's averaged, final shard to ``keep`` (the overlapped step's
``keep_grad``) when its reduce-scatter lands.  A kept shard stays in the host buffer it
landed in (:attr:`held`) and the group's early step reads it, so its final sum is neither
written to NVMe nor read back by the optimizer.  The same interface as the one-process
NVMe gradient home (:class:`infinity.grads.nvme_store.NvmeGradStore`): a kept shard the
overlapped step does not step after all is written as usual (:meth:`flush_held`); with
clipping and bf16 moments it is written after its speculative step (:meth:`write_held`, on
the step's worker) so that a redo (the whole window, Note [Speculative clipping]) reads it
from the extent; with fp32 moments a redo recovers it from the moments (Note [Redo from
moments]) and nothing is written.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["ShardStream"]


class ShardStream:
    def __init__(self, grads):
        self.opt = grads     # the PartitionedGrads whose extents it writes
        self.keep: Callable | None = None     # keep(g) -> bool (the overlapped step)
        self.held: dict[int, torch.Tensor] = {}

    def flush_held(self, gid: int) -> None:
        """(main thread) A kept shard is not stepped early after all: to its extent now,
        waited for (the boundary step reads it)."""
        buf = self.held.pop(gid, None)
        if buf is None:
            return
        opt = self.opt
        opt._grad_valid[gid] = True
        self._write(gid, buf)
        opt.host_pool.give_back(buf)

    def will_write(self, gid: int) -> None:
        """(main thread) :meth:`write_held` will write ``gid``'s kept shard to its extent
        (a clipped redo reads it there)."""
        self.opt._grad_valid[gid] = True

    def write_held(self, gid: int, buf: torch.Tensor) -> None:
        """Write ``gid``'s kept final shard to its extent (any thread: no pool access)."""
        self._write(gid, buf)

    def _write(self, gid: int, buf: torch.Tensor) -> None:
        opt = self.opt
        t0 = time.perf_counter()
        opt.swap.write(opt._grad_ext[gid], buf).wait()
        if opt.acct is not None:
            opt.acct.link("nvme_write", buf.numel() * 4, time.perf_counter() - t0)

    def release(self, gid: int) -> None:
        """(main thread) ``gid``'s early step ended: its kept shard goes back."""
        buf = self.held.pop(gid, None)
        if buf is not None:
            self.opt.host_pool.give_back(buf)

    def reset(self) -> None:
        """After the step or a dropped window: shards still held go back."""
        bufs, self.held = list(self.held.values()), {}
        for buf in bufs:
            self.opt.host_pool.give_back(buf)
