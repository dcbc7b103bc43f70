"""``infinity.initialize(model, config) -> Engine``: forward, backward, step, stats, close.

The engine wires together the parameter groups (``infinity.zero.groups``), the tiered
memory manager (``infinity.memory``), the hooks and trace-based prefetch
(``infinity.zero``) and the optimizer side (``infinity.engine_optimizer``).  Weights out
(``state_dict``/``save_pretrained``) live in ``infinity.engine_weights``.
"""
from __future__ import annotations

import logging
import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.engine_optimizer import EngineOptimizer
from infinity.memory.accounting import Accounting
from infinity.memory.device import choose_device, default_device_budget, make_device
from infinity.memory.manager import MemoryManager
from infinity.memory.plan import PlacementPlan, nvme_dirs_ok, remove_if_empty
from infinity.memory.pool import BufferPool
from infinity.zero.groups import build_groups
from infinity.zero.hooks import ParamHooks
from infinity.zero.prefetch import PrefetchCoordinator

log = logging.getLogger("infinity.engine")

__all__ = ["Engine", "initialize"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PARAM_HOME = {"none": "device", "cpu": "cpu", "nvme": "nvme"}


def initialize(model: nn.Module, config=None, *, lr_scheduler=None, timeline=None) -> "Engine":
    """Wrap ``model`` for offloaded training. ``config``: dict, JSON/YAML path,
    :class:`InfinityConfig` or None.  ``lr_scheduler``: optional factory
    ``f(optimizer) -> torch LR scheduler`` (replaces the config ``scheduler``)."""
    return Engine(model, config, lr_scheduler=lr_scheduler, timeline=timeline)


class Engine:
    def __init__(self, model: nn.Module, config=None, *, lr_scheduler=None, timeline=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"initialize: expected a torch.nn.Module, got {type(model).__name__}")
        self.cfg = cfg = InfinityConfig.load(config)
        self.module = model
        if timeline is None:
            from infinity.profile import Timeline
            timeline = Timeline(enabled=False)      # every call a no-op until profile()
        self.timeline = timeline
        self.dtype = _DTYPES[cfg.precision]
        self.gas = cfg.gradient_accumulation_steps
        self.acct = Accounting()
        self.micro_steps = 0
        self._closed = False
        self.aio = self.swap = None
        self.mm = self.opt = self.hooks = self.zero = None
        self.overlap = None
        # overlap each group's optimizer update with backward where that cannot change
        # results (infinity.engine_overlap); set False to always step at the boundary
        self.overlap_optimizer_step = True
        self._orig_dtypes: dict[int, torch.dtype] = {}
        self._dev_tier = None
        self.device = self._choose_device(model)
        self._move_buffers(model)
        try:
            self._setup(lr_scheduler)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ device
    @staticmethod
    def _choose_device(model: nn.Module) -> torch.device:
        """cpu, or the one CUDA device holding every parameter (single process); see
        :func:`infinity.memory.device.choose_device` for what is refused."""
        import torch.distributed as dist
        ws = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return choose_device([p.device for p in model.parameters()],
                             cuda_available=torch.cuda.is_available(), world_size=ws)

    def _move_buffers(self, model: nn.Module) -> None:
        """Buffers live where compute runs (a CPU buffer of a CUDA model moves there)."""
        if self.device.type == "cpu":
            return                        # the CPU path leaves buffers as they are
        for mod in model.modules():
            for k, b in mod._buffers.items():
                if b is not None and b.device != self.device:
                    mod._buffers[k] = b.to(self.device)

    def _to_device(self, x):
        if isinstance(x, torch.Tensor) and x.device != self.device:
            return x.to(self.device, non_blocking=x.is_pinned())
        return x

    def _device_budget(self, model: nn.Module) -> int | None:
        on_dev = sum(p.numel() * p.element_size() for p in model.parameters()
                     if p.device == self.device)
        return default_device_budget(self.device, self.cfg.device_memory_bytes, on_dev)

    # ------------------------------------------------------------------ setup
    def _setup(self, lr_scheduler) -> None:
        cfg, model = self.cfg, self.module
        # ZeRO across ranks (None at world size 1): partitioned memory manager + optimizer
        from infinity.zero.distributed import ZeroSetup
        self.zero = ZeroSetup.from_config(cfg, accounting=self.acct, timeline=self.timeline)
        ws = self.zero.world_size if self.zero else 1
        rank = self.zero.rank if self.zero else 0
        param_home = _PARAM_HOME[cfg.offload.params]
        for p in model.parameters():
            self._orig_dtypes.setdefault(id(p), p.dtype)
        # the device tier (budget: device_memory_gb, on CUDA default free memory) is made
        # before the plan: a separate device memory adds copies and host staging to it
        self.device_budget = device_budget = self._device_budget(model)
        self._dev_tier = make_device(self.device, device_budget, self.acct)
        separate = not self._dev_tier.zero_copy
        gp = build_groups(model, self.dtype, param_home, world_size=ws)
        self.plan = gp
        if not gp.groups:
            raise ValueError(f"initialize: {type(model).__name__} has no parameters")
        # low-precision compute: floating buffers follow the compute dtype (as module.to())
        if self.dtype != torch.float32:
            for mod in model.modules():
                for k, b in mod._buffers.items():
                    if b is not None and b.is_floating_point():
                        mod._buffers[k] = b.to(self.dtype)
        needs_nvme = param_home == "nvme" or cfg.offload.optimizer == "nvme"
        if needs_nvme:
            from infinity.io import AioEngine, SwapSpace
            self._created_dirs = nvme_dirs_ok(cfg.offload.nvme_paths)
            a = cfg.aio
            self.aio = AioEngine(a.block_size, a.queue_depth, a.threads, a.engine)
            self.swap = SwapSpace(cfg.offload.nvme_paths, self.aio, rank=rank,
                                   accounting=self.acct)
        from infinity.optim.offload_step import DEFAULT_TILE_NUMEL, OptimizerStateStore
        largest_trainable = max((g.padded_numel // ws for g in gp.groups if g.trainable),
                                default=1)
        tile = min(DEFAULT_TILE_NUMEL, largest_trainable)
        if cfg.host_memory_bytes is not None:
            # keep the optimizer's tile ring (~3 slots x 4 fp32 tensors) within ~15 % of the cap
            tile = max(65536, min(tile, int(cfg.host_memory_bytes * 0.15) // 48))
        sink = self.dtype if (self.dtype != torch.float32 and param_home == "nvme") else None
        self.store = OptimizerStateStore(cfg.offload.optimizer, swap=self.swap,
                                         tile_numel=tile, accounting=self.acct,
                                         timeline=self.timeline, sink_dtype=sink)
        placement = PlacementPlan(cfg.precision, param_home, cfg.offload.optimizer,
                                  cfg.prefetch.depth, gp.groups, cfg.host_memory_bytes,
                                  device_budget,
                                  optimizer_ring_bytes=self.store.host_bytes(),
                                  separate_device=separate)
        placement.compute(self.gas)
        if cfg.host_memory_bytes is not None and placement.host_total > cfg.host_memory_bytes \
                and self.swap is not None and self.zero is None:
            placement.grad_home = "nvme"      # the cap cannot hold the fp32 grads: NVMe home
            placement.compute(self.gas)
        if self.zero is not None:             # per-rank shares; spill grad shards if needed
            from infinity.zero.distributed import partition_placement
            self.zero = ZeroSetup.with_grad_spill(self.zero, cfg, gp.groups)
            partition_placement(placement, self.zero)
        placement.check()
        if cfg.precision == "fp32" and param_home == "nvme" and self.zero is None \
                and not separate and device_budget is None \
                and cfg.host_memory_bytes is not None \
                and cfg.host_memory_bytes > placement.host_total \
                and placement.grad_home == "host":
            # the cap's headroom keeps clean copies of NVMe params (write-through: in fp32
            # the param is the master the optimizer updates in place)
            placement.param_cache_budget = cfg.host_memory_bytes - placement.host_total
            placement.compute(self.gas)
            placement.check()
        self.placement = placement
        if self.swap is not None and placement.nvme_total:
            self.swap.reserve(placement.nvme_total)
        log.info("%s", placement.describe())
        host_cap = cfg.host_memory_bytes
        pool_budget = None
        if host_cap is not None:
            store_host = sum(v for k, v in placement.host.items() if k.startswith("optimizer"))
            pool_budget = host_cap - store_host
        self.host_pool = BufferPool("host", pool_budget, self.acct)
        mm_kw = dict(device=self.device, device_budget=device_budget,
                     host_pool=self.host_pool, swap=self.swap, accounting=self.acct,
                     timeline=self.timeline, device_tier=self._dev_tier)
        opt_kw = dict(store=self.store, swap=self.swap, host_pool=self.host_pool,
                      accounting=self.acct, timeline=self.timeline, lr_scheduler=lr_scheduler)
        if self.zero is None:
            self.mm = MemoryManager(gp.groups, **mm_kw)
            self.opt = EngineOptimizer(model, cfg, gp.groups, gp.names, **opt_kw)
            if placement.param_cache_budget:
                self.mm.enable_cache()
                self.opt.lazy_grads = True    # gradient buffers only while they hold one
        else:
            self.mm = self.zero.memory_manager(gp.groups, **mm_kw)
            self.opt = self.zero.optimizer(model, cfg, gp.groups, gp.names, **opt_kw)
        self._dev_tier = None                 # owned (and closed) by the manager now
        staging = None
        paged_nvme = [g for g in gp.groups if g.home == "nvme"]
        if paged_nvme:
            staging = self.host_pool.lease(max(g.nbytes for g in paged_nvme), torch.uint8)
        from infinity.zero.init import adopting   # params built under infinity.Init
        for g in gp.groups:
            with adopting(g.slots):
                init = None
                if g.trainable and self.dtype != torch.float32:
                    init = torch.zeros(g.padded_numel, dtype=torch.float32)
                    with torch.no_grad():
                        for s in g.slots:
                            init[s.offset:s.offset + s.numel].copy_(
                                s.param.detach().reshape(-1))
                self.mm.place(g, staging)
                if g.trainable:
                    self.opt.register(g, init)
                del init
        if staging is not None:
            self.host_pool.give_back(staging)
            self.host_pool.trim()
        if placement.grad_home == "nvme":
            self.opt.alloc_grads("nvme")
        else:
            self.opt.alloc_grads()
        dev = getattr(self.mm, "dev", None)
        if dev is not None and hasattr(self.opt, "attach_device"):
            # separate device memory: grads leave by D2H, staging bounded as planned
            self.opt.attach_device(dev, placement.grad_d2h_bytes)
        self.coord = PrefetchCoordinator(self.mm, cfg.prefetch.depth, self.acct)
        from infinity.engine_overlap import OverlappedStep, eligible
        on_grad = self.opt.accumulate
        if eligible(self):
            self.overlap = OverlappedStep(self.opt, self.mm, self.coord, self.acct)
            accumulate, overlap = self.opt.accumulate, self.overlap
            slot_index = {id(s): i for g in gp.groups for i, s in enumerate(g.slots)}

            def on_grad(g, slot, grad):
                accumulate(g, slot, grad)
                overlap.grad_arrived(g, slot_index[id(slot)])
        self.hooks = ParamHooks(model, gp, self.mm, self.coord, on_grad)
        self.hooks.install()

    # ------------------------------------------------------------------ training API
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._check_open()
        self._drain_overlap()              # a fetch must not read a home being updated
        if self.device.type != "cpu":     # inputs follow the parameters (top-level tensors)
            args = tuple(self._to_device(a) for a in args)
            kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
        if self.dtype != torch.float32:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        with self.timeline.span("forward", "forward"):
            return self.module(*args, **kwargs)

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Scale ``loss`` by 1/gradient_accumulation_steps (and the fp16 loss scale) and
        run backward; gradients accumulate in fp32 at their home."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward: expected a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        scale = self.opt.scaler.scale / self.gas
        if scale != 1.0:
            loss = loss.float() * scale      # fp32: an fp16 loss times 65536 overflows
        final = (self.micro_steps + 1) % self.gas == 0
        before_backward = getattr(self.opt, "before_backward", None)
        if before_backward is not None:
            before_backward(final)
        ov = self.overlap
        if ov is not None and final and self.overlap_optimizer_step and not retain_graph:
            ov.begin()
        with self.timeline.span("backward", "backward"):
            try:
                loss.backward(retain_graph=retain_graph)
            finally:
                if ov is not None:
                    ov.end()
            self.hooks.finish_backward()
            end_backward = getattr(self.opt, "end_backward", None)
            if end_backward is not None:
                end_backward()

    def step(self) -> bool:
        """Call after every micro-batch; applies the optimizer at accumulation boundaries.
        Returns True when an update was applied at this call."""
        self._check_open()
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return False
        busy = [g.name for g in self.mm.groups if g.users]
        if busy:
            raise RuntimeError(f"engine.step: called while modules are still executing "
                               f"(groups in use: {busy[:4]}); call it after backward")
        od = self.acct.counters.get("on_demand_fetches", 0)
        self.mm.wait_host_reads()          # no copy may still read a home being updated
        with self.timeline.span("optimizer", "step"):
            try:
                done = self.overlap.finish() if self.overlap is not None else None
            except BaseException:
                self.opt.abandon_window()  # the failed window's gradients are dropped
                raise
            applied = self.opt.boundary_step(done) if done else self.opt.boundary_step()
        if applied:
            self.mm.refresh_resident()     # separate device: resident copies from mirrors
        self.timeline.mark_step(self.opt.boundaries)
        self._last_on_demand = od - getattr(self, "_od_at_last_step", 0)
        self._od_at_last_step = od
        return applied

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Declare that ``module``'s forward uses ``param`` although another module owns it
        (like DeepSpeed's ``register_external_parameter``); otherwise ``param`` is released
        (a NaN placeholder) while ``module`` runs."""
        self._check_open()
        g = self.plan.param_group.get(id(param))
        if g is None:
            raise KeyError("register_external_parameter: that parameter is not part of the "
                           "model given to initialize")
        if not any(m is module for m in self.module.modules()):
            raise ValueError("register_external_parameter: module is not part of the model")
        self.hooks.add_external(module, g)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    @property
    def lr(self) -> float:
        return self.opt.lr

    @property
    def global_steps(self) -> int:
        return self.opt.step_count

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    # ------------------------------------------------------------------ facts
    def stats(self) -> dict:
        d = self.acct.as_dict()
        for k in ("on_demand_fetches", "prefetched_fetches", "untracked_fetches",
                  "divergent_steps", "prefetch_unused", "prefetch_evicted",
                  "device_budget_overflows", "optimizer_groups_overlapped",
                  "optimizer_master_handoffs", "optimizer_master_read_bytes_saved"):
            d.setdefault(k, 0)
        d.update({
            "step": self.opt.step_count,
            "micro_step": self.micro_steps,
            "lr": self.opt.lr,
            "loss_scale": float(self.opt.scaler.scale),
            "skipped_steps": int(self.opt.scaler.skipped_steps),
            "grad_norm": float(self.opt.last_grad_norm),
            "optimizer_step_seconds": float(self.opt.last_step_seconds),
            "on_demand_fetches_last_step": int(getattr(self, "_last_on_demand", 0)),
            "host_cap_bytes": self.cfg.host_memory_bytes or 0,
            "device_cap_bytes": getattr(self, "device_budget", None) or 0,
            "groups": len(self.mm.groups),
        })
        return d

    # ------------------------------------------------------------------ profile
    def profile(self, directory=None, **kw):
        """``with engine.profile("prof/"):`` records the timeline (I/O, forward, backward,
        optimizer, waits) and writes the Chrome trace, summary and plots on exit."""
        from infinity.profile.session import ProfileSession
        return ProfileSession(self.timeline, directory, stats_fn=self.stats, **kw)

    # ------------------------------------------------------------------ weights out
    def state_dict(self):
        from infinity.engine_weights import StreamedStateDict
        self._check_open()
        self._drain_overlap()
        return StreamedStateDict(self)

    def save_pretrained(self, directory, *, max_shard_bytes: int = 2 * 10 ** 9) -> list[str]:
        from infinity.engine_weights import save_pretrained
        self._check_open()
        self._drain_overlap()
        return save_pretrained(self, directory, max_shard_bytes=max_shard_bytes)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory, tag=None, **kw):
        """Atomic sharded checkpoint ``directory/<tag>`` (default ``step-<N>``); see
        ``infinity.checkpoint.save_checkpoint`` for ``kw`` (async_, shard_bytes, ...).
        At world size > 1 every rank calls it and writes its own shard."""
        from infinity.checkpoint.engine_state import save_engine_checkpoint
        self._check_open()
        self._drain_overlap()
        return save_engine_checkpoint(self, directory, tag, **kw)

    def load_checkpoint(self, directory, tag=None, **kw):
        """Verify then load ``directory/<tag>`` (default: ``latest``); returns its meta.
        Any world size or offload configuration may have written it; at world size > 1
        every rank calls it."""
        from infinity.checkpoint.engine_state import load_engine_checkpoint
        self._check_open()
        self._drain_overlap()
        return load_engine_checkpoint(self, directory, tag, **kw)

    # ------------------------------------------------------------------ lifetime
    def _drain_overlap(self) -> None:
        """Wait for group steps submitted during backward when the boundary step has not
        collected them (forward, weights out or a checkpoint before ``step()``)."""
        if self.overlap is not None and self.overlap.busy:
            self.overlap.wait()            # step() still collects them

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: already closed; create a new one with infinity.initialize")

    def close(self) -> None:
        """Idempotent: remove hooks, free buffers, close the swap space (files removed)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for what, fn in (("overlapped step", getattr(self.overlap, "close", None)),
                         ("hooks", getattr(self.hooks, "remove", None)),
                         ("memory", getattr(self.mm, "close", None)),
                         ("device", getattr(self._dev_tier, "close", None)),
                         ("optimizer", getattr(getattr(self, "store", None), "close", None)),
                         ("swap", getattr(self.swap, "close", None)),
                         ("aio", getattr(self.aio, "close", None))):
            if fn is None:
                continue
            try:
                fn()
            except Exception as e:  # keep closing the rest; report the first failure
                errors.append((what, e))
                log.error("engine.close: closing %s failed: %s", what, e)
        if getattr(self, "host_pool", None) is not None:
            self.host_pool.close()
        if getattr(self, "zero", None) is not None:
            try:
                self.zero.close()
            except Exception as e:
                errors.append(("zero", e))
        remove_if_empty(getattr(self, "_created_dirs", []))
        if errors:
            what, e = errors[0]
            raise RuntimeError(f"engine.close: closing {what} failed: {e}") from e

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.cfg
        return (f"Engine(precision={c.precision}, params={c.offload.params}, "
                f"optimizer={c.offload.optimizer}, groups={len(self.plan.groups)}, "
                f"closed={self._closed})")
