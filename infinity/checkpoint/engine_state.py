"""The :class:`Checkpointable` protocol for :class:`infinity.engine.Engine`.

Kept in the checkpoint package so the engine only needs two delegating methods
(``engine.save_checkpoint`` / ``engine.load_checkpoint``). What is saved:

- every trainable parameter's fp32 master under its model name (read tile-wise
  from the optimizer state store, wherever it lives: device, host or NVMe),
- ``optim.<name>.exp_avg`` / ``optim.<name>.exp_avg_sq`` (fp32 as the store returns),
- frozen parameters (compute dtype, from their home) and persistent buffers under
  their model names, so ``infinity export`` yields the whole model,
- meta: step counters, loss-scaler state, the torch LR scheduler state (when one
  is used and JSON-able), RNG states, the config, world size, precision.

One parameter is in host memory at a time (one staging buffer reused). Loading
writes masters and states back through the store, refreshes the low-precision
compute copies and the frozen parameters at each parameter's home, copies the
buffers, and restores counters/scaler/scheduler/RNG. The
names and shapes are the model's, so a checkpoint loads under another offload
configuration or precision (fp32 masters are always saved).
"""
import dataclasses
import json
import logging

import torch

from .errors import CheckpointError
from .rng import rng_state_from_json, rng_state_to_json

log = logging.getLogger("infinity.checkpoint")

OPTIM_STATES = ("exp_avg", "exp_avg_sq")


def _jsonable(x):
    try:
        return json.loads(json.dumps(x))
    except (TypeError, ValueError):
        return None


def _check_meta(meta, where):
    """Reject meta the engine cannot restore, so a load fails before it changes anything
    (meta is applied after the tensors; a bad value there would leave a half-loaded engine)."""
    def bad(key, why):
        return CheckpointError(f"checkpoint {where}: meta[{key!r}] {why}; the checkpoint was not "
                               f"written by this engine or is damaged: load another tag")

    for key in ("step", "boundaries", "micro_step"):
        v = meta.get(key)
        if key == "step" or v is not None:
            if type(v) is not int or v < 0:
                raise bad(key, f"must be an integer >= 0, got {v!r}")
    ls = meta.get("loss_scaler")
    if ls is not None:
        if not isinstance(ls, dict):
            raise bad("loss_scaler", f"must be an object, got {type(ls).__name__}")
        sc = ls.get("scale", 1.0)
        if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not (0 < sc < float("inf")):
            raise bad("loss_scaler", f"has scale {sc!r}; expected a finite number > 0")
        for k in ("clean_steps", "skipped_steps"):
            if k in ls and (type(ls[k]) is not int or ls[k] < 0):
                raise bad("loss_scaler", f"has {k} {ls[k]!r}; expected an integer >= 0")
    for key in ("torch_scheduler", "rng"):
        v = meta.get(key)
        if v is not None and not isinstance(v, dict):
            raise bad(key, f"must be an object or null, got {type(v).__name__}")


class EngineCheckpoint:
    """Adapter: ``save_checkpoint(EngineCheckpoint(engine), dir)``."""

    def __init__(self, engine):
        self.e = engine
        self.opt = engine.opt
        self.store = engine.opt.store
        self.groups = list(engine.mm.groups)

    # -- helpers -----------------------------------------------------------------
    def _check_idle(self, what):
        busy = [g.name for g in self.groups if g.users]
        if busy:
            raise CheckpointError(f"engine.{what}: modules are still executing (groups in use: "
                                  f"{busy[:4]}); call it between steps")

    def _trainable_slots(self):
        for g in self.opt.groups:
            key = self.opt.key(g)
            for s in g.slots:
                if s.trainable:
                    yield g, key, s

    def _frozen_slots(self):
        for g in self.groups:
            for s in g.slots:
                if not s.trainable:
                    yield g, s

    def _buffers(self):
        for mod_name, mod in self.e.module.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for bn, b in mod._buffers.items():
                if b is not None and bn not in skip:
                    yield (f"{mod_name}.{bn}" if mod_name else bn), mod, bn, b

    def _home_read(self, g):
        """The group's compute-dtype values (flat), from wherever they are current."""
        from infinity.memory.record import Location
        if g.state is Location.DEVICE and g.device_buf is not None:
            return g.device_buf
        if g.home == "cpu":
            return g.host_buf
        if g.home == "nvme":
            from infinity.io import aligned_empty
            buf = aligned_empty(g.padded_numel, g.dtype)
            self.e.swap.read(g.extent, buf).wait()
            return buf
        return g.device_buf

    def _release_cached(self):
        """Drop cached device copies of paged groups (they would be stale after a load)."""
        from infinity.memory.record import Location
        for g in self.groups:
            if g.home != "device" and g.state not in (Location.NVME, Location.HOST):
                self.e.mm.release(g)

    # -- Checkpointable: save ------------------------------------------------------
    def checkpoint_tensors(self):
        self._check_idle("save_checkpoint")
        slots = list(self._trainable_slots())
        stage = torch.empty(max([s.numel for _, _, s in slots] + [1]), dtype=torch.float32)
        for g, key, s in slots:
            buf = stage[: s.numel]
            self.store.read_master(key, buf, start=s.offset)
            yield s.name, buf.view(s.shape)
            for which in OPTIM_STATES:
                self.store.read_state(key, which, buf, start=s.offset)
                yield f"optim.{s.name}.{which}", buf.view(s.shape)
        last, flat = None, None
        for g, s in self._frozen_slots():
            if g is not last:
                flat, last = self._home_read(g), g
            yield s.name, flat[s.offset:s.offset + s.numel].view(s.shape)
        for name, _, _, b in self._buffers():
            yield name, b

    def checkpoint_meta(self):
        e, opt = self.e, self.opt
        sched = None
        if opt.torch_sched is not None:
            sched = _jsonable(opt.torch_sched.state_dict())
            if sched is None:
                log.warning("the LR scheduler's state is not JSON-serialisable; it is not saved "
                            "(the resumed run recomputes it from the step count only if it is "
                            "the config scheduler)")
        cfg = _jsonable(dataclasses.asdict(e.cfg)) if dataclasses.is_dataclass(e.cfg) else None
        return {
            "step": int(opt.step_count),
            "boundaries": int(opt.boundaries),
            "micro_step": int(e.micro_steps),
            "loss_scaler": _jsonable(opt.scaler.state_dict()),
            "torch_scheduler": sched,
            "rng": rng_state_to_json(),
            "config": cfg,
            "precision": e.cfg.precision,
            "world_size": 1,
            "model_names": [s.name for _, _, s in self._trainable_slots()]
            + [s.name for _, s in self._frozen_slots()] + [n for n, *_ in self._buffers()],
        }

    # -- Checkpointable: load ------------------------------------------------------
    def checkpoint_expected(self):
        exp = {}
        for _, _, s in self._trainable_slots():
            exp[s.name] = (tuple(s.shape), torch.float32)
            for which in OPTIM_STATES:
                exp[f"optim.{s.name}.{which}"] = (tuple(s.shape), None)
        for _, s in self._frozen_slots():
            exp[s.name] = (tuple(s.shape), None)
        for name, _, _, b in self._buffers():
            exp[name] = (tuple(b.shape), None)
        return exp

    def load_checkpoint_tensors(self, reader):
        self._check_idle("load_checkpoint")
        _check_meta(reader.meta, reader.path)  # before anything is written into the engine
        self._release_cached()
        slots = list(self._trainable_slots())
        stage = torch.empty(max([s.numel for _, _, s in slots] + [1]), dtype=torch.float32)
        fp32 = self.e.cfg.precision == "fp32"
        by_group = {}
        for g, key, s in slots:
            buf = stage[: s.numel]
            reader.read(s.name, out=buf)
            self.store.write_master(key, buf, start=s.offset)
            if not fp32:  # the compute copy at the param home is separate from the master
                by_group.setdefault(g.gid, (g, []))[1].append((s, buf.clone()))
                if sum(t.numel() for _, t in by_group[g.gid][1]) > (1 << 26):
                    self._write_home(*by_group.pop(g.gid))
            for which in OPTIM_STATES:
                reader.read(f"optim.{s.name}.{which}", out=buf)
                self.store.write_state(key, which, buf, start=s.offset)
        for g, items in by_group.values():
            self._write_home(g, items)
        frozen = {}
        for g, s in self._frozen_slots():  # after the masters: a group may hold both kinds
            t = reader.read(s.name).reshape(-1).to(g.dtype)
            frozen.setdefault(g.gid, (g, []))[1].append((s, t))
        for g, items in frozen.values():
            self._write_home(g, items)
        with torch.no_grad():
            for name, mod, bn, b in self._buffers():
                b.copy_(reader.read(name).to(b.dtype))

    def _write_home(self, g, items):
        """Refresh low-precision compute values of ``g``'s slots at its home."""
        if g.home == "nvme":
            flat = self._home_read(g)
            for s, t in items:
                flat[s.offset:s.offset + s.numel].copy_(t)
            self.e.swap.write(g.extent, flat).wait()
        else:
            flat = g.host_buf if g.home == "cpu" else g.device_buf
            for s, t in items:
                flat[s.offset:s.offset + s.numel].copy_(t)

    def load_checkpoint_meta(self, meta):
        e, opt = self.e, self.opt
        try:
            opt.step_count = int(meta["step"])
            opt.boundaries = int(meta.get("boundaries", meta["step"]))
            e.micro_steps = int(meta.get("micro_step", opt.boundaries * e.gas))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint meta lacks valid step counters: {err}") from None
        if meta.get("loss_scaler"):
            opt.scaler.load_state_dict(meta["loss_scaler"])
        if opt.torch_sched is not None and meta.get("torch_scheduler") is not None:
            opt.torch_sched.load_state_dict(meta["torch_scheduler"])
            lrs = opt.torch_sched.get_last_lr()
            for pg, lr in zip(opt.sched_target.param_groups, lrs):
                pg["lr"] = lr
        if meta.get("rng") is not None:
            rng_state_from_json(meta["rng"])


def save_engine_checkpoint(engine, directory, tag=None, **kw):
    """Checkpoint writes show on the engine's timeline ("nvme_write" lane, "ckpt:<name>");
    they are not added to its link accounting (that counts swap traffic per step)."""
    from .api import save_checkpoint
    kw.setdefault("timeline", getattr(engine, "timeline", None))
    return save_checkpoint(EngineCheckpoint(engine), directory, tag, **kw)


def load_engine_checkpoint(engine, directory, tag=None, **kw):
    from .api import load_checkpoint
    return load_checkpoint(EngineCheckpoint(engine), directory, tag, **kw)
