"""Which ranks share a node, and the sub-groups ZeRO++ communicates in.

Nodes come from the ``LOCAL_WORLD_SIZE`` every rank sees (torchrun sets it): ranks ``r``
with the same ``r // LOCAL_WORLD_SIZE`` form a node, so 4 ranks started on one machine
with ``LOCAL_WORLD_SIZE=2`` act as 2 nodes x 2.  Unset, the whole world is one node.

* :class:`Topology` is pure arithmetic (no communication): node of a rank, the ranks of a
  node, the *inter-node* peers of a rank (same local index on every node), the hpZ
  secondary-partition groups (``hpz`` consecutive ranks), and the byte-counting
  convention of ``engine.stats()`` (:meth:`Topology.sent_all_gather`,
  :meth:`Topology.sent_reduce_scatter`).
* :func:`new_subgroups` creates the process groups for a list of rank lists.
  ``torch.distributed.new_group`` is collective over the *whole* world: every rank
  creates every group, in the same order, and keeps the one it belongs to.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

__all__ = ["Topology", "env_local_world_size", "new_subgroups"]


def env_local_world_size(world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` from the environment (ranks per node); the whole world when
    unset.  It must divide the world size (every node holds as many ranks)."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not v.strip():
        return int(world_size)
    try:
        n = int(v)
    except ValueError as e:
        raise ValueError(f"LOCAL_WORLD_SIZE={v!r} is not an integer (ranks per node, as "
                         f"torchrun sets it)") from e
    if n < 1 or world_size % n:
        raise ValueError(f"LOCAL_WORLD_SIZE={n} does not divide the world size {world_size}: "
                         f"every node must run the same number of ranks")
    return n


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks, ``local_size`` per node (consecutive ranks), this ``rank``."""
    rank: int
    world_size: int
    local_size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Topology: rank {self.rank} not in a world of {self.world_size}")
        if self.local_size < 1 or self.world_size % self.local_size:
            raise ValueError(f"Topology: {self.local_size} ranks per node do not divide the "
                             f"world size {self.world_size}")

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> "Topology":
        return cls(rank, world_size, env_local_world_size(world_size))

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_size

    def node_of(self, r: int) -> int:
        return r // self.local_size

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    def node_ranks(self, node: int | None = None) -> list[int]:
        n = self.node if node is None else node
        return list(range(n * self.local_size, (n + 1) * self.local_size))

    def intra_groups(self) -> list[list[int]]:
        """The ranks of each node."""
        return [self.node_ranks(n) for n in range(self.nodes)]

    def inter_groups(self) -> list[list[int]]:
        """For each local index j: the ranks with index j on every node."""
        return [[n * self.local_size + j for n in range(self.nodes)]
                for j in range(self.local_size)]

    def blocks(self, size: int) -> list[list[int]]:
        """Groups of ``size`` consecutive ranks (the hpZ secondary partitions)."""
        if size < 1 or self.world_size % size:
            raise ValueError(f"zero_pp.hpz_partition_size={size} must divide the world size "
                             f"{self.world_size} (it is the ranks per secondary partition, "
                             f"typically the ranks per node, LOCAL_WORLD_SIZE)")
        return [list(range(b * size, (b + 1) * size)) for b in range(self.world_size // size)]

    def others_off_node(self, ranks) -> int:
        """How many of ``ranks`` (other than this one) live on another node."""
        return sum(1 for r in ranks if r != self.rank and self.node_of(r) != self.node)

    # ---- the counting convention of engine.stats() (gloo is opaque: counted, not measured)
    def sent_all_gather(self, shard_bytes: int, ranks=None) -> tuple[int, int]:
        """(sent, of which to other nodes): an all-gather sends this rank's shard to every
        other rank of its group (``ranks``: the group, default the world)."""
        ranks = range(self.world_size) if ranks is None else ranks
        peers = sum(1 for r in ranks if r != self.rank)
        return peers * shard_bytes, self.others_off_node(ranks) * shard_bytes

    def sent_reduce_scatter(self, chunk_bytes: int, ranks=None) -> tuple[int, int]:
        """A reduce-scatter sends every other rank its chunk of this rank's buffer: the
        same figures as an all-gather of a chunk."""
        return self.sent_all_gather(chunk_bytes, ranks)


def new_subgroups(rank_lists: list[list[int]], rank: int, timeout_s: float):
    """Create one process group per rank list (collective: every rank creates all of
    them in the same order) and return the one containing ``rank`` with its ranks."""
    import torch.distributed as dist
    mine = None
    td = datetime.timedelta(seconds=float(timeout_s))
    for ranks in rank_lists:
        pg = dist.new_group(ranks=ranks, timeout=td)
        if rank in ranks:
            mine = (pg, list(ranks))
    if mine is None:
        raise ValueError(f"new_subgroups: rank {rank} is in none of {rank_lists}")
    return mine
