"""The engine's assembly: from a model and a config to the parts that move one shard
along the data path, in that order — ZeRO setup, device tier, groups
(:mod:`infinity.runtime.groups`), NVMe swap, optimizer state store, placement plan
(:class:`infinity.memory.plan.PlacementPlan`), host pool, memory manager and step driver
(:mod:`infinity.optim.driver`, or the partitioned pair of :mod:`infinity.zero`), the
gradient route (:mod:`infinity.grads`), prefetch and hooks (:mod:`infinity.runtime`) and
the overlapped step (:mod:`infinity.engine.overlap`).
"""
from __future__ import annotations

import contextlib

import logging

import torch

from infinity.config_sections import GB
from infinity.grads.route import grad_sink
from infinity.memory.device import default_device_budget, make_device
from infinity.memory.manager import MemoryManager
from infinity.memory.plan import PlacementPlan, nvme_dirs_ok
from infinity.memory.pool import BufferPool
from infinity.optim.driver import EngineOptimizer
from infinity.optim.offload_step import STATE_TORCH_DTYPES
from infinity.runtime.groups import build_groups
from infinity.runtime.hooks import ParamHooks
from infinity.runtime.prefetch import PrefetchCoordinator

log = logging.getLogger("infinity.engine")

__all__ = ["assemble", "device_budget_for", "reuse_bytes_for"]

_PARAM_HOME = {"none": "device", "cpu": "cpu", "nvme": "nvme"}


REUSE_LINE = "groups kept for reuse (prefetch.reuse_gb)"


def reuse_bytes_for(cfg, zero, device_budget: int | None, placement) -> int:
    """Bytes of released groups kept for their next use in the micro-step (Note [Reuse
    within a micro-step] in infinity/runtime/prefetch.py), added to the placement plan's
    device tier: ``prefetch.reuse_gb`` when set; automatic at ZeRO stage 3 across ranks
    (a re-fetch is an all-gather): ``DEFAULT_REUSE_BYTES``; otherwise 0.  With a device
    budget at most what the budget leaves above the plan, and never more than the paged
    parameters."""
    from infinity.runtime.prefetch import DEFAULT_REUSE_BYTES
    if cfg.prefetch.reuse_gb is not None:
        want = int(round(cfg.prefetch.reuse_gb * GB))
    elif zero is not None and zero.stage == 3:
        want = DEFAULT_REUSE_BYTES if device_budget is None else int(device_budget)
    else:
        want = 0
    sharded = zero is not None and zero.stage == 3
    paged = sum(g.nbytes for g in placement.groups
                if sharded or g.home != "device" or g.quant is not None)
    kept = min(want, paged)
    if device_budget is not None:
        kept = min(kept, max(0, int(device_budget) - placement.device_total))
    if kept > 0:
        placement.device[REUSE_LINE] = kept
    return kept


def device_budget_for(device: torch.device, cfg, model) -> int | None:
    """The device tier's budget: ``device_memory_gb``, else (CUDA) the free memory."""
    on_dev = sum(p.numel() * p.element_size() for p in model.parameters()
                 if p.device == device)
    return default_device_budget(device, cfg.device_memory_bytes, on_dev)


def _params_follow(g, device: torch.device) -> None:
    """A model built on CPU (or under ``infinity.Init``) computing on a GPU (ZeRO on a GPU
    node): a group at its home leaves placeholders on the compute device, so parameters
    are on that device before the first fetch as after every release."""
    from infinity.memory.record import Location, placeholder
    if device.type == "cpu" or g.state is Location.DEVICE:
        return
    for s in g.slots:
        if s.param.device != device:
            s.param.data = placeholder(g.dtype, s.shape, device)


def _tiling_across_ranks(engine) -> dict:
    """Tiling's ZeRO hooks: the shard is final when the group's uses are done; an
    Embedding's touched tiles are the union over ranks (a sum on the engine's group)."""
    if engine.zero is None:
        return {}
    comm = engine.zero.comm
    return {"group_final": engine.opt.grads.tiled_final,
            "union": lambda m: comm.all_reduce_sum(m, group="default", name="touched tiles")}


def _param_cache_allowed(cfg, zero, separate: bool, device_budget, placement,
                         undo_room: int) -> bool:
    """Whether released NVMe-homed groups keep clean host copies (the parameter cache,
    Note [Cache write-through] in infinity/memory/manager.py): fp32 (the parameter is the
    master the optimizer updates in place and writes through), NVMe param home, zero-copy
    device tier, gradients in host memory, no activations on the host tier, and
    ``offload.host_memory_gb`` above the placement plan and ``undo_room`` (the undo copies
    of host-resident optimizer states, Note [commit point]).  One process: no device budget
    either (the copies are the device tier's buffers, adopted by the host pool).  ZeRO
    stage 3 across ranks (Note [Shard cache] in infinity/zero/partitioned_memory.py): each
    rank copies its own shards within its own cap's headroom (the plan is already one
    rank's share); not with ZeRO++, not at stages 1-2 (no paged parameters)."""
    if not (cfg.precision == "fp32" and cfg.offload.params == "nvme" and not separate
            and cfg.host_memory_bytes is not None
            and cfg.host_memory_bytes > placement.host_total + undo_room
            and placement.grad_home == "host" and cfg.activation_offload.home != "cpu"):
        return False
    if zero is None:
        return device_budget is None
    return zero.stage == 3 and zero.zeropp is None and not zero.spill


def assemble(engine, lr_scheduler) -> None:
    """Build ``engine``'s parts in dependency order, each attribute set as soon as it
    exists (so ``engine.close()`` frees whatever a failure part-way left built)."""
    cfg, model = engine.cfg, engine.module
    # ZeRO across ranks (None at world size 1): partitioned memory manager + optimizer
    from infinity.zero.distributed import SLOTS_LINE, ZeroSetup
    engine.zero = ZeroSetup.from_config(cfg, accounting=engine.acct, timeline=engine.timeline,
                                        device=engine.device)
    ws = engine.zero.world_size if engine.zero else 1
    rank = engine.zero.rank if engine.zero else 0
    param_home = _PARAM_HOME[cfg.offload.params]
    for p in model.parameters():
        engine.orig_dtypes.setdefault(id(p), p.dtype)
    # the device tier (budget: device_memory_gb, on CUDA default free memory) is made
    # before the plan: a separate device memory adds copies and host staging to it
    engine.device_budget = device_budget = device_budget_for(engine.device, cfg, model)
    engine.device_tier_to_own = make_device(engine.device, device_budget, engine.acct)
    separate = not engine.device_tier_to_own.zero_copy
    engine.grouping = grouping = build_groups(model, engine.dtype, param_home, world_size=ws)
    if not grouping.groups:
        raise ValueError(f"initialize: {type(model).__name__} has no parameters")
    # offload.frozen_weights: frozen weights kept quantized at their home (Note [Quantized
    # homes] in infinity/memory/frozen_quant.py); before the plan, which counts their bytes
    from infinity.engine.frozen import plan_frozen_weights
    plan_frozen_weights(engine, grouping)
    # low-precision compute: floating buffers follow the compute dtype (as module.to())
    if engine.dtype != torch.float32:
        for mod in model.modules():
            for k, b in mod._buffers.items():
                if b is not None and b.is_floating_point():
                    mod._buffers[k] = b.to(engine.dtype)
    # memory-centric tiling (infinity.runtime.tiling): layers larger than their share of the
    # device budget are computed tile by tile, never fetched whole
    from infinity.runtime.tiling import plan_tiles, tiling_limit
    # across ranks (Note [Tiles across ranks]): stage 3, whose paged groups are the only
    # ones (stages 1-2 keep parameters on the device); not with ZeRO++ (its gathers and
    # reductions run on their own threads and groups)
    tile_gb = cfg.tiling.max_group_gb
    tile_specs = {} if engine.zero is not None and engine.zero.zeropp is not None \
        else plan_tiles(grouping, tiling_limit(
            None if tile_gb is None else int(round(tile_gb * GB)), device_budget,
            cfg.prefetch.depth))
    act_home = cfg.activation_offload.home
    needs_nvme = param_home == "nvme" or cfg.offload.optimizer == "nvme" or act_home == "nvme"
    if needs_nvme:
        from infinity.io import AioEngine, SwapSpace
        engine.created_dirs = nvme_dirs_ok(cfg.offload.nvme_paths)
        a = cfg.aio
        engine.aio = AioEngine(a.block_size, a.queue_depth, a.threads, a.engine)
        engine.swap = SwapSpace(cfg.offload.nvme_paths, engine.aio, rank=rank,
                               accounting=engine.acct)
    from infinity.optim.offload_step import DEFAULT_TILE_NUMEL, OptimizerStateStore
    largest_trainable = max((g.padded_numel // ws for g in grouping.groups if g.trainable),
                            default=1)
    state_dtype = STATE_TORCH_DTYPES[cfg.optimizer.state_dtype]
    tile = min(DEFAULT_TILE_NUMEL, largest_trainable)
    if cfg.host_memory_bytes is not None:
        # keep the optimizer's tile ring (~3 slots x fp32 master + grad + the two moments)
        # within ~15 % of the cap
        per_elem = 3 * (8 + 2 * state_dtype.itemsize)
        tile = max(65536, min(tile, int(cfg.host_memory_bytes * 0.15) // per_elem))
    sink = engine.dtype if (engine.dtype != torch.float32 and param_home == "nvme") else None
    engine.store = OptimizerStateStore(cfg.offload.optimizer, swap=engine.swap,
                                     tile_numel=tile, state_dtype=state_dtype,
                                     accounting=engine.acct,
                                     timeline=engine.timeline, sink_dtype=sink)
    placement = PlacementPlan(cfg.precision, param_home, cfg.offload.optimizer,
                              cfg.prefetch.depth, grouping.groups, cfg.host_memory_bytes,
                              device_budget,
                              optimizer_ring_bytes=engine.store.host_bytes(),
                              separate_device=separate,
                              grad_accum_dtype=cfg.gradient_accumulation_dtype,
                              state_bytes=state_dtype.itemsize,
                              tile_bytes={g.gid: sp.tile_bytes() for sp in tile_specs.values()
                                          for g in sp.groups})
    # Note [Streamed gradients]: what infinity.engine.overlap.eligible will allow (one
    # process, or ZeRO stage 3 across ranks -- the spilled shards; on any device tier)
    placement.stream_grads = cfg.precision in ("fp32", "bf16") and (
        engine.zero is None or engine.zero.stage == 3)
    # Note [Speculative clipping]: streamed sums are written for a redo unless it redoes
    # from the moments (fp32 moments: Note [Redo from moments])
    placement.clipping = float(cfg.gradient_clipping) > 0 and state_dtype != torch.float32
    placement.compute(engine.gas)
    if cfg.host_memory_bytes is not None and placement.host_total > cfg.host_memory_bytes \
            and engine.swap is not None and engine.zero is None:
        placement.grad_home = "nvme"      # the cap cannot hold the fp32 grads: NVMe home
        placement.compute(engine.gas)
    if engine.zero is not None:             # per-rank shares; spill grad shards if needed
        from infinity.zero.distributed import partition_placement
        engine.zero = ZeroSetup.with_grad_spill(engine.zero, cfg, grouping.groups)
        partition_placement(placement, engine.zero)
    placement.check()
    # Note [commit point]: the undo copies of host-resident optimizer states that a
    # window's steps update in place come first (without their room no group step
    # overlaps backward); the parameter cache takes the rest of the cap's headroom
    undo_room = sum(v for k, v in placement.host.items() if k.startswith("optimizer states"))
    if _param_cache_allowed(cfg, engine.zero, separate, device_budget, placement, undo_room):
        # the cap's headroom keeps clean copies of NVMe params (write-through: in fp32
        # the param is the master the optimizer updates in place); across ranks each
        # rank's copies of its own shards in its own cap's headroom (Note [Shard cache])
        placement.param_cache_budget = cfg.host_memory_bytes - placement.host_total - undo_room
        if engine.zero is not None:
            placement.param_shards = engine.zero.world_size
        placement.compute(engine.gas)
        if engine.zero is not None:
            from infinity.zero.distributed import partition_placement
            partition_placement(placement, engine.zero)
        placement.check()
    if engine.zero is not None and not engine.zero.start_transport(grouping.groups):
        placement.host.pop(SLOTS_LINE, None)     # the transport is off: no slots
    engine.reuse_bytes = reuse_bytes_for(cfg, engine.zero, device_budget, placement)
    engine.placement = placement
    # Note [commit point]: host undo copies of a window's updated host states fit in what
    # the cap leaves (no cap: any)
    engine.undo_budget = None if cfg.host_memory_bytes is None else \
        max(0, cfg.host_memory_bytes - placement.host_total)
    _plan_shadow_budget(engine, cfg, placement, grouping.groups)
    if engine.swap is not None and placement.nvme_total:
        engine.swap.reserve(placement.nvme_total)
    log.info("%s", placement.describe())
    host_cap = cfg.host_memory_bytes
    pool_budget = None
    if host_cap is not None:
        store_host = sum(v for k, v in placement.host.items() if k.startswith("optimizer"))
        # the transport's shared-memory slots are host memory outside the pool
        pool_budget = host_cap - store_host - placement.host.get(SLOTS_LINE, 0)
        if placement.param_cache_budget:
            # the undo copies (not pool buffers) keep their room: the cached copies in the
            # pool may not grow into it
            pool_budget -= undo_room
    engine.host_pool = BufferPool("host", pool_budget, engine.acct)
    mm_kw = dict(device=engine.device, device_budget=device_budget,
                 host_pool=engine.host_pool, swap=engine.swap, accounting=engine.acct,
                 timeline=engine.timeline, device_tier=engine.device_tier_to_own)
    opt_kw = dict(store=engine.store, swap=engine.swap, host_pool=engine.host_pool,
                  accounting=engine.acct, timeline=engine.timeline, lr_scheduler=lr_scheduler)
    cache = bool(placement.param_cache_budget)
    if engine.zero is None:
        engine.mm = MemoryManager(grouping.groups, cache=cache, **mm_kw)
        # with the cache, gradient buffers are leased only while they hold one
        engine.opt = EngineOptimizer(model, cfg, grouping.groups, grouping.names, lazy_grads=cache,
                                     **opt_kw)
    else:
        engine.mm = engine.zero.memory_manager(grouping.groups, cache=cache, **mm_kw)
        engine.opt = engine.zero.optimizer(model, cfg, grouping.groups, grouping.names, **opt_kw)
    engine.opt.on_extents_moved = engine.follow_extents   # Note [roll forward]
    if engine.zero is None:                # Note [Finish in the next forward]
        from infinity.engine.deferred import start
        engine.opt.defer_finish = lambda: start(engine)
    engine.device_tier_to_own = None                 # owned (and closed) by the manager now
    paged_nvme = [g for g in grouping.groups if g.home == "nvme"]
    from infinity.procutil import trim_heap
    from infinity.zero.init import adopting   # params built under infinity.Init
    with contextlib.ExitStack() as scope:
        staging = scope.enter_context(engine.host_pool.scoped(
            max(g.home_nbytes for g in paged_nvme), torch.uint8)) if paged_nvme else None
        for g in grouping.groups:
            with adopting(g.slots):
                init = None
                if g.trainable and engine.dtype != torch.float32:
                    init = torch.zeros(g.padded_numel, dtype=torch.float32)
                    with torch.no_grad():
                        for s in g.slots:
                            init[s.offset:s.offset + s.numel].copy_(
                                s.param.detach().reshape(-1))
                engine.mm.place(g, staging)
                if g.quant is not None:       # its quantizer's temporaries: not kept resident
                    trim_heap()
                _params_follow(g, engine.device)
                if g.trainable:
                    engine.opt.register(g, init)
                del init
    if paged_nvme:
        engine.host_pool.trim()
    if placement.grad_home == "nvme":      # the groups that fit keep host accumulators
        engine.opt.grads.alloc_grads("nvme", host_gids=placement.grad_host_gids,
                               partial_dtype=torch.bfloat16
                               if cfg.gradient_accumulation_dtype == "bf16" else torch.float32)
    else:
        engine.opt.grads.alloc_grads()
    # separate device memory: grads leave by D2H, staging bounded as planned
    engine.opt.attach_device(engine.mm.dev, placement.grad_d2h_bytes)
    # separate device memory: the pinned staging of the first steps' copies is allocated
    # (and registered with CUDA) now, not inside the hooks of those steps
    engine.host_pool.reserve(engine.mm.staging_sizes(cfg.prefetch.depth)
                             + engine.opt.grads.staging_sizes())
    engine.coord = PrefetchCoordinator(engine.mm, cfg.prefetch.depth, engine.acct,
                                       reuse_bytes=engine.reuse_bytes)
    from infinity.engine.overlap import OverlappedStep, eligible
    after = None
    if eligible(engine):
        engine.overlap = OverlappedStep(engine.opt, engine.mm, engine.coord, engine.acct,
                                        undo_budget=engine.undo_budget,
                                        grad_window=placement.stream_window,
                                        sharded=engine.zero is not None)
        # Note [shadow budget]: commit_shadow_gb 0 -- no speculative steps
        engine.overlap.speculate = not (cfg.offload.commit_shadow_gb == 0
                                        and engine.store.shadow_budget is not None)
        if engine.zero is None and engine.opt.grads.grad_d2h is None:
            # (ZeRO: the reduced shard's landing, grad_final; a separate device: the D2H's
            # landing, GradD2H.landed)
            after = engine.overlap.grad_arrived
    # (gradients enter only inside engine.backward: Note [foreign backward] in core.py)
    on_grad = engine.grad_gate(grad_sink(engine.opt.grads.accumulate, grouping.groups, after=after))
    acts = None
    if act_home != "none":                  # saved activations on the host tier or NVMe
        from infinity.runtime.activations import ActivationOffload
        acts = ActivationOffload(act_home, cfg.activation_offload.scope, swap=engine.swap,
                                 accounting=engine.acct, timeline=engine.timeline,
                                 host_budget=engine.undo_budget, depth=cfg.prefetch.depth)
    engine.hooks = ParamHooks(model, grouping, engine.mm, engine.coord, on_grad, gate=engine.gate,
                              activations=acts)
    if tile_specs:
        from infinity.runtime.tiling import Tiling
        engine.tiling = Tiling(tile_specs, engine.mm, engine.acct,
                               accumulate=engine.grad_gate(engine.opt.grads.accumulate),
                               accumulate_rows=engine.grad_gate(engine.opt.grads.accumulate_rows),
                               accepts_rows=engine.opt.grads.accumulates_rows, after=after,
                               **_tiling_across_ranks(engine))
        engine.tiling.install(grouping)
        # Note [Recompute keeps its tiles]: within what the host cap leaves (the same on
        # every rank: the plan is); no cap, no bound (a checkpointed segment's tiles)
        if cfg.host_memory_bytes is not None:
            engine.tiling.keep_budget = max(0, cfg.host_memory_bytes - engine.placement.host_total)
        log.info("%s", engine.tiling.describe())
    engine.hooks.install()


def _plan_shadow_budget(engine, cfg, placement, groups) -> None:
    """Note [shadow budget]: bound the commit shadows by ``offload.commit_shadow_gb`` (or
    the free space, automatic) in the plan, the reservation and the store."""
    from infinity.memory.shadow_budget import SHADOW_LINE, free_swap_bytes, shadow_budget
    full = placement.nvme.get(SHADOW_LINE, 0)
    if not full or engine.swap is None:
        return
    ws = engine.zero.world_size if engine.zero is not None else 1
    numels = [g.padded_numel for g in groups if g.trainable]
    ring = -(-full * max(numels) // sum(numels)) + 3 * 4096   # (page slack)
    homes = placement.nvme_total - full
    local = 1
    if engine.zero is not None:
        from infinity.zero.distributed import local_ranks
        local = local_ranks(ws)
    budget = shadow_budget(cfg.offload.commit_shadow_gb, full, ring, homes,
                           free_swap_bytes(engine.swap.dirs), local)
    engine.store.shadow_budget = budget
    if budget is not None:
        placement.nvme[SHADOW_LINE] = budget
        log.info("infinity: commit shadows limited to %.3f GB of the %.3f GB one shadow per "
                 "optimizer state tensor would take (offload.commit_shadow_gb%s): updates stay "
                 "all-or-nothing, groups beyond it are written after the commit decision",
                 budget / 1e9, full / 1e9,
                 "" if cfg.offload.commit_shadow_gb is not None else " automatic: free space")

