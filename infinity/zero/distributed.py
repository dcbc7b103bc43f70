"""Wiring ZeRO stages 1-3 into the engine when the world has more than one rank.

:class:`ZeroSetup` is what the engine asks at ``initialize`` time: the process group
(created from the environment if needed, with ``dist_timeout_s``), the stage, this rank,
and the partitioned memory manager / optimizer classes.  At world size 1 there is
nothing to partition and the engine runs its single-process path (every stage behaves
identically there).

:func:`gathered_state_dict` returns the full (unpadded) parameter values on every rank,
one group at a time, for tests and consolidated exports.  Like every collective API it
must be called by all ranks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from infinity.zero.comm import Comm, ensure_process_group
from infinity.zero.partition import Partition

log = logging.getLogger("infinity.zero")

__all__ = ["ZeroSetup", "ShardSource", "gathered_state_dict", "grad_spill_needed", "partition_placement",
           "stream_window",
           "read_param_gathered", "zeropp_placement"]


class ZeroSetup:
    """Process group + stage for one engine; ``None`` from :meth:`from_config` at world size 1."""

    def __init__(self, comm: Comm, stage: int, created_pg: bool, spill_grads: bool = False,
                 zeropp=None, reduce_bucket_bytes: int = 0):
        self.comm = comm
        # Note [Gradient buckets] (infinity/zero/grad_buckets.py): 0 = whole groups
        self.reduce_bucket_bytes = int(reduce_bucket_bytes)
        self.zeropp = zeropp             # infinity.zero.zeropp.ZeroPP when zero_pp is on
        self.stage = int(stage)
        self.created_pg = created_pg
        self.spill = spill_grads
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.part = Partition(comm.rank, comm.world_size)

    @classmethod
    def from_config(cls, cfg, *, accounting=None, timeline=None,
                    device="cpu") -> "ZeroSetup | None":
        """The partitioning setup, or None at world size 1 (see :meth:`with_grad_spill`)."""
        import torch.distributed as dist
        created = ensure_process_group(cfg.dist_timeout_s)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        stage = int(cfg.zero_stage)
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {stage!r}")
        if stage < 3 and cfg.offload.params != "none":
            raise ValueError(f"offload.params={cfg.offload.params!r} needs zero_stage 3 "
                             f"(stage {stage} keeps a full copy of the parameters on every rank)")
        comm = Comm(timeout_s=cfg.dist_timeout_s, accounting=accounting, timeline=timeline,
                    device=device, transport=cfg.intra_node_transport)
        log.info("ZeRO stage %d over %d ranks (%s), this is rank %d", stage, comm.world_size,
                 comm.backend, comm.rank)
        zpp = getattr(cfg, "zero_pp", None)
        zeropp = None
        if zpp is not None and zpp.enabled:
            from infinity.zero.zeropp import ZeroPP
            try:
                zeropp = ZeroPP(zpp, comm)
            except BaseException:
                comm.close()
                raise
        return cls(comm, stage, created, zeropp=zeropp,
                   reduce_bucket_bytes=int(getattr(cfg, "reduce_bucket_mb", 0) * 1e6))

    @classmethod
    def with_grad_spill(cls, zero: "ZeroSetup", cfg, groups) -> "ZeroSetup":
        """Decide the gradient home once the groups are known: the averaged fp32 gradient
        shards are *spilled to NVMe* when the optimizer lives on NVMe, the stage partitions
        gradients (2, 3) and the shards would take more than half of the host budget
        (``offload.host_memory_gb``, else available RAM).  (At world size 1 the engine's
        own NVMe gradient home, ``infinity.grads.nvme_store``, does this.)"""
        zero.spill = grad_spill_needed(cfg, groups, zero.world_size, zero.stage)
        return zero

    def memory_manager(self, groups, **kw):
        if self.stage == 3:
            from infinity.zero.partitioned_memory import PartitionedMemoryManager
            return PartitionedMemoryManager(groups, comm=self.comm, zeropp=self.zeropp, **kw)
        from infinity.memory.manager import MemoryManager
        mm = MemoryManager(groups, **kw)
        if self.zeropp is not None:          # qgZ at stage 2 orders its reads after compute
            self.zeropp.attach_device(mm.dev)
        return mm

    def optimizer(self, model, cfg, groups, names, **kw):
        from infinity.zero.partitioned_optimizer import PartitionedOptimizer
        opt = PartitionedOptimizer(model, cfg, groups, names, comm=self.comm,
                                   stage=self.stage, spill_grads=self.spill, **kw)
        if self.zeropp is not None and self.zeropp.qg and self.stage >= 2:
            opt.grads.reduce_scatter_sum = self.zeropp.reduce_scatter_sum      # qgZ
        return opt

    @property
    def host_collectives(self) -> bool:
        """Whether the big collectives run on host tensors (what the shared-memory
        transport carries): on CPU-only ranks and the simulated device every gather and
        reduction, on GPUs only stage 1's gradient all-reduce."""
        return self.comm.compute_device.type == "cpu" or self.stage == 1

    def start_transport(self, groups) -> bool:
        """Collective: map the shared-memory slots between local ranks for these groups'
        collectives (after the placement plan, which counts them, was checked).  Whether
        the slots exist (False: every collective goes over the process group)."""
        shm = self.comm.shm
        if shm is None or not groups or not self.host_collectives:
            return False
        return bool(shm.channels) or shm.allocate(*transport_bytes(groups))

    def close(self) -> None:
        try:
            if self.zeropp is not None:
                self.zeropp.close()
        finally:
            self.comm.close()


def partition_placement(placement, zero: "ZeroSetup | None") -> None:
    """Scale a :class:`infinity.memory.plan.PlacementPlan` computed over whole groups to
    what one rank holds: optimizer states always, fp32 gradients from stage 2, the
    parameter home at stage 3 are 1/W of the whole (fetch windows, staging and the tile
    ring are per rank already).  Also moves spilled gradients from host to NVMe."""
    if zero is None:
        return
    w = zero.world_size

    def scale(d, key):
        if w > 1 and key in d:
            d[key] = -(-d[key] // w)
    for d in (placement.host, placement.nvme, placement.device):
        for key in list(d):
            if key.startswith("optimizer states") or key.startswith("commit shadows"):
                scale(d, key)     # (shadows: one per state tensor of this rank's shard)
            elif key.startswith("fp32 gradient accumulation") and zero.stage >= 2:
                scale(d, key)
            elif key.startswith("param home") and zero.stage == 3:
                scale(d, key)
    if placement.separate_device and zero.stage >= 2 and any(g.trainable for g in
                                                             placement.groups):
        device_grad_lines(placement, zero)
    shm = getattr(getattr(zero, "comm", None), "shm", None)
    if shm is not None and placement.groups and zero.host_collectives:
        # the intra-node transport's own slots
        placement.host[SLOTS_LINE] = \
            shm.plan_bytes(*transport_bytes(placement.groups), w)
    zpp = getattr(zero, "zeropp", None)
    if zpp is not None:
        zeropp_placement(placement, zpp, zero.stage)
    if zero.spill:
        key = "fp32 gradient accumulation"
        if key in placement.host:
            placement.nvme[key + " (spilled)"] = placement.host.pop(key)
            if placement.grad_accum_dtype == "bf16":   # lossy partial sums between micro-steps
                placement.nvme["bf16 partial gradient sums (spilled)"] = \
                    placement.nvme[key + " (spilled)"] // 2
        stream_window(placement, w)


def device_grad_lines(placement, zero: "ZeroSetup") -> None:
    """Stages 2-3 on separate device memory: the gradients reduced on the device, as
    PartitionedOptimizer leases them.  Buckets (Note [Gradient buckets]): at most
    ``k + MAX_OPEN_BUCKETS`` of the largest bucket, in the working precision, and ``k``
    reduced buckets' D2H staging; whole groups (``reduce_bucket_mb: 0``, or qgZ): full fp32
    buffers of the groups being assembled (two: the current one and a tied one open across
    backward) and in flight, the reduced shards, and their D2H staging.  A tiled group's
    gradient moves a tile of rows at a time (Note [Tile gradients across ranks])."""
    from infinity.memory.pool import ALIGN, round_up
    from infinity.zero.grad_buckets import MAX_OPEN_BUCKETS, bucket_numel
    from infinity.zero.partitioned_grads import MAX_INFLIGHT_REDUCTIONS as k
    w = zero.world_size
    placement.device.pop("gradient D2H sources", None)
    placement.host.pop("gradient D2H staging", None)
    zpp = getattr(zero, "zeropp", None)
    bucketed = zero.reduce_bucket_bytes > 0 and not (zpp is not None and zpp.qg)
    trainable = [g for g in placement.groups if g.trainable]
    tiled = [g for g in trainable if placement.tile_bytes.get(g.gid)]
    whole = tiled if bucketed else trainable
    if bucketed and len(tiled) < len(trainable):
        size = max(min(bucket_numel(zero.reduce_bucket_bytes, g.dtype.itemsize),
                       g.padded_numel // w) * g.dtype.itemsize
                   for g in trainable if g not in tiled)
        n = k + MAX_OPEN_BUCKETS
        placement.device[f"gradient buckets awaiting reduction ({n} x {size} bytes, "
                         f"reduce_bucket_mb)"] = n * size
        placement.host[f"reduced gradient bucket D2H staging ({k} buckets)"] = k * size
    if not whole:
        return

    def grad_numel(g):     # a tiled group's gradient moves a tile of rows at a time
        tb = placement.tile_bytes.get(g.gid)
        return g.padded_numel if not tb else min(g.padded_numel,
                                                 tb // max(1, g.nbytes // g.padded_numel))
    full = round_up(4 * max(grad_numel(g) for g in whole), ALIGN)
    shard = round_up(-(-full // w), ALIGN)
    placement.device[f"gradients awaiting reduce-scatter (fp32, {k + 3} x largest group "
                     f"+ {2 * k + 1} shards)"] = (k + 3) * full + (2 * k + 1) * shard
    placement.host[f"reduced gradient shard D2H staging ({k} shards)"] = k * shard


SLOTS_LINE = "shared-memory slots (intra_node_transport)"   # a placement-plan host line


def transport_bytes(groups) -> tuple[int, int]:
    """The largest collectives' whole buffers: a gathered group (working precision; qwZ's
    int8 rows are smaller) and a reduced gradient (fp32 at most)."""
    return (max(g.padded_numel * g.dtype.itemsize for g in groups),
            4 * max(g.padded_numel for g in groups))


def stream_window(placement, world_size: int) -> None:
    """Note [Streamed gradients] across ranks (spilled shards, stage 3): up to
    ``STREAM_GRAD_WINDOW`` final shards of the largest group in hand for their early step,
    in what the host cap leaves (none: no streaming); ``placement.stream_grads`` says
    whether the overlapped step runs (set by the engine's assembly)."""
    from infinity.memory.pool import ALIGN, round_up
    from infinity.memory.plan import STREAM_GRAD_WINDOW
    placement.stream_window = 0
    trainable = [g for g in placement.groups if g.trainable]
    if not (placement.stream_grads and trainable):
        return
    size = round_up(4 * -(-max(g.padded_numel for g in trainable) // world_size), ALIGN)
    cap = placement.host_cap
    spare = None if cap is None else cap - placement.host_total
    placement.stream_window = STREAM_GRAD_WINDOW if spare is None else \
        max(0, min(STREAM_GRAD_WINDOW, spare // size))
    if placement.stream_window:
        placement.host["gradient shards in hand for their early step (grads on NVMe)"] = \
            placement.stream_window * size


def zeropp_placement(placement, zpp, stage: int) -> None:
    """ZeRO++'s device memory (:mod:`infinity.zero.zeropp`): the hpZ secondary shards
    (1/hpz of every group, kept from forward to the step) and qwZ's transient buffers of
    one gather (the int8 values and scales, the fp32 dequantized group)."""
    from infinity.memory.pool import ALIGN, round_up
    from infinity.zero.zeropp import qwz_wire_bytes
    # a frozen base kept quantized goes its own way (Note [Quantized shards]): no qwZ, and
    # its hpZ secondary shard is 1/hpz of the gathered payload bytes
    from infinity.zero.quantized_shards import qshard_bytes
    groups = [g for g in placement.groups if g.quant is None]
    if stage == 3 and zpp.hpz > 1:
        w = zpp.comm.world_size
        placement.device[f"hpZ secondary partition (1/{zpp.hpz} of the params)"] = sum(
            round_up(zpp.secondary_numel(g.padded_numel) * g.dtype.itemsize, ALIGN)
            for g in groups) + sum(round_up(qshard_bytes(g, w) * w // zpp.hpz, ALIGN)
                                   for g in placement.groups if g.quant is not None)
    if stage == 3 and zpp.qw and groups:
        n = max(g.padded_numel for g in groups)
        placement.device["qwZ gather buffers (int8 + scales + fp32, largest group)"] = \
            qwz_wire_bytes(n) + 4 * n


def grad_spill_needed(cfg, groups, world_size: int, stage: int) -> bool:
    """True when the fp32 gradient shards should live on NVMe (see
    :meth:`ZeroSetup.with_grad_spill`)."""
    from infinity.memory.plan import mem_available_bytes
    if cfg.offload.optimizer != "nvme" or stage < 2:
        return False
    grad_bytes = sum(4 * g.padded_numel // world_size for g in groups if g.trainable)
    cap = cfg.host_memory_bytes
    if cap is None:
        # no cap: this rank's share of the node's free RAM (the ranks of a node share it)
        avail = mem_available_bytes()
        cap = None if avail is None else avail // local_ranks(world_size)
    if cap is None or grad_bytes <= cap // 2:
        return False
    log.info("gradients: %.3f GB of fp32 gradient shards exceed half the host budget "
             "(%.3f GB): spilling them to NVMe", grad_bytes / 1e9, cap / 1e9)
    return True


def local_ranks(world_size: int) -> int:
    """Ranks sharing this node: torchrun's ``LOCAL_WORLD_SIZE``, else the whole world
    (the conservative answer for a single node)."""
    import os
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        n = 0
    return n if 0 < n <= world_size else max(1, int(world_size))


@dataclass(frozen=True)
class ShardSource:
    """What reading parameter values across ranks needs from an engine, and nothing more
    (``Engine.shard_source``): its groups, the group of each parameter, the ZeRO setup
    (None: one process), the fp32 master of a trainable group's shard, the swap space of
    NVMe homes, and the engine's own ``state_dict`` (one process)."""
    groups: list
    param_group: dict
    zero: object
    read_master: Callable        # (group, out fp32 tensor of its shard) -> None
    swap: object
    state_dict: Callable


def _shard_values(src: ShardSource, g, lo: int, hi: int) -> torch.Tensor:
    """This rank's shard of group ``g`` as fp32 (the master when there is one)."""
    out = torch.empty(hi - lo, dtype=torch.float32)
    if g.trainable:
        src.read_master(g, out)
        return out
    if g.quant is not None and src.zero.stage < 3:     # replicated, stored quantized
        from infinity.memory.frozen_quant import home_values
        return out.copy_(home_values(g, src.swap)[lo:hi])
    if g.quant is not None:          # Note [Quantized shards]: gathered (collective)
        from infinity.zero.quantized_shards import gathered_values
        return out.copy_(gathered_values(g, src.zero.comm, src.swap)[lo:hi])
    if src.zero.stage < 3:
        return out.copy_(g.device_buf[lo:hi])
    if g.home == "nvme":
        from infinity.memory.pool import aligned_buffer
        esize = torch.empty((), dtype=g.dtype).element_size()
        raw = aligned_buffer((hi - lo) * esize)
        src.swap.read(g.extent, raw.view(g.dtype)).wait()
        return out.copy_(raw.view(g.dtype))
    return out.copy_(g.host_buf)


def gathered_state_dict(engine) -> dict[str, torch.Tensor]:
    """``{name: fp32 tensor}`` of every parameter (first name of tied ones), gathered from
    all ranks group by group.  Collective: call it on every rank."""
    src = engine.shard_source()
    zero = src.zero
    res: dict[str, torch.Tensor] = {}
    for g in src.groups:
        if zero is None:
            lo, hi = 0, g.padded_numel
            full = _shard_values_single(src, g)
        else:
            lo, hi = zero.part.range(g.padded_numel)
            mine = _shard_values(src, g, lo, hi)
            full = torch.empty(g.padded_numel, dtype=torch.float32)
            zero.comm.all_gather_into(full, mine, group="default",
                                      name=f"state of group {g.gid}")
        for s in g.slots:
            res[s.name] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
    return res


def _shard_values_single(src: ShardSource, g) -> torch.Tensor:
    sd = src.state_dict()
    full = torch.zeros(g.padded_numel, dtype=torch.float32)
    for s in g.slots:
        full[s.offset:s.offset + s.numel].copy_(sd[s.name].reshape(-1))
    return full


def read_param_gathered(engine, p: torch.nn.Parameter,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full current value of parameter ``p`` (as ``out_dtype``: the engine passes the
    parameter's original dtype) assembled from every rank's shard of its group.
    Collective: every rank reads the same parameters in the same order
    (``engine.state_dict()`` iterates in model order on every rank)."""
    src = engine.shard_source()
    zero = src.zero
    g = src.param_group[id(p)]
    slot = next(s for s in g.slots if s.param is p)
    lo, hi = zero.part.range(g.padded_numel)
    mine = _shard_values(src, g, lo, hi)
    full = torch.empty(g.padded_numel, dtype=torch.float32)
    zero.comm.all_gather_into(full, mine, group="default", name=f"parameter {slot.name}")
    return full[slot.offset:slot.offset + slot.numel].view(slot.shape).to(out_dtype).clone()
