"""save_checkpoint / load_checkpoint over the :class:`Checkpointable` protocol.

The engine (or any object) implements five methods; this module does the rest
(streaming, sharding, hashing, atomic commit, verification, async save).
"""
import json
import logging
import os
import queue
import threading
from typing import Iterator, Protocol, runtime_checkable

import torch

from . import manifest as mf
from .errors import CheckpointError
from .fsutil import check_path, ensure_checkpoint_root, remove_tree
from .reader import CheckpointReader
from .safetensors_stream import HASH_BLOCK_BYTES
from .writer import (DEFAULT_HEADER_RESERVE, DEFAULT_SHARD_BYTES, RankShardWriter, begin,
                     cleanup_stale, finalize, temp_dir_name)

log = logging.getLogger("infinity.checkpoint")

DEFAULT_ASYNC_HOST_BYTES = 1 << 30


@runtime_checkable
class Checkpointable(Protocol):
    """What an object must provide to be saved/loaded by this package.

    ``checkpoint_tensors`` yields ``(name, tensor)`` or ``(name, tensor, Piece)``
    one at a time (model parameter names for the fp32 master weights,
    ``"optim.<name>.exp_avg"`` / ``"optim.<name>.exp_avg_sq"`` for Adam states).
    The writer consumes each tensor before asking for the next, so the producer may
    reuse one staging buffer. With a :class:`Piece`, the tensor is the flat element
    range ``[piece.start, piece.start + numel)`` of a tensor of ``piece.full_shape``
    (a rank's partition).
    """

    def checkpoint_tensors(self) -> Iterator[tuple]: ...

    def checkpoint_meta(self) -> dict: ...

    def checkpoint_expected(self) -> dict: ...

    def load_checkpoint_tensors(self, reader: CheckpointReader) -> None: ...

    def load_checkpoint_meta(self, meta: dict) -> None: ...


# ---------------------------------------------------------------------------------
class SaveHandle:
    """Result of :func:`save_checkpoint`. ``wait()`` returns the checkpoint path and
    re-raises the error of an asynchronous save."""

    def __init__(self, root, tag):
        self.root, self.tag = root, tag
        self.path = os.path.join(root, tag)
        self._thread = None
        self._error = None
        self._reported = False
        self.peak_queued_bytes = 0

    def done(self):
        return self._thread is None or not self._thread.is_alive()

    def wait(self):
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path


_pending_lock = threading.Lock()
_pending = None


def wait_pending(raise_errors=True):
    """Block until an in-flight asynchronous save finished. Its error is re-raised
    here unless its ``wait()`` already reported it (or ``raise_errors`` is False)."""
    global _pending
    with _pending_lock:
        h, _pending = _pending, None
    if h is None:
        return
    reported = h._reported
    try:
        h.wait()
    except BaseException as e:  # noqa: BLE001
        if raise_errors and not reported:
            raise
        log.warning("previous asynchronous checkpoint save failed: %s", e)


class _AsyncSave(SaveHandle):
    """Writer thread fed by a queue of copied tensors holding at most ``max_host_bytes``
    (a single tensor larger than the bound is admitted alone)."""

    _END = object()
    _ABORT = object()

    def __init__(self, root, tag, tmp, meta, max_host_bytes, writer_kw):
        super().__init__(root, tag)
        self._tmp, self._meta = tmp, meta
        self._max = int(max_host_bytes)
        self._q = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._queued = 0
        self._writer_kw = writer_kw
        self._thread = threading.Thread(target=self._run, name=f"infinity-ckpt-{tag}", daemon=False)
        self._thread.start()

    def put(self, name, tensor, piece):
        nbytes = tensor.numel() * tensor.element_size()
        with self._cv:
            while self._error is None and self._queued > 0 and self._queued + nbytes > self._max:
                self._cv.wait()
            if self._error is not None:
                raise self._error
            self._queued += nbytes  # reserve, then copy outside the lock
            self.peak_queued_bytes = max(self.peak_queued_bytes, self._queued)
        try:
            copy = tensor.detach().to("cpu", copy=True)
        except BaseException:
            with self._cv:
                self._queued -= nbytes
            raise
        self._q.put((name, copy, piece, nbytes))

    def end(self, ok=True):
        self._q.put(self._END if ok else self._ABORT)

    def _run(self):
        w = None
        try:
            w = RankShardWriter(self._tmp, 0, **self._writer_kw)
            while True:
                item = self._q.get()
                if item is self._ABORT:
                    raise CheckpointError("asynchronous save aborted by the producer")
                if item is self._END:
                    break
                name, t, piece, nbytes = item
                w.add(name, t, piece)
                del t, item
                with self._cv:
                    self._queued -= nbytes
                    self._cv.notify_all()
            part = w.finish()
            finalize(self.root, self.tag, self._tmp, 1, self._meta, parts=[part])
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            if w is not None:
                w.abort()
            remove_tree(self._tmp)
            with self._cv:
                self._error = e if isinstance(e, CheckpointError) else CheckpointError(
                    f"asynchronous save of {self.path} failed: {e}")
                if self._error is not e:
                    self._error.__cause__ = e
                self._cv.notify_all()
            log.error("asynchronous checkpoint save %s failed: %s", self.path, e)


# ---------------------------------------------------------------------------------
def _dist_info():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def dist_device():
    d = torch.distributed
    if d.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bcast_ints(vals, src=0):
    t = torch.tensor(vals, dtype=torch.int64, device=dist_device())
    torch.distributed.broadcast(t, src)
    return [int(x) for x in t.tolist()]


def _all_ok(ok):
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=dist_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def _snapshot_meta(obj):
    meta = obj.checkpoint_meta()
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint_meta() must return a dict, got {type(meta).__name__}")
    try:
        meta = json.loads(json.dumps(meta))
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint_meta() is not JSON-serialisable: "
                              f"{type(e).__name__}: {e}") from e
    mf.check_depth(meta, "checkpoint_meta()", "the meta")
    return meta


def _items(obj):
    for item in obj.checkpoint_tensors():
        if len(item) == 2:
            yield item[0], item[1], None
        elif len(item) == 3:
            yield item
        else:
            raise CheckpointError(f"checkpoint_tensors() must yield (name, tensor[, Piece]), got "
                                  f"a tuple of {len(item)}")


def default_tag(meta, step):
    if step is None:
        step = meta.get("step")
    if step is None:
        raise CheckpointError("no tag given and no step known (pass tag= or step=, or put "
                              "'step' in checkpoint_meta())")
    return f"step-{int(step)}"


def save_checkpoint(obj, dir, tag=None, *, step=None, shard_bytes=DEFAULT_SHARD_BYTES,
                    async_=False, max_host_bytes=DEFAULT_ASYNC_HOST_BYTES,
                    header_reserve=DEFAULT_HEADER_RESERVE, hash_block_bytes=HASH_BLOCK_BYTES,
                    timeline=None, accounting=None, extra_meta=None):
    """Write ``obj``'s state to ``dir/<tag>`` atomically and point ``dir/latest`` at it.

    Default tag ``step-<N>`` from ``step`` or ``meta["step"]``. Under an initialised
    ``torch.distributed`` every rank must call this; each writes its own files and
    rank 0 writes the manifest and commits. ``async_=True`` (world size 1) copies
    tensors into a queue of at most ``max_host_bytes`` and writes them on a background
    thread: the call returns once every tensor is copied (so later training cannot
    change what is saved), the last ``max_host_bytes`` are written in the background.
    A later save or load waits for it. Returns a :class:`SaveHandle`.
    ``extra_meta`` (a JSON-able dict) is merged into the meta, e.g.
    ``{"model_config": ..., "tokenizer": ...}`` from :func:`infinity.checkpoint.model_meta`,
    which ``infinity export`` turns into ``config.json`` and friends.
    """
    global _pending
    wait_pending()
    rank, world = _dist_info()
    meta = _snapshot_meta(obj)
    if extra_meta:
        try:
            meta.update(json.loads(json.dumps(dict(extra_meta))))
        except (TypeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"extra_meta is not JSON-serialisable: "
                                  f"{type(e).__name__}: {e}") from e
        mf.check_depth(meta, "extra_meta", "the meta")
    tag = mf.check_tag(tag if tag is not None else default_tag(meta, step))
    root = os.path.abspath(check_path(dir, "checkpoint directory"))
    writer_kw = dict(shard_bytes=shard_bytes, header_reserve=header_reserve,
                     hash_block_bytes=hash_block_bytes, timeline=timeline, accounting=accounting)

    setup_err, pid = None, os.getpid()
    if rank == 0:
        try:
            ensure_checkpoint_root(root)
            cleanup_stale(root)
            tmp = begin(root, tag)
        except BaseException as e:  # noqa: BLE001 - reported to all ranks below
            setup_err = e
    if world > 1:
        pid, ok = _bcast_ints([pid, 0 if setup_err else 1])
        if not ok and setup_err is None:
            raise CheckpointError(f"rank 0 could not prepare checkpoint {root}/{tag}")
    if setup_err is not None:
        raise setup_err
    tmp = os.path.join(root, temp_dir_name(tag, pid))

    if async_ and world == 1:
        h = _AsyncSave(root, tag, tmp, meta, max_host_bytes, writer_kw)
        try:
            for name, t, piece in _items(obj):
                h.put(name, t, piece)
        except BaseException:
            h.end(ok=False)
            h._thread.join()
            raise
        h.end()
        with _pending_lock:
            _pending = h
        return h
    if async_:
        log.info("asynchronous checkpoint save is not supported at world size %d; saving "
                 "synchronously", world)

    err, w = None, None
    try:
        w = RankShardWriter(tmp, rank, **writer_kw)
        for name, t, piece in _items(obj):
            w.add(name, t, piece)
        w.finish()
    except BaseException as e:  # noqa: BLE001 - re-raised after the collective
        err = e
        if w is not None:
            w.abort()
    ok = _all_ok(err is None) if world > 1 else err is None
    if rank == 0:
        if ok:
            try:
                finalize(root, tag, tmp, world, meta)
            except BaseException as e:  # noqa: BLE001
                err = err or e
                ok = False
        if not ok:
            remove_tree(tmp)
    if world > 1:
        ok = _bcast_ints([1 if ok else 0])[0] == 1
    if err is not None:
        raise err
    if not ok:
        raise CheckpointError(f"saving checkpoint {root}/{tag} failed on another rank")
    return SaveHandle(root, tag)


def load_checkpoint(obj, dir, tag=None, *, strict=True):
    """Verify ``dir/<tag>`` (``latest`` when None) completely, check it matches
    ``obj.checkpoint_expected()``, then call ``obj.load_checkpoint_tensors(reader)``
    and ``obj.load_checkpoint_meta(meta)``. Nothing in ``obj`` is touched before
    every checksum passed. Returns the meta dict.

    Two optional methods beyond the protocol (the engine has both), also called before
    anything is touched: ``check_checkpoint(reader)`` (semantic checks of the manifest and
    meta, before any byte is hashed) and ``checkpoint_value_checks()`` (``{name:
    ValueCheck}``: values checked while :meth:`CheckpointReader.verify` hashes them, see
    :mod:`infinity.checkpoint.values`)."""
    wait_pending(raise_errors=False)
    check = getattr(obj, "check_checkpoint", None)
    values = getattr(obj, "checkpoint_value_checks", None)
    with CheckpointReader(dir, tag) as r:
        if check is not None:
            check(r)
        r.verify(value_checks=values() if values is not None else None)
        r.check_compatible(obj.checkpoint_expected(), strict=strict)
        obj.load_checkpoint_tensors(r)
        obj.load_checkpoint_meta(r.meta)
        return r.meta
