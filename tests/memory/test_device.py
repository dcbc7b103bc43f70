"""The device tier's transfer protocol, exercised on CPU.

``SimulatedDevice`` defers every copy until its event completes (after ``delay``
queries or when waited on) and NaN-fills fresh device memory, so using a buffer
before its event, or reusing a staging buffer before its copy ran, gives wrong
numbers.  The manager-level tests check values, budgets and ordering; the
"broken manager" tests show that those checks do catch the two ordering bugs.
"""
import functools
import time

import pytest
import torch
from torch import nn

import infinity
from infinity.io import AioEngine, SwapSpace
from infinity.memory.accounting import Accounting
from infinity.memory.device import CpuDevice, SimulatedDevice, make_device
from infinity.memory.manager import MemoryManager
from infinity.memory.pool import BufferPool
from infinity.memory.record import GroupRecord, Location, ParamSlot
from infinity.profile import Timeline

NEVER = 10 ** 9          # an event that completes only when someone waits on it


# ------------------------------------------------------------------ the device alone
def test_simulated_copy_happens_only_when_its_event_completes():
    dev = SimulatedDevice(None, Accounting(), delay=3)
    dst = dev.lease(4096, torch.float32)
    src = torch.arange(1024, dtype=torch.float32)
    x = dev.h2d(dst, src)
    assert torch.isnan(dst).all()                 # fresh device memory is garbage
    assert not x.ready() and not x.ready()        # two queries: still in flight
    assert torch.isnan(dst).all()
    assert x.ready() and torch.equal(dst, src)    # third query completes it
    assert x.t_done is not None and x.t_done >= x.t0


def test_simulated_streams_are_in_order_and_compute_wait_runs_the_copy():
    dev = SimulatedDevice(None, Accounting(), delay=NEVER)
    a, b = dev.lease(4096, torch.float32), dev.lease(4096, torch.float32)
    xa = dev.h2d(a, torch.full((1024,), 1.0))
    xb = dev.h2d(b, torch.full((1024,), 2.0))
    dev.compute_waits(xb)                         # waiting on b completes a first (in order)
    assert xa.ready() and bool((a == 1).all()) and bool((b == 2).all())
    host = torch.zeros(1024)
    xd = dev.d2h(host, b)
    assert bool((host == 0).all())
    xd.wait_host()
    assert bool((host == 2).all())


def test_copy_into_device_memory_must_be_ordered_after_compute():
    """Note [fresh device memory] (first found on a GPU): a buffer fresh from the allocator is
    free only for the compute stream, so the pool orders it after compute's work (as a
    give-back does) before a copy stream may write it; memory nothing ordered is refused."""
    dev = SimulatedDevice(None, Accounting(), delay=NEVER)
    dst = dev.lease(4096, torch.float32)           # fresh from the pool's allocator
    dev.compute_waits(dev.h2d(dst, torch.ones(1024)))
    assert bool((dst == 1).all())
    dev.give_back(dst)
    again = dev.lease(4096, torch.float32)         # the same buffer, given back after compute
    dev.compute_waits(dev.h2d(again, torch.full((1024,), 2.0)))
    assert bool((again == 2).all())
    with pytest.raises(RuntimeError, match="fresh device memory"):
        dev.h2d(torch.empty(1024), torch.ones(1024))   # not the pool's: nothing ordered it


def test_an_allocator_that_skips_the_ordering_is_caught_by_the_engine(monkeypatch):
    """The GPU defect as the simulated device sees it: with DeviceTier._fresh not ordering
    fresh buffers, the engine's first step (every fetch on demand into fresh buffers) fails
    with the protocol error instead of computing on overwritten weights."""
    import infinity.engine.build as eng_mod
    from infinity.memory.device import DeviceTier

    monkeypatch.setattr(DeviceTier, "_fresh", lambda self, buf: buf)
    monkeypatch.setattr(eng_mod, "make_device",
                        lambda device, budget, acct: SimulatedDevice(budget, acct, delay=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    cfg = {"offload": {"params": "cpu", "optimizer": "cpu", "device_memory_gb": 0.001}}
    with infinity.initialize(model, cfg) as e:
        with pytest.raises(RuntimeError, match="fresh device memory"):
            e(torch.randn(4, 16))


def test_retire_runs_callback_only_after_the_copy_completed():
    dev = SimulatedDevice(None, Accounting(), delay=2)
    dst = dev.lease(4096, torch.float32)
    x = dev.h2d(dst, torch.ones(1024))
    freed = []
    dev.retire(x, lambda: freed.append(1))        # first query: not done
    assert freed == []
    dev.poll()                                    # second query: done
    assert freed == [1] and bool((dst == 1).all())


def test_cpu_device_is_zero_copy_and_make_device_selects_by_device():
    assert isinstance(make_device(torch.device("cpu"), None, Accounting()), CpuDevice)
    assert make_device("cpu", None, Accounting()).zero_copy
    with pytest.raises(ValueError, match="no device tier"):
        make_device("meta", None, Accounting())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_device("cuda", None, Accounting())


def test_device_budget_is_enforced_by_the_pool():
    acct = Accounting()
    dev = SimulatedDevice(2 * 4096, acct)
    a = dev.lease(4096, torch.float32)
    dev.lease(4096, torch.float32)
    assert not dev.pool.can_lease(4096)
    dev.give_back(a)
    assert dev.pool.can_lease(4096)
    assert acct.as_dict()["device_peak_bytes"] == 2 * 4096


# ------------------------------------------------------------------ through the manager
def _groups(n, home, numel=1000, padded=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    out, values = [], []
    for i in range(n):
        p = nn.Parameter(torch.randn(numel, generator=g))
        values.append(p.detach().clone())
        slots = [ParamSlot(f"w{i}", p, 0, numel, p.shape, True)]
        out.append(GroupRecord(i, f"m{i}", slots, numel, padded, torch.float32, home))
    return out, values


def _manager(groups, home, tmp, *, delay, budget=None, host_budget=None, cls=MemoryManager,
             timeline=None, fake_swap=False):
    acct = Accounting()
    swap = aio = None
    if home == "nvme" and fake_swap:
        swap = _FakeSwap(instant=True)
    elif home == "nvme":
        aio = AioEngine(1 << 20, 8, 1, "auto")
        swap = SwapSpace([tmp], aio)
    host_pool = BufferPool("host", host_budget, acct)
    dev = SimulatedDevice(budget, acct, delay=delay)
    mm = cls(groups, device=torch.device("cpu"), device_budget=budget, host_pool=host_pool,
             swap=swap, accounting=acct, timeline=timeline, device_tier=dev)
    for g in groups:
        mm.place(g)
    return mm, dev, acct, swap, aio


def _close(mm, swap, aio):
    mm.close()
    if aio is not None:
        swap.close()
        aio.close()


def _run_window(mm, groups, values, depth):
    """Use every group in order with ``depth`` fetched ahead; return per-group max error."""
    errs = []
    for i, g in enumerate(groups):
        for j in range(i, min(i + 1 + depth, len(groups))):
            mm.fetch_async(groups[j], allow_overflow=False)
        mm.wait_resident(g)
        p = g.slots[0].param
        errs.append(float((p.detach() - values[i]).abs().nan_to_num(float("inf")).max()))
        mm.release(g)
    return errs


@pytest.mark.parametrize("home", ["cpu", "nvme"])
@pytest.mark.parametrize("delay", [1, 3, NEVER])
def test_manager_fetch_protocol_delivers_the_right_values(swap_dir, home, delay):
    groups, values = _groups(5, home)
    mm, dev, acct, swap, aio = _manager(groups, home, swap_dir, delay=delay, budget=3 * 4096)
    try:
        for _ in range(2):       # second round reuses pooled device and staging buffers
            assert _run_window(mm, groups, values, depth=2) == [0.0] * len(groups)
        assert all(g.state is (Location.NVME if home == "nvme" else Location.HOST)
                   for g in groups)
        # every H2D was followed by compute waiting on that buffer's event before use
        kinds = [k for k, _ in dev.log]
        assert kinds.count("h2d") == 2 * len(groups) == kinds.count("wait")
        for k, (kind, ptr) in enumerate(dev.log):
            if kind == "wait":
                assert ("done", ptr) in dev.log[:k]
        st = acct.as_dict()
        assert st["device_peak_bytes"] <= 3 * 4096          # within the device budget
        assert st["h2d_bytes"] == 2 * len(groups) * 4096
        if home == "nvme":
            assert st["nvme_read_bytes"] == 2 * len(groups) * 4096
            assert mm.host_pool.leased == 0                 # all staging came back
    finally:
        _close(mm, swap, aio)


def test_staging_is_not_reused_before_its_copy_completed(swap_dir):
    """With copies that only run when waited on, the staging buffer of a fetched group
    must stay leased until its H2D ran; prefetching the next group needs a second one."""
    groups, values = _groups(3, "nvme")
    mm, dev, acct, swap, aio = _manager(groups, "nvme", swap_dir, delay=NEVER)
    try:
        mm.fetch_async(groups[0], allow_overflow=False)
        mm.wait_resident(groups[0])           # compute waited: the copy ran
        mm.fetch_async(groups[1], allow_overflow=False)
        mm.fetch_async(groups[2], allow_overflow=False)
        mm.wait_resident(groups[1])
        mm.wait_resident(groups[2])
        for g, v in zip(groups, values):
            assert torch.equal(g.slots[0].param.detach(), v)
        assert mm.host_pool.leased == 0
    finally:
        _close(mm, swap, aio)


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_correct_manager_passes_the_bug_scenario(swap_dir, home):
    groups, values = _groups(4, home)
    mm, dev, acct, swap, aio = _manager(groups, home, swap_dir, delay=NEVER, fake_swap=True)
    try:
        assert _run_window(mm, groups, values, depth=2) == [0.0] * 4
    finally:
        _close(mm, swap, aio)


class _NoComputeWait(MemoryManager):
    """Bug: uses the device buffer without waiting on the H2D event."""

    def _finish_h2d(self, g, f):
        staging, f.staging = f.staging, None
        self.dev.retire(f.xfer, (lambda: self.host_pool.give_back(staging))
                        if staging is not None else (lambda: None))


class _EarlyStagingReuse(MemoryManager):
    """Bug: gives the staging buffer back as soon as the H2D was issued."""

    def _start_h2d(self, g, f):
        super()._start_h2d(g, f)
        self.host_pool.give_back(f.staging)
        f.staging = None

    def fetch_async(self, g, *, allow_overflow):
        ok = super().fetch_async(g, allow_overflow=allow_overflow)
        f = g.pending
        if f is not None and f.landing is not None:
            f.landing.exception()     # the lander issued its H2D: a deterministic order
        return ok


@pytest.mark.parametrize("bug,home", [(_NoComputeWait, "cpu"), (_NoComputeWait, "nvme"),
                                      (_EarlyStagingReuse, "nvme")])
def test_ordering_bugs_are_caught(swap_dir, bug, home):
    # reads that complete at once make the staging reuse order deterministic
    groups, values = _groups(4, home)
    mm, dev, acct, swap, aio = _manager(groups, home, swap_dir, delay=NEVER, cls=bug,
                                        fake_swap=True)
    try:
        errs = _run_window(mm, groups, values, depth=2)
        assert any(e != 0.0 for e in errs), "the simulated device did not expose the bug"
    finally:
        try:
            _close(mm, swap, aio)
        except Exception:
            pass


# ------------------------------------------------------------------ NVMe read timing
class _Handle:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished

    def wait(self):
        self.finished = True
        return 0


class _FakeSwap:
    """Reads copy immediately but report completion only when the test says so."""

    def __init__(self, instant=False):
        self.data = {}
        self.handles = []
        self.instant = instant

    def allocate(self, nbytes):
        return len(self.data)

    def write(self, ext, t, offset=0):
        self.data[ext] = t.clone()
        h = _Handle()
        h.finished = True
        return h

    def read(self, ext, t, offset=0):
        t.copy_(self.data[ext].view(t.dtype)[: t.numel()])
        h = _Handle()
        h.finished = self.instant
        self.handles.append(h)
        return h


def test_nvme_read_is_timed_to_its_completion_not_to_the_wait():
    groups, values = _groups(2, "nvme")
    acct, tl = Accounting(), Timeline(enabled=True)
    swap = _FakeSwap()
    mm = MemoryManager(groups, device=torch.device("cpu"), device_budget=None,
                       host_pool=BufferPool("host", None, acct), swap=swap, accounting=acct,
                       timeline=tl)
    for g in groups:
        mm.place(g)
    a, b = groups
    mm.fetch_async(a, allow_overflow=False)
    mm.fetch_async(b, allow_overflow=False)
    swap.handles[0].finished = True          # a's read completes while b is in use
    mm.wait_resident(b)                      # polls: a's completion observed here
    t_seen = time.perf_counter()
    time.sleep(0.02)                         # compute on b; a is not waited for yet
    mm.wait_resident(a)
    ev_a = [e for e in tl.events("nvme_read")]
    assert len(ev_a) == 2
    ends = sorted(e.t1 for e in ev_a)
    assert ends[1] <= t_seen                 # both reads end before the later wait
    assert torch.equal(a.slots[0].param.detach(), values[0])
    mm.release(a)
    mm.release(b)
    mm.close()


# ------------------------------------------------------------------ whole engine
@pytest.mark.parametrize("params,precision", [("cpu", "fp32"), ("nvme", "fp32"),
                                              ("nvme", "bf16")])
def test_engine_trains_identically_through_the_simulated_device(swap_dir, monkeypatch,
                                                                 params, precision):
    import infinity.engine.build as eng_mod

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                             nn.Linear(32, 8))

    def run(model, sim):
        cfg = {"precision": precision, "gradient_accumulation_steps": 2,
               "gradient_clipping": 1.0, "optimizer": {"lr": 1e-2, "weight_decay": 0.1},
               "offload": {"params": params, "optimizer": "cpu", "nvme_paths": [swap_dir],
                           "device_memory_gb": 0.0001}}
        devs = []
        if sim:
            def dev_factory(device, budget, acct):
                dev = SimulatedDevice(budget, acct, delay=2)
                devs.append(dev)
                return dev
            monkeypatch.setattr(eng_mod, "make_device", dev_factory)
        else:
            monkeypatch.setattr(eng_mod, "make_device", make_device)
        g = torch.Generator().manual_seed(3)
        losses = []
        with infinity.initialize(model, cfg) as e:
            for _ in range(6):
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
                loss = torch.nn.functional.mse_loss(e(x).float(), y)
                losses.append(loss.item())
                e.backward(loss)
                e.step()
            sd = {k: v.clone() for k, v in e.state_dict().items()}
            st = e.stats()
        return losses, sd, st, devs

    l_ref, sd_ref, _, _ = run(build(0), sim=False)
    l_sim, sd_sim, st, devs = run(build(0), sim=True)
    assert devs and devs[0].log                       # the simulated device was used
    kinds = {k for k, _ in devs[0].log}
    assert {"h2d", "d2h", "wait", "done"} <= kinds    # params up, grads down, events waited
    assert st["h2d_bytes"] > 0
    assert st["device_peak_bytes"] <= 0.0001e9 or st["device_budget_overflows"] > 0
    assert l_sim == l_ref                             # same arithmetic, bit for bit
    for k in sd_ref:
        assert torch.equal(sd_sim[k], sd_ref[k]), k


def test_engine_grad_d2h_consumed_before_its_event_is_caught(swap_dir, monkeypatch):
    """Bug variant: accumulate gradients from the staging buffer without waiting for the
    D2H event; the simulated device leaves the staging stale, so training diverges."""
    import infinity.engine.build as eng_mod
    from infinity.grads.d2h import GradD2H

    def eager(self, x, g, slots, staging):     # no x.wait_host(): reads stale staging
        for s in slots:
            self.sink(g, s, staging[s.offset:s.offset + s.numel].view(s.shape))
    monkeypatch.setattr(GradD2H, "_accumulate", eager)

    monkeypatch.setattr(eng_mod, "make_device",
                        lambda device, budget, acct: SimulatedDevice(None, acct, delay=NEVER))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    ref = [p.detach().clone() for p in model.parameters()]
    ref_model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), ref):
            p.copy_(r)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)
    cfg = {"optimizer": {"lr": 1e-2}, "offload": {"params": "cpu", "optimizer": "cpu"}}
    g = torch.Generator().manual_seed(3)
    with infinity.initialize(model, cfg) as e:
        for _ in range(2):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
            loss = torch.nn.functional.mse_loss(e(x), y)
            e.backward(loss)
            e.step()
            torch.nn.functional.mse_loss(ref_model(x), y).backward()
            opt.step()
            opt.zero_grad()
        sd = {k: v.clone() for k, v in e.state_dict().items()}
    err = max(float((sd[k] - p.detach()).abs().max()) for k, p in ref_model.named_parameters())
    assert not err < 1e-6, "gradients used before their D2H completed went unnoticed"


def test_released_param_placeholder_stays_on_the_params_device():
    """A CUDA parameter's .data cannot point at a CPU tensor; 'meta' stands in for cuda."""
    p = nn.Parameter(torch.empty(2, 3, device="meta"))
    g = GroupRecord(0, "m", [ParamSlot("w", p, 0, 6, p.shape, True)], 6, 1024,
                    torch.float32, "cpu")
    g.set_home_state()
    assert p.device.type == "meta" and p.shape == (2, 3)
    q = nn.Parameter(torch.ones(4))
    h = GroupRecord(1, "n", [ParamSlot("w", q, 0, 4, q.shape, True)], 4, 1024,
                    torch.float32, "cpu")
    h.set_home_state()
    assert q.device.type == "cpu" and torch.isnan(q).all()


def test_staging_lease_exhausted_in_a_prefetch_leaks_nothing(swap_dir):
    """fetch_async leases a device buffer, then pinned staging (NVMe home, separate device
    memory): when the staging lease fails (host budget full) the device buffer and its
    budget go back, the group stays at home and can be fetched once there is room."""
    from infinity.memory.pool import PoolExhausted
    groups, values = _groups(2, "nvme")
    size = max(g.nbytes for g in groups)
    mm, dev, acct, swap, aio = _manager(groups, "nvme", swap_dir, delay=1,
                                        host_budget=4096 * ((size + 4095) // 4096))
    try:
        g = groups[0]
        blocker = mm.host_pool.lease(size, torch.uint8)     # the host budget is now full
        leased_before = mm.device_pool.leased
        with pytest.raises(PoolExhausted):
            mm.fetch_async(g, allow_overflow=False)
        assert mm.device_pool.leased == leased_before      # the device buffer went back
        assert not mm.fetch_pending(g) and g.device_buf is None
        mm.host_pool.give_back(blocker)
        mm.fetch_async(g, allow_overflow=False)
        mm.wait_resident(g)
        assert torch.equal(g.slots[0].param.detach(), values[0])
        mm.release(g)
        assert mm.device_pool.leased == leased_before
    finally:
        _close(mm, swap, aio)


def test_fetch_waits_for_a_step_still_writing_the_home(swap_dir):
    """A group stepped early by the overlapped optimizer step may be fetched again if the
    order diverges from the trace: the fetch must wait for that step (home_busy) before it
    reads the home, or it would read half-written values."""
    groups, values = _groups(2, "cpu")
    mm, dev, acct, swap, aio = _manager(groups, "cpu", swap_dir, delay=1)
    try:
        g = groups[0]
        order = []

        def running_step():
            order.append("waited for the step")
            g.host_buf.add_(1.0)                 # the step's update lands before the read
        mm.mark_home_busy(g.gid, running_step)
        mm.fetch_async(g, allow_overflow=False)
        order.append("fetch started")
        mm.wait_resident(g)
        assert order == ["waited for the step", "fetch started"]
        assert torch.equal(g.slots[0].param.detach(), values[0] + 1.0)
        assert not mm.home_busy(g.gid)
        mm.release(g)
    finally:
        _close(mm, swap, aio)


# ------------------------------------------------------------------ H2D on landing
def test_h2d_of_a_landed_read_starts_without_the_main_thread(swap_dir):
    """Note [H2D on landing]: on separate device memory the H2D of an NVMe read that
    landed in staging is issued by the lander as soon as the read completes, while the
    main thread is busy elsewhere (computing) and calls nothing on the manager."""
    groups, values = _groups(3, "nvme")
    mm, dev, acct, swap, aio = _manager(groups, "nvme", swap_dir, delay=NEVER)
    try:
        for g in groups:
            mm.fetch_async(g, allow_overflow=False)
        ptrs = [g.device_buf.data_ptr() for g in groups]
        deadline = time.monotonic() + 20
        while not all(("h2d", p) in dev.log for p in ptrs) and time.monotonic() < deadline:
            time.sleep(0.005)               # "compute": no manager call at all
        assert all(("h2d", p) in dev.log for p in ptrs), dev.log
        assert all(g.state is Location.READING for g in groups)   # main thread not involved
        for g, v in zip(groups, values):
            mm.wait_resident(g)
            assert torch.equal(g.slots[0].param.detach(), v)
            mm.release(g)
        assert mm.host_pool.leased == 0 and mm.device_pool.leased == 0
        assert acct.as_dict()["nvme_read_bytes"] == 3 * 4096
    finally:
        _close(mm, swap, aio)


class _FailingReadSwap(_FakeSwap):
    """The read of extent ``bad`` fails with EIO when it is waited for."""

    def __init__(self, bad):
        super().__init__(instant=True)
        self.bad = bad

    def read(self, ext, t, offset=0):
        h = super().read(ext, t, offset)
        if ext == self.bad:
            from infinity.io import AioError

            def fail():
                raise AioError(5, "injected read failure", "/swap/fake", 0, t.numel())
            h.wait = fail
        return h


def test_failed_read_on_the_lander_raises_for_its_group_only(swap_dir):
    groups, values = _groups(3, "nvme")
    acct = Accounting()
    swap = _FailingReadSwap(bad=None)
    dev = SimulatedDevice(None, acct, delay=1)
    mm = MemoryManager(groups, device=torch.device("cpu"), device_budget=None,
                       host_pool=BufferPool("host", None, acct), swap=swap, accounting=acct,
                       device_tier=dev)
    for g in groups:
        mm.place(g)
    from infinity.io import AioError
    swap.bad = groups[1].extent
    try:
        for g in groups:
            mm.fetch_async(g, allow_overflow=False)
        mm.wait_resident(groups[0])
        mm.wait_resident(groups[2])              # another group's failure is not raised here
        with pytest.raises(AioError, match="injected"):
            mm.wait_resident(groups[1])
        assert groups[1].state is Location.NVME and groups[1].device_buf is None
        for i in (0, 2):
            assert torch.equal(groups[i].slots[0].param.detach(), values[i])
            mm.release(groups[i])
        swap.bad = None                           # the next use reads it again
        mm.fetch_async(groups[1], allow_overflow=False)
        mm.wait_resident(groups[1])
        assert torch.equal(groups[1].slots[0].param.detach(), values[1])
        mm.release(groups[1])
        assert mm.host_pool.leased == 0 and mm.device_pool.leased == 0
    finally:
        mm.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_host_staging_is_allocated_at_initialize_not_in_the_first_steps(
        swap_dir, monkeypatch, precision):
    """Separate device memory: the pinned staging of the NVMe reads and of the gradient
    D2H copies is allocated (and, on CUDA, registered) by initialize; training then leases
    it without allocating any host buffer (no cudaHostRegister inside the hooks)."""
    monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 8))
    cfg = {"precision": precision, "optimizer": {"lr": 1e-2},
           "offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [swap_dir],
                       "device_memory_gb": 0.01}}
    g = torch.Generator().manual_seed(1)
    with infinity.initialize(model, cfg) as e:
        pool = e.host_pool
        reserved = e.mm.staging_sizes(e.cfg.prefetch.depth) \
            + e.opt.grads.staging_sizes()
        assert reserved                                  # there is staging to reserve
        allocs = []
        real = pool._allocator
        pool._allocator = lambda n: (allocs.append(n), real(n))[1]
        for _ in range(3):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            e.backward(torch.nn.functional.mse_loss(e(x).float(), y))
            e.step()
        assert e.stats()["h2d_bytes"] > 0 and e.stats()["d2h_bytes"] > 0
        assert allocs == [], f"host buffers allocated during training: {allocs}"
