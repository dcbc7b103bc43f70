"""Memory-centric tiling: a layer too large for its share of the device budget is never
fetched whole.

Which modules: an ``nn.Linear``, ``nn.Embedding`` or GPT-2's ``Conv1D``
(``transformers.pytorch_utils.Conv1D``: weight stored ``(in, out)``, ``y = x @ W + b``; told
by its class name and module, transformers is not imported) - their own ``forward`` - whose parameter
groups are paged (home ``cpu`` or ``nvme``), hold only that module's weight (and bias), are
used by no module that is not tiled too (a tied embedding / LM head pair is tiled as a
pair, with the same rows per tile), and one of which is larger than the *tiling limit*:
``tiling.max_group_gb`` when set, else ``offload.device_memory_gb / (prefetch.depth + 2)``
(the share of one group in the fetch window; no device budget, no limit).  A Linear is
split by output rows, an Embedding by rows (a lookup reads only the tiles its indices
touch), a Conv1D by rows of its stored weight (input features, contiguous in storage:
``y = sum_t x[..., r0:r1] @ W[r0:r1] + b``, the bias read whole once), into tiles of at
most the limit's bytes.

How: the module's ``forward`` computes through :class:`_TiledLinearFn`, which reads each
tile of the weight and bias from where the group's values are (Note [Tiles] in
:mod:`infinity.memory.manager`: in place from a host home on a zero-copy tier, otherwise a
device-tier lease the size of one tile), computes that block of output columns, and gives
the tile back before reading the next (Note [Tile prefetch]: the read of the next tile is
started before the current one computes - an NVMe read in flight on a zero-copy tier, across
ranks the gather worker's job - so at most two tiles are leased at once).  Backward reads
the tiles again (prefetched alike), adds each tile's contribution to the input gradient and hands the tile's weight and bias gradient rows to
the group's gradient buffer as they are made (``accumulate_rows``; where gradients only
leave as whole slots - the D2H route, the NVMe gradient home - the rows are assembled
into one slot-sized tensor first).  The parameters keep their names and objects (their
``.data`` stays the released placeholder): ``state_dict``, checkpoints and the optimizer
see the same groups as without tiling.  The hooks never fetch a tiled module's groups
(:meth:`Tiling.install` takes them out of the module map before the hooks are installed).

The overlapped step (:mod:`infinity.engine.overlap`) hears that a slot's gradient is final
(``after``) only once every use recorded in forward has run its backward (a module called
twice, a tied pair): :class:`Tiling` counts the uses per group.

Across ranks (ZeRO stage 3, the only stage with paged parameters): ``read_range`` of the
partitioned manager gathers each tile from the owners of its pieces, ``accumulate_rows`` of
the partitioned optimizer reduces the rows to them (Note [Tiles across ranks], Note [Tile
gradients across ranks]), ``group_final`` tells it when a group's uses are done, and an
Embedding reads the union over ranks of the tiles the lookups touch (``union``), so every
rank issues the same collectives in the same order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infinity.memory.record import GroupRecord, ParamSlot
from infinity.runtime.groups import Grouping

__all__ = ["TileSpec", "Tiling", "plan_tiles", "tiling_limit"]

# an NVMe tile read covers the 4 KiB-aligned byte range around the tile (Note [Tiles])
_IO_ALIGN = 4096


def tiling_limit(max_group_bytes: int | None, device_budget: int | None,
                 depth: int) -> int | None:
    """The group size above which a tileable module is tiled (None: no tiling)."""
    if max_group_bytes is not None:
        return int(max_group_bytes)
    if device_budget is None:
        return None
    return int(device_budget) // (int(depth) + 2)


def _conv1d_class(mod: nn.Module):
    """GPT-2's ``transformers.pytorch_utils.Conv1D`` among ``mod``'s classes, or None (by
    name and module: transformers is an optional dependency, not imported here)."""
    for c in type(mod).__mro__:
        if c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils":
            return c
    return None


def _is_conv1d(mod: nn.Module) -> bool:
    return _conv1d_class(mod) is not None


@dataclass
class TileSpec:
    """One tiled ``nn.Linear`` (tiles of ``rows`` output rows), ``nn.Embedding`` (tiles of
    ``rows`` rows) or ``Conv1D`` (tiles of ``rows`` rows of the stored ``(in, out)`` weight,
    i.e. input features).  ``out_features``/``in_features`` are the stored weight's rows
    and row length (for a Conv1D: its input and output features)."""
    module: nn.Module
    rows: int
    weight: tuple[GroupRecord, ParamSlot]
    bias: tuple[GroupRecord, ParamSlot] | None

    @property
    def out_features(self) -> int:
        return int(self.weight[1].shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight[1].shape[1])

    @property
    def conv1d(self) -> bool:
        return _is_conv1d(self.module)

    @property
    def groups(self) -> list[GroupRecord]:
        out = [self.weight[0]]
        if self.bias is not None and self.bias[0] is not out[0]:
            out.append(self.bias[0])
        return out

    def tiles(self):
        n = self.out_features
        for r0 in range(0, n, self.rows):
            yield r0, min(n, r0 + self.rows)

    def tile_bytes(self) -> int:
        """Device bytes one tile takes (weight and bias rows, each padded to the aligned
        range an NVMe read covers)."""
        isz = self.weight[0].dtype.itemsize
        if isinstance(self.module, nn.Embedding):     # the tile, and its gradient rows
            return 2 * (self.rows * self.in_features * isz + 2 * _IO_ALIGN)
        b = self.rows * self.in_features * isz + 2 * _IO_ALIGN
        q = self.weight[0].quant            # a quantized base: Note [Quantized tiles]
        if q is not None:
            b += q.tile_overhead_bytes(self.rows * self.in_features, isz)
        if self.bias is not None:                     # a Conv1D's bias: read whole
            b += (self.in_features if self.conv1d else self.rows) * isz + 2 * _IO_ALIGN
        return b


def _tileable(mod: nn.Module) -> bool:
    if isinstance(mod, nn.Linear):
        return type(mod).forward is nn.Linear.forward \
            and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2
    if isinstance(mod, nn.Embedding):
        # max_norm renormalises the weight in place; sparse / scale_grad_by_freq: not here
        return type(mod).forward is nn.Embedding.forward and mod.max_norm is None \
            and not mod.sparse and not mod.scale_grad_by_freq
    conv = _conv1d_class(mod)
    if conv is not None:
        w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
        return type(mod).forward is conv.forward and isinstance(w, torch.Tensor) \
            and w.dim() == 2 and (b is None or (b.dim() == 1 and b.shape[0] == w.shape[1]))
    return False


def _params(mod: nn.Module) -> list:
    return [p for p in (mod.weight, getattr(mod, "bias", None)) if p is not None]


def plan_tiles(grouping: Grouping, limit: int | None) -> dict[nn.Module, TileSpec]:
    """The modules to tile under ``limit`` (bytes), each with its tile rows."""
    if limit is None:
        return {}
    users: dict[int, list[nn.Module]] = {}
    for mod, groups in grouping.module_groups.items():
        for g in groups:
            users.setdefault(g.gid, []).append(mod)
    cand: dict[nn.Module, dict] = {}
    for mod, groups in grouping.module_groups.items():
        if not _tileable(mod) or not any(g.nbytes > limit for g in groups) \
                or any(g.home == "device" or g.sharded for g in groups):
            continue
        where = {id(s.param): (g, s) for g in groups for s in g.slots}
        params = _params(mod)
        if len(where) != len(params) or any(id(p) not in where for p in params):
            continue                      # a group holding anything else: not tiled
        cand[mod] = where
    # a group used by a module that is not tiled would be fetched whole anyway: its users
    # are all tiled, or none is
    changed = True
    while changed:
        changed = False
        for mod in list(cand):
            if any(u not in cand for g in grouping.module_groups[mod] for u in users[g.gid]):
                del cand[mod]
                changed = True
    out: dict[nn.Module, TileSpec] = {}
    for mod, where in cand.items():
        w = where[id(mod.weight)]
        isz = w[0].dtype.itemsize
        bias = getattr(mod, "bias", None)
        row = mod.weight.shape[1] * isz + (isz if bias is not None else 0)
        budget = limit - 4 * _IO_ALIGN
        if isinstance(mod, nn.Embedding):
            budget //= 2                  # the tile and its gradient rows
        elif _is_conv1d(mod):             # the whole bias beside the weight rows
            row = mod.weight.shape[1] * isz
            budget -= bias.numel() * isz if bias is not None else 0
        rows = max(1, min(mod.weight.shape[0], budget // row))
        out[mod] = TileSpec(mod, int(rows), w, where[id(bias)] if bias is not None else None)
    # a tied pair is tiled consistently: the same rows per tile for every user of a group
    by_group: dict[int, int] = {}
    for sp in out.values():
        gid = sp.weight[0].gid
        by_group[gid] = min(by_group.get(gid, sp.rows), sp.rows)
    for sp in out.values():
        sp.rows = by_group[sp.weight[0].gid]
    return out


def _tile_nbytes(w: torch.Tensor, b) -> int:
    """Bytes of a tile's weight rows and bias rows (None: no bias)."""
    return w.numel() * w.element_size() + (0 if b is None else b.numel() * b.element_size())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _TiledFn(torch.autograd.Function):
    """A tiled module's computation; ``params`` (the weight and bias placeholders) are
    inputs only so that autograd knows the output depends on trainable parameters: their
    gradients go to the groups by rows, never through autograd."""

    @staticmethod
    def forward(ctx, x, runner, *params):
        ctx.runner = runner
        ctx.save_for_backward(x)
        # (a backward that needs no input gradient reads no tile: nothing to keep for it)
        return runner.forward_tiles(x, need_gx=ctx.needs_input_grad[0])

    @staticmethod
    def backward(ctx, gy):
        x, = ctx.saved_tensors
        gx = ctx.runner.backward_tiles(x, gy, ctx.needs_input_grad[0])
        return (gx, None) + (None,) * (len(ctx.needs_input_grad) - 2)


class _Runner:
    """Computes one tiled module, tile by tile."""

    def __init__(self, spec: TileSpec, tiling: "Tiling"):
        self.spec = spec
        self.t = tiling

    def _tile(self, r0: int, r1: int):
        """Rows ``r0 .. r1`` of the weight and bias, read now: ``(w, b, leases)``."""
        return self._finish(self._start(r0, r1))

    def _done(self, leases) -> None:
        for lease in leases:
            self.t.mm.give_back_range(lease)

    # the next tile is read while the current one computes (Note [Tile prefetch])
    def _start(self, r0: int, r1: int, refs=None) -> list:
        """Start reading rows ``r0 .. r1`` of ``refs`` (default: the weight and bias)."""
        out = []
        try:
            for ref in ((self.spec.weight, self.spec.bias) if refs is None else refs):
                if ref is not None:
                    g, s = ref
                    per = int(s.shape[1]) if len(s.shape) == 2 else 1
                    p = self.t.mm.read_range_start(g, s.offset + r0 * per, s.offset + r1 * per)
                    out.append((p, (r1 - r0, per) if len(s.shape) == 2 else None))
        except BaseException:
            self._cancel(out)
            raise
        return out

    @staticmethod
    def _cancel(pending) -> None:
        for p, _ in pending:
            p.cancel()

    def _finish(self, pending):
        views, leases = [], []
        try:
            for i, (p, shape) in enumerate(pending):
                view, lease = p.result()
                leases.append(lease)
                views.append(view.view(*shape) if shape is not None else view)
        except BaseException:
            self._done(leases)
            self._cancel(pending[i + 1:])
            raise
        return views[0], (views[1] if len(views) > 1 else None), leases

    def _tiles(self, ranges, refs=None, kept=None, keep=None):
        """``(r0, r1, w, b)`` per row range, each tile given back when the loop moves on;
        the next tile's read is started before the current one is handed out.  ``kept``:
        tiles the recompute kept (Note [Recompute keeps its tiles]), used instead of a read;
        ``keep``: a dict the tiles are copied into for the backward that follows."""
        ranges = list(ranges)

        def start(i):
            if kept is not None and ranges[i] in kept:
                return None                   # kept: nothing to read
            return self._start(*ranges[i], refs)
        nxt = start(0) if ranges else None
        try:
            for i, (r0, r1) in enumerate(ranges):
                cur, nxt = nxt, None
                if cur is None:
                    w, b = kept.pop((r0, r1))
                    w, b, leases = self.t.kept_to_device(w, b)
                else:
                    w, b, leases = self._finish(cur)
                try:
                    if i + 1 < len(ranges):
                        nxt = start(i + 1)
                    if keep is not None:
                        self.t.keep(keep, (r0, r1), w, b)
                    yield r0, r1, w, b
                finally:
                    self._done(leases)
        finally:
            if nxt is not None:
                self._cancel(nxt)

    def _sinks(self):
        sp = self.spec
        refs = [r for r in (sp.weight, sp.bias) if r is not None and r[1].trainable]
        return [self.t.sink(r) for r in refs]

    # ------------------------------------------------------------------ Linear
    def forward_tiles(self, x: torch.Tensor, need_gx: bool = True) -> torch.Tensor:
        if isinstance(self.spec.module, nn.Embedding):
            return self._embed_forward(x)
        if self.spec.conv1d:
            return self._conv1d_forward(x, need_gx)
        outs = []
        # a recompute: kept for the backward that follows (Note [Recompute keeps its tiles])
        keep = self.t.keep_for(self) if need_gx else None
        with contextlib.closing(self._tiles(self.spec.tiles(), keep=keep)) as tiles:
            for _, _, w, b in tiles:
                outs.append(F.linear(x, w, b))
        self.t.acct.count("tiles_forward", len(outs))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def backward_tiles(self, x: torch.Tensor, gy: torch.Tensor, need_gx: bool):
        if isinstance(self.spec.module, nn.Embedding):
            self._embed_backward(x, gy)
            return None
        if self.spec.conv1d:
            return self._conv1d_backward(x, gy, need_gx)
        spec = self.spec
        n_in = spec.in_features
        x2 = x.reshape(-1, n_in)
        gy2 = gy.reshape(-1, spec.out_features)
        gx = torch.zeros_like(x2) if need_gx else None
        sinks = self._sinks()
        wsink = sinks[0] if sinks and spec.weight[1].trainable else None
        bsink = sinks[-1] if spec.bias is not None and spec.bias[1].trainable else None
        n = 0
        kept = self.t.kept_for(self)
        tiles = self._tiles(spec.tiles(), kept=kept) if need_gx else \
            ((r0, r1, None, None) for r0, r1 in spec.tiles())
        with contextlib.closing(tiles):
            n = self._backward_loop(tiles, x2, gy2, gx, wsink, bsink, n_in)
        self.t.acct.count("tiles_backward", n)
        self.t.use_done(spec)
        return None if gx is None else gx.view_as(x)

    def _backward_loop(self, tiles, x2, gy2, gx, wsink, bsink, n_in) -> int:
        n = 0
        for r0, r1, w, _ in tiles:
            last = r1 == self.spec.out_features
            gyt = gy2[:, r0:r1]
            if gx is not None:
                gx.addmm_(gyt.to(w.dtype), w)
            if wsink is not None:
                wsink(r0 * n_in, (gyt.t() @ x2).to(x2.dtype), last)
            if bsink is not None:
                bsink(r0, gyt.sum(0), last)
            n += 1
        return n

    # ------------------------------------------------------------------ Conv1D
    def _conv1d_forward(self, x: torch.Tensor, need_gx: bool = True) -> torch.Tensor:
        """``x @ W + b`` as ``b + sum_t x[:, r0:r1] @ W[r0:r1]`` (tiles of input rows; the
        bias read whole, once)."""
        spec = self.spec
        n_in, n_out = spec.out_features, spec.in_features
        x2 = x.reshape(-1, n_in)
        dtype = spec.weight[0].dtype
        if spec.bias is not None:
            b, _, leases = self._finish(self._start(0, n_out, (spec.bias,)))
            try:
                out = b.to(x2.dtype).expand(x2.shape[0], n_out).clone()
            finally:
                self._done(leases)
        else:
            out = torch.zeros(x2.shape[0], n_out, dtype=torch.promote_types(x2.dtype, dtype),
                              device=x2.device)
        n = 0
        keep = self.t.keep_for(self) if need_gx else None
        with contextlib.closing(self._tiles(spec.tiles(), (spec.weight,), keep=keep)) as tiles:
            for r0, r1, w, _ in tiles:
                out.addmm_(x2[:, r0:r1].to(out.dtype), w.to(out.dtype))
                n += 1
        self.t.acct.count("tiles_forward", n)
        return out.view(*x.shape[:-1], n_out)

    def _conv1d_backward(self, x: torch.Tensor, gy: torch.Tensor, need_gx: bool):
        """``gW[r0:r1] = x[:, r0:r1]^T gy``, ``gx[:, r0:r1] = gy W[r0:r1]^T``, ``gb =
        sum gy`` (the whole bias once, after the weight rows)."""
        spec = self.spec
        n_in, n_out = spec.out_features, spec.in_features
        x2 = x.reshape(-1, n_in)
        gy2 = gy.reshape(-1, n_out)
        gx = torch.zeros_like(x2) if need_gx else None
        wsink = self.t.sink(spec.weight) if spec.weight[1].trainable else None
        bsink = self.t.sink(spec.bias) if spec.bias is not None and spec.bias[1].trainable \
            else None
        n = 0
        kept = self.t.kept_for(self)
        tiles = self._tiles(spec.tiles(), (spec.weight,), kept=kept) if need_gx else \
            ((r0, r1, None, None) for r0, r1 in spec.tiles())
        with contextlib.closing(tiles):
            for r0, r1, w, _ in tiles:
                if gx is not None:
                    gx[:, r0:r1].addmm_(gy2.to(w.dtype), w.t())
                if wsink is not None:
                    wsink(r0 * n_out, (x2[:, r0:r1].t() @ gy2.to(x2.dtype)).to(x2.dtype),
                          r1 == n_in)
                n += 1
        if bsink is not None:
            bsink(0, gy2.sum(0), True)
        self.t.acct.count("tiles_backward", n)
        self.t.use_done(spec)
        return None if gx is None else gx.view_as(x)

    # ------------------------------------------------------------------ Embedding
    def _touched(self, tile_of: torch.Tensor) -> list[int]:
        """The tiles a lookup reads, ascending: the ones its indices touch; across ranks
        (``Tiling.union``) the union over ranks, so every rank reads (and gathers) the same
        tiles in the same order."""
        mine = torch.unique(tile_of).tolist()
        if self.t.union is None:
            return mine
        n = -(-self.spec.out_features // self.spec.rows)
        mask = torch.zeros(n, dtype=torch.float32)
        if mine:
            mask[mine] = 1.0
        self.t.union(mask)
        return mask.nonzero(as_tuple=True)[0].tolist()

    def _embed_forward(self, ids: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        d = spec.in_features
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= spec.out_features):
            raise IndexError(f"index out of range in self: embedding {spec.weight[1].name} "
                             f"(tiled) has {spec.out_features} rows, the indices span "
                             f"{int(flat.min())}..{int(flat.max())}")
        out = torch.empty(flat.numel(), d, dtype=spec.weight[0].dtype, device=ids.device)
        tile_of = torch.div(flat, spec.rows, rounding_mode="floor")
        n = 0
        ranges = [(t * spec.rows, min(spec.out_features, (t + 1) * spec.rows))
                  for t in self._touched(tile_of)]     # only the tiles the lookup touches
        with contextlib.closing(self._tiles(ranges)) as tiles:
            for r0, r1, w, _ in tiles:
                sel = (tile_of == r0 // spec.rows).nonzero(as_tuple=True)[0]
                if sel.numel():               # (across ranks: touched by another rank)
                    out[sel] = w.index_select(0, flat[sel] - r0)
                n += 1
        self.t.acct.count("tiles_forward", n)
        return out.view(*ids.shape, d)

    def _embed_backward(self, ids: torch.Tensor, gy: torch.Tensor) -> None:
        spec = self.spec
        d = spec.in_features
        sinks = self._sinks()
        if sinks:
            sink = sinks[0]
            flat = ids.reshape(-1)
            gy2 = gy.reshape(-1, d)
            pad = spec.module.padding_idx
            tile_of = torch.div(flat, spec.rows, rounding_mode="floor")
            touched = set(torch.unique(tile_of).tolist())
            shared = set(self._touched(tile_of)) if self.t.union is not None else None
            for t, (r0, r1) in enumerate(spec.tiles()):
                last = r1 == spec.out_features
                if shared is not None and t not in shared:
                    continue              # across ranks: no rank has rows of it (adds 0)
                if t not in touched:      # no gradient rows: zeros (first use of a window)
                    sink(r0 * d, None, last, (r1 - r0) * d)
                    continue
                sel = (tile_of == t).nonzero(as_tuple=True)[0]
                part = torch.zeros(r1 - r0, d, dtype=gy2.dtype)
                part.index_add_(0, flat[sel] - r0, gy2[sel])
                if pad is not None and r0 <= pad < r1:
                    part[pad - r0].zero_()   # F.embedding: no gradient for padding_idx
                sink(r0 * d, part, last, part.numel())
            self.t.acct.count("tiles_backward", len(touched))
        self.t.use_done(spec)


class Tiling:
    """The tiled modules of one engine: installs their tiled ``forward``, routes their
    gradient rows (``accumulate_rows`` where ``accepts_rows(g)``, else the rows assembled
    and ``accumulate(g, slot, grad)`` once per use) and tells ``after(g, slot_index)``
    (the overlapped step, or None) when a slot's gradient is final in this backward."""

    def __init__(self, specs: dict[nn.Module, TileSpec], manager, accounting, *,
                 accumulate, accumulate_rows, accepts_rows, after=None, group_final=None,
                 union=None):
        self.specs = specs
        self.mm = manager
        self.acct = accounting
        self.accumulate = accumulate
        self.accumulate_rows = accumulate_rows
        self.accepts_rows = accepts_rows
        self.after = after
        # ZeRO (world size > 1): ``group_final(g)`` once every use of ``g`` ran its
        # backward (the optimizer's tiled_final: its shard is final); ``union(mask)`` sums
        # a float tensor over ranks in place (an Embedding's touched tiles)
        self.group_final = group_final
        self.union = union
        self._installed: list[nn.Module] = []
        self._live: dict[int, int] = {}   # gid -> uses recorded in forward, not yet backward
        self._kept: dict[int, list] = {}   # id(runner) -> tiles kept by its recomputes
        self._kept_bytes = 0
        self._slot_index = {id(s): i for sp in specs.values() for g in sp.groups
                            for i, s in enumerate(g.slots)}

    @property
    def gids(self) -> set[int]:
        return {g.gid for s in self.specs.values() for g in s.groups}

    def sink(self, ref):
        """``put(start, part, last[, numel])`` for one slot's gradient rows in one use
        (``part`` None: ``numel`` zeros)."""
        g, slot = ref
        if self.accepts_rows(g):
            def put(start, part, last, numel=None):
                self.accumulate_rows(g, slot, start, part, last, numel)
            return put
        full = torch.zeros(slot.numel, dtype=torch.float32)

        def put_full(start, part, last, numel=None):
            if part is not None:
                full[start:start + part.numel()].copy_(part.reshape(-1))
            if last:
                self.accumulate(g, slot, full.view(slot.shape))
        return put_full

    def use_recorded(self, spec: TileSpec) -> None:
        for g in spec.groups:
            self._live[g.gid] = self._live.get(g.gid, 0) + 1

    def use_done(self, spec: TileSpec) -> None:
        """One use's backward ended: a group with no use left has its final gradient."""
        for g in spec.groups:
            n = self._live.get(g.gid, 0) - 1
            if n > 0:
                self._live[g.gid] = n
                continue
            self._live.pop(g.gid, None)
            if self.group_final is not None:
                self.group_final(g)
            if self.after is not None:
                for i, s in enumerate(g.slots):
                    if s.trainable:
                        self.after(g, i)

    # Note [Recompute keeps its tiles]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # With activation checkpointing a tiled layer's forward runs again inside backward (the
    # recompute), reading every tile, and its backward follows at once, reading them all a
    # third time.  The recompute copies each tile it read into host memory (keep_for, a
    # per-use record pushed per runner: a layer used twice in one checkpointed segment is
    # recomputed twice and its backwards run in reverse order, so the last record pushed is
    # the next one taken) and the backward uses the copies (kept_for) instead of reading
    # them from NVMe -- and, across ranks, instead of gathering them: every rank keeps the
    # same tiles (the budget is counted in tile bytes, the same on every rank), so the
    # ranks' collectives stay in step.  The copies are dropped when their backward ran,
    # and every one left at the end of backward (reset).  ``keep_budget``: host bytes the
    # copies may take at once (None: no bound); a tile beyond it is read again.
    keep_budget: int | None = None

    def keep_for(self, runner) -> dict | None:
        """A recompute (forward inside backward) of ``runner``: the dict its tiles are kept
        in, else None."""
        if not _in_backward() or self.keep_budget == 0:
            return None
        store: dict = {}
        self._kept.setdefault(id(runner), []).append(store)
        return store

    def kept_for(self, runner) -> dict | None:
        """The tiles the last recompute of ``runner`` kept (taken: a use's backward)."""
        stack = self._kept.get(id(runner))
        if not stack:
            return None
        store = stack.pop()
        if not stack:
            del self._kept[id(runner)]
        return store

    def keep(self, store: dict, key, w: torch.Tensor, b) -> None:
        n = _tile_nbytes(w, b)
        if self.keep_budget is not None and self._kept_bytes + n > self.keep_budget:
            return
        store[key] = (w.detach().to("cpu", copy=True),
                      None if b is None else b.detach().to("cpu", copy=True))
        self._kept_bytes += n
        self.acct.count("tiles_kept_for_backward")

    def kept_to_device(self, w: torch.Tensor, b):
        """A kept tile for the backward: ``(w, b, leases)`` on the compute device."""
        n = _tile_nbytes(w, b)
        self._kept_bytes -= n
        self.acct.count("tiles_reused_from_recompute")
        self.acct.count("tile_reread_bytes_saved", n)
        dev = self.mm.device
        if dev.type != "cpu":
            w = w.to(dev, non_blocking=False)
            b = None if b is None else b.to(dev, non_blocking=False)
        return w, b, []

    def reset(self) -> None:
        """After a failed forward/backward, and at the end of backward: no use is pending,
        no kept tile is left."""
        self._live.clear()
        self._kept.clear()
        self._kept_bytes = 0

    def install(self, grouping: Grouping) -> None:
        """Tiled modules compute by tiles; their groups leave the hooks' module map."""
        for mod, spec in self.specs.items():
            grouping.module_groups.pop(mod, None)
            runner = _Runner(spec, self)
            params = tuple(_params(mod))

            def forward(x, _runner=runner, _params=params, _spec=spec):
                # (a recomputation inside backward is not a new use of the group)
                if torch.is_grad_enabled() and not _in_backward() and (x.requires_grad or any(
                        p.requires_grad for p in _params)):
                    self.use_recorded(_spec)
                return _TiledFn.apply(x, _runner, *_params)
            mod.forward = forward        # an instance attribute: removed by remove()
            self._installed.append(mod)

    def remove(self) -> None:
        for mod in self._installed:
            mod.__dict__.pop("forward", None)
        self._installed.clear()

    def describe(self) -> str:
        if not self.specs:
            return "tiling: none"
        parts = [f"{type(s.module).__name__} {s.weight[1].name} ({s.out_features} rows in "
                 f"tiles of {s.rows})" for s in self.specs.values()]
        return "tiling: " + ", ".join(parts)
