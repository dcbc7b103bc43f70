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
in the same order).  Parameters that are neither Init-managed nor released by an engine are
left alone (the block is then a plain ``with``).  Parameters already adopted by an engine
cannot be edited in place: change them before ``initialize`` (their values can be read with
``engine.state_dict()[name]``); this is refused with an error rather than silently reading
the placeholder.
"""
from __future__ import annotations

import torch

from infinity.memory.record import placeholder
from infinity.zero.init import _record

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

    def __enter__(self):
        if not self.enabled:
            return self
        held = []
        for p in self.params:
            rec = _record(p)
            if rec is None:
                if _is_released(p):
                    raise RuntimeError(
                        f"GatheredParameters: a parameter of shape {tuple(p.shape)} is held by an "
                        f"infinity engine; edit parameters before infinity.initialize / "
                        f"InfinityTrainer.train (read them with engine.state_dict()[name])")
                continue
            held.append((p, rec))
        try:
            for p, rec in held:
                p.data = rec.store.get(rec)          # collective at world size > 1
        except BaseException:
            for p, rec in held:
                p.data = placeholder(rec.dtype, rec.shape)
            raise
        self._held = held
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        held, self._held = self._held, []
        store_back = self.modifier_rank is not None and exc_type is None
        try:
            for p, rec in held:
                if store_back:
                    value = self._from_modifier(p.data.detach(), rec)
                    _rehome_if_reshaped(rec, value)
                    rec.store.put(rec, value.to(rec.dtype).contiguous())
        finally:
            for p, rec in held:
                p.data = placeholder(rec.dtype, rec.shape)
        return False

    def _from_modifier(self, value: torch.Tensor, rec) -> torch.Tensor:
        if rec.store.world_size == 1:
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
