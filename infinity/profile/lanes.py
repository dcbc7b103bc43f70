"""The lanes a :class:`infinity.profile.Timeline` records, in display order (links
first, then compute, then waits) — the one vocabulary the timeline, its summary and its
outputs share, so none of them imports another for it."""

LINK_LANES = ("nvme_read", "nvme_write", "h2d", "d2h", "allgather", "reduce_scatter")
COMPUTE_LANES = ("forward", "backward", "optimizer")
WAIT_LANE = "wait"
LANES = LINK_LANES + COMPUTE_LANES + (WAIT_LANE,)

__all__ = ["LINK_LANES", "COMPUTE_LANES", "WAIT_LANE", "LANES"]
