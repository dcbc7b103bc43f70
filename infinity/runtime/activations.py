"""Activation offload: the tensors autograd saves for backward live on the host tier or NVMe.

:class:`ActivationOffload` is called by the saved-tensor hooks of
:class:`infinity.runtime.hooks.ParamHooks` for every saved tensor that is not a view of a
parameter group (those are packed as references, see ``hooks.py``):

* ``scope="checkpoints"``: only the inputs an activation-checkpoint boundary saves
  (``torch.utils.checkpoint.checkpoint``, reentrant or not, which Hugging Face's
  ``gradient_checkpointing_enable()`` calls) — the one tensor per layer that stays alive
  from forward to backward; everything inside a checkpointed region is recomputed anyway.
  Without checkpointing nothing is offloaded (one warning).
* ``scope="all"``: every saved tensor of at least :data:`MIN_OFFLOAD_BYTES`.

``pack`` copies the tensor into a page-aligned host buffer (D2H when it is on a separate
device) and returns a small :class:`SavedActivation` handle.  Home ``"cpu"``: the buffer is
the home (host-tier bytes, bounded by what ``offload.host_memory_gb`` leaves after the
placement plan).  Home ``"nvme"``: the buffer is staging for an asynchronous write into an
extent of the rank's :class:`~infinity.io.SwapSpace` (the private, already-unlinked swap
files); at most a read-ahead window of writes is in flight, then their staging is freed.

``unpack`` (backward) returns the values (a read when on NVMe; H2D on a separate device)
and starts reading the activations saved just before it — backward uses them next — so
that at most ``max(depth, 1)`` × the activation being unpacked is read ahead (and as
much written behind in forward).

Lifetime: a handle frees its extent / host buffer when autograd drops it (after its node
ran, or with the graph).  Frees requested from a destructor are deferred to the next call
on the main thread (an extent is never freed under an in-flight write).
:meth:`ActivationOffload.release_all` (a failed forward/backward, ``close``) releases every
live handle at once: no extents, no host buffers left; a handle released so raises a clear
error if a stale graph is run again.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import deque

import torch

from infinity.io import aligned_empty
from infinity.memory.pool import ALIGN, round_up
from infinity.runtime.interrupts import never_raise_in

log = logging.getLogger("infinity.runtime")

__all__ = ["ActivationOffload", "SavedActivation", "SavedView", "ActivationBudgetError",
           "MIN_OFFLOAD_BYTES"]

# Saved tensors smaller than this stay where they are (scalars, shapes, tiny masks): an
# NVMe request per few bytes costs more than it frees.
MIN_OFFLOAD_BYTES = 4096

_CHECKPOINT_FILE = torch.utils.checkpoint.__file__
_FRAMES = 12     # how far up the stack a checkpoint boundary's save is looked for


def from_checkpoint_boundary() -> bool:
    """True when the tensor being packed is saved by ``torch.utils.checkpoint`` itself (the
    inputs of a checkpointed region: ``save_for_backward`` of ``CheckpointFunction`` or
    the non-reentrant input saver)."""
    f = sys._getframe(1)
    for _ in range(_FRAMES):
        if f is None:
            return False
        if f.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        f = f.f_back
    return False


class ActivationBudgetError(MemoryError):
    """Offloaded activations on the host tier would exceed what the host cap leaves."""


class SavedActivation:
    """One offloaded saved tensor: its shape/dtype/device and where its bytes are."""
    __slots__ = ("store", "shape", "dtype", "device", "nbytes", "span", "host", "extent",
                 "write_io", "read_io", "read_buf", "order", "index", "released", "out",
                 "savers", "keep", "unpacked", "__weakref__")

    def __init__(self, store, t: torch.Tensor, order: list, index: int):
        self.store = store
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.device = t.device
        self.nbytes = t.numel() * t.element_size()
        self.span = round_up(max(self.nbytes, 1), ALIGN)
        self.host = None          # host buffer: the home ("cpu") or write staging ("nvme")
        self.extent = None        # NVMe extent ("nvme")
        self.write_io = None
        self.read_io = None       # a read ahead in flight into read_buf
        self.read_buf = None
        self.order = order        # the pass's handles (weak), in pack order
        self.index = index
        self.released = False
        self.out = None           # weak reference to the last tensor handed to autograd
        self.savers = 0           # saves (packs) not unpacked yet: Note [One read per save]
        self.keep = None          # the read-back tensor, held while savers remain
        self.unpacked = False     # read back once already (the read-ahead skips it)

    def __del__(self):
        store = self.store
        if store is not None and not self.released:
            try:
                store._dropped(self)
            except Exception as e:  # a destructor must not raise
                log.warning("infinity: freeing an offloaded activation failed: %s", e)


never_raise_in(SavedActivation.__del__)     # Note [held interrupts]: a destructor's signal


class SavedView:
    """A saved tensor that is a view of an offloaded base: the base is offloaded once, and
    every view saved from it is rebuilt from it in backward (size, stride, offset)."""
    __slots__ = ("base", "size", "stride", "offset")

    def __init__(self, base: SavedActivation, t: torch.Tensor, offset: int):
        self.base = base
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = offset


class ActivationOffload:
    def __init__(self, home: str, scope: str, *, swap=None, accounting, timeline=None,
                 host_budget: int | None = None, depth: int = 2):
        if home not in ("cpu", "nvme"):
            raise ValueError(f"ActivationOffload: home must be \"cpu\" or \"nvme\", got {home!r}")
        if scope not in ("checkpoints", "all"):
            raise ValueError(f"ActivationOffload: scope must be \"checkpoints\" or \"all\", "
                             f"got {scope!r}")
        if home == "nvme" and swap is None:
            raise ValueError("ActivationOffload: home \"nvme\" needs a SwapSpace")
        self.home = home
        self.scope = scope
        self.swap = swap
        self.acct = accounting
        self.timeline = timeline
        self.host_budget = host_budget
        self.depth = max(1, int(depth))
        self.host_bytes = 0                  # host-tier bytes held by handles (home "cpu")
        self.nvme_bytes = 0                  # extent bytes held by handles (home "nvme")
        self.largest = 0                     # largest activation of the current pass
        self._lock = threading.Lock()
        self._live: dict[int, weakref.ref] = {}
        self._order: list = []
        self._writes: deque = deque()        # handles whose NVMe write is in flight
        self._deferred: deque = deque()      # (extent, io handles) dropped by destructors
        self._dedupe: dict[int, tuple] = {}  # id(tensor) -> (weakref(t), version, weakref(h))
        self._packed_in_pass = False
        self._warned_no_checkpoint = False

    # ------------------------------------------------------------------ pass
    def begin_pass(self) -> None:
        """A training forward starts: a new pack order (prefetch follows it backwards)."""
        self._reap()
        self._order = []
        self._dedupe.clear()
        self.largest = 0
        self._packed_in_pass = False

    def end_forward(self) -> None:
        """Forward is done: every write in flight completes and its staging goes (so the
        memory the activations left is free before backward starts, and every offloaded
        activation is read back exactly once)."""
        self._dedupe.clear()
        while self._writes:
            self._finish_write(self._writes.popleft())
        if self.scope == "checkpoints" and not self._packed_in_pass \
                and not self._warned_no_checkpoint:
            self._warned_no_checkpoint = True
            log.warning("infinity: activation_offload.scope \"checkpoints\" offloads the inputs "
                        "of activation-checkpointed regions, and this forward had none: enable "
                        "torch.utils.checkpoint / model.gradient_checkpointing_enable(), or use "
                        "scope \"all\"")

    def end_backward(self) -> None:
        self._reap()

    # ------------------------------------------------------------------ pack
    def wants(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False              # parameters, tensor subclasses, sparse, nested: kept
        base = t._base
        if base is not None and isinstance(base, torch.nn.Parameter):
            return False              # a view of a (device-resident) parameter: not an activation
        if t.numel() * t.element_size() < MIN_OFFLOAD_BYTES:
            return False
        return self.scope == "all" or from_checkpoint_boundary()

    def pack(self, t: torch.Tensor):
        """The saved tensor ``t`` -> a :class:`SavedActivation`, a :class:`SavedView` of one
        (``t`` is a view of a contiguous base: the base is offloaded once for all its saved
        views), or ``t`` itself when it is not offloaded."""
        if not self.wants(t):
            return t
        base = t._base
        if base is None or type(base) is not torch.Tensor or not base.is_contiguous() \
                or base.dtype != t.dtype:
            base = t
        h = self._pack_base(base)
        h.savers += 1
        if base is t:
            return h
        return SavedView(h, t, t.storage_offset() - base.storage_offset())

    def _pack_base(self, t: torch.Tensor) -> SavedActivation:
        hit = self._dedupe.get(id(t))
        if hit is not None:                  # the same tensor saved again (x -> q, k, v)
            wt, ver, wh = hit
            h = wh()
            if wt() is t and ver == t._version and h is not None and not h.released:
                return h
        self._reap()
        h = SavedActivation(self, t, self._order, len(self._order))
        if self.home == "cpu" and self.host_budget is not None \
                and self.host_bytes + h.span > self.host_budget:
            h.released = True
            raise ActivationBudgetError(
                f"activation offload (home \"cpu\"): {self.host_bytes + h.span} bytes of "
                f"activations would be on the host tier, but offload.host_memory_gb leaves "
                f"{self.host_budget} bytes after the placement plan (this activation: "
                f"{tuple(t.shape)} {t.dtype}, {h.nbytes} bytes); raise "
                f"offload.host_memory_gb, use activation_offload.home \"nvme\", or a smaller "
                f"micro-batch")
        t0 = time.perf_counter()
        buf = aligned_empty(h.span, torch.uint8, lock=False)
        with torch.no_grad():
            buf[:h.nbytes].view(h.dtype).view(h.shape).copy_(t)
        h.host = buf
        self._order.append(weakref.ref(h))
        self._live[id(h)] = weakref.ref(h)
        self.largest = max(self.largest, h.span)
        self._packed_in_pass = True
        if self.home == "cpu":
            with self._lock:
                self.host_bytes += h.span
            self.acct.alloc("host", h.span)
        else:
            h.extent = self.swap.allocate(h.span)
            self.nvme_bytes += h.span
            h.write_io = self.swap.write(h.extent, buf)
            self._writes.append(h)
            self._bound_writes(keep=h.span)
        self.acct.count("activation_offload_bytes", h.nbytes)
        self._lane("pack", t0, h.nbytes)
        self._dedupe[id(t)] = (weakref.ref(t), t._version, weakref.ref(h))
        return h

    def _window(self, span: int) -> int:
        """Bytes of I/O kept in flight around an activation of ``span`` bytes: ``depth`` of
        it (at least one whole activation), so the memory an offload holds back stays
        proportional to the tensors at hand, not to the largest one of the pass."""
        return self.depth * max(span, ALIGN)

    def _bound_writes(self, keep: int = 0) -> None:
        """Retire finished writes (their staging is freed); wait for the oldest while more
        than the window is in flight."""
        q = self._writes
        pending = sum(h.span for h in q)
        window = self._window(keep)
        while q and (q[0].write_io is None or q[0].write_io.done() or pending > window):
            h = q.popleft()
            pending -= h.span
            self._finish_write(h)

    def _finish_write(self, h: SavedActivation) -> None:
        io, h.write_io = h.write_io, None
        if io is not None:
            t0 = time.perf_counter()
            io.wait()
            self.acct.link("nvme_write", h.span, time.perf_counter() - t0)
        h.host = None                         # the staging goes: the bytes are on NVMe

    # ------------------------------------------------------------------ unpack
    def unpack(self, x) -> torch.Tensor:
        if isinstance(x, SavedView):
            base = self._unpack_base(x.base)
            return base.as_strided(x.size, x.stride, base.storage_offset() + x.offset)
        return self._unpack_base(x)

    def _unpack_base(self, h: SavedActivation) -> torch.Tensor:
        if h.released:
            raise RuntimeError(
                "infinity: this saved activation was released when an earlier forward/backward "
                "failed (or the engine closed); run forward again to rebuild the graph")
        out = h.out() if h.out is not None else None
        if out is not None:                   # the same activation unpacked twice in a row
            self._used(h, out)
            return out
        self._reap()
        t0 = time.perf_counter()
        if h.host is not None:                # home "cpu", or an NVMe write still staged
            buf = h.host
        elif h.read_io is not None:           # read ahead
            buf = self._finish_read(h)
        else:
            self._start_read(h)
            buf = self._finish_read(h)
        self._read_ahead(h)
        t = buf[:h.nbytes].view(h.dtype).view(h.shape)
        if h.device != t.device:              # separate device memory: H2D (synchronous:
            dev = torch.empty(h.shape, dtype=h.dtype, device=h.device)   # the host buffer
            dev.copy_(t)                                                 # may go right after)
            t = dev
        h.out = weakref.ref(t)
        h.unpacked = True
        self._used(h, t)
        self.acct.count("activation_fetch_bytes", h.nbytes)
        self._lane("unpack", t0, h.nbytes)
        return t

    @staticmethod
    def _used(h: SavedActivation, t: torch.Tensor) -> None:
        """Note [One read per save]: one tensor saved by several autograd nodes (logits
        saved by both the LM head's matmul and the loss; ``x`` by ``pow`` and ``mul``) is
        offloaded once (``_dedupe``) and counted once per save.  The first unpack reads it
        back; the tensor is then held (``keep``) until every save was unpacked, so the
        later nodes do not read the same bytes from NVMe again once the first node let go
        of it.  The hold is what autograd would hold without offload; it ends with the
        last unpack (or the handle).  The read-ahead skips handles already read back:
        backward's order is not exactly the reverse of forward's, and a consumed handle
        would otherwise be read a second time for nothing."""
        h.savers -= 1
        h.keep = t if h.savers > 0 else None

    def _start_read(self, h: SavedActivation) -> None:
        h.read_buf = aligned_empty(h.span, torch.uint8, lock=False)
        h.read_io = (time.perf_counter(), self.swap.read(h.extent, h.read_buf))

    def _finish_read(self, h: SavedActivation) -> torch.Tensor:
        (t0, io), h.read_io = h.read_io, None
        io.wait()
        self.acct.link("nvme_read", h.span, time.perf_counter() - t0)
        buf, h.read_buf = h.read_buf, None
        return buf

    def _read_ahead(self, h: SavedActivation) -> None:
        """Start reading the activations packed just before ``h`` (backward's next), up to
        the window's bytes."""
        if self.home != "nvme":
            return
        budget = self._window(h.span)
        inflight = 0
        j = h.index - 1
        order = h.order
        while j >= 0 and inflight < budget:
            o = order[j]()
            j -= 1
            if o is None or o.released or o.host is not None or o.extent is None:
                continue
            if o.unpacked or (o.out is not None and o.out() is not None):
                continue
            if o.read_io is None:
                self._start_read(o)
            inflight += o.span

    # ------------------------------------------------------------------ release
    def _dropped(self, h: SavedActivation) -> None:
        """Destructor path (any thread): defer what needs the swap space."""
        h.released = True
        host_span = h.span if self.home == "cpu" and h.host is not None else 0
        if host_span:
            with self._lock:
                self.host_bytes -= host_span
            self.acct.free("host", host_span)
        h.host = h.keep = None
        ios = [x for x in (h.write_io, h.read_io[1] if h.read_io else None) if x is not None]
        if h.extent is not None or ios:
            self._deferred.append((h.extent, ios, h.read_buf))
        h.extent = h.write_io = h.read_io = h.read_buf = None
        self._live.pop(id(h), None)

    def _reap(self) -> None:
        q = self._deferred
        while q:
            ext, ios, _buf = q.popleft()
            for io in ios:
                try:
                    io.wait()
                except Exception as e:  # noqa: BLE001 - the extent is freed regardless
                    log.debug("infinity: activation I/O of a dropped handle failed: %s", e)
            if ext is not None:
                self.nvme_bytes -= ext.span
                if self.swap is not None and not self.swap.closed:
                    self.swap.free(ext)
        if self._writes:
            self._bound_writes()

    def release_all(self) -> None:
        """Release every live offloaded activation (a failed forward/backward, close): no
        extent and no host buffer stays; the handles raise if used again."""
        self._writes.clear()
        for ref in list(self._live.values()):
            h = ref()
            if h is not None and not h.released:
                self._dropped(h)
        self._live.clear()
        self._order = []
        self._dedupe.clear()
        self._reap()

    def close(self) -> None:
        self.release_all()

    # ------------------------------------------------------------------ facts
    @property
    def live_count(self) -> int:
        return sum(1 for r in self._live.values() if r() is not None)

    def _lane(self, what: str, t0: float, nbytes: int) -> None:
        tl = self.timeline
        if tl is not None and tl.enabled:
            tl.add("activations", f"{what} {self.home}", t0, time.perf_counter(), nbytes)
