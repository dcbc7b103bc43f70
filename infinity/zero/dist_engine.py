"""TEMPORARY: the engine's setup with ZeRO partitioning, until it is folded into
``infinity/engine.py`` (owned by the engine engineer; edited only after it is ready)."""
from __future__ import annotations

import logging

import torch

from infinity.engine import Engine, _PARAM_HOME
from infinity.memory.plan import PlacementPlan, nvme_dirs_ok
from infinity.memory.pool import BufferPool
from infinity.zero.distributed import ZeroSetup
from infinity.zero.groups import build_groups
from infinity.zero.hooks import ParamHooks
from infinity.zero.init import adopting
from infinity.zero.prefetch import PrefetchCoordinator

log = logging.getLogger("infinity.zero")


class PartitionedEngine(Engine):
    def _setup(self, lr_scheduler) -> None:
        cfg, model = self.cfg, self.module
        self.zero = ZeroSetup.from_config(cfg, accounting=self.acct, timeline=self.timeline)
        ws = self.zero.world_size if self.zero else 1
        rank = self.zero.rank if self.zero else 0
        param_home = _PARAM_HOME[cfg.offload.params]
        for p in model.parameters():
            self._orig_dtypes.setdefault(id(p), p.dtype)
        gp = build_groups(model, self.dtype, param_home, world_size=ws)
        self.plan = gp
        if not gp.groups:
            raise ValueError(f"initialize: {type(model).__name__} has no parameters")
        if self.dtype != torch.float32:
            for mod in model.modules():
                for k, b in mod._buffers.items():
                    if b is not None and b.is_floating_point():
                        mod._buffers[k] = b.to(self.dtype)
        needs_nvme = param_home == "nvme" or cfg.offload.optimizer == "nvme"
        if needs_nvme:
            from infinity.io import AioEngine, SwapSpace
            nvme_dirs_ok(cfg.offload.nvme_paths)
            a = cfg.aio
            self.aio = AioEngine(a.block_size, a.queue_depth, a.threads, a.engine)
            self.swap = SwapSpace(cfg.offload.nvme_paths, self.aio, rank=rank)
        from infinity.optim.offload_step import DEFAULT_TILE_NUMEL, OptimizerStateStore
        largest_trainable = max((g.padded_numel // ws for g in gp.groups if g.trainable), default=1)
        tile = min(DEFAULT_TILE_NUMEL, largest_trainable)
        sink = self.dtype if (self.dtype != torch.float32 and param_home == "nvme") else None
        self.store = OptimizerStateStore(cfg.offload.optimizer, swap=self.swap,
                                         tile_numel=tile, accounting=self.acct,
                                         timeline=self.timeline, sink_dtype=sink)
        placement = PlacementPlan(cfg.precision, param_home, cfg.offload.optimizer,
                                  cfg.prefetch.depth, gp.groups, cfg.host_memory_bytes,
                                  cfg.device_memory_bytes,
                                  optimizer_ring_bytes=self.store.host_bytes())
        placement.compute(self.gas)
        self.zero = ZeroSetup.with_grad_spill(self.zero, cfg, gp.groups, accounting=self.acct,
                                              timeline=self.timeline)
        from infinity.zero.distributed import partition_placement
        partition_placement(placement, self.zero)
        placement.check()
        self.placement = placement
        if self.swap is not None and placement.nvme_total:
            self.swap.reserve(placement.nvme_total)
        host_cap = cfg.host_memory_bytes
        pool_budget = None
        if host_cap is not None:
            store_host = sum(v for k, v in placement.host.items() if k.startswith("optimizer"))
            pool_budget = host_cap - store_host
        self.host_pool = BufferPool("host", pool_budget, self.acct)
        mm_kw = dict(device=self.device, device_budget=cfg.device_memory_bytes,
                     host_pool=self.host_pool, swap=self.swap, accounting=self.acct,
                     timeline=self.timeline)
        opt_kw = dict(store=self.store, swap=self.swap, host_pool=self.host_pool,
                      accounting=self.acct, timeline=self.timeline, lr_scheduler=lr_scheduler)
        if self.zero is None:
            from infinity.engine_optimizer import EngineOptimizer
            from infinity.memory.manager import MemoryManager
            self.mm = MemoryManager(gp.groups, **mm_kw)
            self.opt = EngineOptimizer(model, cfg, gp.groups, gp.names, **opt_kw)
        else:
            self.mm = self.zero.memory_manager(gp.groups, **mm_kw)
            self.opt = self.zero.optimizer(model, cfg, gp.groups, gp.names, **opt_kw)
        staging = None
        paged_nvme = [g for g in gp.groups if g.home == "nvme"]
        if paged_nvme:
            staging = self.host_pool.lease(max(g.nbytes for g in paged_nvme), torch.uint8)
        for g in gp.groups:
            with adopting(g.slots):
                init = None
                if g.trainable and self.dtype != torch.float32:
                    init = torch.zeros(g.padded_numel, dtype=torch.float32)
                    with torch.no_grad():
                        for s in g.slots:
                            init[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                self.mm.place(g, staging)
                if g.trainable:
                    self.opt.register(g, init)
                del init
        if staging is not None:
            self.host_pool.give_back(staging)
            self.host_pool.trim()
        self.opt.alloc_grads()
        self.coord = PrefetchCoordinator(self.mm, cfg.prefetch.depth, self.acct)
        self.hooks = ParamHooks(model, gp, self.mm, self.coord, self.opt.accumulate)
        self.hooks.install()

    def close(self) -> None:
        was = self._closed
        try:
            super().close()
        finally:
            if not was and getattr(self, "zero", None) is not None:
                self.zero.close()
