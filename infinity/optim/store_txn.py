"""The store side of an optimizer window's transaction (Note [commit point], Note [shadow
budget] in :mod:`infinity.optim.step_txn`): shadows prepared within the budget, commit,
rollback.  Mixed into :class:`infinity.optim.offload_step.OptimizerStateStore`, whose
partitions, locks and swap space it uses."""
from __future__ import annotations

from typing import Any, Dict

from infinity.optim.step_txn import StepTxn
from infinity.optim.tile_pipeline import extent_nbytes

__all__ = ["TransactionalStore"]


class TransactionalStore:
    """Transactions over the store's extent-backed and host-resident states."""

    # -- transactions (Note [commit point] in StepTxn) ------------------------------
    def prepare(self, txn: StepTxn, key: str, *, force: bool = False) -> bool:
        """Give every extent-backed state tensor of ``key`` its shadow in ``txn`` (allocated
        once, then reused window after window).  Call on the thread that owns the swap
        accounting (the engine's main thread), before ``step(..., txn=txn)``.  It does not
        wait for a running step (the overlapped step prepares group k+1 while group k's
        step runs): it touches only the spare shadows and ``txn``'s entries for ``key``.

        Note [shadow budget]: with :attr:`shadow_budget` set, the shadows allocated at once
        stay within it (idle spares of other tensors are freed to make room); returns False,
        taking nothing, when ``key``'s do not fit -- unless ``force`` (one group must always
        be writable: the budget never goes below the largest group's states)."""
        with self._spare_lock:
            part = self._part(key)
            todo = [b for b in part.backing.values()
                    if b.extent is not None and id(b) not in txn.writes]
            need = sum(b.nbytes for b in todo if id(b) not in self._spare)
            budget = self.shadow_budget
            if need and budget is not None and self._shadow_bytes + need > budget:
                self._free_spares(self._shadow_bytes + need - budget, keep={id(b) for b in todo})
                if self._shadow_bytes + need > budget and not force:
                    return False
            for b in todo:
                shadow = self._spare.get(id(b))   # (interrupt-safe order: never lost)
                if shadow is None:
                    shadow = self.swap.allocate(b.nbytes)
                    self._spare[id(b)] = shadow
                    self._shadow_bytes += b.nbytes
                    self.shadow_peak = max(self.shadow_peak, self._shadow_bytes)
                txn.writes[id(b)] = [b, shadow, set()]
                del self._spare[id(b)]
            return True

    def _free_spares(self, nbytes: int, keep=frozenset()) -> None:
        """Free idle shadow extents (not ``keep``'s) until ``nbytes`` are freed or none is
        left (Note [shadow budget])."""
        sizes = {id(b): b.nbytes for p in self._parts.values() for b in p.backing.values()}
        for bid in [k for k in self._spare if k not in keep]:
            if nbytes <= 0:
                return
            ext = self._spare.pop(bid)
            size = sizes.get(bid, 0)
            self._shadow_bytes -= size
            nbytes -= size
            self.swap.free(ext)

    def shadow_bytes_allocated(self) -> int:
        """NVMe bytes of shadow extents allocated now (Note [shadow budget])."""
        return self._shadow_bytes

    def shadow_need(self, key: str) -> int:
        """NVMe bytes ``key``'s shadows take (one per extent-backed state tensor)."""
        return sum(b.nbytes for b in self._part(key).backing.values() if b.extent is not None)

    def host_state_bytes(self, key: str, master_in_hand: bool = False) -> int:
        """Bytes of ``key``'s state that live in host tensors (what a transactional step
        copies for undo); ``master_in_hand``: the master comes as ``master_buf``."""
        part = self._part(key)
        return sum(b.host.numel() * b.host.element_size() for r, b in part.backing.items()
                   if b.host is not None and not (r == "master" and master_in_hand))

    def shadow_bytes(self) -> int:
        """NVMe bytes one transaction's shadows take: one per extent-backed state tensor."""
        return sum(b.nbytes for p in self._parts.values() for b in p.backing.values() if b.extent is not None)

    def commit(self, txn: StepTxn) -> Dict[Any, Any]:
        """Make ``txn``'s writes the state: every written backing now reads its shadow.
        Returns ``{old extent: new extent}`` so owners of external extent masters can
        follow.  O(number of tensors); no I/O."""
        moved = {}
        with self._lock, self._spare_lock:
            for b, shadow, tiles in txn.writes.values():
                if not tiles:                       # prepared but never stepped: keep as spare
                    self._spare[id(b)] = shadow
                    continue
                if len(tiles) != len(b.valid):
                    raise RuntimeError(f"OptimizerStateStore.commit: {len(tiles)} of {len(b.valid)} tiles "
                                       f"written in this transaction (internal error)")
                old = b.extent
                b.extent = shadow
                b.valid = [True] * len(b.valid)
                self._spare[id(b)] = old
                moved[old] = shadow
            txn.writes.clear()
            txn.undo.clear()
            txn.keys.clear()
            txn.nonfinite.clear()
            txn.unrestorable = False
        return moved

    def rollback(self, txn: StepTxn) -> None:
        """Forget ``txn``'s writes: host tensors get their undo copies back, shadows are
        kept as spares (their contents are garbage, overwritten before any commit).  Raises
        for a transaction past :meth:`StepTxn.finish_only` (Note [finish only])."""
        if txn.irreversible and txn.keys:
            raise RuntimeError(
                "optimizer: the update failed after its commit decision, part-way through "
                "host-resident optimizer states updated in place (Note [finish only]); they "
                "cannot be restored: reload the last checkpoint")
        if txn.unrestorable:
            raise RuntimeError(
                f"optimizer: the update of {sorted(txn.keys)} cannot be rolled back: host-resident "
                f"optimizer states were updated in place without undo copies (they did not fit "
                f"the host memory cap, Note [commit point]); reload the last checkpoint")
        with self._lock, self._spare_lock:
            for view, saved, _ in reversed(txn.undo):
                view.copy_(saved)
            for b, shadow, _ in txn.writes.values():
                self._spare[id(b)] = shadow
            txn.writes.clear()
            txn.undo.clear()
            txn.keys.clear()
            txn.nonfinite.clear()

    def rollback_key(self, txn: StepTxn, key: str) -> None:
        """:meth:`rollback` for ``key``'s writes only (the rest of ``txn`` stays)."""
        with self._lock, self._spare_lock:
            keep = []
            for entry in reversed(txn.undo):
                if entry[2] == key:
                    entry[0].copy_(entry[1])
                    txn.undo_bytes -= entry[1].numel() * entry[1].element_size()
                else:
                    keep.append(entry)
            txn.undo[:] = keep[::-1]
            for b in self._part(key).backing.values():
                entry = txn.writes.pop(id(b), None)
                if entry is not None:
                    self._spare[id(b)] = entry[1]
            txn.keys.discard(key)
            txn.nonfinite.discard(key)
