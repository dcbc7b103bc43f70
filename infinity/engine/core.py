"""``infinity.initialize(model, config) -> Engine``: forward, backward, step, stats, close.

The engine's parts are built by :func:`infinity.engine.build.assemble` (groups and
hooks from :mod:`infinity.runtime`, the tiered memory manager from :mod:`infinity.memory`,
the gradient route from :mod:`infinity.grads`, the step driver from
:mod:`infinity.optim.driver`, their ZeRO counterparts from :mod:`infinity.zero`).  Weights
out (``state_dict``/``save_pretrained``) live in :mod:`infinity.engine.weights`,
checkpoints in :mod:`infinity.engine.checkpoint_state`, the step overlapped with backward
in :mod:`infinity.engine.overlap`.
"""
from __future__ import annotations

import logging
import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.engine.build import assemble
from infinity.memory.accounting import Accounting
from infinity.memory.device import choose_device
from infinity.memory.plan import remove_if_empty

log = logging.getLogger("infinity.engine")

__all__ = ["Engine", "initialize"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        # results (infinity.engine.overlap); set False to always step at the boundary
        self.overlap_optimizer_step = True
        self._orig_dtypes: dict[int, torch.dtype] = {}
        self._dev_tier = None
        self.device = self._choose_device(model)
        self._move_buffers(model)
        try:
            assemble(self, lr_scheduler)
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

    # ------------------------------------------------------------------ training API
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._check_open()
        self._drain_overlap()              # Note [Overlap safety]: a fetch must not read
        #                                    a home being updated
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
        self.opt.before_backward(final)
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
            self.opt.end_backward()

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
        g = self.grouping.param_group.get(id(param))
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
        from infinity.engine.weights import StreamedStateDict
        self._check_open()
        self._drain_overlap()
        return StreamedStateDict(self)

    def save_pretrained(self, directory, *, max_shard_bytes: int = 2 * 10 ** 9) -> list[str]:
        from infinity.engine.weights import save_pretrained
        self._check_open()
        self._drain_overlap()
        return save_pretrained(self, directory, max_shard_bytes=max_shard_bytes)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory, tag=None, **kw):
        """Atomic sharded checkpoint ``directory/<tag>`` (default ``step-<N>``); see
        ``infinity.checkpoint.save_checkpoint`` for ``kw`` (async_, shard_bytes, ...).
        At world size > 1 every rank calls it and writes its own shard."""
        from infinity.engine.checkpoint_state import save_engine_checkpoint
        self._check_open()
        self._drain_overlap()
        return save_engine_checkpoint(self, directory, tag, **kw)

    def load_checkpoint(self, directory, tag=None, **kw):
        """Verify then load ``directory/<tag>`` (default: ``latest``); returns its meta.
        Any world size or offload configuration may have written it; at world size > 1
        every rank calls it."""
        from infinity.engine.checkpoint_state import load_engine_checkpoint
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
                f"optimizer={c.offload.optimizer}, groups={len(self.grouping.groups)}, "
                f"closed={self._closed})")
