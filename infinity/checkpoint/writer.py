"""Writing a checkpoint: per-rank shard files, the manifest, and the atomic commit.

Layout while writing (all under the checkpoint root ``dir``)::

    dir/.tmp-<tag>-<pid>/            0700, pid = rank 0's writer process
        rank<r>-<nnnnn>.safetensors  0600, each rank writes its own
        rank<r>.part.json            0600, what rank r wrote (merged by rank 0)
        manifest.json                0600, written last by rank 0

Commit (rank 0, after every rank finished): fsync files and the temp dir, then

1. ``dir/<tag>`` absent: rename temp -> ``dir/<tag>``, fsync ``dir``.
2. ``dir/<tag>`` present: atomically *exchange* temp and ``dir/<tag>``
   (``renameat2(RENAME_EXCHANGE)``), fsync ``dir``, delete the temp name (which now
   holds the old checkpoint). Without RENAME_EXCHANGE: rename old ->
   ``dir/.trash-<tag>-<pid>``, rename temp -> ``dir/<tag>``, delete the trash.
3. Replace ``dir/latest`` atomically (temp file + fsync + rename + fsync dir).

Crash (kill -9) states and what they leave:

- during 0 (writing): ``dir/<tag>`` (if any) and ``latest`` untouched; a stale temp
  dir is removed by the next save (only once its pid is dead).
- after 1/2: ``dir/<tag>`` is the complete new checkpoint; the old one may linger
  under a temp name and is removed by the next save. ``latest`` still names a
  complete tag (the previous one, or this tag).
- fallback between its two renames: ``dir/<tag>`` is missing, the complete old
  copy is in ``dir/.trash-<tag>-<pid>``; readers fall back to it and the next save
  renames it back.
- during 3: ``latest`` is either the old or the new content (rename is atomic); a
  stale ``.latest.tmp-<pid>`` is removed by the next save.
"""
import json
import logging
import os
import time

from infinity.procutil import pid_alive

from . import dtypes
from . import manifest as mf
from .errors import CheckpointError
from .fsutil import (atomic_write_text, exchange, fsync_dir, fsync_fd, make_private_dir,
                     open_private_file, remove_tree, write_all)
from .safetensors_stream import HASH_BLOCK_BYTES, SafetensorsStreamWriter

log = logging.getLogger("infinity.checkpoint")

DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_HEADER_RESERVE = 256 * 1024


class Piece:
    """A flat element range of a bigger tensor: the tensor handed to the writer holds
    elements ``[start, start + numel)`` of the row-major flattening of ``full_shape``."""

    __slots__ = ("full_shape", "start")

    def __init__(self, full_shape, start):
        self.full_shape = tuple(int(s) for s in full_shape)
        self.start = int(start)


def temp_dir_name(tag, pid):
    return f".tmp-{tag}-{pid}"


def trash_dir_name(tag, pid):
    return f".trash-{tag}-{pid}"


def cleanup_stale(root):
    """Remove leftovers of crashed writers (temp dirs, trash dirs, latest temp files)
    whose writer pid is dead; restore a trashed tag whose replacement never arrived."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        kind = None
        for prefix in (".tmp-", ".trash-", ".deleted-", ".latest.tmp-"):
            if name.startswith(prefix):
                kind = prefix
                break
        if kind is None:
            continue
        rest = name[len(kind):]
        pid_s = rest.rsplit("-", 1)[-1]
        if not pid_s.isdigit():
            continue
        pid = int(pid_s)
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(root, name)
        if kind == ".trash-":
            tag = rest[: -(len(pid_s) + 1)]
            target = os.path.join(root, tag)
            if tag and not os.path.lexists(target):
                log.warning("restoring checkpoint %s from %s (a writer died mid-swap)", target, path)
                os.rename(path, target)
                fsync_dir(root)
                continue
        log.info("removing stale checkpoint leftover %s (writer pid %d is gone)", path, pid)
        remove_tree(path)


def begin(root, tag, pid=None):
    """Rank 0: create (or reuse) the private temp directory for ``tag``; returns its path."""
    mf.check_tag(tag)
    tmp = os.path.join(root, temp_dir_name(tag, os.getpid() if pid is None else pid))
    if os.path.lexists(tmp):
        remove_tree(tmp)  # our own pid: a previous failed attempt of this process
    make_private_dir(tmp)
    return tmp


class RankShardWriter:
    """One rank's writer: streams tensors into ``rank<r>-<n>.safetensors`` files of at
    most ``shard_bytes`` data each (a tensor larger than that gets a file of its own)."""

    def __init__(self, tmpdir, rank=0, *, shard_bytes=DEFAULT_SHARD_BYTES,
                 header_reserve=DEFAULT_HEADER_RESERVE, hash_block_bytes=HASH_BLOCK_BYTES,
                 timeline=None, accounting=None):
        if shard_bytes <= 0:
            raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
        self.tmpdir = tmpdir
        self.rank = int(rank)
        self.shard_bytes = int(shard_bytes)
        self.header_reserve = header_reserve
        self.hash_block_bytes = hash_block_bytes
        self.timeline = timeline
        self.accounting = accounting
        self._cur = None
        self._index = 0
        self.files = {}
        self.tensors = {}  # name -> {"dtype", "shape", "pieces": [...]}
        self.bytes_written = 0

    def _open_next(self):
        name = mf.shard_file_name(self.rank, self._index)
        self._index += 1
        self._cur_name = name
        self._cur = SafetensorsStreamWriter(os.path.join(self.tmpdir, name),
                                            header_reserve=self.header_reserve,
                                            hash_block_bytes=self.hash_block_bytes,
                                            metadata={"format": "pt", "writer": "infinity"})

    def _close_cur(self):
        if self._cur is not None:
            info = self._cur.close()
            info["rank"] = self.rank
            self.files[self._cur_name] = info
            self._cur = None

    def add(self, name, tensor, piece=None):
        """Write one tensor (or one flat piece of a tensor, see :class:`Piece`)."""
        if not isinstance(name, str) or not name or len(name) > 1000:
            raise CheckpointError(f"invalid tensor name {name!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if piece is None:
            full_shape, start, key, shape = tuple(tensor.shape), 0, name, None
        else:
            full_shape, start = piece.full_shape, piece.start
            key, shape = f"{name}#{start}", (tensor.numel(),)
        numel_full = 1
        for s in full_shape:
            numel_full *= s
        if start < 0 or start + tensor.numel() > numel_full:
            raise CheckpointError(f"tensor {name!r}: piece [{start}, {start + tensor.numel()}) "
                                  f"outside shape {full_shape}")
        if self._cur is not None and self._cur.data_bytes > 0 and (
                self._cur.data_bytes + nbytes > self.shard_bytes
                or not self._cur.fits(key, tensor.reshape(shape) if shape else tensor)):
            self._close_cur()
        if self._cur is None:
            self._open_next()
        t0 = time.perf_counter()
        b, e = self._cur.add(key, tensor.reshape(shape) if shape else tensor)
        dt = time.perf_counter() - t0
        if self.timeline is not None and getattr(self.timeline, "enabled", False):
            self.timeline.add("nvme_write", f"ckpt:{name}", t0, t0 + dt, nbytes)
        if self.accounting is not None:
            self.accounting.link("nvme_write", nbytes, dt)
        self.bytes_written += nbytes
        st = dtypes.to_st(tensor.dtype)
        ent = self.tensors.get(name)
        if ent is None:
            ent = self.tensors[name] = {"dtype": st, "shape": list(full_shape), "pieces": []}
        elif ent["dtype"] != st or ent["shape"] != list(full_shape):
            raise CheckpointError(f"tensor {name!r} written twice with different dtype/shape")
        ent["pieces"].append({"rank": self.rank, "file": self._cur_name, "key": key,
                              "start": start, "numel": tensor.numel(), "offsets": [b, e]})

    def finish(self):
        """Close the last shard and write ``rank<r>.part.json``; returns the part dict."""
        self._close_cur()
        part = {"rank": self.rank, "files": self.files, "tensors": self.tensors}
        path = os.path.join(self.tmpdir, f"rank{self.rank}.part.json")
        fd = open_private_file(path)
        try:
            write_all(fd, json.dumps(part).encode(), path)
            fsync_fd(fd, path)
        finally:
            os.close(fd)
        return part

    def abort(self):
        if self._cur is not None:
            self._cur.abort()
            self._cur = None


def merge_parts(parts, world_size, tag, meta):
    """Combine the per-rank parts into a manifest dict (validated by the caller)."""
    files, tensors, ranks = {}, {}, []
    for part in sorted(parts, key=lambda p: p["rank"]):
        ranks.append({"rank": part["rank"], "files": sorted(part["files"])})
        files.update(part["files"])
        for name, ent in part["tensors"].items():
            cur = tensors.get(name)
            if cur is None:
                tensors[name] = {"dtype": ent["dtype"], "shape": ent["shape"],
                                 "pieces": list(ent["pieces"])}
            elif cur["dtype"] != ent["dtype"] or cur["shape"] != ent["shape"]:
                raise CheckpointError(f"tensor {name!r}: ranks disagree on dtype/shape "
                                      f"({cur['dtype']}{cur['shape']} vs {ent['dtype']}{ent['shape']})")
            else:
                cur["pieces"].extend(ent["pieces"])
    for name, t in tensors.items():
        t["pieces"].sort(key=lambda p: p["start"])
    return {"format": mf.FORMAT, "version": mf.VERSION, "tag": tag, "world_size": int(world_size),
            "created_unix": time.time(), "ranks": ranks, "files": files,
            "tensors": tensors, "meta": meta}


def read_parts(tmpdir, world_size):
    parts = []
    for r in range(world_size):
        p = os.path.join(tmpdir, f"rank{r}.part.json")
        try:
            with open(p, encoding="utf-8") as f:
                parts.append(json.load(f))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"rank {r} did not finish its part of the checkpoint ({p}: {e})") from e
    return parts


def finalize(root, tag, tmpdir, world_size, meta, parts=None):
    """Rank 0: write the manifest into ``tmpdir`` and commit it as ``root/<tag>``,
    then point ``root/latest`` at it. ``meta`` must be JSON-serialisable."""
    if parts is None:
        parts = read_parts(tmpdir, world_size)
    m = merge_parts(parts, world_size, tag, meta)
    mpath = os.path.join(tmpdir, mf.MANIFEST_NAME)
    mf.validate(m, mpath)
    try:
        text = mf.seal(m)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {e}") from e
    for r in range(world_size):
        p = os.path.join(tmpdir, f"rank{r}.part.json")
        if os.path.exists(p):
            os.unlink(p)
    fd = open_private_file(mpath)
    try:
        write_all(fd, text.encode("utf-8"), mpath)
        fsync_fd(fd, mpath)
    finally:
        os.close(fd)
    fsync_dir(tmpdir)
    commit(root, tag, tmpdir)
    return m


def _rename(a, b):
    try:
        os.rename(a, b)
    except OSError as e:
        raise CheckpointError(f"cannot rename {a} -> {b}: {os.strerror(e.errno)} "
                              f"(errno {e.errno})") from e


def commit(root, tag, tmpdir):
    """Atomically install ``tmpdir`` as ``root/<tag>`` and update ``root/latest``."""
    final = os.path.join(root, tag)
    if os.path.lexists(final):
        if exchange(tmpdir, final):
            fsync_dir(root)
            remove_tree(tmpdir)  # now holds the old checkpoint
        else:
            trash = os.path.join(root, trash_dir_name(tag, os.getpid()))
            _rename(final, trash)
            fsync_dir(root)
            _rename(tmpdir, final)
            fsync_dir(root)
            remove_tree(trash)
    else:
        _rename(tmpdir, final)
        fsync_dir(root)
    atomic_write_text(os.path.join(root, mf.LATEST_NAME), tag + "\n")
    log.info("checkpoint %s committed", final)


def delete(root, tag, *, allow_latest=False):
    """Remove checkpoint ``root/<tag>`` so that it disappears atomically: rename it to
    ``root/.deleted-<tag>-<pid>`` (fsync), then delete that. A crash leaves at most a
    hidden leftover that the next save removes, never a half-deleted tag. Refuses to
    delete the tag ``latest`` names unless ``allow_latest``."""
    mf.check_tag(tag)
    final = os.path.join(root, tag)
    if not os.path.isdir(final):
        raise CheckpointError(f"checkpoint {final} does not exist")
    if not allow_latest:
        try:
            with open(os.path.join(root, mf.LATEST_NAME), encoding="utf-8") as f:
                if f.read(1024).strip() == tag:
                    raise CheckpointError(f"refusing to delete {final}: 'latest' points to it")
        except FileNotFoundError:
            pass
    gone = os.path.join(root, f".deleted-{tag}-{os.getpid()}")
    _rename(final, gone)
    fsync_dir(root)
    remove_tree(gone)
