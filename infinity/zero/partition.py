"""Which part of each flat parameter group a data-parallel rank owns.

Every flat group is padded (by :func:`infinity.runtime.groups.build_groups` with
``world_size``) to a multiple of ``world_size`` x the 4096-byte alignment unit, so each
rank owns one equal, contiguous, 4096-byte aligned shard ``[lo, hi)`` of it::

    group (padded_numel):  | rank 0 shard | rank 1 shard | ... | rank W-1 shard |
                           lo = r * S, hi = lo + S, S = padded_numel / W

The padding is internal: it never appears in a parameter's shape, in a state dict or
in a checkpoint.  Helpers here are pure arithmetic (no communication).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Partition", "clip_segments", "pad_numel"]


def pad_numel(numel: int, world_size: int, align_elems: int = 1) -> int:
    """Smallest multiple of ``world_size * align_elems`` that is >= ``max(numel, 1)``."""
    unit = max(1, int(world_size)) * max(1, int(align_elems))
    n = max(int(numel), 1)
    return (n + unit - 1) // unit * unit


@dataclass(frozen=True)
class Partition:
    """Shard ownership of one rank in a world of ``world_size`` ranks."""
    rank: int
    world_size: int

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Partition: rank {self.rank} is not in a world of size "
                             f"{self.world_size}")

    def shard_numel(self, padded_numel: int) -> int:
        if padded_numel % self.world_size:
            raise ValueError(f"Partition: a group of {padded_numel} elements cannot be split "
                             f"evenly over {self.world_size} ranks (it must be padded with "
                             f"build_groups(..., world_size={self.world_size}))")
        return padded_numel // self.world_size

    def range(self, padded_numel: int, rank: int | None = None) -> tuple[int, int]:
        """``(lo, hi)`` element range owned by ``rank`` (default: this rank)."""
        s = self.shard_numel(padded_numel)
        r = self.rank if rank is None else rank
        return r * s, (r + 1) * s


def clip_segments(segments, lo: int, hi: int) -> list[tuple]:
    """Restrict ``(start, numel, lr, weight_decay[, overrides])`` segments covering a whole
    group to the shard ``[lo, hi)``, re-based so the shard starts at 0 (any further
    elements are kept as they are).  The result covers ``[0, hi-lo)``."""
    out = []
    for start, n, *rest in segments:
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            out.append((a - lo, b - a, *rest))
    covered = sum(seg[1] for seg in out)
    if covered != hi - lo:
        raise ValueError(f"clip_segments: segments cover {covered} of the {hi - lo} elements of "
                         f"shard [{lo}, {hi}); they must cover the whole group")
    return out
