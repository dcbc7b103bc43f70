"""One record per managed parameter group, with an explicit location state machine.

A *group* is the flat concatenation of one module's direct trainable parameters, or of
its direct frozen ones (tied weights are one group used by several modules).  Its
*home* is where the authoritative copy lives between uses: ``"device"`` (always
resident), ``"cpu"`` (a host buffer) or ``"nvme"`` (an extent in a
:class:`infinity.io.SwapSpace`).  Fetching it makes a
device-tier buffer hold the values and points every parameter's ``.data`` at a view
into that buffer; releasing points them back at an empty tensor.

States (``Location``)::

    NVME --begin_read--> READING --finish_read--> DEVICE      (NVMe home, read straight
                                                               into the compute buffer)
    HOST --begin_to_device--> TO_DEVICE --finish_to_device--> DEVICE   (host home)
    CACHED --begin_to_device--> TO_DEVICE     (NVMe home with a clean host copy: used like
                                               a host home, not read from NVMe)
    READING --read_landed--> TO_DEVICE          (CUDA: the NVMe read landed in pinned host
                                                 staging, the H2D copy is in flight)
    DEVICE --release--> NVME | HOST | CACHED                     (home copy is current;
                                 an NVMe-homed group keeping a clean host copy -> CACHED)
    CACHED --drop_host_copy--> NVME     (an NVMe-homed group forgets its cached host copy)
    DEVICE --forget_host_copy--> DEVICE  (in use: its buffer stops being a cached copy)
    TO_DEVICE --forget_host_copy--> TO_DEVICE  (ZeRO-3: the gather that read the cached
                                                shard copy has finished; the copy goes)
    READING | TO_DEVICE --abort_fetch--> NVME | HOST | CACHED   (a failed read, or the
                                          window it was for failed: back to the home state)

A ZeRO-3 group (``sharded``) keeps only this rank's shard at its home, whichever it is,
and is gathered into a full compute buffer before every use: NVMe home as above; a host
or *device* home goes ``HOST --begin_to_device--> TO_DEVICE --finish_to_device-->
DEVICE --release--> HOST`` (``HOST`` then means "at its home, not gathered": for a
device home the shard stays resident in device memory).  An NVMe-homed ZeRO-3 group that
is ``CACHED`` keeps a clean host copy of its *shard* only (``host_buf``, shard-sized; the
gather reads it instead of NVMe: Note [Shard cache] in infinity/zero/partitioned_memory.py).

Nothing is ever written back on release: parameters do not change during
forward/backward and the optimizer updates the home (and a cached copy) in place.

Transitions only happen through the methods below; each checks its precondition and
raises :class:`StateError` naming the group and the actual state.
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["Location", "StateError", "ParamSlot", "GroupRecord", "placeholder", "holder_of",
           "register_holder", "unregister_holder"]

_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def placeholder(dtype: torch.dtype, shape, device=None) -> torch.Tensor:
    """What a released parameter's ``.data`` points at: its true shape over ONE NaN element
    (zero strides), so ``p.shape``/``p.dtype`` stay right, autograd can accumulate a grad
    into it, and any accidental use computes NaN instead of silently plausible numbers."""
    device = torch.device("cpu") if device is None else torch.device(device)
    # a parameter's .data can only be pointed at a tensor of its own device type
    t = _PLACEHOLDERS.get((dtype, device))
    if t is None:
        t = _PLACEHOLDERS[(dtype, device)] = torch.full((), float("nan"), dtype=dtype,
                                                        device=device)
    return t.expand(shape)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a released parameter's placeholder."""
    ph = _PLACEHOLDERS.get((t.dtype, t.device))
    if ph is None or t.numel() == 0:
        return False
    try:
        ptr = t.untyped_storage().data_ptr()
        return ptr != 0 and ptr == ph.untyped_storage().data_ptr()
    except RuntimeError:            # exotic tensors have no storage pointer
        return False                # (and every meta tensor's pointer is 0: not ours)


# Note [held parameters]: an engine that has released its model's parameters (``.data`` =
# placeholder) registers here, so code below the engine (``infinity.GatheredParameters``) can
# find who holds a parameter and read its value without importing the engine.  A holder has
# ``holds(p) -> bool``, ``read_held(p) -> Tensor`` and ``write_held([(p, value)])`` (both
# collective at world size > 1).
_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()


def register_holder(holder) -> None:
    _HOLDERS.add(holder)


def unregister_holder(holder) -> None:
    _HOLDERS.discard(holder)


def holder_of(p: torch.Tensor):
    """The live engine holding parameter ``p``, or None."""
    for h in list(_HOLDERS):
        if h.holds(p):
            return h
    return None


class Location(enum.Enum):
    NVME = "nvme"
    READING = "reading"
    HOST = "host"
    CACHED = "cached"        # NVMe home + a clean host copy (Note [Cache write-through])
    TO_DEVICE = "to_device"
    DEVICE = "device"


class StateError(RuntimeError):
    """An operation was attempted on a record in the wrong state (a runtime bug)."""


@dataclass
class ParamSlot:
    """Where one parameter lives inside its group's flat buffer."""
    name: str
    param: torch.nn.Parameter
    offset: int          # element offset inside the group
    numel: int
    shape: torch.Size
    trainable: bool


@dataclass(eq=False)
class GroupRecord:
    """A flat group of parameters and its place in the memory tiers."""
    gid: int
    name: str                         # owning module's qualified name
    slots: list[ParamSlot]
    numel: int                        # sum of parameter sizes
    padded_numel: int                 # rounded up for aligned I/O (and world size)
    dtype: torch.dtype                # compute dtype of the fetched buffer
    home: str                         # "device" | "cpu" | "nvme"
    state: Location = Location.DEVICE
    # storage
    device_buf: torch.Tensor | None = None   # flat, padded_numel, compute dtype, when fetched
    host_buf: torch.Tensor | None = None     # flat home copy when home == "cpu"; the
    #                                          cached copy of an NVMe home (CACHED); a
    #                                          quantized group's payload when its home is
    #                                          memory (host, or device: Note [Quantized homes])
    extent: object | None = None             # SwapSpace extent when home == "nvme"
    pending: object | None = None            # in-flight fetch (READING/TO_DEVICE)
    # bookkeeping used by the hooks (and by Note [Overlap safety] in infinity/engine/overlap.py)
    users: int = 0                    # modules currently executing with this group
    saved_refs: int = 0               # autograd saved tensors that reference the buffer
    grads_pending: set = field(default_factory=set)  # slot indices awaiting grads (backward)
    hold_until_backward_end: bool = False
    recompute_users: int = 0          # recomputed uses of a frozen group not yet backpropagated
    prefetched: bool = False          # fetched ahead of use by the prefetcher
    grad_buf: torch.Tensor | None = None     # fp32 accumulation buffer (padded_numel)
    sharded: bool = False             # ZeRO-3: only this rank's shard is at home (paged)
    # offload.frozen_weights: the home holds this quantized payload layout instead of the
    # flat values (a QuantLayout; Note [Quantized homes] in infinity/memory/frozen_quant.py)
    quant: object | None = None

    # ------------------------------------------------------------------ derived
    @property
    def nbytes(self) -> int:
        return self.padded_numel * self.dtype.itemsize

    @property
    def home_nbytes(self) -> int:
        """Bytes of the home copy: the flat buffer, or a quantized group's payload."""
        return self.nbytes if self.quant is None else self.quant.nbytes

    @property
    def trainable(self) -> bool:
        return any(s.trainable for s in self.slots)

    @property
    def resident(self) -> bool:
        """True when the parameters point at valid data (DEVICE)."""
        return self.state is Location.DEVICE

    def _need(self, *states: Location, op: str) -> None:
        if self.state not in states:
            want = " or ".join(s.name for s in states)
            raise StateError(f"group {self.gid} ({self.name or '<root>'}): cannot {op} in state "
                             f"{self.state.name}; it must be {want}")

    # ------------------------------------------------------------------ transitions
    def begin_read(self, buf: torch.Tensor, handle) -> None:
        """NVME -> READING: an NVMe read into ``buf`` (the compute buffer) is in flight."""
        self._need(Location.NVME, op="begin an NVMe read")
        self.device_buf = buf
        self.pending = handle
        self.state = Location.READING

    def finish_read(self) -> None:
        """READING -> DEVICE once the read handle completed."""
        self._need(Location.READING, op="finish an NVMe read")
        self.pending = None
        self.state = Location.DEVICE
        self._point_params()

    def read_landed(self, handle) -> None:
        """READING -> TO_DEVICE: the NVMe read into host staging completed and the
        host-to-device copy ``handle`` into ``device_buf`` is in flight."""
        self._need(Location.READING, op="start the host-to-device copy of a finished read")
        self.pending = handle
        self.state = Location.TO_DEVICE

    def begin_to_device(self, buf: torch.Tensor, handle=None) -> None:
        """HOST or CACHED -> TO_DEVICE: a host-to-device copy into ``buf`` is in flight
        (or done)."""
        self._need(Location.HOST, Location.CACHED, op="begin a host-to-device copy")
        self.device_buf = buf
        self.pending = handle
        self.state = Location.TO_DEVICE

    def finish_to_device(self) -> None:
        """TO_DEVICE -> DEVICE."""
        self._need(Location.TO_DEVICE, op="finish a host-to-device copy")
        self.pending = None
        self.state = Location.DEVICE
        self._point_params()

    def release(self) -> torch.Tensor | None:
        """DEVICE -> home (NVME or HOST), or CACHED. Returns the device buffer to give back
        to its pool.

        Parameters never change during forward/backward, so the home copy is current and
        nothing is written back (the optimizer updates the home directly).
        """
        if self.home == "device" and not self.sharded and self.quant is None:
            raise StateError(f"group {self.gid} ({self.name}): a device-homed group is never "
                             f"released (only a ZeRO-3 shard is)")
        self._need(Location.DEVICE, op="release")
        buf, self.device_buf = self.device_buf, None
        for s in self.slots:
            s.param.data = placeholder(self.dtype, s.shape, s.param.device)
        # an NVMe-homed group whose buffer stays as a clean host copy is CACHED
        if self.home == "nvme":
            self.state = Location.NVME if self.host_buf is None else Location.CACHED
        else:
            self.state = Location.HOST
        self.prefetched = False
        self.hold_until_backward_end = False
        self.recompute_users = 0
        return buf

    def abort_fetch(self) -> torch.Tensor | None:
        """READING/TO_DEVICE -> home: an in-flight fetch is abandoned (it failed, or the
        window it was for failed).  Returns the buffer it was filling (to give back), or
        None when that was the host copy itself."""
        self._need(Location.READING, Location.TO_DEVICE, op="abandon a fetch")
        buf, self.device_buf = self.device_buf, None
        self.pending = None
        for s in self.slots:
            s.param.data = placeholder(self.dtype, s.shape, s.param.device)
        self.state = self._home_state()
        self.prefetched = False
        return None if buf is self.host_buf else buf

    def drop_host_copy(self) -> None:
        """CACHED -> NVME: an NVMe-homed group forgets its cached host copy (the NVMe home
        is current: the copy was written through)."""
        if self.home != "nvme":
            raise StateError(f"group {self.gid} ({self.name}): only an NVMe-homed group has a "
                             f"cached host copy to drop (home {self.home!r})")
        self._need(Location.CACHED, op="drop its cached host copy")
        self.host_buf = None
        self.state = Location.NVME

    def forget_host_copy(self) -> None:
        """DEVICE stays DEVICE: an NVMe-homed group in use stops treating its buffer as a
        cached host copy (it is released to its home afterwards).  A ZeRO-3 group being
        gathered (TO_DEVICE) may forget its cached shard copy too, once the gather that
        read it has finished (the manager waits for it first)."""
        if self.home != "nvme":
            raise StateError(f"group {self.gid} ({self.name}): only an NVMe-homed group has a "
                             f"cached host copy to forget (home {self.home!r})")
        if self.sharded:
            self._need(Location.DEVICE, Location.TO_DEVICE, op="forget its cached host copy")
        else:
            self._need(Location.DEVICE, op="forget its cached host copy")
        self.host_buf = None

    def make_resident(self, buf: torch.Tensor) -> None:
        """Initial placement of a device-homed group (always DEVICE afterwards)."""
        if self.home != "device":
            raise StateError(f"group {self.gid} ({self.name}): make_resident needs home 'device', "
                             f"home is {self.home!r}")
        self.device_buf = buf
        self.state = Location.DEVICE
        self._point_params()

    def set_home_state(self) -> None:
        """Initial state after the home copy has been written (params empty until fetched);
        also where an interrupted release ends up (Note [window abort])."""
        self.state = self._home_state()
        for s in self.slots:
            s.param.data = placeholder(self.dtype, s.shape, s.param.device)

    # ------------------------------------------------------------------ helpers
    def _home_state(self) -> Location:
        """The state of a group that is not fetched: at its home, or (NVMe home with a
        clean host copy) cached."""
        if self.home == "nvme":
            return Location.NVME if self.host_buf is None else Location.CACHED
        return Location.HOST

    def _point_params(self) -> None:
        buf = self.device_buf
        for s in self.slots:
            s.param.data = buf[s.offset:s.offset + s.numel].view(s.shape)

    def view_of(self, slot: ParamSlot, flat: torch.Tensor) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
