"""``CudaDevice`` driven through a fake ``torch.cuda`` (no GPU here): the stream and event
calls the CUDA path makes, checked call by call.

* an H2D records its destination on the copy stream (``record_stream``: the allocator
  must not hand the memory out while the copy may still write it) and is bracketed by
  timing events (link seconds are the copy's device time);
* the next copy into a buffer compute gave back waits for compute's last use, and a
  buffer the pool frees forgets that event (a new allocation at the same address must
  not wait on a stale one);
* the ZeRO-3 gather's helpers: the side stream, the completion marker compute waits on.
"""
import contextlib

import pytest
import torch

from infinity.memory.accounting import Accounting
from infinity.memory.device import CudaDevice


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.enable_timing = enable_timing
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 1.5


class FakeStream:
    def __init__(self, name="s"):
        self.name = name
        self.waited: list = []

    def wait_event(self, ev):
        self.waited.append(ev)


class FakeCuda:
    """What CudaDevice uses of torch.cuda."""

    def __init__(self):
        self.compute = FakeStream("compute")
        self.current = self.compute
        self.made: list = []
        self.devices_entered: list = []

    def Stream(self, device=None):
        s = FakeStream(f"side{len(self.made)}")
        self.made.append(s)
        return s

    def Event(self, enable_timing=False):
        return FakeEvent(enable_timing)

    @contextlib.contextmanager
    def stream(self, s):
        old, self.current = self.current, s
        try:
            yield
        finally:
            self.current = old

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def device(self, d):
        self.devices_entered.append(torch.device(d))
        yield


class FakeTensor:
    """Just what the copy path touches: device, size, storage pointer, copy_, record_stream."""

    def __init__(self, ptr, numel, device):
        self.ptr, self.n, self.device = ptr, numel, torch.device(device)
        self.recorded: list = []
        self.copied_from = None

    def numel(self):
        return self.n

    def element_size(self):
        return 4

    def is_pinned(self):
        return True

    def untyped_storage(self):
        return type("S", (), {"data_ptr": lambda _s: self.ptr})()

    def data_ptr(self):
        return self.ptr

    def copy_(self, src, non_blocking=False):
        assert non_blocking, "a device copy must not block the host"
        self.copied_from = src
        return self

    def record_stream(self, s):
        self.recorded.append(s)


@pytest.fixture
def fake(monkeypatch):
    fc = FakeCuda()
    for name in ("Stream", "Event", "stream", "current_stream", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fc, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fc


class _HostBackedCuda(CudaDevice):
    """The real CudaDevice with a host allocator for its pool (buffers are only keyed by
    address here); its on_drop hook is the real one."""

    def _pool_kw(self):
        kw = super()._pool_kw()
        kw["allocator"] = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
        return kw


def _dev(fake):
    return _HostBackedCuda(torch.device("cuda", 0), 1 << 20, Accounting())


def test_h2d_records_its_destination_and_is_device_timed(fake):
    dev = _dev(fake)
    dst, src = FakeTensor(0x1000, 256, "cuda:0"), FakeTensor(0x9000, 256, "cpu")
    x = dev.h2d(dst, src)
    assert dst.copied_from is src
    assert dst.recorded == [dev.h2d_stream]          # the allocator waits for the copy
    assert x.start is not None and x.start.enable_timing and x.event.enable_timing
    assert x.start.recorded_on is dev.h2d_stream and x.event.recorded_on is dev.h2d_stream
    assert x.ready() and x.seconds() == 1.5e-3       # elapsed_time is in milliseconds
    # issued under its own device (the manager's lander thread issues H2Ds too)
    assert fake.devices_entered == [torch.device("cuda", 0)]
    d = dev.d2h(FakeTensor(0xa000, 256, "cpu"), FakeTensor(0x2000, 256, "cuda:0"))
    assert d.start is not None and d.start.recorded_on is dev.d2h_stream
    with pytest.raises(ValueError, match="host source"):
        dev.h2d(FakeTensor(0x1000, 4, "cuda:0"), FakeTensor(0x2000, 4, "cuda:0"))


def test_next_copy_waits_for_compute_unless_the_buffer_was_freed(fake):
    dev = _dev(fake)
    buf = dev.lease(4096, torch.uint8)
    ptr = buf.untyped_storage().data_ptr()
    dev.give_back(buf)                                # compute's last use: an event
    last_use = dev._free_after[ptr]
    assert last_use.recorded_on is fake.compute
    dev.h2d(FakeTensor(ptr, 4, "cuda:0"), FakeTensor(0x9000, 4, "cpu"))
    assert dev.h2d_stream.waited == [last_use]        # the copy comes after compute
    buf = dev.lease(4096, torch.uint8)
    dev.give_back(buf)
    assert ptr in dev._free_after
    dev.pool.trim()                                   # memory back to the allocator
    assert ptr not in dev._free_after                 # no stale event for a new buffer
    dev.h2d(FakeTensor(ptr, 4, "cuda:0"), FakeTensor(0x9000, 4, "cpu"))
    assert dev.h2d_stream.waited == [last_use]        # nothing more waited on


def test_gather_stream_waits_for_compute_and_compute_waits_for_the_marker(fake):
    dev = _dev(fake)
    buf = dev.lease(4096, torch.uint8)
    ptr = buf.untyped_storage().data_ptr()
    dev.give_back(buf)
    last_use = dev._free_after[ptr]
    out = FakeTensor(ptr, 1024, "cuda:0")
    with dev.side_stream():
        assert fake.current is dev.gather_stream
        dev.wait_free(out)                            # before the all-gather writes it
        marker = dev.mark(out)
    assert dev.gather_stream.waited == [last_use]
    assert marker.event.recorded_on is dev.gather_stream
    assert out.recorded == [dev.gather_stream]
    dev.compute_waits(marker)
    assert fake.compute.waited == [marker.event]      # stream order, host not blocked
