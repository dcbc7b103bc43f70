"""``infinity.GatheredParameters(params, modifier_rank=None)``: DeepSpeed's context manager for
touching parameters outside forward, for models built under :class:`infinity.Init`.

Inside the block every listed parameter that lives in an Init home (NVMe or host, at world
size > 1 this rank's 1/W chunk) holds its full real values in ``param.data``.  On exit:

* ``modifier_rank=None``: the values are only read; whatever was written is discarded and
  the placeholders come back (DeepSpeed's semantics);
* ``modifier_rank=r``: rank ``r``'s values (broadcast to every rank at world size > 1) are
  stored back into the Init home.  A parameter whose ``.data`` was replaced by a tensor of
  another shape (``resize_token_embeddings`` does ``weight.data = new``) is re-homed with
  the new shape.

Typical use: resize the vocabulary and initialise new tokens of a model built under
``Init`` before it is given to ``infinity.initialize`` / ``InfinityTrainer``::

    with infinity.Init(cfg):
        model = AutoModelForCausalLM.from_config(config)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    with infinity.GatheredParameters([emb.weight, head.weight], modifier_rank=0):
        model.resize_token_embeddings(len(tokenizer))

Entering and leaving are collective at world size > 1 (every rank lists the same parameters
in the same order).  Parameters that are neither Init-managed nor held by an engine are
left alone (the block is then a plain ``with``).

Parameters held by an engine (after ``initialize`` / ``InfinityTrainer.train`` started, outside
forward/backward; released to placeholders or resident with ``offload.params: none``) are
gathered too: inside the block they hold their current values (the fp32
master in bf16/fp16 training, as ``engine.state_dict()``), and get the engine's placeholder back
on exit.  With ``modifier_rank=r`` rank ``r``'s values (broadcast at world size > 1) are stored
into the engine as ``engine.load_checkpoint`` stores parameters: the fp32 master of a trainable
parameter (the optimizer steps from the new value), the compute-dtype copy at its home (NVMe,
host or device; at ZeRO-3 each rank its shard), a frozen parameter's home.  **The Adam moments
are kept** (``exp_avg``/``exp_avg_sq`` and the step count are untouched), exactly as assigning
``p.data`` under ``torch.optim.AdamW`` keeps them; zero them yourself by loading a checkpoint if
the new values should start fresh.  (DeepSpeed writes only the compute-dtype partition, so a
bf16/fp16 engine's fp32 master overwrites the edit at the next step; infinity writes both.)  The
shape of an engine-held parameter is fixed at ``initialize``: a value of another shape
(``resize_token_embeddings``) is refused with nothing stored - resize under ``Init``, before
``initialize``.  Called between steps; inside an accumulation window whose optimizer steps
started during backward, the window is dropped first (one warning), as ``state_dict()`` does.
"""
from __future__ import annotations

import torch

from infinity.memory.record import placeholder
from infinity.zero.init import record_of

__all__ = ["GatheredParameters"]


def _is_released(p: torch.Tensor) -> bool:
    """``p.data`` is an engine placeholder (one element seen through zero strides)."""
    d = p.data
    return d.numel() > 1 and all(s == 0 for s in d.stride())


class GatheredParameters:
    """See the module doc.  ``params``: a parameter or an iterable of them (``None``
    entries skipped); ``fwd_module`` is accepted for DeepSpeed compatibility and unused;
    ``enabled=False`` makes the block a no-op."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        seen, self.params = set(), []
        for p in params or ():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if modifier_rank is not None and (isinstance(modifier_rank, bool)
                                          or not isinstance(modifier_rank, int)
                                          or modifier_rank < 0):
            raise ValueError(f"GatheredParameters: modifier_rank must be None or a rank >= 0, "
                             f"got {modifier_rank!r}")
        self.modifier_rank = modifier_rank
        self.enabled = bool(enabled)
        self._held: list = []
        self._engine_held: list = []     # (param, the engine's placeholder it had)

    def __enter__(self):
        if not self.enabled:
            return self
        held, engine_held = [], []
        for p in self.params:
            rec = record_of(p)
            if rec is None:
                eng = _live_holder(p)     # released to a placeholder, or resident (offload none)
                if eng is not None or _is_released(p):
                    engine_held.append((p, eng or self._holder(p)))
                continue
            held.append((p, rec))
        if self.modifier_rank is not None:
            for _p, eng in engine_held:
                ws = _engine_world(eng)
                if self.modifier_rank >= ws:
                    raise ValueError(f"GatheredParameters: modifier_rank={self.modifier_rank} but "
                                     f"the engine holding the parameters runs {ws} rank(s)")
        try:
            for p, rec in held:
                p.data = rec.store.get(rec)          # collective at world size > 1
            for p, eng in engine_held:
                self._engine_held.append((p, p.data))      # the engine's placeholder
                p.data = eng.read_held(p).to(p.device, p.dtype)   # collective at world size > 1
        except BaseException:
            for p, rec in held:
                p.data = placeholder(rec.dtype, rec.shape)
            self._restore_engine_held()
            raise
        self._held = held
        return self

    @staticmethod
    def _holder(p):
        from infinity.memory.record import holder_of
        eng = holder_of(p)
        if eng is None:
            raise RuntimeError(
                f"GatheredParameters: a parameter of shape {tuple(p.shape)} was released by an "
                f"infinity engine that is closed (or not found): its values are gone with it; "
                f"read weights before engine.close() (engine.state_dict()[name])")
        return eng

    def _restore_engine_held(self) -> None:
        held, self._engine_held = self._engine_held, []
        for p, ph in held:
            p.data = ph

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        held, self._held = self._held, []
        store_back = self.modifier_rank is not None and exc_type is None
        try:
            if store_back:
                self._store_engine_held()
        finally:
            self._restore_engine_held()
        try:
            for p, rec in held:
                if store_back:
                    value = self._from_modifier(p.data.detach(), rec.store.world_size)
                    _rehome_if_reshaped(rec, value)
                    rec.store.put(rec, value.to(rec.dtype).contiguous())
        finally:
            for p, rec in held:
                p.data = placeholder(rec.dtype, rec.shape)
        return False

    def _store_engine_held(self) -> None:
        """Rank ``modifier_rank``'s values of the engine-held parameters into their
        engines (one ``write_held`` per engine, after every broadcast)."""
        by_engine: dict[int, tuple] = {}
        for p, _ph in self._engine_held:
            eng = self._holder(p)
            value = self._from_modifier(p.data.detach(), _engine_world(eng))
            by_engine.setdefault(id(eng), (eng, []))[1].append((p, value))
        for eng, values in by_engine.values():
            eng.write_held(values)

    def _from_modifier(self, value: torch.Tensor, world_size: int) -> torch.Tensor:
        if world_size == 1:
            return value
        import torch.distributed as dist
        meta = [(tuple(value.shape), value.dtype)]
        dist.broadcast_object_list(meta, src=self.modifier_rank)
        shape, dtype = meta[0]
        if dist.get_rank() != self.modifier_rank:
            value = torch.empty(shape, dtype=dtype)
        else:
            value = value.contiguous()
        dist.broadcast(value, src=self.modifier_rank)
        return value


def _live_holder(p):
    from infinity.memory.record import holder_of
    return holder_of(p)


def _engine_world(eng) -> int:
    z = getattr(eng, "zero", None)
    return 1 if z is None else int(z.world_size)


def _rehome_if_reshaped(rec, value: torch.Tensor) -> None:
    """``value`` has another shape or dtype than ``rec`` (e.g. a resized embedding): free the
    old home and describe the new one (``put`` then allocates it)."""
    if tuple(value.shape) == tuple(rec.shape) and value.dtype == rec.dtype:
        return
    store = rec.store
    if rec.extent is not None and store.swap is not None and not store.swap.closed:
        store.swap.free(rec.extent)
    rec.extent = None
    rec.host = None
    rec.shape = value.shape
    rec.dtype = value.dtype
    rec.numel = value.numel()
