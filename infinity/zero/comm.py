"""Collectives for ZeRO partitioning over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

* :func:`ensure_process_group` creates the default process group from the environment
  (``torchrun`` sets ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) when
  ``WORLD_SIZE`` > 1 and none exists yet, with ``dist_timeout_s`` as the timeout: one
  group with both backends, ``"cpu:gloo,cuda:nccl"`` when CUDA is available (this rank's
  device ``cuda:LOCAL_RANK`` is made current first), ``"gloo"`` otherwise.  A collective
  runs on the backend of its tensors' device: device buffers (all-gathers, gradient
  reduce-scatters) over NCCL, host tensors (votes, norms, host mirrors) over gloo.
* :class:`Comm` is the one facade every collective goes through.  A process group the
  user created is used when it can carry the tensors' devices (a CPU backend always, a
  CUDA one when computing on CUDA); otherwise :func:`check_backends` says what to create.
* :class:`Comm` owns two extra process groups over the same ranks: ``param`` (parameter
  all-gathers, issued only by the fetch worker thread) and ``grad`` (gradient
  reductions, issued only by the training thread).  Collectives are matched across ranks
  by their order *within one process group*; keeping each group to a single issuing
  thread keeps that order identical on every rank while both overlap.
* Bytes this rank *sends* are counted by convention (gloo is opaque) into the accounting's
  ``allgather_sent_bytes`` / ``grad_comm_sent_bytes`` and their ``*_inter_bytes`` part to
  ranks of other nodes (nodes from ``LOCAL_WORLD_SIZE``, :mod:`infinity.zero.hierarchy`):
  an all-gather sends this rank's shard to every other rank of its group, a
  reduce-scatter every other rank its chunk, an all-to-all each peer its row; a gradient
  all-reduce counts as a reduce-scatter plus an all-gather.  ZeRO++'s sub-groups
  (:mod:`infinity.zero.zeropp`) are registered with :meth:`Comm.add_group`.
* Every collective returns a :class:`CommHandle` (``wait()``; ``done()`` asks without
  blocking), or waits itself when
  ``async_op=False``.  A failure — including a peer that died or stopped participating,
  which gloo/NCCL turn into an error after the process-group timeout — raises
  :class:`CollectiveError` naming this rank, the collective, the tensor and the timeout.
* Note [failures in seconds]: a rank that drops its window tells the others through the
  process group's store (:meth:`Comm.report_failure`).  A rank waiting on a host
  collective (gloo, or the shared-memory transport) asks the store every
  :data:`FAILURE_POLL_S` while it waits, and when another rank reported a failure it
  stops waiting at once: it aborts the shared-memory transport and raises
  :class:`CollectiveError` naming that rank (a stalled rank that reports nothing is
  still bounded by ``dist_timeout_s``).  The abandoned collective leaves the process
  groups out of step, so :attr:`Comm.failed` is set and no further collective is issued:
  the engine then refuses every call until the ranks are restarted (the process group
  belongs to the launcher).  Device (NCCL) collectives are waited on by their stream, not
  by the host: a failure reaches them at the next host collective (the step's vote).

Both gloo and NCCL support ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` in the
torch this project pins (checked: torch 2.13 gloo); if a backend lacks
``reduce_scatter_tensor``, :meth:`Comm.reduce_scatter_sum` falls back to an all-reduce of
the full buffer followed by taking this rank's slice (same result, twice the traffic).
"""
from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from infinity.zero import shm_transport
from infinity.zero.hierarchy import Topology

log = logging.getLogger("infinity.zero")

__all__ = ["CollectiveError", "CommHandle", "Comm", "ensure_process_group", "env_world_size",
           "backend_map", "check_backends", "default_backend", "local_rank"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or \
    getattr(dist, "reduce_scatter_tensor", None)


class CollectiveError(RuntimeError):
    """A collective failed or timed out (usually: another rank died or diverged)."""


#: seconds between two looks at the store while waiting on a host collective (Note
#: [failures in seconds])
FAILURE_POLL_S = 0.5
#: process groups with abandoned collectives, kept (not destroyed) until the process ends
_ABANDONED: list = []
#: what ends every rank-failure message: the way out
RESTART = ("the ranks' collectives are out of step now: restart every rank (the process "
           "group belongs to the launcher) and load_checkpoint to go on")


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not an integer") from e


def ensure_process_group(timeout_s: float) -> bool:
    """Create the default process group from the environment if ``WORLD_SIZE`` > 1 and none
    exists.  Returns True when this call created it (the caller then destroys it)."""
    if dist.is_available() and dist.is_initialized():
        return False
    ws = env_world_size()
    if ws <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={ws} but this torch build has no torch.distributed")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={ws} but {', '.join(missing)} not set; launch with "
                           f"torchrun (or set RANK, MASTER_ADDR and MASTER_PORT)")
    backend = default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(local_rank())   # NCCL binds this rank to its own GPU
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=float(timeout_s)))
    log.info("created the %s process group: rank %d of %d (timeout %ss)", backend,
             dist.get_rank(), ws, timeout_s)
    return True


def local_rank() -> int:
    """This rank's index on its node (``LOCAL_RANK`` from torchrun; 0 when unset)."""
    v = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(v)
    except ValueError as e:
        raise ValueError(f"LOCAL_RANK={v!r} is not an integer") from e


def default_backend() -> str:
    """The backend infinity creates: both, so each tensor goes over its device's backend."""
    from infinity.memory.device import simulate_device
    if torch.cuda.is_available() and dist.is_nccl_available() and not simulate_device():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def backend_map(group=None) -> dict[str, str]:
    """``{device type: backend}`` of a process group (``"cpu:gloo,cuda:nccl"`` ->
    ``{"cpu": "gloo", "cuda": "nccl"}``; a plain ``"nccl"`` group carries CUDA only)."""
    try:
        cfg = str(dist.get_backend_config(group))
    except Exception:  # noqa: BLE001 - older torch: the plain backend name
        cfg = str(dist.get_backend(group))
    out = {}
    for part in cfg.split(","):
        if ":" in part:
            dev, be = part.split(":", 1)
            out[dev.strip()] = be.strip()
        elif part.strip() == "nccl":
            out["cuda"] = "nccl"
        elif part.strip():
            out.setdefault("cpu", part.strip())
            out.setdefault("cuda", part.strip())
    return out


def check_backends(backends: dict[str, str], device: torch.device, world_size: int) -> None:
    """Raise with what to create when the group cannot carry infinity's tensors: host ones
    (votes, norms, host mirrors, stage-1 gradients) always, device ones on CUDA."""
    device = torch.device(device)
    want = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    have = ",".join(f"{k}:{v}" for k, v in backends.items()) or "none"
    missing = [t for t in ("cpu", device.type) if t not in backends]
    if missing:
        raise RuntimeError(
            f"ZeRO over {world_size} ranks on {device}: the default process group "
            f"({have}) has no backend for {' and '.join(sorted(set(missing)))} tensors, which "
            f"infinity's collectives use; create it with "
            f"dist.init_process_group({want!r}) (or let infinity.initialize create it)")
    if device.type == "cuda" and backends.get("cuda") != "nccl":
        log.warning("ZeRO on %s: CUDA tensors go over %r, not NCCL (slow: staged through "
                    "the host); create the group with dist.init_process_group(%r)",
                    device, backends.get("cuda"), want)


class _Waiters:
    """A few daemon threads that block in ``work.wait()`` for :meth:`Comm.wait_watching`."""
    _queue: "queue.SimpleQueue | None" = None
    _lock = threading.Lock()
    THREADS = 4

    @classmethod
    def submit(cls, work) -> Future:
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.SimpleQueue()
                for i in range(cls.THREADS):
                    threading.Thread(target=cls._loop, name=f"infinity-comm-wait-{i}",
                                     daemon=True).start()
        fut: Future = Future()
        cls._queue.put((work, fut))
        return fut

    @classmethod
    def _loop(cls) -> None:
        while True:
            work, fut = cls._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
            else:
                fut.set_result(None)


class CommHandle:
    """An in-flight collective; ``wait()`` blocks, runs the completion action once, and
    raises :class:`CollectiveError` with context on failure."""
    __slots__ = ("comm", "work", "what", "post", "t0", "done_", "link", "nbytes", "poll")

    def __init__(self, comm: "Comm", work, what: str, post=None, link=None, nbytes=0,
                 poll=False):
        self.comm = comm
        self.work = work
        self.what = what
        self.post = post
        self.t0 = time.perf_counter()
        self.done_ = False
        self.link = link
        self.nbytes = nbytes
        self.poll = poll              # a host collective: watch for failed ranks meanwhile

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (the collective completed or failed);
        never blocks.  ``wait()`` still has to be called to run the completion action."""
        if self.done_ or self.work is None:
            return True
        try:
            return bool(self.work.is_completed())
        except Exception:  # noqa: BLE001 - a backend without the query: wait() tells
            return True

    def wait(self) -> None:
        if self.done_:
            return
        try:
            if self.work is not None:
                if self.poll:
                    self.comm.wait_watching(self.work)
                self.work.wait()
        except Exception as e:
            self.done_ = True
            raise self.comm.error(self.what, e) from e
        self.done_ = True
        self.comm.account(self.link, self.nbytes, self.t0)
        if self.post is not None:
            post, self.post = self.post, None
            post()


class Comm:
    """Rank/world facts and the collectives ZeRO needs, over the default process group."""

    def __init__(self, *, timeout_s: float = 600.0, accounting=None, timeline=None,
                 device: torch.device | str = "cpu", transport: str = "auto"):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Comm: no torch.distributed process group; call "
                               "ensure_process_group() or launch with torchrun")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backends = backend_map()
        self.backend = ",".join(f"{k}:{v}" for k, v in self.backends.items()) \
            if len(set(self.backends.values())) > 1 else dist.get_backend()
        check_backends(self.backends, torch.device(device), self.world_size)
        self.timeout_s = float(timeout_s)
        self.acct = accounting
        self.timeline = timeline
        td = datetime.timedelta(seconds=self.timeout_s)
        # new_group is itself collective: every rank creates them in the same order
        self.groups = {"default": None,
                       "param": dist.new_group(timeout=td),
                       "grad": dist.new_group(timeout=td)}
        self._group_ranks: dict[str, list[int]] = {}      # sub-groups (ZeRO++); else the world
        try:     # nodes (for the inter-node byte counters) from LOCAL_WORLD_SIZE
            self.topo = Topology.from_env(self.rank, self.world_size)
        except ValueError as e:
            log.warning("comm: %s; counting every rank as one node", e)
            self.topo = Topology(self.rank, self.world_size, self.world_size)
        self.device = torch.device("cpu")
        self.compute_device = torch.device(device)
        self.failed: list[tuple[int, str]] | None = None   # Note [failures in seconds]
        # between the ranks of one host: shared memory for the big host-tensor collectives
        self.shm = shm_transport.create(self, transport)
        st = self._store()
        if st is not None:             # a failure reported by an earlier engine is stale
            try:
                st.delete_key(f"{self._FAIL_KEY}{self.rank}")
            except Exception:  # noqa: BLE001 - not every store can delete
                pass

    # ------------------------------------------------------------------ errors, accounting
    def error(self, what: str, e: BaseException) -> CollectiveError:
        first = self.failed or self.reported_failures()
        if first:
            why = "; ".join(f"rank {r} failed first: {msg}" for r, msg in first)
            return CollectiveError(
                f"rank {self.rank} of {self.world_size} ({self.backend}): {what} failed: {e}. "
                f"{why}. This rank's window was dropped too: no rank applied the update; "
                f"{RESTART}")
        return CollectiveError(
            f"rank {self.rank} of {self.world_size} ({self.backend}): {what} failed: {e}. "
            f"Another rank probably raised, died or stopped calling collectives (each waits "
            f"at most dist_timeout_s={self.timeout_s:g}s); see that rank's error first")

    # ---- failures told to the other ranks (through the process group's store)
    _FAIL_KEY = "infinity/failed/"

    @staticmethod
    def _store():
        try:
            from torch.distributed import distributed_c10d as c10d
            return c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store (or a backend without one): best effort
            return None

    def report_failure(self, exc: BaseException) -> None:
        """Tell the other ranks why this rank dropped its window (their collectives then
        fail naming it instead of only timing out)."""
        st = self._store()
        if st is None:
            return
        try:
            msg = f"{type(exc).__name__}: {exc}"[:500]
            st.set(f"{self._FAIL_KEY}{self.rank}", msg)
        except Exception as e:  # noqa: BLE001 - the original error matters more
            log.debug("comm: could not report the failure to the other ranks: %s", e)

    def reported_failures(self) -> list[tuple[int, str]]:
        st = self._store()
        if st is None:
            return []
        out = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{self._FAIL_KEY}{r}"
            try:
                if st.check([key]):
                    out.append((r, st.get(key).decode(errors="replace")))
            except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
                continue
        return out

    def wait_watching(self, work) -> None:
        """Until ``work`` completed (its ``wait()`` then returns or raises at once), asking
        the store every :data:`FAILURE_POLL_S` whether another rank failed; if one did,
        abort (Note [failures in seconds]) and raise.  The blocking ``wait()`` runs on one of
        a few daemon threads (``is_completed()`` is not reliable for every gloo work: some
        complete only when waited on), so an abandoned wait never holds the process."""
        try:
            if work.is_completed():
                return
        except Exception:  # noqa: BLE001 - a backend without the query: wait below
            pass
        fut = _Waiters.submit(work)
        while True:
            try:
                fut.result(timeout=FAILURE_POLL_S)     # (re-raises the work's error)
                return
            except FutureTimeout:
                failed = self.reported_failures()
                if failed:
                    self.abort(failed)
                    raise RuntimeError("abandoned: another rank reported a failure while "
                                       "this rank waited") from None

    def abort(self, failed) -> None:
        """Another rank failed: stop every collective of this one (Note [failures in
        seconds]); the shared-memory channels refuse further work."""
        self.failed = list(failed)
        if self.shm is not None:
            self.shm.abort(f"rank {failed[0][0]} failed: {failed[0][1]}")

    def account(self, link: str | None, nbytes: int, t0: float) -> None:
        if link is None:
            return
        t1 = time.perf_counter()
        if self.acct is not None:
            self.acct.link(link, nbytes, t1 - t0)
        tl = self.timeline
        if tl is not None and getattr(tl, "enabled", False):
            tl.add(link, link, t0, t1, nbytes)

    # ---- bytes this rank sends (engine.stats(): gloo is opaque, so counted by convention)
    def add_group(self, name: str, pg, ranks: list[int]) -> None:
        """Register a sub-group (created with :func:`infinity.zero.hierarchy.new_subgroups`)
        under ``name``; :meth:`close` destroys it."""
        self.groups[name] = pg
        self._group_ranks[name] = list(ranks)

    def group_ranks(self, group: str) -> list[int]:
        return self._group_ranks.get(group) or list(range(self.world_size))

    def count_sent(self, kind: str, sent: int, inter: int) -> None:
        """``kind``: ``"allgather"`` (parameter gathers) or ``"grad_comm"`` (gradient
        reduction): ``<kind>_sent_bytes`` and ``<kind>_sent_inter_bytes`` (to other nodes)."""
        if self.acct is not None:
            self.acct.count(f"{kind}_sent_bytes", int(sent))
            self.acct.count(f"{kind}_sent_inter_bytes", int(inter))

    def _count_chunks(self, kind: str, chunk_bytes: int, group: str, times: int = 1) -> None:
        sent, inter = self.topo.sent_all_gather(chunk_bytes, self.group_ranks(group))
        self.count_sent(kind, times * sent, times * inter)

    def _run(self, fn, what: str, async_op: bool, post=None, link=None, nbytes=0,
             tensors=()):
        """``fn()`` issues the collective asynchronously (its work object, or None when it
        completed); ``async_op=False`` waits for it here.  Host collectives (no CUDA
        tensor) are waited on watching for failed ranks (Note [failures in seconds])."""
        if self.failed:
            raise self.error(what, RuntimeError("not issued: an earlier collective was "
                                                "abandoned"))
        t0 = time.perf_counter()
        try:
            work = fn()
        except Exception as e:
            raise self.error(what, e) from e
        h = CommHandle(self, work, what, post, link, nbytes,
                       poll=not any(t.is_cuda for t in tensors))
        h.t0 = t0
        if not async_op:
            h.wait()
            return None
        return h

    def _shm(self, group: str, *tensors: torch.Tensor):
        """The shared-memory channel carrying ``group``'s collectives on these tensors, or
        None (then the process group carries them)."""
        if self.shm is None or not self.shm.carries(*tensors):
            return None
        if len({t.dtype for t in tensors}) != 1:
            return None
        return self.shm.channel(group)

    # ------------------------------------------------------------------ collectives
    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, *, group: str = "param",
                        async_op: bool = False, name: str = "") -> CommHandle | None:
        """``out`` (group size x shard numel) receives every rank's ``shard`` in rank order."""
        n = len(self.group_ranks(group))
        if out.numel() != shard.numel() * n:
            raise ValueError(f"all_gather: output has {out.numel()} elements, expected "
                             f"{n} x {shard.numel()}")
        pg = self.groups[group]
        nbytes = out.numel() * out.element_size()
        what = f"all_gather of {name or 'tensor'} ({nbytes} bytes, group {group!r})"
        self._count_chunks("allgather", shard.numel() * shard.element_size(), group)
        ch = self._shm(group, out, shard)
        if ch is not None:
            return self._run(lambda: ch.submit(lambda: ch.all_gather(out, shard)),
                             what + " [shm]", async_op, link="allgather", nbytes=nbytes,
                             tensors=(out,))
        return self._run(lambda: _all_gather(out, shard, group=pg, async_op=True),
                         what, async_op, link="allgather", nbytes=nbytes, tensors=(out,))

    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor, *, group: str = "grad",
                           async_op: bool = False, post=None, name: str = "") -> CommHandle | None:
        """``out`` (shard) receives this rank's slice of the sum over ranks of ``full``."""
        if full.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {full.numel()} elements, expected "
                             f"{self.world_size} x {out.numel()}")
        pg = self.groups[group]
        nbytes = full.numel() * full.element_size()
        what = f"reduce_scatter of {name or 'tensor'} ({nbytes} bytes, group {group!r})"
        self._count_chunks("grad_comm", out.numel() * out.element_size(), group)
        ch = self._shm(group, out, full)
        if ch is not None:
            return self._run(lambda: ch.submit(lambda: ch.reduce_scatter(out, full)),
                             what + " [shm]", async_op, post, link="reduce_scatter",
                             nbytes=nbytes, tensors=(out,))
        if _reduce_scatter is not None:
            fn = lambda: _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=pg,
                                         async_op=True)
            return self._run(fn, what, async_op, post, link="reduce_scatter", nbytes=nbytes,
                             tensors=(out,))
        lo = self.rank * out.numel()

        def post_slice():
            out.copy_(full[lo:lo + out.numel()])
            if post is not None:
                post()
        fn = lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return self._run(fn, what + " [all_reduce fallback]", async_op, post_slice,
                         link="reduce_scatter", nbytes=nbytes, tensors=(full,))

    def all_reduce_sum(self, t: torch.Tensor, *, group: str = "grad", async_op: bool = False,
                       post=None, name: str = "") -> CommHandle | None:
        pg = self.groups[group]
        nbytes = t.numel() * t.element_size()
        what = f"all_reduce of {name or 'tensor'} ({nbytes} bytes, group {group!r})"
        if group == "grad":      # gradients (stage 1): a reduce-scatter + an all-gather
            self._count_chunks("grad_comm", -(-nbytes // len(self.group_ranks(group))),
                               group, times=2)
        ch = self._shm(group, t)
        if ch is not None:
            return self._run(lambda: ch.submit(lambda: ch.all_reduce(t)), what + " [shm]",
                             async_op, post, link="reduce_scatter", nbytes=nbytes,
                             tensors=(t,))
        return self._run(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg,
                                                 async_op=True),
                         what, async_op, post, link="reduce_scatter", nbytes=nbytes,
                         tensors=(t,))

    def broadcast(self, t: torch.Tensor, src: int, *, group: str = "param",
                  async_op: bool = False, name: str = "") -> CommHandle | None:
        """``t`` on every rank receives rank ``src``'s ``t`` (memory-centric tiling at stage
        3: the owner of a piece of a tile sends it to the others).  Counted as parameter
        traffic (``allgather_sent_bytes``): the owner sends its piece to every other rank."""
        pg = self.groups[group]
        nbytes = t.numel() * t.element_size()
        what = f"broadcast of {name or 'tensor'} from rank {src} ({nbytes} bytes, group {group!r})"
        if self.rank == src:
            self._count_chunks("allgather", nbytes, group)
        return self._run(lambda: dist.broadcast(t, src, group=pg, async_op=True),
                         what, async_op, link="allgather", nbytes=nbytes, tensors=(t,))

    def reduce_sum(self, t: torch.Tensor, dst: int, *, group: str = "grad",
                   async_op: bool = False, post=None, name: str = "") -> CommHandle | None:
        """``t`` on rank ``dst`` receives the sum over ranks of ``t`` (other ranks' ``t`` is
        left undefined; memory-centric tiling at stages 2-3: a tile's gradient piece goes to
        the rank owning it).  Counted as gradient traffic: every other rank sends its piece."""
        pg = self.groups[group]
        nbytes = t.numel() * t.element_size()
        what = f"reduce of {name or 'tensor'} to rank {dst} ({nbytes} bytes, group {group!r})"
        if self.rank != dst:
            inter = nbytes if self.topo.node_of(dst) != self.topo.node_of(self.rank) else 0
            self.count_sent("grad_comm", nbytes, inter)
        return self._run(lambda: dist.reduce(t, dst, op=dist.ReduceOp.SUM, group=pg,
                                             async_op=True),
                         what, async_op, post, link="reduce_scatter", nbytes=nbytes,
                         tensors=(t,))

    def all_to_all_into(self, out: torch.Tensor, inp: torch.Tensor, *, group: str,
                        name: str = "") -> None:
        """Row ``i`` of ``inp`` (one row per rank of ``group``, group order) goes to rank
        ``i``; row ``j`` of ``out`` comes from rank ``j``.  Counted as gradient traffic
        (qgZ is its only user)."""
        n = len(self.group_ranks(group))
        if inp.shape[0] != n or out.shape != inp.shape:
            raise ValueError(f"all_to_all: {tuple(inp.shape)} -> {tuple(out.shape)}; expected "
                             f"{n} equal rows each way")
        pg = self.groups[group]
        nbytes = inp.numel() * inp.element_size()
        what = f"all_to_all of {name or 'tensor'} ({nbytes} bytes, group {group!r})"
        self._count_chunks("grad_comm", nbytes // n, group)
        self._run(lambda: dist.all_to_all_single(out, inp, group=pg, async_op=True), what,
                  False, link="reduce_scatter", nbytes=nbytes, tensors=(out,))

    def all_reduce_scalar(self, x: float, *, name: str = "scalar") -> float:
        t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        self.all_reduce_sum(t, group="default", name=name)
        return float(t.item())

    def barrier(self, name: str = "barrier") -> None:
        t = torch.zeros(1, device=self.device)
        self.all_reduce_sum(t, group="default", name=name)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        if self.failed:
            # collectives were abandoned on these groups (Note [failures in seconds]):
            # destroying them would wait for the peers (up to dist_timeout_s); they are
            # left to the process's end
            _ABANDONED.extend(pg for k, pg in self.groups.items() if k != "default" and pg)
            self.groups = {k: None for k in self.groups}
            return
        for k in [k for k in self.groups if k != "default"]:
            pg = self.groups.get(k)
            if pg is not None:
                try:
                    dist.destroy_process_group(pg)
                except Exception as e:  # best effort while tearing down after an error
                    log.debug("comm: destroying the %s group failed: %s", k, e)
                self.groups[k] = None

