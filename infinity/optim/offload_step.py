"""Optimizer state (fp32 master, ``exp_avg``, ``exp_avg_sq``) at its home, and
the pipelined Adam step over it.

Homes (``offload.optimizer``):

* ``"nvme"``: master, ``exp_avg`` and ``exp_avg_sq`` live in swap extents
  (one extent per state tensor per key, so every tile is three large, 4096-
  aligned I/Os each way). The step streams tiles through a fixed ring of
  aligned host buffers: read tile i+1 || ``adam_step`` on tile i || write
  tile i-1, and emits the updated low-precision params in the same pass.
* ``"cpu"``: the states are host tensors; the step is the same tile loop with
  no I/O (grads or an external master may still be extents).
* ``"none"``: device home. On a CPU-only machine the device tier is host
  memory, so this is ``"cpu"``; on CUDA the same CPU code runs on host copies
  (device grads/param_out are copied per tile), which is correct but not fast.

``exp_avg``/``exp_avg_sq`` start at zero without writing zeros to NVMe: each
extent-backed tensor keeps a per-tile "written" bitmap and never-written tiles
are zero-filled in the ring buffer instead of read.

Public: :class:`StepItem`, :class:`OptimizerStateStore`, :data:`HOMES` (and
:class:`StepTxn`, from :mod:`infinity.optim.step_txn`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from infinity.optim.step_txn import StepTxn
from infinity.optim.store_txn import TransactionalStore
from infinity.optim.tile_pipeline import LinkMeter, Slot, TilePipeline, TileTask, drain, extent_nbytes, round_up

log = logging.getLogger("infinity.optim")

HOMES = ("none", "cpu", "nvme")
DEFAULT_TILE_NUMEL = 4 * 1024 * 1024      # 16 MiB per fp32 tensor per ring slot
DEFAULT_PIPELINE_DEPTH = 3
_STATE_DTYPES = (torch.float32, torch.bfloat16)
# ``optimizer.state_dtype`` (config name) -> the moments' torch dtype
STATE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class StepItem:
    """What one ``step`` does to one registered partition.

    ``grad``: flat host tensor (fp32/bf16/fp16) of the partition's numel, or a
    swap Extent holding it (``grad_dtype`` elements, read tile-wise).
    ``segments``: ``(start, numel, lr, weight_decay)`` covering ``[0, numel)``; a
    segment may carry a fifth element ``(beta1, beta2, eps)`` overriding the step's
    values for its elements (per-group hyperparameters), or None.
    ``param_out``: flat tensor (bf16/fp16/fp32) receiving the updated params.
    ``param_sink(key, elem_offset, tile_tensor) -> handle | None``: called once
    per tile with the updated params of ``[elem_offset, elem_offset+len)``; the
    tile is ``sink_dtype`` (store option; fp32 master tile when None), backed
    by a 4096-aligned buffer that stays valid until the returned handle's
    ``wait()`` returns (the store waits for it before reusing the buffer).
    ``master_buf``: a host fp32 tensor, 4096-aligned, that already holds the current
    values of an extent-backed master (e.g. the parameter buffer fetched for backward):
    the step updates it in place and writes the master tiles from it, instead of
    reading them from NVMe into the ring (saves the master's read).  It must stay
    untouched by others until ``step`` returns (Note [Master hand-off] in
    infinity/engine/overlap.py, Note [Cache write-through] in infinity/memory/manager.py).
    """
    key: str
    grad: Any
    segments: Sequence[tuple]
    param_out: Optional[torch.Tensor] = None
    param_sink: Optional[Callable[[str, int, torch.Tensor], Any]] = None
    grad_dtype: torch.dtype = torch.float32
    master_buf: Optional[torch.Tensor] = None


class _Backing:
    """Where one state tensor of a partition lives: a host tensor or an extent."""
    __slots__ = ("host", "extent", "dtype", "esz", "nbytes", "valid", "owned")

    def __init__(self, dtype, *, host=None, extent=None, nbytes=0, ntiles=0, valid=False, owned=True):
        self.host = host
        self.extent = extent
        self.dtype = dtype
        self.esz = torch.empty((), dtype=dtype).element_size()
        self.nbytes = nbytes                   # extent capacity in bytes
        self.valid = None if extent is None else [valid] * ntiles
        self.owned = owned

    def offset(self, tile: int, tile_numel: int) -> int:
        return tile * tile_numel * self.esz

    def io_bytes_at(self, tile: int, tile_numel: int, n: int) -> int:
        off = self.offset(tile, tile_numel)
        return min(round_up(n * self.esz), self.nbytes - off)


class _Partition:
    """One registered flat fp32 partition and its three state tensors."""
    __slots__ = ("key", "numel", "ntiles", "backing")

    def __init__(self, key: str, numel: int, ntiles: int):
        self.key = key
        self.numel = numel
        self.ntiles = ntiles
        self.backing: Dict[str, _Backing] = {}


_extent_nbytes = extent_nbytes


class OptimizerStateStore(TransactionalStore):
    """fp32 master + Adam moments for flat partitions, at ``home``, stepped tile-wise.

    Args:
        home: ``"none"`` | ``"cpu"`` | ``"nvme"`` (see module doc).
        swap: an ``infinity.io.SwapSpace``; required for ``"nvme"`` and whenever
            grads or an external master are Extents.
        tile_numel: elements per tile (rounded up to a multiple of 2048 so every
            tile boundary is 4096-byte aligned for fp32 and bf16).
        state_dtype: ``torch.float32`` or ``torch.bfloat16`` for the moments.
        accounting: ``infinity.memory.accounting.Accounting`` or None.
        timeline: ``infinity.profile.Timeline`` or None.
        pipeline_depth: ring slots D (>= 2). Reads run D-2 tiles ahead (at least
            one) and writes of earlier tiles overlap the compute of tile i; D=3
            (default) is read i+1 || compute i || write i-1. Host cost: D tiles of
            each buffered tensor (see ``host_bytes()``).
        sink_dtype: dtype of the tile handed to ``param_sink`` (None: the fp32
            master tile; bf16/fp16: written by adam_step in the same pass).
        kernel: the per-tile update, ``adam_step``'s signature (None: the SIMD
            ``infinity.optim.adam_step``). Benchmarks pass a no-op to time the I/O alone.
    """

    def __init__(self, home: str, *, swap=None, tile_numel: int = DEFAULT_TILE_NUMEL,
                 state_dtype: torch.dtype = torch.float32, accounting=None, timeline=None,
                 pipeline_depth: int = DEFAULT_PIPELINE_DEPTH, sink_dtype: Optional[torch.dtype] = None,
                 kernel: Optional[Callable] = None):
        if home not in HOMES:
            raise ValueError(f"OptimizerStateStore: home must be one of {HOMES}, got {home!r}")
        if home == "nvme" and swap is None:
            raise ValueError("OptimizerStateStore: home 'nvme' needs a SwapSpace (swap=...); "
                             "create one with infinity.io.SwapSpace(nvme_paths, engine)")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"OptimizerStateStore: state_dtype must be float32 or bfloat16, got {state_dtype}")
        if not isinstance(tile_numel, int) or tile_numel <= 0:
            raise ValueError(f"OptimizerStateStore: tile_numel must be a positive int, got {tile_numel!r}")
        if not isinstance(pipeline_depth, int) or pipeline_depth < 2:
            raise ValueError(f"OptimizerStateStore: pipeline_depth must be an int >= 2, got {pipeline_depth!r}")
        if sink_dtype is not None and sink_dtype not in _LOWP_DTYPES:
            raise ValueError(f"OptimizerStateStore: sink_dtype must be None, float32, bfloat16 or float16, "
                             f"got {sink_dtype}")
        if kernel is None:
            from infinity.optim import adam_step as kernel  # late: infinity.optim may import this module

        self.home = home
        self.swap = swap
        self.tile_numel = round_up(tile_numel, 2048)
        self.state_dtype = state_dtype
        self.sink_dtype = sink_dtype
        self.accounting = accounting
        self.timeline = timeline
        self.pipeline_depth = pipeline_depth
        self._adam_step = kernel
        self._parts: Dict[str, _Partition] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._host_state_bytes = 0
        self._spare: Dict[int, Any] = {}   # id(backing) -> its shadow extent (Note [commit point])
        self._spare_lock = threading.Lock()   # prepare() vs commit/rollback, not vs step()
        # Note [shadow budget] (StepTxn): NVMe bytes of shadow extents allowed at once (idle
        # spares and those in transactions); None: one per extent-backed state tensor
        self.shadow_budget: Optional[int] = None
        self._shadow_bytes = 0             # shadow extents allocated now
        self.shadow_peak = 0               # the most allocated at once
        self._slots = self._alloc_ring()
        self._ring_bytes = sum(b.numel() * b.element_size() for s in self._slots for b in s.bufs.values())
        if self._ring_bytes and accounting is not None:
            accounting.alloc("host", self._ring_bytes)
        log.debug("OptimizerStateStore(home=%s, tile_numel=%d, depth=%d, state_dtype=%s): ring %d bytes",
                  home, self.tile_numel, pipeline_depth, state_dtype, self._ring_bytes)

    # -- construction ---------------------------------------------------------
    def _alloc_ring(self) -> List[Slot]:
        from infinity.io import aligned_empty
        roles = {}
        if self.swap is not None:
            roles["master"] = torch.float32     # an NVMe or external-extent master
            roles["grad"] = torch.float32       # grads as extents (bf16/fp16 grads use a view of it)
        if self.home == "nvme":
            roles["exp_avg"] = self.state_dtype
            roles["exp_avg_sq"] = self.state_dtype
        if self.sink_dtype is not None:
            roles["sink"] = self.sink_dtype
        return [Slot(bufs={r: aligned_empty(self.tile_numel, dt) for r, dt in roles.items()})
                for _ in range(self.pipeline_depth)]

    def _check_open(self):
        if self._closed:
            raise RuntimeError("OptimizerStateStore is closed")

    def _part(self, key) -> _Partition:
        self._check_open()
        try:
            return self._parts[key]
        except KeyError:
            raise KeyError(f"OptimizerStateStore: unknown key {key!r} (registered: "
                           f"{sorted(self._parts)[:8]}{'...' if len(self._parts) > 8 else ''})") from None

    def add(self, key: str, numel: int, *, init: Optional[torch.Tensor] = None, external_master=None) -> None:
        """Register a flat fp32 partition ``key`` of ``numel`` elements.

        ``init``: initial values (any float dtype, ``numel`` elements), copied or
        streamed to the home as the fp32 master. ``external_master``: a host fp32
        tensor or an Extent that already holds the master; updated in place.
        Neither: the master starts at zero. Moments start at zero.
        """
        with self._lock:
            self._check_open()
            if key in self._parts:
                raise ValueError(f"OptimizerStateStore.add: key {key!r} is already registered")
            if not isinstance(numel, int) or numel <= 0:
                raise ValueError(f"OptimizerStateStore.add({key!r}): numel must be a positive int, got {numel!r}")
            if init is not None and external_master is not None:
                raise ValueError(f"OptimizerStateStore.add({key!r}): pass init or external_master, not both")
            if init is not None:
                if not isinstance(init, torch.Tensor) or init.numel() != numel or not init.is_floating_point():
                    raise ValueError(f"OptimizerStateStore.add({key!r}): init must be a float tensor of "
                                     f"{numel} elements, got {type(init).__name__} "
                                     f"{getattr(init, 'shape', None)} {getattr(init, 'dtype', None)}")
            ntiles = (numel + self.tile_numel - 1) // self.tile_numel
            part = _Partition(key, numel, ntiles)
            owned = []
            try:
                part.backing["master"] = self._master_backing(key, numel, ntiles, external_master, owned)
                for role in ("exp_avg", "exp_avg_sq"):
                    part.backing[role] = self._new_backing(numel, ntiles, self.state_dtype, owned)
                self._parts[key] = part
                if init is not None:
                    self._write_range(part, "master", init.reshape(-1), 0)
            except BaseException as e:
                self._parts.pop(key, None)
                self._release(owned)
                if isinstance(e, OSError):
                    need = numel * (4 + 2 * torch.empty((), dtype=self.state_dtype).element_size())
                    e.add_note(f"infinity: OptimizerStateStore.add({key!r}, {numel}) at home {self.home!r} "
                               f"needs about {need} bytes for the fp32 master and the two moments; "
                               f"nothing of it is kept.")
                raise

    def _master_backing(self, key, numel, ntiles, ext, owned) -> _Backing:
        if ext is None:
            return self._new_backing(numel, ntiles, torch.float32, owned)
        if isinstance(ext, torch.Tensor):
            if ext.dtype != torch.float32 or ext.device.type != "cpu" or not ext.is_contiguous() \
                    or ext.numel() != numel:
                raise ValueError(f"OptimizerStateStore.add({key!r}): external_master tensor must be a contiguous "
                                 f"CPU float32 tensor of {numel} elements, got {ext.dtype} on {ext.device}, "
                                 f"numel {ext.numel()}, contiguous={ext.is_contiguous()}")
            return _Backing(torch.float32, host=ext.view(-1), owned=False)
        if self.swap is None:
            raise ValueError(f"OptimizerStateStore.add({key!r}): an Extent external_master needs swap=SwapSpace")
        nbytes = _extent_nbytes(ext)
        if nbytes < numel * 4:
            raise ValueError(f"OptimizerStateStore.add({key!r}): external_master extent holds {nbytes} bytes, "
                             f"needs {numel * 4} for {numel} fp32 elements")
        return _Backing(torch.float32, extent=ext, nbytes=nbytes, ntiles=ntiles, valid=True, owned=False)

    def _new_backing(self, numel, ntiles, dtype, owned) -> _Backing:
        if self.home == "nvme":
            esz = torch.empty((), dtype=dtype).element_size()
            nbytes = round_up(numel * esz)
            ext = self.swap.allocate(nbytes)
            b = _Backing(dtype, extent=ext, nbytes=nbytes, ntiles=ntiles, valid=False)
            owned.append(b)
            return b
        host = torch.zeros(numel, dtype=dtype)
        b = _Backing(dtype, host=host)
        self._host_state_bytes += host.numel() * host.element_size()
        if self.accounting is not None:
            self.accounting.alloc("host", host.numel() * host.element_size())
        owned.append(b)
        return b

    def _release(self, backings: Iterable[_Backing]) -> None:
        for b in backings:
            if not b.owned:
                continue
            if b.extent is not None:
                try:
                    self.swap.free(b.extent)
                except Exception as e:  # noqa: BLE001 - cleanup must go on
                    log.warning("OptimizerStateStore: freeing an extent failed: %s", e)
                b.extent = None
            elif b.host is not None:
                nb = b.host.numel() * b.host.element_size()
                self._host_state_bytes -= nb
                if self.accounting is not None:
                    self.accounting.free("host", nb)
                b.host = None

    # -- tile I/O (used by the pipeline and by read/write_*) --------------------
    def _read_tile(self, b: _Backing, tile: int, buf: torch.Tensor, n: int):
        nbytes = b.io_bytes_at(tile, self.tile_numel, n)
        return self.swap.read(b.extent, buf.view(torch.uint8)[:nbytes], offset=b.offset(tile, self.tile_numel))

    def _write_tile(self, b: _Backing, tile: int, buf: torch.Tensor, n: int, extent=None):
        nbytes = b.io_bytes_at(tile, self.tile_numel, n)
        return self.swap.write(b.extent if extent is None else extent, buf.view(torch.uint8)[:nbytes],
                               offset=b.offset(tile, self.tile_numel))

    # -- the step ---------------------------------------------------------------
    def step(self, items: Sequence[StepItem], *, step: int, beta1: float, beta2: float, eps: float,
             adamw: bool = True, bias_correction: bool = True, grad_scale: float = 1.0,
             txn: Optional[StepTxn] = None) -> frozenset:
        """One Adam/AdamW step over ``items`` (each key at most once).  Returns the keys
        whose result is not finite (Note [non-finite result]; also added to
        ``txn.nonfinite``): empty when the update is sound.

        ``txn``: hold the writes back until :meth:`commit` (Note [commit point] in
        :class:`StepTxn`); the items' keys must have been :meth:`prepare`-d.
        I/O errors (``AioError``, e.g. ENOSPC) propagate with a note naming the
        key and tile; nothing is left in flight when this raises.
        """
        with self._lock:
            self._check_open()
            tasks = self._plan(items)
            if txn is not None:
                for it in items:
                    for b in self._parts[it.key].backing.values():
                        if b.extent is not None and id(b) not in txn.writes:
                            raise RuntimeError(f"OptimizerStateStore.step({it.key!r}): prepare(txn, key) "
                                               f"was not called for this transaction")
                    txn.keys.add(it.key)
            hp = dict(step=step, beta1=beta1, beta2=beta2, eps=eps, adamw=adamw,
                      bias_correction=bias_correction, grad_scale=grad_scale)
            meter = LinkMeter(self.accounting, self.timeline)
            pipe = TilePipeline(self, self._slots, meter, self._adam_step, txn=txn)
            try:
                pipe.run(tasks, hp)
            except OSError as e:
                t = pipe.current
                where = f"key {t.part.key!r} tile {t.index} (elements {t.start}..{t.start + t.numel})" \
                    if t is not None else "setup"
                e.add_note(f"infinity: optimizer step {step} (home={self.home}) failed at {where}; "
                           f"no I/O is left in flight. Check free space and permissions of the NVMe "
                           f"paths {getattr(self.swap, 'dirs', None)}.")
                raise
            finally:
                if txn is not None:
                    txn.nonfinite |= pipe.nonfinite
            return frozenset(pipe.nonfinite)

    def _plan(self, items: Sequence[StepItem]) -> List[TileTask]:
        seen = set()
        tasks: List[TileTask] = []
        for it in items:
            part = self._part(it.key)
            if it.key in seen:
                raise ValueError(f"OptimizerStateStore.step: key {it.key!r} appears twice in one step")
            seen.add(it.key)
            grad, param_out = self._check_item(part, it)
            master_buf = self._check_master_buf(part, it)
            segs = _normalize_segments(part, it.segments)
            si = 0
            for t in range(part.ntiles):
                lo = t * self.tile_numel
                hi = min(part.numel, lo + self.tile_numel)
                sub = []
                while si < len(segs) and segs[si][0] < hi:
                    s0, s1, lr, wd, ov = segs[si]
                    a, b = max(s0, lo), min(s1, hi)
                    sub.append((a - lo, b - a, lr, wd, ov))
                    if s1 <= hi:
                        si += 1
                    else:
                        break
                tasks.append(TileTask(part, it, t, lo, hi - lo, sub, grad, param_out, master_buf))
        return tasks

    def _check_item(self, part: _Partition, it: StepItem):
        k, n = part.key, part.numel
        g = it.grad
        if isinstance(g, torch.Tensor):
            if g.dtype not in _GRAD_DTYPES or g.numel() != n or not g.is_contiguous():
                raise ValueError(f"OptimizerStateStore.step({k!r}): grad must be a contiguous fp32/bf16/fp16 "
                                 f"tensor of {n} elements, got {g.dtype} numel {g.numel()} "
                                 f"contiguous={g.is_contiguous()}")
            g = g.view(-1)
        elif g is None:
            raise ValueError(f"OptimizerStateStore.step({k!r}): grad is None")
        else:
            if self.swap is None:
                raise ValueError(f"OptimizerStateStore.step({k!r}): grad is an Extent but the store has no swap")
            if it.grad_dtype not in _GRAD_DTYPES:
                raise ValueError(f"OptimizerStateStore.step({k!r}): grad_dtype {it.grad_dtype} not supported")
            need = n * torch.empty((), dtype=it.grad_dtype).element_size()
            if _extent_nbytes(g) < need:
                raise ValueError(f"OptimizerStateStore.step({k!r}): grad extent holds {_extent_nbytes(g)} bytes, "
                                 f"needs {need}")
        po = it.param_out
        if po is not None:
            if not isinstance(po, torch.Tensor) or po.dtype not in _LOWP_DTYPES or po.numel() != n \
                    or not po.is_contiguous():
                raise ValueError(f"OptimizerStateStore.step({k!r}): param_out must be a contiguous "
                                 f"fp32/bf16/fp16 tensor of {n} elements, got {getattr(po, 'dtype', po)} "
                                 f"numel {getattr(po, 'numel', lambda: None)()}")
            po = po.view(-1)
        if it.param_sink is not None and not callable(it.param_sink):
            raise ValueError(f"OptimizerStateStore.step({k!r}): param_sink must be callable")
        return g, po

    def _check_master_buf(self, part: _Partition, it: StepItem) -> Optional[torch.Tensor]:
        mb = it.master_buf
        if mb is None:
            return None
        k, n = part.key, part.numel
        b = part.backing["master"]
        room = 0
        if isinstance(mb, torch.Tensor) and mb.device.type == "cpu":
            room = mb.untyped_storage().nbytes() - mb.storage_offset() * mb.element_size()
        if b.extent is None or not isinstance(mb, torch.Tensor) or mb.dtype != torch.float32 \
                or mb.device.type != "cpu" or not mb.is_contiguous() or mb.numel() < n \
                or mb.data_ptr() % 4096 or room < min(round_up(n * 4), b.nbytes):
            raise ValueError(f"OptimizerStateStore.step({k!r}): master_buf must be a contiguous, "
                             f"4096-aligned CPU float32 tensor of at least {n} elements with "
                             f"{round_up(n * 4)} bytes of storage, for an extent-backed master; "
                             f"got {getattr(mb, 'dtype', type(mb).__name__)} numel "
                             f"{getattr(mb, 'numel', lambda: None)()} (master on "
                             f"{'NVMe' if b.extent is not None else 'the host'})")
        return mb.view(-1)

    # -- checkpoint access ------------------------------------------------------
    def read_master(self, key: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Copy master elements ``[start, start + out.numel())`` into ``out`` (any float dtype)."""
        return self._locked_range(key, "master", out, start, write=False)

    def read_state(self, key: str, which: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Copy ``exp_avg`` or ``exp_avg_sq`` elements into ``out`` (zeros where never written)."""
        return self._locked_range(key, _state_role(which), out, start, write=False)

    def write_master(self, key: str, src: torch.Tensor, start: int = 0) -> None:
        """Overwrite master elements ``[start, start + src.numel())`` with ``src`` (converted to fp32)."""
        self._locked_range(key, "master", src, start, write=True)

    def write_state(self, key: str, which: str, src: torch.Tensor, start: int = 0) -> None:
        """Overwrite ``exp_avg``/``exp_avg_sq`` elements (converted to the state dtype)."""
        self._locked_range(key, _state_role(which), src, start, write=True)

    def _locked_range(self, key, role, t, start, *, write):
        with self._lock:
            part = self._part(key)
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_floating_point():
                raise ValueError(f"OptimizerStateStore: {role} of {key!r}: expected a CPU float tensor, "
                                 f"got {type(t).__name__} {getattr(t, 'dtype', '')}")
            if not isinstance(start, int) or start < 0 or start + t.numel() > part.numel:
                raise ValueError(f"OptimizerStateStore: {role} of {key!r}: range [{start}, "
                                 f"{start} + {t.numel()}) outside the partition of {part.numel} elements")
            if write:
                self._write_range(part, role, t.reshape(-1), start)
                return None
            if not t.is_contiguous():
                raise ValueError(f"OptimizerStateStore: read of {role} of {key!r}: out must be contiguous")
            self._read_range(part, role, t.view(-1), start)
            return t

    def _tiles(self, part, start, count):
        """(tile, lo, hi) for each tile overlapping [start, start + count), in partition coordinates."""
        end = start + count
        t = start // self.tile_numel
        while t * self.tile_numel < end:
            lo = t * self.tile_numel
            yield t, lo, min(part.numel, lo + self.tile_numel)
            t += 1

    def _range_bufs(self, role, dtype):
        """The ring's buffers for ``role`` (a fp32 master buffer for an external-extent master)."""
        name = role if role in self._slots[0].bufs else "master"
        return [sl.bufs[name].view(torch.uint8).view(dtype) for sl in self._slots]

    def _read_range(self, part, role, out, start):
        """Tile-wise read of ``[start, start + out.numel())``, up to ``depth`` reads in flight."""
        b = part.backing[role]
        k = out.numel()
        if k == 0:
            return
        if b.host is not None:
            out.copy_(b.host[start:start + k])
            return
        bufs = self._range_bufs(role, b.dtype)
        meter = LinkMeter(self.accounting, self.timeline)
        tiles = list(self._tiles(part, start, k))
        pending = []                     # (handle, t0, nbytes, buf, tile, lo, hi) in tile order

        def finish(entry):
            h, t0, nbytes, buf, t, lo, hi = entry
            if h is not None:
                h.wait()
                meter.io("nvme_read", part.key, nbytes, t0, time.perf_counter())
            a, e = max(lo, start), min(hi, start + k)
            if h is not None:
                out[a - start:e - start].copy_(buf[a - lo:e - lo])
            else:
                out[a - start:e - start].zero_()

        try:
            for idx, (t, lo, hi) in enumerate(tiles):
                if len(pending) == len(bufs):
                    finish(pending.pop(0))
                buf = bufs[idx % len(bufs)]
                if b.valid[t]:
                    nbytes = b.io_bytes_at(t, self.tile_numel, hi - lo)
                    pending.append((self._read_tile(b, t, buf, hi - lo), time.perf_counter(), nbytes,
                                    buf, t, lo, hi))
                else:
                    pending.append((None, 0.0, 0, buf, t, lo, hi))
            while pending:
                finish(pending.pop(0))
        except BaseException:
            drain([p[0] for p in pending if p[0] is not None])
            raise

    def _write_range(self, part, role, src, start):
        """Tile-wise write of ``src`` at ``start`` (read-modify-write of partial tiles),
        up to ``depth`` writes in flight."""
        b = part.backing[role]
        k = src.numel()
        if k == 0:
            return
        if b.host is not None:
            b.host[start:start + k].copy_(src)
            return
        bufs = self._range_bufs(role, b.dtype)
        meter = LinkMeter(self.accounting, self.timeline)
        inflight = [None] * len(bufs)    # (handle, t0, nbytes, tile) per buffer

        def finish(slot):
            entry = inflight[slot]
            if entry is None:
                return
            inflight[slot] = None
            h, t0, nbytes, t = entry
            h.wait()
            meter.io("nvme_write", part.key, nbytes, t0, time.perf_counter())
            b.valid[t] = True

        try:
            for idx, (t, lo, hi) in enumerate(self._tiles(part, start, k)):
                slot = idx % len(bufs)
                finish(slot)
                buf = bufs[slot]
                a, e = max(lo, start), min(hi, start + k)
                n = hi - lo
                nbytes = b.io_bytes_at(t, self.tile_numel, n)
                if a > lo or e < hi:                     # partial tile: read-modify-write
                    if b.valid[t]:
                        self._wait(self._read_tile(b, t, buf, n), "nvme_read", part.key, nbytes)
                    else:
                        buf[:n].zero_()
                buf[a - lo:e - lo].copy_(src[a - start:e - start])
                inflight[slot] = (self._write_tile(b, t, buf, n), time.perf_counter(), nbytes, t)
            for slot in range(len(bufs)):
                finish(slot)
        except BaseException:
            drain([x[0] for x in inflight if x is not None])
            raise

    def _wait(self, handle, link, key, nbytes):
        t0 = time.perf_counter()
        handle.wait()
        LinkMeter(self.accounting, self.timeline).io(link, key, nbytes, t0, time.perf_counter())

    # -- introspection ------------------------------------------------------------
    def keys(self) -> List[str]:
        return list(self._parts)

    def numel(self, key: str) -> int:
        return self._part(key).numel

    def master_io_bytes(self, key: str) -> int:
        """Bytes one step reads (and writes) for ``key``'s master when it is an extent."""
        part = self._part(key)
        b = part.backing["master"]
        if b.extent is None:
            return 0
        return sum(b.io_bytes_at(t, self.tile_numel, hi - lo)
                   for t, lo, hi in self._tiles(part, 0, part.numel))

    def host_bytes(self) -> int:
        """Host memory this store holds: the tile ring plus host-resident states it owns."""
        return self._ring_bytes + self._host_state_bytes

    def nvme_bytes(self) -> int:
        """Bytes of swap extents this store allocated (external masters not included)."""
        return sum(b.nbytes for p in self._parts.values() for b in p.backing.values()
                   if b.extent is not None and b.owned)

    def close(self) -> None:
        """Free owned extents and buffers. Idempotent; the SwapSpace itself is not closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in self._parts.values():
                self._release(p.backing.values())
            self._parts.clear()
            self._shadow_bytes = 0
            for ext in self._spare.values():
                try:
                    self.swap.free(ext)
                except Exception as e:  # noqa: BLE001 - cleanup must go on
                    log.warning("OptimizerStateStore: freeing a shadow extent failed: %s", e)
            self._spare.clear()
            self._slots = []
            if self._ring_bytes and self.accounting is not None:
                self.accounting.free("host", self._ring_bytes)
            self._ring_bytes = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _state_role(which: str) -> str:
    if which not in ("exp_avg", "exp_avg_sq"):
        raise ValueError(f"OptimizerStateStore: state must be 'exp_avg' or 'exp_avg_sq', got {which!r}")
    return which


def _segment_overrides(key, seg) -> Optional[Tuple[float, float, float]]:
    """The optional fifth element of a segment: ``(beta1, beta2, eps)`` or None."""
    if len(seg) == 4 or seg[4] is None:
        return None
    ov = seg[4]
    if len(seg) != 5 or not isinstance(ov, (tuple, list)) or len(ov) != 3:
        raise ValueError(f"OptimizerStateStore.step({key!r}): a segment is (start, numel, lr, "
                         f"weight_decay[, (beta1, beta2, eps)]), got {seg!r}")
    return tuple(float(x) for x in ov)


def _normalize_segments(part: _Partition, segments) -> List[tuple]:
    """Validate (start, numel, lr, wd[, (beta1, beta2, eps)]) segments and return merged
    (start, end, lr, wd, overrides-or-None) ranges."""
    if not segments:
        raise ValueError(f"OptimizerStateStore.step({part.key!r}): segments is empty; pass "
                         f"[(0, {part.numel}, lr, weight_decay)] for one group")
    segs = sorted(((int(sg[0]), int(sg[1]), float(sg[2]), float(sg[3]),
                    _segment_overrides(part.key, sg)) for sg in segments),
                  key=lambda sg: sg[:2])
    out: List[tuple] = []
    pos = 0
    for s, n, lr, wd, ov in segs:
        if s != pos or n <= 0:
            raise ValueError(f"OptimizerStateStore.step({part.key!r}): segments must tile [0, {part.numel}) "
                             f"without gaps or overlaps; found ({s}, {n}) where element {pos} was expected")
        if out and out[-1][2:] == (lr, wd, ov):
            out[-1] = (out[-1][0], s + n, lr, wd, ov)
        else:
            out.append((s, s + n, lr, wd, ov))
        pos = s + n
    if pos != part.numel:
        raise ValueError(f"OptimizerStateStore.step({part.key!r}): segments cover [0, {pos}) but the partition "
                         f"has {part.numel} elements")
    return out


__all__ = ["HOMES", "DEFAULT_TILE_NUMEL", "STATE_TORCH_DTYPES", "StepItem", "StepTxn", "OptimizerStateStore"]
