"""The lanes a :class:`infinity.profile.Timeline` records, in display order (links
first, then compute, then waits) — the one vocabulary the timeline, its summary and its
outputs share, so none of them imports another for it."""

LINK_LANES = ("nvme_read", "nvme_write", "h2d", "d2h", "allgather", "reduce_scatter")
COMPUTE_LANES = ("forward", "backward", "optimizer")
WAIT_LANE = "wait"
# activation offload: saved tensors packed to their home in forward / unpacked in backward
# (their NVMe bytes also appear in the nvme_read / nvme_write links)
ACTIVATION_LANE = "activations"
LANES = LINK_LANES + COMPUTE_LANES + (ACTIVATION_LANE, WAIT_LANE)

__all__ = ["LINK_LANES", "COMPUTE_LANES", "ACTIVATION_LANE", "WAIT_LANE", "LANES"]
