"""Collectives between the ranks of one node through shared memory.

On a node, gloo moves a host tensor from one rank to another through the loopback TCP
stack: the sender's copy into the kernel, the receiver's copy out of it, and two gloo
threads per rank (``gloo_tcp_loop``, ``pt_gloo_runloop``) that took ~25 % of a CPU-only
rank's CPU in the 2-rank ZeRO-3 benchmark.  Here every rank maps every other rank's
*slot* (shared memory) instead: a rank copies what the others need into its own slot,
all ranks meet at a barrier, and each copies (all-gather) or sums (reduce-scatter) what
it needs straight out of the others' slots.  One memory copy per byte each way, no
kernel, no extra threads beyond one per channel.

* :class:`ShmTransport` is created collectively by :class:`infinity.zero.comm.Comm`
  (:func:`create`) when every rank of the world runs on this machine (same kernel boot
  id and user; ``LOCAL_WORLD_SIZE`` covers the world) and ``intra_node_transport`` is
  ``"auto"``.  It carries host tensors only (:meth:`ShmTransport.carries`): on CPU-only
  ranks and the simulated device every gather and reduction, on GPUs the host ones
  (stage 1's gradient all-reduce); CUDA buffers keep going over NCCL.  Every rank decides together (one all-gather
  of the facts), so either all ranks use it or none.
* A :class:`Channel` is one ordered stream of collectives: ``param`` (parameter
  all-gathers, issued by the fetch worker) and ``grad`` (gradient reduce-scatters and
  all-reduces, issued by the training thread), each with its own worker thread and its
  own gloo group for the barriers, so the order matches on every rank as it does for the
  process groups (:mod:`infinity.zero.comm`).  An operation returns a future; the
  :class:`~infinity.zero.comm.CommHandle` waits on it like on a gloo work object.
* Slots: sized by the engine once its groups are known (:meth:`ShmTransport.allocate`,
  collective): per rank and channel, two parities of a shard (``param``) or of one shard
  per rank (``grad``), at most ``SLOT_BYTES`` each (bigger collectives take several
  pieces).  Their memory is reserved up front (``posix_fallocate``: a ``/dev/shm`` too
  small — a container's 64 MB default — fails there and every rank falls back to the
  process group, never a SIGBUS later) and counted by the placement plan.  The files
  live in a private directory ``/dev/shm/infinity-shm-*`` (0700, files 0600); every rank
  maps every slot, then rank 0 removes the directory with the files before any rank goes
  on: once set up, nothing is left behind however the processes end (the memory is
  freed when the last rank unmaps it); only a rank dying during the set-up can leave it.
* One *piece* (at most a slot) per barrier; piece ``k`` uses parity ``k % 2``.  A rank
  writes piece ``k + 2`` (the same parity as ``k``) only after barrier ``k + 1``, which
  every rank entered only after reading piece ``k``: one barrier per piece suffices.
* The barrier is a gloo all-reduce of one integer over the channel's group, with the
  process group's timeout: a rank that died or stopped turns into an error on every
  other rank, as with gloo collectives (the caller wraps it in
  :class:`~infinity.zero.comm.CollectiveError`).  A rank whose local copy failed
  contributes 1 and every rank raises.  After any error the channel refuses further
  work (its piece counter would no longer match the other ranks').
"""
from __future__ import annotations

import datetime
import logging
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist

from infinity.config_sections import INTRA_NODE_TRANSPORTS as TRANSPORTS

log = logging.getLogger("infinity.zero")

__all__ = ["ShmTransport", "Channel", "create", "TRANSPORTS", "SLOT_BYTES"]

SLOT_BYTES = 64 << 20          # at most, per parity, rank and channel
ALIGN = 64
SHM_ROOT = "/dev/shm"
_ID_BYTES = 64


def _node_id() -> bytes:
    """What identifies this machine's kernel and user (same value on every rank of a node)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    try:
        st = os.stat(SHM_ROOT)
        dev = f"{st.st_dev}".encode()
    except OSError:
        dev = b""
    return (boot + b"/" + dev + b"/" + str(os.getuid()).encode())[:_ID_BYTES]


def _name_os_thread(name: str) -> None:
    """Name the calling OS thread (Linux ``prctl(PR_SET_NAME)``; best effort)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _usable_here() -> bool:
    return bool(_node_id()) and os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK)


class _Work:
    """What :class:`infinity.zero.comm.CommHandle` needs of a backend work object."""
    __slots__ = ("fut",)

    def __init__(self, fut: Future):
        self.fut = fut

    def is_completed(self) -> bool:
        return self.fut.done()

    def wait(self) -> None:
        self.fut.result()


class Channel:
    """One ordered stream of shared-memory collectives with its own worker thread."""

    def __init__(self, name: str, rank: int, world_size: int, pg, slots: list[torch.Tensor],
                 slot_bytes: int):
        self.name = name
        self.slot_bytes = int(slot_bytes)      # per parity
        self.rank = rank
        self.world_size = world_size
        self.pg = pg
        self.slots = slots                    # slots[r]: rank r's 2 x slot_bytes uint8
        self.piece = 0
        self.broken: BaseException | None = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._queue: list = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"infinity-shm-{name}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ worker
    def submit(self, fn) -> _Work:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"shared-memory channel {self.name!r} is closed")
            self._queue.append((fn, fut))
            self._cv.notify()
        return _Work(fut)

    def _loop(self) -> None:
        _name_os_thread(f"infinity-shm-{self.name[0]}")   # for per-thread CPU in /proc
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                fn, fut = self._queue.pop(0)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if self.broken is not None:
                    raise RuntimeError(f"shared-memory channel {self.name!r} stopped after an "
                                       f"earlier error: {self.broken}")
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                if self.broken is None:
                    self.broken = e
                fut.set_exception(e)
            else:
                fut.set_result(None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify()
        for _fn, fut in pending:
            fut.cancel()

    # ------------------------------------------------------------------ one piece
    def _slot(self, r: int, parity: int) -> torch.Tensor:
        return self.slots[r][parity * self.slot_bytes:(parity + 1) * self.slot_bytes]

    def _barrier(self, failed: bool) -> None:
        self._flag.fill_(1 if failed else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.SUM, group=self.pg)
        n = int(self._flag.item())
        if n and not failed:
            raise RuntimeError(f"{n} other rank(s) failed their part of a shared-memory "
                               f"{self.name} collective")

    def _step(self, write, read) -> None:
        """``write(my slot)``; barrier; ``read(slot of rank r)`` for the other ranks."""
        parity = self.piece & 1
        self.piece += 1
        try:
            write(self._slot(self.rank, parity))
        except BaseException:
            self._barrier(True)
            raise
        self._barrier(False)
        read(lambda r: self._slot(r, parity))

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """``out`` (world x shard) receives every rank's ``shard`` in rank order."""
        n, me = self.world_size, self.rank
        ob = out.view(-1).view(torch.uint8)
        sb = shard.reshape(-1).view(torch.uint8)
        s = sb.numel()
        mine = ob[me * s:(me + 1) * s]
        if mine.data_ptr() != sb.data_ptr():
            mine.copy_(sb)
        step = self.slot_bytes
        for a in range(0, s, step):
            b = min(s, a + step)

            def write(slot, a=a, b=b):
                slot[:b - a].copy_(sb[a:b])

            def read(slot_of, a=a, b=b):
                for r in range(n):
                    if r != me:
                        ob[r * s + a:r * s + b].copy_(slot_of(r)[:b - a])
            self._step(write, read)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (shard) receives this rank's slice of the sum over ranks of ``full``;
        sums in the order: this rank's own slice, then the others in rank order."""
        n, me = self.world_size, self.rank
        s = out.numel()
        flat = full.reshape(-1)
        o = out.view(-1)
        el = flat.element_size()
        sub = (self.slot_bytes // n) // ALIGN * ALIGN   # bytes of the sub-slot for each rank
        per = max(1, sub // el)                       # elements per piece
        own = flat[me * s:(me + 1) * s]
        if o.data_ptr() != own.data_ptr():
            o.copy_(own)
        for a in range(0, s, per):
            b = min(s, a + per)
            nb = (b - a) * el

            def write(slot, a=a, b=b, nb=nb):
                for r in range(n):
                    if r != me:
                        slot[r * sub:r * sub + nb].copy_(
                            flat[r * s + a:r * s + b].view(torch.uint8))

            def read(slot_of, a=a, b=b, nb=nb):
                dst = o[a:b]
                for r in range(n):
                    if r != me:
                        dst.add_(slot_of(r)[me * sub:me * sub + nb].view(flat.dtype))
            self._step(write, read)

    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` becomes the sum over ranks (a reduce-scatter of equal parts, then an
        all-gather of the summed parts; the part sizes pad to the world size)."""
        n = self.world_size
        flat = t.view(-1)
        part = -(-flat.numel() // n)
        if part * n == flat.numel():
            buf = flat
        else:
            buf = torch.zeros(part * n, dtype=flat.dtype)
            buf[:flat.numel()].copy_(flat)
        mine = torch.empty(part, dtype=flat.dtype)
        self.reduce_scatter(mine, buf)
        self.all_gather(buf, mine)
        if buf is not flat:
            flat.copy_(buf[:flat.numel()])


class ShmTransport:
    """The channels of one :class:`~infinity.zero.comm.Comm` (``param``, ``grad``).

    Made by :func:`create` (collective: may every rank use it?) without memory; the
    engine sizes and maps the slots with :meth:`allocate` (collective, once the groups
    are known) — until then, and if that fails, every collective goes over the process
    group on every rank."""

    CHANNELS = ("param", "grad")

    def __init__(self, rank: int, world_size: int, pgs: list, backend: str):
        self.rank = rank
        self.world_size = world_size
        self.channels: dict[str, Channel] = {}
        self._pgs = pgs
        self.backend = backend
        self.path: str | None = None  # the slots' directory (removed once they were mapped)
        self.slot_bytes: dict[str, int] = {}

    def channel(self, group: str) -> Channel | None:
        return self.channels.get(group)

    @staticmethod
    def carries(*tensors: torch.Tensor) -> bool:
        """Host tensors laid out flat (what the slots copy from and into)."""
        return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def slot_sizes(param_bytes: int, grad_bytes: int, world_size: int) -> dict[str, int]:
        """Bytes per parity of each channel's slot for collectives over at most
        ``param_bytes`` (a gathered group) and ``grad_bytes`` (a reduced gradient): the
        ``param`` slot holds a shard, the ``grad`` slot one shard per rank (a
        reduce-scatter in one piece); each at most ``SLOT_BYTES`` (larger collectives
        take several pieces)."""
        n = int(world_size)

        def shard(full):
            return -(-(-(-int(full) // n)) // ALIGN) * ALIGN
        return {"param": max(ALIGN, min(SLOT_BYTES, shard(param_bytes))),
                "grad": max(n * ALIGN, min(SLOT_BYTES, n * shard(grad_bytes)))}

    @classmethod
    def plan_bytes(cls, param_bytes: int, grad_bytes: int, world_size: int) -> int:
        """Host memory this rank's own slots commit (both parities of both channels)."""
        return 2 * sum(cls.slot_sizes(param_bytes, grad_bytes, world_size).values())

    # ------------------------------------------------------------------ set-up
    def allocate(self, param_bytes: int, grad_bytes: int) -> bool:
        """Collective over the default group: size the slots (:meth:`slot_sizes`), reserve them (``posix_fallocate``: a full ``/dev/shm`` fails here,
        never later as a SIGBUS) and map every rank's.  False (on every rank) when some
        rank could not: the process group then carries everything."""
        if self.channels:
            raise RuntimeError("shm transport: slots already allocated")
        n, me = self.world_size, self.rank
        sizes = self.slot_sizes(param_bytes, grad_bytes, n)
        need = 2 * sum(sizes.values())
        fail = torch.zeros(1, dtype=torch.int32)
        why = None
        try:
            st = os.statvfs(SHM_ROOT)
            free = st.f_bavail * st.f_frsize
            if free < 2 * n * need:      # leave this node's /dev/shm half free
                why = (f"{SHM_ROOT} has {free / 2**20:.0f} MiB free; the slots of {n} ranks "
                       f"need {n * need / 2**20:.0f} MiB (x2 headroom)")
        except OSError as e:
            why = f"statvfs({SHM_ROOT}): {e}"
        if why:
            fail.fill_(1)
        dist.all_reduce(fail)
        if int(fail.item()):
            return self._off(why or "another rank's /dev/shm is too small")
        # rank 0 makes the private directory and tells the others its name
        name = torch.zeros(256, dtype=torch.uint8)
        tmp = None
        if me == 0:
            try:
                tmp = tempfile.mkdtemp(prefix="infinity-shm-", dir=SHM_ROOT)
                b = tmp.encode()
                name[:len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
            except OSError as e:
                why = f"cannot create a directory in {SHM_ROOT}: {e}"
        dist.broadcast(name, 0)
        path = bytes(name.tolist()).rstrip(b"\0").decode()
        slots: dict[str, list] = {c: [None] * n for c in self.CHANNELS}
        try:
            if not path:
                raise OSError(why or "rank 0 could not create the shared-memory directory")
            for c in self.CHANNELS:
                slots[c][me] = _map(os.path.join(path, f"{c}-r{me}"), sizes[c], create=True)
        except OSError as e:
            why = str(e)
            fail.fill_(1)
        dist.all_reduce(fail)
        if not int(fail.item()):
            try:
                for c in self.CHANNELS:
                    for r in range(n):
                        if r != me:
                            slots[c][r] = _map(os.path.join(path, f"{c}-r{r}"), sizes[c],
                                               create=False)
            except OSError as e:
                why = str(e)
                fail.fill_(1)
            dist.all_reduce(fail)        # every rank mapped every slot (or one could not)
        # nothing stays on the file system: every rank mapped every slot (or gave up),
        # rank 0 removes the directory with the files, and no rank goes on before that
        if me == 0 and tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.all_reduce(torch.zeros(1))     # a barrier on the host backend (gloo)
        if int(fail.item()):
            return self._off(why or "another rank could not map the shared slots")
        self.path = path
        self.slot_bytes = sizes
        self.channels = {c: Channel(c, me, n, pg, slots[c], sizes[c])
                         for c, pg in zip(self.CHANNELS, self._pgs)}
        log.info("shm transport: %d ranks share memory (%s, %.0f MiB per rank): parameter "
                 "all-gathers and gradient reductions bypass %s", n, SHM_ROOT,
                 need / 2**20, self.backend)
        return True

    def _off(self, why: str) -> bool:
        log.warning("shm transport: off (%s): collectives between local ranks go over %s",
                    why, self.backend)
        return False

    def abort(self, why: str) -> None:
        """Another rank failed (Note [failures in seconds] in infinity/zero/comm.py): every
        channel refuses further work; the slots stay mapped (a worker may still be inside
        a barrier, which the process group's timeout ends)."""
        for ch in self.channels.values():
            if ch.broken is None:
                ch.broken = RuntimeError(why)
            ch.close()

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        for pg in self._pgs:
            try:
                dist.destroy_process_group(pg)
            except Exception as e:  # noqa: BLE001 - best effort while tearing down
                log.debug("shm transport: destroying a barrier group failed: %s", e)
        self._pgs = []


def _map(path: str, slot_bytes: int, create: bool) -> torch.Tensor:
    """Map a rank's slot file (both parities); ``create``: make it (0600) and reserve its
    memory."""
    size = 2 * slot_bytes
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)   # the tensor keeps ``mm`` alive


def create(comm, transport: str) -> ShmTransport | None:
    """Collective over the default group: the (not yet allocated) shared-memory transport
    when every rank can use it (see the module docstring), else None on every rank."""
    if transport not in TRANSPORTS:
        raise ValueError(f"intra_node_transport: expected one of {TRANSPORTS}, got "
                         f"{transport!r}")
    if transport == "process_group" or comm.topo.local_size != comm.world_size:
        return None                      # decided from the same facts on every rank
    n, me = comm.world_size, comm.rank
    ok = _usable_here()
    ident = torch.zeros(_ID_BYTES + 1, dtype=torch.uint8)
    nid = _node_id()
    ident[:len(nid)] = torch.frombuffer(bytearray(nid), dtype=torch.uint8)
    ident[-1] = 1 if ok else 0
    got = [torch.empty_like(ident) for _ in range(n)]
    dist.all_gather(got, ident)
    rows = torch.stack(got)
    if not bool((rows[:, -1] == 1).all()) or not bool((rows == rows[0]).all()):
        log.info("shm transport: not every rank can share memory with the others (other "
                 "machines, users or no %s): collectives go over %s", SHM_ROOT, comm.backend)
        return None
    td = datetime.timedelta(seconds=comm.timeout_s)
    pgs = [dist.new_group(timeout=td, backend="gloo") for _ in ShmTransport.CHANNELS]
    return ShmTransport(me, n, pgs, comm.backend)
