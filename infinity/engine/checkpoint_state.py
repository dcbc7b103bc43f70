"""The :class:`Checkpointable` protocol for :class:`infinity.engine.Engine`.

Kept in the checkpoint package so the engine only needs two delegating methods
(``engine.save_checkpoint`` / ``engine.load_checkpoint``). What is saved:

- every trainable parameter's fp32 master under its model name (read tile-wise
  from the optimizer state store, wherever it lives: device, host or NVMe),
- ``optim.<name>.exp_avg`` / ``optim.<name>.exp_avg_sq`` in the store's moment dtype
  (``optimizer.state_dtype``: fp32 or bf16; the meta records it as
  ``optimizer_state_dtype``; a checkpoint loads into either dtype, converted with one
  log line),
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

World size > 1 (ZeRO, ``engine.zero``): every rank owns the element range
``[lo, hi)`` of each padded flat group (:mod:`infinity.zero.partition`). A rank
writes the parts of masters and Adam states that fall in its range, each as a flat
:class:`~infinity.checkpoint.writer.Piece` of the parameter's full shape (the
padding is never written; a shard may cut a parameter or hold none of it). Frozen
parameters are written by rank 0 at stages 1/2 (complete on every rank) and by
their owners at stage 3 (each rank homes only its shard); buffers by rank 0. The
manifest therefore holds whole, unpadded model tensors split in pieces, which
:meth:`CheckpointReader.read_slice` reads at any world size. Loading: every rank
reads exactly its own ranges (whoever wrote them) into its shard of the store; at
stages 1/2 every rank also rebuilds its full compute-dtype parameters, at stage 3
its home shard. The meta (rank 0's) also holds every rank's RNG state
(``rng_ranks``). :func:`load_engine_checkpoint` is collective: all ranks verify (each
hashing its share of the files), then agree (an all-reduce) before any changes state.
"""
import dataclasses
import json
import logging

import torch

from infinity.checkpoint.errors import CheckpointError
from infinity.checkpoint.reader import CheckpointReader
from infinity.checkpoint.rng import parse_rng_state, rng_state_to_json
from infinity.checkpoint.writer import Piece
from infinity.engine.checkpoint_checks import (OPTIM_STATES, check_engine_checkpoint, check_meta,
                                               saved_accumulation, value_checks)

log = logging.getLogger("infinity.checkpoint")

_STATE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _jsonable(x):
    try:
        return json.loads(json.dumps(x))
    except (TypeError, ValueError):
        return None


class EngineCheckpoint:
    """Adapter: ``save_checkpoint(EngineCheckpoint(engine), dir)``."""

    def __init__(self, engine):
        self.e = engine
        self.opt = engine.opt
        self.store = engine.opt.store
        self.groups = list(engine.mm.groups)
        z = engine.zero
        self.zero = z if (z is not None and z.world_size > 1) else None
        self.rank = self.zero.rank if self.zero else 0
        self.world = self.zero.world_size if self.zero else 1
        # stage 3: each rank homes only its shard of every group's compute-dtype values
        self.sharded_home = self.zero is not None and self.zero.stage == 3
        # stages 1, 2: full compute-dtype params on every rank, optimizer state sharded
        self.replicated = self.zero is not None and self.zero.stage < 3

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

    def _base_refs(self):
        """Note [Base by reference] (infinity/memory/sources.py): ``{slot name: (path,
        key)}`` of the frozen slots a checkpoint names by their pretrained file instead of
        storing them: every slot of a quantized frozen group whose every slot was read
        from a safetensors file of the slot's shape (the same on every rank: every rank
        loads the same files)."""
        from infinity.memory.sources import source_of
        out = {}
        for g in self.groups:
            if g.quant is None or any(s.trainable for s in g.slots):
                continue
            srcs = [source_of(s.param) for s in g.slots]
            if all(src is not None for src in srcs):
                out.update({s.name: src for s, src in zip(g.slots, srcs)})
        return out

    def _base_entry(self, refs):
        from infinity.checkpoint.base_source import base_entry
        fw = self.e.cfg.offload.frozen_weights
        quantized = {g.slots[ps.index].name: ps.quantized for g in self.groups
                     if g.quant is not None for ps in g.quant.slots}
        shapes = {s.name: tuple(s.shape) for _, s in self._frozen_slots()}
        return base_entry([(n, src, shapes[n], quantized[n]) for n, src in refs.items()],
                          {"dtype": fw.dtype, "group_size": fw.group_size,
                           "double_quant": fw.double_quant}, self.e.cfg.precision)

    def _buffers(self):
        for mod_name, mod in self.e.module.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for bn, b in mod._buffers.items():
                if b is not None and bn not in skip:
                    yield (f"{mod_name}.{bn}" if mod_name else bn), mod, bn, b

    def _shard(self, g):
        """This rank's element range of group ``g`` (the whole group at world size 1)."""
        if self.zero is None:
            return 0, g.padded_numel
        return self.zero.part.range(g.padded_numel)

    def _own(self, g, s):
        """Group-relative range ``(a, b)`` of slot ``s`` inside this rank's shard, or None.
        An empty parameter belongs to rank 0 (every tensor must have a writer)."""
        if s.numel == 0:
            return (s.offset, s.offset) if self.rank == 0 else None
        lo, hi = self._shard(g)
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        return (a, b) if a < b else None

    def _item(self, name, s, flat, a):
        """What the writer gets: the whole tensor at world size 1, else a flat piece."""
        if self.world == 1:
            return name, flat.view(s.shape)
        return name, flat, Piece(s.shape, a - s.offset)

    def _home_range(self, g):
        """Group elements held at ``g``'s home: its shard at stage 3, else all of it."""
        return self._shard(g) if self.sharded_home else (0, g.padded_numel)

    def _home_read(self, g):
        """The compute-dtype values of :meth:`_home_range` (flat), from wherever they are
        current."""
        from infinity.memory.record import Location
        if g.quant is not None and self.sharded_home:   # Note [Quantized shards]: collective
            from infinity.zero.quantized_shards import gathered_values
            lo, hi = self._home_range(g)
            return gathered_values(g, self.zero.comm, self.e.swap)[lo:hi]
        if g.quant is not None:      # stored quantized: dequantized values
            from infinity.memory.frozen_quant import home_values
            return home_values(g, self.e.swap)
        if g.host_buf is not None:   # host home, or the host mirror of a resident CUDA group
            return g.host_buf
        if not self.sharded_home and g.state is Location.DEVICE and g.device_buf is not None:
            return g.device_buf
        if g.home == "nvme":
            from infinity.io import aligned_empty
            lo, hi = self._home_range(g)
            buf = aligned_empty(hi - lo, g.dtype)
            self.e.swap.read(g.extent, buf).wait()
            return buf
        return g.device_buf

    def _release_cached(self):
        """Drop cached device copies of paged groups (they would be stale after a load)."""
        from infinity.memory.record import Location
        for g in self.groups:
            if self.e.mm.paged(g) and g.state not in (Location.NVME, Location.HOST,
                                                      Location.CACHED):
                self.e.mm.release(g)
        self.e.mm.drop_cache()          # Note [Cache write-through]: homes about to be rewritten

    # -- Checkpointable: save ------------------------------------------------------
    def checkpoint_tensors(self):
        self._check_idle("save_checkpoint")
        own = [(g, key, s, r) for g, key, s in self._trainable_slots()
               if (r := self._own(g, s)) is not None]
        most = max([b - a for *_, (a, b) in own] + [1])
        stage = torch.empty(most, dtype=torch.float32)
        # the moments are saved as the store keeps them (bf16 states: half the bytes)
        sstage = stage if self.store.state_dtype == torch.float32 else \
            torch.empty(most, dtype=self.store.state_dtype)
        for g, key, s, (a, b) in own:
            lo = self._shard(g)[0]
            buf = stage[: b - a]
            self.store.read_master(key, buf, start=a - lo)
            yield self._item(s.name, s, buf, a)
            for which in OPTIM_STATES:
                sbuf = sstage[: b - a]
                self.store.read_state(key, which, sbuf, start=a - lo)
                yield self._item(f"optim.{s.name}.{which}", s, sbuf, a)
        # frozen params: complete on every rank except at stage 3, where each owner
        # writes its shard; at stages 1/2 (and world size 1) rank 0 writes them whole;
        # a quantized base read from pretrained files is named in the meta instead
        last, flat = None, None
        refs = self._base_refs()
        for g, s in self._frozen_slots():
            if s.name in refs:
                continue
            if self.sharded_home and g.quant is not None and g is not last:
                flat, last = self._home_read(g), g    # collective: on every rank
            if self.sharded_home:
                r = self._own(g, s)
                if r is None:
                    continue
                (a, b), lo = r, self._home_range(g)[0]
            elif self.rank == 0:
                a, b, lo = s.offset, s.offset + s.numel, 0
            else:
                continue
            if g is not last:
                flat, last = self._home_read(g), g
            yield self._item(s.name, s, flat[a - lo:b - lo], a)
        if self.rank == 0:
            for name, _, _, b in self._buffers():
                yield name, b.cpu()

    def _rng_ranks(self, mine):
        """Every rank's RNG state (collective; called on all ranks by save_checkpoint)."""
        if self.world == 1:
            return None
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

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
        rng = rng_state_to_json()
        from infinity.checkpoint.export import model_meta
        try:       # a Hugging Face model's config: `infinity export` writes config.json from it
            described = model_meta(e.module)
        except Exception as err:  # noqa: BLE001 - a model config that cannot be described
            log.warning("checkpoint: the model's config is not recorded (%s); export writes "
                        "weights only", err)
            described = {}
        return {
            **described,
            "step": int(opt.step_count),
            "boundaries": int(opt.boundaries),
            "micro_step": int(e.micro_steps),
            "loss_scaler": _jsonable(opt.scaler.state_dict()),
            "torch_scheduler": sched,
            "rng": rng,
            "rng_ranks": self._rng_ranks(rng),
            "config": cfg,
            "precision": e.cfg.precision,
            "optimizer_state_dtype": _STATE_NAMES[self.store.state_dtype],
            "world_size": self.world,
            "zero_stage": self.zero.stage if self.zero else None,
            **({"frozen_base": self._base_entry(refs)} if (refs := self._base_refs()) else {}),
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

    def _trainable_names(self):
        return [s.name for _, _, s in self._trainable_slots()]

    def check_checkpoint(self, reader):
        """Meta and manifest consistency (:mod:`infinity.engine.checkpoint_checks`): cheap,
        before a byte is hashed."""
        check_engine_checkpoint(reader, self._trainable_names(), gas=self.e.gas)

    def checkpoint_value_checks(self):
        """Masters and Adam moments checked while ``verify()`` hashes them (finite;
        ``exp_avg_sq`` >= 0)."""
        return value_checks(self._trainable_names())

    def load_checkpoint_tensors(self, reader):
        """Each rank reads its own ranges of every tensor, whatever world size wrote them."""
        self._check_idle("load_checkpoint")
        self.check_checkpoint(reader)   # before anything is written into the engine
        if reader.base is not None:     # Note [Base by reference]: its files, unchanged
            reader.base.verify()
        self._release_cached()
        self.e.mm.wait_host_reads()     # no copy still reads a home about to be written
        own = [(g, key, s, r) for g, key, s in self._trainable_slots()
               if (r := self._own(g, s)) is not None]
        most = max([b - a for *_, (a, b) in own] + [1])
        stage = torch.empty(most, dtype=torch.float32)
        # the moments are read in the dtype they were saved in and converted by the store
        saved_sdt = self._saved_state_dtype(reader, own)
        sstage = stage if saved_sdt == torch.float32 else torch.empty(most, dtype=saved_sdt)
        # the compute copy at the home is separate from the master unless fp32; at
        # stages 1/2 it is the full replicated parameter buffer, rebuilt below
        home_copy = self.e.cfg.precision != "fp32" and not self.replicated
        by_group = {}
        for g, key, s, (a, b) in own:
            lo = self._shard(g)[0]
            buf = stage[: b - a]
            reader.read_slice(s.name, a - s.offset, b - a, out=buf)
            self.store.write_master(key, buf, start=a - lo)
            if home_copy:
                by_group.setdefault(g.gid, (g, []))[1].append((a, buf.clone()))
                if sum(t.numel() for _, t in by_group[g.gid][1]) > (1 << 26):
                    self._write_home(*by_group.pop(g.gid))
            for which in OPTIM_STATES:
                sbuf = sstage[: b - a]
                reader.read_slice(f"optim.{s.name}.{which}", a - s.offset, b - a, out=sbuf)
                self.store.write_state(key, which, sbuf, start=a - lo)
        for g, items in by_group.values():
            self._write_home(g, items)
        if self.replicated:  # every rank holds every parameter: rebuild them all
            for g, _, s in self._trainable_slots():
                t = reader.read(s.name).reshape(-1).to(g.dtype)
                self._write_home(g, [(s.offset, t)])
        frozen = {}
        for g, s in self._frozen_slots():  # after the masters: a group may hold both kinds
            if self.sharded_home:
                r = self._own(g, s)
                if r is None:
                    continue
                a, b = r
            else:
                a, b = s.offset, s.offset + s.numel
            # (a base kept by reference: the file's values, quantized again below)
            t = reader.read_slice(s.name, a - s.offset, b - a, base_as_trained=False)
            frozen.setdefault(g.gid, (g, []))[1].append((a, t.to(g.dtype)))
        if self.sharded_home:        # Note [Quantized shards]: collective, every rank in order
            for g in {id(g): g for g, _ in self._frozen_slots()}.values():
                if g.quant is not None:
                    self._write_home(g, frozen.pop(g.gid, (g, []))[1])
        for g, items in frozen.values():
            self._write_home(g, items)
        with torch.no_grad():
            for name, mod, bn, b in self._buffers():
                b.copy_(reader.read(name).to(b.dtype))
        self.e.mm.refresh_resident()    # separate device: resident copies from host mirrors

    def write_param_values(self, values):
        """Store new values of parameters into the engine (``infinity.GatheredParameters``
        with ``modifier_rank``): ``values`` maps slot name -> the full tensor (the same on
        every rank; its shape the parameter's). Each rank writes the ranges it owns exactly
        as :meth:`load_checkpoint_tensors` does: the fp32 master of a trainable parameter
        (and the separate compute copy at its home in bf16/fp16; at stages 1/2 the full
        replicated parameter), a frozen parameter's home. The Adam moments are left as they
        are (like assigning ``p.data`` under ``torch.optim.AdamW``)."""
        self._check_idle("GatheredParameters")
        self._release_cached()
        self.e.mm.wait_host_reads()     # no copy still reads a home about to be written
        # a frozen weight stored quantized cannot take new values: refused before anything
        # is written when one changed; given back unchanged (every gathered parameter is),
        # it is skipped
        values = dict(values)
        for g, s in self._frozen_slots():
            v = values.get(s.name)
            if v is None or g.quant is None:
                continue
            if not torch.equal(v.reshape(-1).to(g.dtype), self._quantized_value(g, s)):
                raise ValueError(
                    f"GatheredParameters: {s.name} is a frozen weight stored quantized "
                    f"(offload.frozen_weights) and was changed; it cannot be modified in "
                    f"place -- change the base before initialize, or set "
                    f"offload.frozen_weights.dtype to null")
            del values[s.name]
        home_copy = self.e.cfg.precision != "fp32" and not self.replicated
        homes = {}
        for g, key, s in self._trainable_slots():
            v = values.get(s.name)
            if v is None:
                continue
            flat = v.reshape(-1)
            r = self._own(g, s)
            if r is not None:
                a, b = r
                lo = self._shard(g)[0]
                piece = flat[a - s.offset:b - s.offset].to(torch.float32).contiguous()
                self.store.write_master(key, piece, start=a - lo)
                if home_copy:
                    homes.setdefault(g.gid, (g, []))[1].append((a, piece.to(g.dtype)))
            if self.replicated:
                homes.setdefault(g.gid, (g, []))[1].append((s.offset, flat.to(g.dtype)))
        for g, s in self._frozen_slots():
            v = values.get(s.name)
            if v is None:
                continue
            flat = v.reshape(-1).to(g.dtype)
            if self.sharded_home:
                r = self._own(g, s)
                if r is None:
                    continue
                a, b = r
                homes.setdefault(g.gid, (g, []))[1].append((a, flat[a - s.offset:b - s.offset]))
            else:
                homes.setdefault(g.gid, (g, []))[1].append((s.offset, flat))
        for g, items in homes.values():
            self._write_home(g, items)
        self.e.mm.refresh_resident()    # separate device: resident copies from host mirrors

    def _quantized_value(self, g, s):
        """Slot ``s`` of quantized group ``g`` as training sees it (dequantized, flat, the
        working dtype); at stage 3 gathered from every rank (collective)."""
        if self.sharded_home:
            from infinity.zero.quantized_shards import gathered_values
            return gathered_values(g, self.zero.comm, self.e.swap)[s.offset:s.offset + s.numel]
        from infinity.memory.frozen_quant import slot_value
        return slot_value(g, self.e.swap, s)

    def _saved_state_dtype(self, reader, own):
        """The dtype the checkpoint's Adam moments were saved in (that of its first
        moment tensor; checkpoints before ``optimizer.state_dtype`` hold fp32).  A dtype
        other than this engine's ``optimizer.state_dtype`` is converted on load: one INFO
        line says so (fp32 -> bf16 rounds each moment to bf16; bf16 -> fp32 is exact)."""
        if not own:
            return self.store.state_dtype
        s = own[0][2]
        saved = reader.info(f"optim.{s.name}.exp_avg")[1]
        if saved not in _STATE_NAMES:
            raise CheckpointError(f"checkpoint {reader.path}: the Adam moments are {saved}; this "
                                  f"engine reads fp32 or bf16 moments: the checkpoint was not "
                                  f"written by infinity or is damaged")
        if saved != self.store.state_dtype:
            log.info("checkpoint %s: Adam moments saved in %s, converted to %s "
                     "(optimizer.state_dtype)", reader.path, _STATE_NAMES[saved],
                     _STATE_NAMES[self.store.state_dtype])
        return saved

    def _write_home(self, g, items):
        """Write compute values ``(group offset, flat tensor)`` into ``g``'s home (its
        shard of it at stage 3)."""
        lo = self._home_range(g)[0]
        if g.quant is not None and self.sharded_home:   # Note [Quantized shards]: collective
            from infinity.zero.quantized_shards import write_gathered_values
            hi = self._home_range(g)[1]
            mine = torch.zeros(hi - lo, dtype=g.dtype)
            for a, t in items:
                mine[a - lo:a - lo + t.numel()].copy_(t)
            write_gathered_values(g, self.zero.comm, self.e.swap, lo, mine)
            return
        if g.quant is not None:      # stored quantized: quantized again (frozen_quant)
            from infinity.memory.frozen_quant import home_values, write_home_values
            current = home_values(g, self.e.swap)
            flat = current.clone()
            for a, t in items:
                flat[a:a + t.numel()].copy_(t)
            write_home_values(g, self.e.swap, flat, current)
            return
        if g.home == "nvme":
            flat = self._home_read(g)
            for a, t in items:
                flat[a - lo:a - lo + t.numel()].copy_(t)
            self.e.swap.write(g.extent, flat).wait()
        else:
            flat = g.host_buf if g.host_buf is not None else g.device_buf
            for a, t in items:
                flat[a - lo:a - lo + t.numel()].copy_(t)

    def load_checkpoint_meta(self, meta):
        e, opt = self.e, self.opt
        check_meta(meta, "meta", gas=e.gas)   # validated before the tensors too; cheap
        rng = meta.get("rng")
        ranks = meta.get("rng_ranks")
        if ranks and self.rank < len(ranks):  # this rank's own stream when it was saved
            rng = ranks[self.rank]
        apply_rng = parse_rng_state(rng) if rng is not None else None
        try:
            opt.step_count = int(meta["step"])
            opt.boundaries = int(meta.get("boundaries", meta["step"]))
            # the position inside the accumulation window (check_meta: < the saved window)
            saved = saved_accumulation(meta, "meta", e.gas)
            pos = int(meta.get("micro_step", opt.boundaries * saved)) - opt.boundaries * saved
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint meta lacks valid step counters: {err}") from None
        if pos and saved != e.gas:
            log.warning("checkpoint saved %d micro-batch(es) into a window of %d; this engine "
                        "accumulates %d: the window restarts at its boundary (the partial "
                        "window's gradients are never saved)", pos, saved, e.gas)
            pos = 0
        e.micro_steps = opt.boundaries * e.gas + pos
        if meta.get("loss_scaler"):
            opt.scaler.load_state_dict(meta["loss_scaler"])
        if opt.torch_sched is not None and meta.get("torch_scheduler") is not None:
            opt.torch_sched.load_state_dict(meta["torch_scheduler"])
            lrs = opt.torch_sched.get_last_lr()
            for pg, lr in zip(opt.sched_target.param_groups, lrs):
                pg["lr"] = lr
        if apply_rng is not None:
            apply_rng()


def save_engine_checkpoint(engine, directory, tag=None, **kw):
    """Checkpoint writes show on the engine's timeline ("nvme_write" lane, "ckpt:<name>");
    they are not added to its link accounting (that counts swap traffic per step).
    Collective at world size > 1: every rank calls it (see ``save_checkpoint``)."""
    from infinity.checkpoint.api import save_checkpoint
    kw.setdefault("timeline", engine.timeline)
    return save_checkpoint(EngineCheckpoint(engine), directory, tag, **kw)


def load_engine_checkpoint(engine, directory, tag=None, **kw):
    """Verify, then load. At world size > 1 every rank must call it: all ranks verify
    the checkpoint and agree before any changes state, so a damaged or incompatible
    checkpoint (or ranks resolving ``latest`` differently) fails every rank with the
    engine unchanged."""
    from infinity.checkpoint.api import load_checkpoint
    ec = EngineCheckpoint(engine)
    if ec.world == 1:
        return load_checkpoint(ec, directory, tag, **kw)
    return _load_collective(ec, directory, tag, **kw)


def _agree(ok, fingerprint=0):
    """All-reduce: (every rank ok, every rank has the same fingerprint)."""
    from infinity.checkpoint.api import dist_device
    import torch.distributed as dist
    t = torch.tensor([1 if ok else 0, fingerprint, -fingerprint], dtype=torch.int64,
                     device=dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    v = [int(x) for x in t.tolist()]
    return v[0] == 1, v[1] == -v[2]


def hash_share(files, rank, world):
    """The files whose SHA-256 rank ``rank`` checks in a collective load: largest first
    to the least-loaded rank (the same answer on every rank), so the ranks hash the
    checkpoint once between them instead of once each."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += files[name]["size"]
        if r == rank:
            mine.append(name)
    return mine


def _load_collective(ec, directory, tag=None, *, strict=True):
    from infinity.checkpoint.api import wait_pending
    wait_pending(raise_errors=False)
    r, err, fp = None, None, 0
    try:
        r = CheckpointReader(directory, tag)
        fp = int(r.manifest["checksum"][:15], 16)   # which checkpoint this rank resolved
        ec.check_checkpoint(r)        # meta and manifest first: cheap
        r.verify(hash_files=hash_share(r.manifest["files"], ec.rank, ec.world),
                 value_checks=ec.checkpoint_value_checks())
        r.check_compatible(ec.checkpoint_expected(), strict=strict)
        ec._check_idle("load_checkpoint")
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        err = e
    try:
        ok, same = _agree(err is None, fp)
        if err is not None:
            raise err
        if not ok:
            raise CheckpointError(f"loading checkpoint {r.path}: verification failed on another "
                                  f"rank (see its error); nothing was loaded on any rank")
        if not same:
            raise CheckpointError(f"loading checkpoint from {directory}: the ranks resolved "
                                  f"different checkpoints ('latest' changed during the load?); "
                                  f"nothing was loaded, pass tag= explicitly")
        try:
            ec.load_checkpoint_tensors(r)
        except Exception as e:  # noqa: BLE001
            err = e
        ok, _ = _agree(err is None)
        if err is not None:
            raise err
        if not ok:
            raise CheckpointError(f"loading checkpoint {r.path} failed on another rank after "
                                  f"verification; the engine's parameters are partly loaded: "
                                  f"load a checkpoint again before training")
        ec.load_checkpoint_meta(r.meta)
        return r.meta
    finally:
        if r is not None:
            r.close()
