"""The device tier's transfer protocol: buffers, host<->device copies, events.

One small interface, three implementations:

* :class:`CpuDevice` - a CPU-only machine.  The device tier is host memory bounded by
  ``device_memory_gb``; a host-homed group is used in place (``zero_copy``) and an
  NVMe-homed group is read straight into the compute buffer, so no copy happens.
* :class:`CudaDevice` - a GPU.  Device buffers come from a budgeted pool on the GPU
  (default budget: free memory minus a documented headroom, :func:`default_device_budget`);
  host->device and device->host copies run with ``non_blocking=True`` on two dedicated
  ``torch.cuda.Stream`` s from pinned host buffers (``infinity.io.aligned_empty``
  registers them with ``cudaHostRegister`` once a CUDA engine exists), bracketed by
  timing events (:meth:`Transfer.seconds` is the copy's device time); ZeRO-3 all-gathers
  run on a third stream (:meth:`DeviceTier.side_stream`, :meth:`DeviceTier.mark`).  Compute makes the current stream wait on that event
  (:meth:`compute_waits`) instead of blocking the host, a host staging buffer goes back
  to its pool only once its event has completed (:meth:`retire`/:meth:`poll`), and a
  device buffer given back after compute records a compute-stream event that the next
  copy into it waits on; so does a buffer fresh from the allocator (Note [fresh device
  memory]).
* :class:`SimulatedDevice` - the same protocol on CPU with *deferred* copies: a copy
  happens only when its event completes (after ``delay`` queries, or when someone
  waits on it), and fresh device buffers are NaN-filled.  Reading a buffer before its
  event, or reusing a source buffer before its copy ran, produces wrong numbers, and a
  copy into device memory that nothing ordered after compute's earlier use of it raises
  (Note [fresh device memory]), so the protocol's ordering is tested without a GPU
  (``tests/memory/test_device.py``).
  ``INFINITY_SIMULATE_DEVICE=1`` makes :func:`make_device` return it for CPU runs at any
  world size (a testing aid; budget ``offload.device_memory_gb``, else 1 GB).

A :class:`Transfer` is one copy: ``dst``, ``src``, its ``event``, bytes and issue time.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque

import torch

from .accounting import Accounting
from .pool import BufferPool

log = logging.getLogger("infinity.memory")

__all__ = ["Transfer", "DeviceTier", "CpuDevice", "CudaDevice", "SimulatedDevice",
           "make_device", "choose_device", "default_device_budget", "simulate_device",
           "SIMULATED_DEFAULT_BUDGET"]

# INFINITY_SIMULATE_DEVICE=1 (a testing aid): the device tier of a CPU run is a
# SimulatedDevice with this budget when offload.device_memory_gb is unset
SIMULATE_ENV = "INFINITY_SIMULATE_DEVICE"
SIMULATED_DEFAULT_BUDGET = 10**9


def simulate_device() -> bool:
    """Whether ``INFINITY_SIMULATE_DEVICE`` asks for the simulated device tier (a testing
    aid: the CUDA protocol - leases, copies, events, budgets - on CPU at any world size)."""
    v = os.environ.get(SIMULATE_ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{SIMULATE_ENV}={os.environ.get(SIMULATE_ENV)!r}: expected 1 or 0")


class Transfer:
    """One asynchronous copy ``dst <- src`` with the event recorded after it (and, on CUDA,
    a timing ``start`` event recorded before it: :meth:`seconds` is then the copy's own
    duration on the device, not when Python happened to observe the event)."""
    __slots__ = ("dst", "src", "event", "link", "nbytes", "t0", "t_done", "start")

    def __init__(self, dst, src, event, link: str, t0: float, start=None):
        self.dst, self.src, self.event, self.link = dst, src, event, link
        self.nbytes = src.numel() * src.element_size()
        self.t0 = t0
        self.t_done: float | None = None     # first time the event was seen complete
        self.start = start

    def seconds(self) -> float:
        """How long the copy took (call once it completed): device-timed on CUDA, else
        from issue to the first time its completion was seen."""
        if self.start is not None and self.t_done is not None:
            return self.start.elapsed_time(self.event) / 1e3
        return max(0.0, (self.t_done if self.t_done is not None else time.perf_counter())
                   - self.t0)

    @property
    def t_end(self) -> float:
        """``t0`` plus :meth:`seconds` (for timelines and link accounting)."""
        return self.t0 + self.seconds()

    def ready(self) -> bool:
        """Non-blocking: has the copy completed? (stamps the completion time)."""
        if self.t_done is None and self.event.query():
            self.t_done = time.perf_counter()
        return self.t_done is not None

    def wait_host(self) -> None:
        """Block the host until the copy completed (for host-side consumers of a D2H)."""
        if self.t_done is None:
            self.event.synchronize()
            self.t_done = time.perf_counter()


class DeviceTier:
    """Interface shared by the implementations (see the module docstring)."""
    kind = "abstract"
    zero_copy = False     # True: host memory is directly usable by compute

    def __init__(self, budget_bytes: int | None, accounting: Accounting):
        self.acct = accounting
        self.pool = BufferPool("device", budget_bytes, accounting, **self._pool_kw())
        self._retiring: list[tuple[Transfer, object]] = []
        self._overflow_warned = False

    def _pool_kw(self) -> dict:
        return {}

    # buffers ------------------------------------------------------------------
    def lease(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.pool.lease(nbytes, dtype)

    def give_back(self, buf: torch.Tensor) -> None:
        """Return a device buffer after compute used it (see :meth:`_after_compute`)."""
        self._after_compute(buf)
        self.pool.give_back(buf)

    def _after_compute(self, buf: torch.Tensor) -> None:
        pass

    # Note [fresh device memory]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A device buffer fresh from torch's caching allocator is free only with respect to
    # the stream that allocated it (compute): its memory may have held an activation that
    # compute freed while kernels reading it are still queued.  A copy into it on a copy
    # stream must therefore wait for compute's work so far, exactly as a copy into a buffer
    # given back after compute does.  Found on the first GPU run (H200): without this, the
    # first micro-step's backward (on-demand fetches into fresh buffers while recomputed
    # activations were being freed) read overwritten weights: NaN or wrong gradients.
    def _fresh(self, buf: torch.Tensor) -> torch.Tensor:
        """A buffer just allocated for the pool: ordered after compute's work so far."""
        self._after_compute(buf)
        return buf

    def lease_or_overflow(self, nbytes: int, dtype: torch.dtype, what: str,
                          allow_overflow: bool = True) -> torch.Tensor | None:
        """A device buffer within the budget; when the budget is full: None if
        ``allow_overflow`` is false, else one past the budget so training progresses -
        counted (``device_budget_overflows``) and warned once with what to change."""
        if self.pool.can_lease(nbytes):
            return self.pool.lease(nbytes, dtype)
        if not allow_overflow:
            return None
        if not self._overflow_warned:
            log.warning("device tier: budget of %s bytes too small for %s (%d more bytes); "
                        "exceeding it to make progress: lower prefetch.depth or raise "
                        "offload.device_memory_gb (stats()['device_budget_overflows'] counts "
                        "these)", self.pool.budget, what, nbytes)
            self._overflow_warned = True
        self.acct.count("device_budget_overflows")
        budget, self.pool.budget = self.pool.budget, None
        try:
            return self.pool.lease(nbytes, dtype)
        finally:
            self.pool.budget = budget

    # streams for collectives ------------------------------------------------------
    def side_stream(self):
        """Context in which a helper thread issues device work (all-gathers) off the
        compute stream; a no-op where there are no streams."""
        return contextlib.nullcontext()

    def mark(self, buf: torch.Tensor) -> "Transfer":
        """A completion marker for work the calling thread issued on its current stream
        that wrote ``buf`` (an all-gather): compute waits on it with :meth:`compute_waits`."""
        return Transfer(buf, buf, _DoneEvent(), "mark", time.perf_counter())

    def wait_free(self, buf: torch.Tensor) -> None:
        """Order the calling thread's current stream after compute's last use of ``buf``,
        before a collective overwrites it (CUDA; elsewhere compute is already done)."""

    # copies -------------------------------------------------------------------
    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        raise NotImplementedError

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        raise NotImplementedError

    def compute_waits(self, t: Transfer) -> None:
        """Compute may use ``t.dst`` after this call (stream-ordered, host not blocked)."""
        raise NotImplementedError

    def refresh(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Overwrite a device buffer that compute keeps using (a resident group after an
        optimizer step): the copy waits for compute's earlier use of ``dst``, and compute's
        later use waits for the copy.  The host is not blocked; ``src`` must stay
        unchanged until the returned transfer completed."""
        self._after_compute(dst)
        t = self.h2d(dst, src)
        self.compute_waits(t)
        return t

    # deferred release ------------------------------------------------------------
    def retire(self, t: Transfer, on_done) -> None:
        """Call ``on_done()`` once ``t`` completed (e.g. give a staging buffer back)."""
        if t.ready():
            on_done()
        else:
            self._retiring.append((t, on_done))

    def poll(self) -> None:
        """Run the ``retire`` callbacks whose transfers have completed."""
        if not self._retiring:
            return
        keep = []
        for t, fn in self._retiring:
            if t.ready():
                fn()
            else:
                keep.append((t, fn))
        self._retiring = keep

    def drain(self) -> None:
        """Wait for every pending transfer and run its callback (close, errors)."""
        for t, fn in self._retiring:
            t.wait_host()
            fn()
        self._retiring = []

    def close(self) -> None:
        self.drain()
        self.pool.close()


class _DoneEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuDevice(DeviceTier):
    """CPU-only machine: the device tier is budgeted host memory; copies are memcpy."""
    kind = "cpu"
    zero_copy = True

    def h2d(self, dst, src):
        t0 = time.perf_counter()
        dst.copy_(src)
        return Transfer(dst, src, _DoneEvent(), "h2d", t0)

    def d2h(self, dst, src):
        t0 = time.perf_counter()
        dst.copy_(src)
        return Transfer(dst, src, _DoneEvent(), "d2h", t0)

    def compute_waits(self, t):
        pass


class CudaDevice(DeviceTier):
    """A CUDA device: budgeted device pool, two copy streams, events (see module doc)."""
    kind = "cuda"

    def __init__(self, device: torch.device, budget_bytes: int | None, accounting: Accounting):
        if not torch.cuda.is_available():
            raise RuntimeError(f"memory: device {device} requested but CUDA is not available")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if budget_bytes is None:
            budget_bytes = default_device_budget(self.device, None)
        super().__init__(budget_bytes, accounting)
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self.gather_stream = torch.cuda.Stream(self.device)   # ZeRO-3 all-gathers
        self._free_after: dict[int, object] = {}   # device buffer ptr -> compute event

    def _pool_kw(self) -> dict:
        dev = self.device

        def alloc(nbytes: int) -> torch.Tensor:
            return self._fresh(torch.empty(nbytes, dtype=torch.uint8, device=dev))

        def on_drop(raw: torch.Tensor) -> None:
            # the memory goes back to the allocator: a later buffer at the same address
            # must not wait on this one's last-use event
            self._free_after.pop(raw.untyped_storage().data_ptr(), None)
        return {"allocator": alloc, "on_drop": on_drop}

    def _after_compute(self, buf):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._free_after[buf.untyped_storage().data_ptr()] = ev

    def h2d(self, dst, src):
        if src.device.type != "cpu" or dst.device != self.device:
            raise ValueError(f"h2d: expected a host source and a {self.device} destination, "
                             f"got {src.device} -> {dst.device}")
        if not src.is_pinned():
            log.debug("h2d: source is not pinned; the copy will not overlap compute")
        t0 = time.perf_counter()
        s = self.h2d_stream
        # (kept, not popped: every copy into any view of this buffer waits for compute's
        # last use of it; an event already passed costs nothing)
        prev = self._free_after.get(dst.untyped_storage().data_ptr())
        # (also issued from the manager's lander thread: Note [H2D on landing])
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            if prev is not None:          # compute's last use of this buffer comes first
                s.wait_event(prev)
            start = torch.cuda.Event(enable_timing=True)
            start.record(s)
            dst.copy_(src, non_blocking=True)
            dst.record_stream(s)           # written on this stream: the allocator waits
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
        return Transfer(dst, src, ev, "h2d", t0, start)

    def d2h(self, dst, src):
        if dst.device.type != "cpu" or src.device != self.device:
            raise ValueError(f"d2h: expected a {self.device} source and a host destination, "
                             f"got {src.device} -> {dst.device}")
        t0 = time.perf_counter()
        s = self.d2h_stream
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))   # src written by compute
        with torch.cuda.stream(s):
            s.wait_event(produced)
            start = torch.cuda.Event(enable_timing=True)
            start.record(s)
            dst.copy_(src, non_blocking=True)
            src.record_stream(s)           # the allocator must not reuse src before this
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
        return Transfer(dst, src, ev, "d2h", t0, start)

    def compute_waits(self, t):
        torch.cuda.current_stream(self.device).wait_event(t.event)

    def side_stream(self):
        return torch.cuda.stream(self.gather_stream)

    def mark(self, buf):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        buf.record_stream(torch.cuda.current_stream(self.device))
        return Transfer(buf, buf, ev, "mark", time.perf_counter())

    def wait_free(self, buf):
        prev = self._free_after.get(buf.untyped_storage().data_ptr())
        if prev is not None:
            torch.cuda.current_stream(self.device).wait_event(prev)


# ---------------------------------------------------------------- simulation on CPU
class _SimStream:
    """An in-order queue of deferred operations."""

    def __init__(self, name: str):
        self.name = name
        self.ops: deque = deque()            # (fn, event)
        self.lock = threading.RLock()        # a gather thread and compute both drive it

    def run_until(self, event) -> None:
        with self.lock:
            while not event.done:
                fn, ev = self.ops.popleft()
                if fn is not None:
                    fn()
                ev.done = True


class _SimEvent:
    """Completes after ``delay`` queries, or when waited on; completing it runs every
    operation queued on its stream before it (streams are in order)."""

    def __init__(self, stream: _SimStream, delay: int):
        self.stream, self.left, self.done = stream, delay, False

    def query(self) -> bool:
        if not self.done:
            self.left -= 1
            if self.left <= 0:
                self.stream.run_until(self)
        return self.done

    def synchronize(self) -> None:
        self.stream.run_until(self)


class SimulatedDevice(DeviceTier):
    """The CUDA protocol on CPU with deferred copies (for tests; see module doc).

    ``delay``: how many ``query()`` calls an event needs before it completes by itself
    (a large value means "only when waited on").  ``log`` records the order of
    ``h2d``/``d2h``/``wait``/``done`` operations for assertions."""
    kind = "simulated"

    def __init__(self, budget_bytes: int | None, accounting: Accounting, *, delay: int = 2):
        super().__init__(budget_bytes, accounting)
        self.delay = delay
        self.h2d_stream = _SimStream("h2d")
        self.d2h_stream = _SimStream("d2h")
        self.log: list[tuple[str, int]] = []

    def _pool_kw(self) -> dict:
        # (the pool is built by DeviceTier.__init__: the ordering set must exist first)
        self._ordered: set[int] = set()

        def alloc(nbytes: int) -> torch.Tensor:
            # fresh device memory is garbage: NaN makes any early use visible
            return self._fresh(torch.full((nbytes // 4,), float("nan"),
                                          dtype=torch.float32).view(torch.uint8))

        def on_drop(raw: torch.Tensor) -> None:
            self._ordered.discard(raw.untyped_storage().data_ptr())
        return {"allocator": alloc, "on_drop": on_drop}

    def _after_compute(self, buf):
        # what CUDA records as an event (Note [fresh device memory]): copies into this
        # memory are ordered after compute's use of it
        self._ordered.add(buf.untyped_storage().data_ptr())

    def _copy(self, stream: _SimStream, link: str, dst, src) -> Transfer:
        if dst.shape != src.shape:
            raise ValueError(f"{link}: shape mismatch {tuple(src.shape)} -> {tuple(dst.shape)}")
        t0 = time.perf_counter()
        ev = _SimEvent(stream, self.delay)
        key = dst.data_ptr()
        with stream.lock:
            stream.ops.append((lambda: (dst.copy_(src), self.log.append(("done", key))), ev))
            self.log.append((link, key))
        return Transfer(dst, src, ev, link, t0)

    def h2d(self, dst, src):
        if dst.untyped_storage().data_ptr() not in self._ordered:
            raise RuntimeError(
                "device protocol: a host-to-device copy into device memory that nothing "
                "ordered after compute's earlier use of it (a buffer not from the device "
                "pool, or one the pool allocated without DeviceTier._fresh): on a GPU it can "
                "overwrite memory queued kernels still read (Note [fresh device memory])")
        return self._copy(self.h2d_stream, "h2d", dst, src)

    def d2h(self, dst, src):
        return self._copy(self.d2h_stream, "d2h", dst, src)

    def compute_waits(self, t):
        # compute runs on the host thread here: waiting on the event = running the copy
        t.event.synchronize()
        self.log.append(("wait", t.dst.data_ptr()))


def choose_device(param_devices, *, cuda_available: bool, world_size: int,
                  local_rank: int = 0) -> torch.device:
    """The device the engine computes on, from the devices of the model's parameters.

    All on one CUDA device: that device (it keeps it, at any world size).  All on CPU (a
    model built on CPU, or under ``infinity.Init``), or no parameters: at world size > 1
    with CUDA available, this rank's GPU ``cuda:LOCAL_RANK`` (the engine places the
    groups there, as DeepSpeed does); otherwise ``cpu``.  ``INFINITY_SIMULATE_DEVICE=1``
    keeps a CPU model on CPU (its device tier is then simulated).  Anything else raises
    with what to do: parameters on several devices (``ValueError``), another device type
    (``NotImplementedError``), CUDA parameters without CUDA (``RuntimeError``)."""
    devs = sorted({torch.device(d) for d in param_devices}, key=str)
    if len(devs) > 1:
        raise ValueError(f"initialize: the model's parameters are on several devices "
                         f"({', '.join(map(str, devs))}); move the whole model to one device "
                         f"(model.to('cuda:0') or model.cpu()) before initialize")
    dev = devs[0] if devs else torch.device("cpu")
    if dev.type == "cpu":
        if world_size > 1 and cuda_available and not simulate_device():
            return torch.device("cuda", int(local_rank))
        return dev
    if dev.type != "cuda":
        raise NotImplementedError(f"initialize: parameters on {dev}; supported devices are "
                                  f"cpu and cuda; move the model to one of them (a model "
                                  f"built on 'meta' must be materialised, e.g. with "
                                  f"infinity.Init and infinity.zero.init.load_safetensors)")
    if not cuda_available:
        raise RuntimeError(f"initialize: parameters on {dev} but CUDA is not available")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# the default CUDA budget leaves this much of the device for activations, the CUDA
# context, NCCL and allocator fragmentation (docs/architecture.md, "Engine wiring")
DEVICE_HEADROOM_FRACTION = 0.15
DEVICE_HEADROOM_MIN = 2 * 10**9


def default_device_budget(device: torch.device, configured: int | None,
                          model_bytes_on_device: int = 0, *, mem_info=None) -> int | None:
    """The device tier's budget: ``offload.device_memory_gb`` when set; on CUDA otherwise
    the free device memory now plus the bytes of the model's parameters already on that
    device (they move into the engine's pools when the groups are placed), minus a
    headroom of ``max(15 % of the device's total memory, 2 GB)`` for activations and the
    CUDA context (never below half of the rest); on CPU None (unbounded), or 1 GB for the
    simulated device (``INFINITY_SIMULATE_DEVICE=1``).  ``mem_info``: ``(free, total)``
    instead of asking CUDA (tests)."""
    if configured is not None:
        return configured
    device = torch.device(device)
    if device.type == "cpu" and simulate_device():
        return SIMULATED_DEFAULT_BUDGET
    if device.type != "cuda":
        return None
    free, total = mem_info if mem_info is not None else torch.cuda.mem_get_info(device)
    avail = int(free) + int(model_bytes_on_device)
    headroom = max(int(total * DEVICE_HEADROOM_FRACTION), DEVICE_HEADROOM_MIN)
    return max(avail - headroom, avail // 2)


def make_device(device: torch.device, budget_bytes: int | None,
                accounting: Accounting) -> DeviceTier:
    """The device tier for ``device`` (``cpu`` or ``cuda[:i]``); on CPU with
    ``INFINITY_SIMULATE_DEVICE=1`` a :class:`SimulatedDevice` (budget ``budget_bytes``,
    else :data:`SIMULATED_DEFAULT_BUDGET`)."""
    device = torch.device(device)
    if device.type == "cpu" and simulate_device():
        return SimulatedDevice(SIMULATED_DEFAULT_BUDGET if budget_bytes is None
                               else budget_bytes, accounting)
    if device.type == "cpu":
        return CpuDevice(budget_bytes, accounting)
    if device.type == "cuda":
        return CudaDevice(device, budget_bytes, accounting)
    raise ValueError(f"memory: no device tier for {device}; supported: cpu, cuda")
