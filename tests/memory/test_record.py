"""The Location state machine: transitions through the owner's methods only, with checks."""
import pytest
import torch

from infinity.memory.record import GroupRecord, Location, ParamSlot, StateError


def _group(home="nvme"):
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).view(2, 3))
    q = torch.nn.Parameter(torch.ones(5))
    slots = [ParamSlot("w", p, 0, 6, p.shape, True), ParamSlot("b", q, 16, 5, q.shape, True)]
    return GroupRecord(0, "lin", slots, 21, 1024, torch.float32, home), p, q


def test_nvme_cycle_points_params_at_the_buffer_and_back():
    g, p, q = _group("nvme")
    g.set_home_state()
    assert g.state is Location.NVME
    assert p.shape == (2, 3) and torch.isnan(p).all()   # placeholder keeps the shape
    buf = torch.zeros(1024)
    buf[:6] = torch.arange(6.0)
    g.begin_read(buf, handle=None)
    assert g.state is Location.READING
    g.finish_read()
    assert g.state is Location.DEVICE
    assert torch.equal(p, torch.arange(6.0).view(2, 3))
    assert p.data_ptr() == buf.data_ptr()
    assert q.data_ptr() == buf[16:].data_ptr()
    out = g.release()
    assert out is buf and g.state is Location.NVME and g.device_buf is None
    assert p.shape == (2, 3) and p.untyped_storage().nbytes() == 4


@pytest.mark.parametrize("op,args,state", [
    ("finish_read", (), Location.NVME),
    ("release", (), Location.NVME),
    ("begin_to_device", (torch.zeros(4),), Location.NVME),
    ("drop_host_copy", (), Location.NVME),
])
def test_wrong_state_raises_with_actual_state(op, args, state):
    g, _, _ = _group("nvme")
    g.set_home_state()
    with pytest.raises(StateError) as ei:
        getattr(g, op)(*args)
    assert state.name in str(ei.value) and "lin" in str(ei.value)


def test_double_read_rejected():
    g, _, _ = _group("nvme")
    g.set_home_state()
    g.begin_read(torch.zeros(1024), None)
    with pytest.raises(StateError, match="READING"):
        g.begin_read(torch.zeros(1024), None)


def test_host_cycle():
    g, p, _ = _group("cpu")
    g.set_home_state()
    assert g.state is Location.HOST
    with pytest.raises(StateError, match="HOST"):
        g.finish_to_device()
    g.begin_to_device(torch.zeros(1024))
    assert g.state is Location.TO_DEVICE
    g.finish_to_device()
    g.release()
    assert g.state is Location.HOST


def test_cached_cycle():
    """An NVMe-homed group released with a clean host copy is CACHED: used again like a
    host home, or forgets the copy and is back at NVME."""
    g, p, _ = _group("nvme")
    g.set_home_state()
    buf = torch.zeros(1024)
    g.begin_read(buf, None)
    g.finish_read()
    g.host_buf = buf                      # the manager kept the buffer as a cached copy
    assert g.release() is buf and g.state is Location.CACHED
    assert torch.isnan(p).all()
    g.begin_to_device(buf)
    g.finish_to_device()
    assert g.state is Location.DEVICE and p.data_ptr() == buf.data_ptr()
    g.release()
    assert g.state is Location.CACHED
    g.drop_host_copy()
    assert g.state is Location.NVME and g.host_buf is None
    with pytest.raises(StateError, match="NVME"):
        g.drop_host_copy()


def test_device_home_is_never_released():
    g, p, _ = _group("device")
    g.make_resident(torch.zeros(1024))
    with pytest.raises(StateError, match="never"):
        g.release()
