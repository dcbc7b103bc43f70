"""The transaction of one optimizer window: what makes an update all-or-nothing (Note
[commit point]), what a rollback can restore (Note [finish only]) and which keys came out
non-finite (Note [non-finite result]).  :class:`infinity.optim.offload_step.OptimizerStateStore`
writes into it, commits it and rolls it back."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

__all__ = ["StepTxn"]


class StepTxn:
    """Writes of one optimizer window held back until :meth:`OptimizerStateStore.commit`.

    Note [commit point]: an update is all-or-nothing.  A step run with ``txn=`` writes
    every extent-backed state tensor (master, ``exp_avg``, ``exp_avg_sq``; an external
    extent master too) to a *shadow* extent of the same size instead of its home, and,
    when ``host_undo`` is set, copies each host-resident state tile it is about to update
    in place (and ``master_buf`` is not) into an undo copy first.  ``commit`` swaps every
    written backing to its shadow (O(1), no I/O; the old extent becomes the next shadow)
    and drops the undo copies; ``rollback`` restores the undo copies and forgets the
    shadows' contents.  Reads during the window see the last committed values.  Extra
    NVMe: one shadow per extent-backed state tensor (<= 1x the optimizer states); extra
    host: the undo copies of the groups stepped in the window (``undo_bytes``).
    Shadows are allocated on the caller's thread by :meth:`OptimizerStateStore.prepare`.

    Note [shadow budget]: the store's ``shadow_budget`` (``offload.commit_shadow_gb``,
    infinity/memory/shadow_budget.py) bounds the shadow extents allocated at once, idle
    spares included: ``prepare`` frees other tensors' idle spares to make room and
    returns False when a group's shadows still do not fit.  Such a group is not stepped
    speculatively (it waits for the decision); at the boundary it is left out of the
    window's transaction and written after the commit decision (Note [roll forward] in
    infinity/optim/driver.py), a batch at a time into transactions of their own.

    Note [finish only]: past the commit decision (the norm is known and finite, the ranks
    voted) host-resident states only have to be finished: the groups whose states are all in
    host memory are stepped after it without undo copies (they cost as much memory traffic
    as the Adam step itself; Note [roll forward] in infinity/optim/driver.py), and with no
    swap space and one process :meth:`finish_only` does the same for everything stepped at
    the boundary.  A rollback of what was stepped that way cannot restore those host
    states, so it raises (the engine enters ``FAILED``) instead of leaving a half-applied
    update behind as if it were the last one.

    Note [non-finite result]: the Adam kernels flag a result that is not finite as
    stored (an overflow from finite inputs: ``exp_avg_sq`` of a huge gradient, a master
    beyond fp16's range for an fp16 copy; csrc/cpu_adam/adam_kernel.h).  :meth:`step`
    returns the keys concerned and adds them to ``nonfinite``; the driver
    (infinity/optim/driver.py ``boundary_step``) then rolls the update back like one
    with a non-finite gradient norm when it still can (a transaction with undo copies or
    shadows for everything stepped) and otherwise -- host states updated in place: no
    transaction, or past :meth:`finish_only` -- stops the engine (``FAILED``) naming the
    groups, since the NaN is already in the weights.
    """
    __slots__ = ("writes", "undo", "undo_bytes", "keys", "host_undo", "irreversible", "nonfinite",
                 "unrestorable")

    def __init__(self, host_undo: bool = True):
        self.writes: Dict[int, list] = {}   # id(backing) -> [backing, shadow extent, tiles written]
        self.undo: List[tuple] = []         # (host view updated in place, its saved copy, key)
        self.undo_bytes = 0
        self.keys: set = set()              # partitions stepped in this window
        self.host_undo = host_undo
        self.irreversible = False           # Note [finish only]
        self.nonfinite: set = set()         # keys with a non-finite result (Note [non-finite result])
        self.unrestorable = False           # a host state was updated in place without an undo copy

    def finish_only(self) -> None:
        """Note [finish only]: from here on host states are updated without undo copies."""
        self.host_undo = False
        self.irreversible = True

    def save(self, view: torch.Tensor, key: Optional[str] = None) -> None:
        """``view`` (a host-resident state of ``key``) is about to be updated in place."""
        if self.host_undo:
            self.undo.append((view, view.clone(), key))
            self.undo_bytes += view.numel() * view.element_size()
        else:
            self.unrestorable = True

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def reversible(self) -> bool:
        """Whether :meth:`OptimizerStateStore.rollback` can restore everything stepped so
        far: not past :meth:`finish_only`, and every host state updated in place has its
        undo copy."""
        return not self.irreversible and not self.unrestorable
