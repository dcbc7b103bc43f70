"""The commit shadow budget (``offload.commit_shadow_gb``): how much NVMe beyond the homes
an all-or-nothing update may take (Note [shadow budget] in infinity/optim/step_txn.py).

Every NVMe-backed state tensor an update writes goes to a shadow extent first (Note
[commit point]); shadows for every tensor cost as much NVMe again as the optimizer states
(12 B/param with fp32 states).  The budget bounds them: the speculative steps overlapped
with backward and the boundary steps before the commit decision take shadows while the
budget has room, the rest of the update is finished after the decision a batch at a time
(Note [roll forward] in infinity/optim/driver.py).

* a number: that many 10^9 bytes (per rank), never less than the largest group's shadows
  (one group must always be writable) nor more than all of them;
* ``None`` (automatic): every shadow where the disk has room for them beside the homes and
  :func:`nvme_headroom`; otherwise what the free space leaves (at least one group).
"""
from __future__ import annotations

import os

from infinity.config_sections import GB

__all__ = ["SHADOW_LINE", "NVME_HEADROOM_FRACTION", "NVME_HEADROOM_MIN", "nvme_headroom",
           "free_swap_bytes", "shadow_budget"]

#: the placement plan's line for the shadows (ZeRO scales it to one rank's share)
SHADOW_LINE = "commit shadows (all-or-nothing updates)"
#: free space the automatic budget leaves on the swap file systems: 2 % of their size,
#: at least 1 GB (logs, checkpoints written beside; a small file system: a tenth of it)
NVME_HEADROOM_FRACTION = 0.02
NVME_HEADROOM_MIN = 1 * GB


def nvme_headroom(total_bytes: int) -> int:
    """Bytes the automatic budget keeps free on a file system of ``total_bytes``."""
    return max(int(total_bytes * NVME_HEADROOM_FRACTION),
               min(NVME_HEADROOM_MIN, total_bytes // 10))


def free_swap_bytes(paths) -> tuple[int, int] | None:
    """``(free, headroom)`` bytes the swap can still grow into over ``paths`` (the files
    stripe evenly: the fullest path decides), or None when a path cannot be asked."""
    frees, heads = [], []
    for p in paths:
        try:
            st = os.statvfs(p)
        except OSError:
            return None
        frees.append(st.f_bavail * st.f_frsize)
        heads.append(nvme_headroom(st.f_blocks * st.f_frsize))
    if not frees:
        return None
    return len(frees) * min(frees), len(frees) * max(heads)


def shadow_budget(setting_gb: float | None, full: int, ring: int, homes: int,
                  free: tuple[int, int] | None, local_ranks: int = 1) -> int | None:
    """The shadow bytes one rank may hold at once, or None for all of them (``full``).

    ``setting_gb``: ``offload.commit_shadow_gb``; ``full``: one shadow per NVMe state
    tensor (this rank's); ``ring``: the largest group's shadows; ``homes``: this rank's
    other planned NVMe bytes; ``free``: :func:`free_swap_bytes` of the swap paths (shared
    by ``local_ranks`` ranks)."""
    if full <= 0:
        return None
    ring = min(ring, full)
    if setting_gb is not None:
        want = int(round(setting_gb * GB))
        return None if want >= full else max(want, ring)
    if free is None:
        return None
    avail, headroom = free
    room = (avail - headroom) // max(1, local_ranks) - homes
    return None if room >= full else max(room, ring)
