"""Reading a checkpoint: resolve ``latest``, verify every byte, stream tensors out.

Nothing from the checkpoint is ever executed or unpickled: the manifest is JSON
validated field by field (see :mod:`.manifest`), tensor bytes are copied into
freshly allocated (or caller-provided) tensors of allow-listed dtypes.
"""
import hashlib
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import torch

from . import dtypes
from . import manifest as mf
from .errors import CheckpointError
from .fsutil import check_path
from .safetensors_stream import read_header

log = logging.getLogger("infinity.checkpoint")

_HASH_CHUNK = 8 << 20
_MAX_VERIFY_THREADS = 8


def _refuse_escape(root, path, what):
    """A ``latest`` file or tag directory that is (or passes through) a symlink leading
    outside the checkpoint root is refused: loading must never read files the root's
    owner did not put under it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CheckpointError(f"{path} ({what!r}) is a symlink leading outside the checkpoint "
                              f"directory {root} (to {real}); refusing to load it. Copy the "
                              f"checkpoint into {root} or load it from where it lives")


def resolve_tag(root, tag=None):
    """The tag directory to read: ``tag``, or the content of ``root/latest``."""
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    if tag is None:
        lp = os.path.join(root, mf.LATEST_NAME)
        _refuse_escape(root, lp, mf.LATEST_NAME)
        try:
            with open(lp, encoding="utf-8") as f:
                tag = f.read(1024).strip()
        except FileNotFoundError:
            raise CheckpointError(f"{root} has no 'latest' file: no checkpoint was completed "
                                  f"there; pass tag= explicitly") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {lp}: {e}") from None
        mf.check_tag(tag, where=f"{lp}: ")
    else:
        mf.check_tag(tag)
    path = os.path.join(root, tag)
    _refuse_escape(root, path, tag)
    if not os.path.isdir(path):
        # A writer may have died between the two renames of the no-RENAME_EXCHANGE
        # fallback: the complete previous copy is then in .trash-<tag>-<pid>.
        prefix = f".trash-{tag}-"
        for n in sorted(os.listdir(root)):
            if n.startswith(prefix) and n[len(prefix):].isdigit() and \
                    os.path.isfile(os.path.join(root, n, mf.MANIFEST_NAME)):
                log.warning("checkpoint %s missing; reading its intact copy %s", path, n)
                return tag, os.path.join(root, n)
        raise CheckpointError(f"checkpoint {path} does not exist (tags here: "
                              f"{list_tags(root)})")
    return tag, path


def list_tags(root):
    """Committed tags in ``root`` (directories with a manifest, excluding temp dirs)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".")
                  and os.path.isfile(os.path.join(root, n, mf.MANIFEST_NAME)))


class CheckpointReader:
    """Read-only view of one checkpoint ``root/<tag>`` (``latest`` when tag is None).

    Construction reads and validates the manifest only. Call :meth:`verify` to
    check every file's size and SHA-256 before loading anything (``load_checkpoint``
    does). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, root, tag=None):
        self.root = os.path.abspath(check_path(root, "checkpoint directory"))
        self.tag, self.path = resolve_tag(self.root, tag)
        mpath = os.path.join(self.path, mf.MANIFEST_NAME)
        try:
            st = os.lstat(mpath)
            if not stat.S_ISREG(st.st_mode) or st.st_size > 256 << 20:
                raise CheckpointError(f"{mpath} is not a regular file of sane size")
            with open(mpath, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{mpath} is missing: {self.path} is not a complete "
                                  f"checkpoint") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {mpath}: {e}") from None
        self.manifest = mf.parse(text, mpath)
        self.meta = self.manifest["meta"]
        self.world_size = self.manifest["world_size"]
        self._tensors = self.manifest["tensors"]
        self._fds = {}
        self._scanner = None
        self.verified = False
        # Note [Base by reference]: frozen tensors named by their pretrained files
        self.base = None
        if isinstance(self.meta.get("frozen_base"), dict):
            from .base_source import BaseSource
            self.base = BaseSource(self.meta["frozen_base"], self.path)

    # -- lifecycle ---------------------------------------------------------------
    def close(self):
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _file_path(self, fname):
        mf.check_file_name(fname, self.path)
        return os.path.join(self.path, fname)

    def _fd(self, fname):
        fd = self._fds.get(fname)
        if fd is None:
            p = self._file_path(fname)
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as e:
                raise CheckpointError(f"cannot open checkpoint file {p}: {os.strerror(e.errno)}") from None
            self._fds[fname] = fd
        return fd

    # -- verification ------------------------------------------------------------
    def verify(self, hash_files=None, value_checks=None):
        """Check every file exists (regular, not a symlink), has the recorded size,
        header and data SHA-256, and a safetensors header that agrees with the
        manifest. Raises CheckpointError naming the first bad file.

        ``hash_files``: only these files' SHA-256 digests are checked (default: all;
        existence, sizes and headers are always checked for every file). A multi-rank
        load hashes a share per rank and makes the ranks agree on the outcome; then
        :attr:`verified` stays False on each rank.

        ``value_checks``: ``{tensor name: ValueCheck}`` (:mod:`.values`), checked in the
        bytes read for hashing (so only in the hashed files): e.g. no NaN/inf in a master
        weight, no negative second moment. A failure raises CheckpointError naming the
        file, the tensor and the first bad element."""
        from .values import ValueScanner
        self._scanner = ValueScanner(self.manifest, value_checks or {}, self._file_path)
        files = self.manifest["files"]
        names = sorted(files)
        for fname in names:  # open every fd up front (not thread safe to create lazily)
            self._lstat_regular(fname, files[fname])
            self._fd(fname)
        if hash_files is None:
            hashed = names
        else:
            wanted = set(hash_files)
            hashed = [n for n in names if n in wanted]
        # one task per header region and per data block, so even one big file is
        # hashed on several cores (hashlib releases the GIL)
        tasks = []
        for fname in hashed:
            fi = files[fname]
            ds, hb = fi["data_start"], fi["hash_block_bytes"]
            tasks.append((fname, 0, ds, fi["header_sha256"], "header"))
            for i, want in enumerate(fi["data_sha256_blocks"]):
                lo = ds + i * hb
                tasks.append((fname, lo, min(fi["size"], lo + hb), want, f"data at bytes {lo}.."))
        workers = max(1, min(len(tasks), os.cpu_count() or 1, _MAX_VERIFY_THREADS))
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="infinity-ckpt-verify") as ex:
                results = list(ex.map(self._hash_range_safe, tasks))
        else:
            results = [self._hash_range_safe(t) for t in tasks]
        for err in results:  # report the first bad file (name order, then offset)
            if err is not None:
                raise err
        for fname in names:
            p = self._file_path(fname)
            data_start, _, _ = read_header(self._fds[fname], p, files[fname]["size"])
            if data_start != files[fname]["data_start"]:
                raise CheckpointError(f"{p}: header length disagrees with the manifest")
        # cross-check manifest pieces against the safetensors headers
        headers = {}
        for name, t in self._tensors.items():
            for piece in t["pieces"]:
                f = piece["file"]
                if f not in headers:
                    headers[f] = read_header(self._fd(f), self._file_path(f), files[f]["size"])[1]
                ent = headers[f].get(piece["key"])
                if ent is None or ent[0] != t["dtype"] or list(ent[2]) != piece["offsets"]:
                    raise CheckpointError(f"{self._file_path(f)}: safetensors header does not match "
                                          f"the manifest for tensor {name!r}")
        if self.base is not None:
            self.base.verify()       # the base's files: present and unchanged
        self.verified = len(hashed) == len(names)
        return True

    def _lstat_regular(self, fname, fi):
        p = self._file_path(fname)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {p} is missing; the checkpoint "
                                  f"{self.path} is incomplete, load another tag") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint file {p} is not a regular file")
        if st.st_size != fi["size"]:
            raise CheckpointError(f"checkpoint file {p} has {st.st_size} bytes, the manifest "
                                  f"records {fi['size']}: the file is truncated or corrupt")

    def _hash_range_safe(self, task):
        try:
            self._hash_range(*task)
        except CheckpointError as e:
            return e
        return None

    def _hash_range(self, fname, lo, hi, want, what):
        p = self._file_path(fname)
        fd = self._fds[fname]
        h = hashlib.sha256()
        scanner, bad_value = self._scanner, None
        buf = bytearray(min(_HASH_CHUNK, hi - lo))
        mv = memoryview(buf)
        pos = lo
        while pos < hi:
            n = min(_HASH_CHUNK, hi - pos)
            got = 0
            while got < n:
                k = os.preadv(fd, [mv[got:n]], pos + got)
                if k <= 0:
                    raise CheckpointError(f"checkpoint file {p}: short read at {pos + got}; the "
                                          f"file is truncated")
                got += k
            h.update(mv[:n])
            if scanner and bad_value is None:  # values checked in the bytes just hashed
                try:
                    scanner.scan(fname, fd, pos, mv[:n])
                except CheckpointError as e:    # reported after the digest (which wins)
                    bad_value = e
            pos += n
        if h.hexdigest() != want:
            raise CheckpointError(f"checkpoint file {p} is corrupt (SHA-256 mismatch in its "
                                  f"{what}); load another tag")
        if bad_value is not None:
            raise bad_value

    # -- queries -----------------------------------------------------------------
    def names(self):
        return list(self._tensors) + ([n for n in self.base.names() if n not in self._tensors]
                                      if self.base is not None else [])

    def __contains__(self, name):
        return name in self._tensors or (self.base is not None and name in self.base)

    def _in_base(self, name):
        return name not in self._tensors and self.base is not None and name in self.base

    def info(self, name):
        """(shape tuple, torch dtype) of tensor ``name``."""
        if self._in_base(name):
            return self.base.info(name)
        t = self._entry(name)
        return tuple(t["shape"]), dtypes.ST_TO_TORCH[t["dtype"]]

    def numel(self, name):
        n = 1
        for s in (self.info(name)[0] if self._in_base(name) else self._entry(name)["shape"]):
            n *= s
        return n

    def _entry(self, name):
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.path}") from None

    def check_compatible(self, expected, *, strict=True):
        """Compare with ``{name: (shape, dtype or None)}``; raise listing every missing,
        unexpected (when ``strict``) and mismatched name."""
        missing, mismatched = [], []
        for name, (shape, dtype) in expected.items():
            if name not in self:
                missing.append(name)
                continue
            cshape, cdtype = self.info(name)
            if tuple(shape) != cshape or (dtype is not None and dtype != cdtype):
                mismatched.append(f"{name}: checkpoint {list(cshape)} {cdtype}, model "
                                  f"{list(shape)} {dtype if dtype is not None else '(any dtype)'}")
        unexpected = [n for n in self._tensors if n not in expected] if strict else []
        if missing or mismatched or unexpected:
            lines = [f"checkpoint {self.path} does not match the model:"]
            if mismatched:
                lines.append(f"  mismatched ({len(mismatched)}): " + "; ".join(mismatched[:50]))
            if missing:
                lines.append(f"  missing from checkpoint ({len(missing)}): " + ", ".join(missing[:50]))
            if unexpected:
                lines.append(f"  unexpected in checkpoint ({len(unexpected)}): " + ", ".join(unexpected[:50]))
            raise CheckpointError("\n".join(lines))

    # -- reading -----------------------------------------------------------------
    def read(self, name, out=None):
        """Whole tensor ``name`` (into ``out`` when given: same numel; cast if dtype differs)."""
        shape, _ = self.info(name)
        res = self.read_slice(name, 0, self.numel(name), out=None if out is None else out)
        if out is None:
            return res.reshape(shape)
        return out

    def read_slice(self, name, start, numel, out=None, *, base_as_trained=True):
        """Flat elements ``[start, start + numel)`` of tensor ``name`` (row-major), e.g.
        one rank's partition at a world size other than the one that saved it.  A frozen
        base tensor kept by reference (Note [Base by reference]) comes from its pretrained
        file: as the run computed with it (``base_as_trained``, the default: what an export
        merges into) or the file's own values (what a load quantizes again)."""
        if self._in_base(name):
            total = self.numel(name)
            if start < 0 or numel < 0 or start + numel > total:
                raise CheckpointError(f"read_slice({name!r}, {start}, {numel}): outside the "
                                      f"{total} elements of the tensor")
            t = self.base.read_slice(name, start, numel, as_trained=base_as_trained)
            if out is None:
                return t.clone()
            out.copy_(t.reshape(out.shape))
            return out
        t = self._entry(name)
        dt = dtypes.ST_TO_TORCH[t["dtype"]]
        total = self.numel(name)
        if start < 0 or numel < 0 or start + numel > total:
            raise CheckpointError(f"read_slice({name!r}, {start}, {numel}): outside the "
                                  f"{total} elements of the tensor")
        if out is not None and out.numel() != numel:
            raise CheckpointError(f"read of {name!r}: out has {out.numel()} elements, "
                                  f"need {numel}")
        direct = (out is not None and out.dtype == dt and out.device.type == "cpu"
                  and out.is_contiguous())
        buf = out if direct else torch.empty(numel, dtype=dt)
        flat = buf.reshape(-1)
        isz = flat.element_size()
        raw = flat.view(torch.uint8).numpy() if numel else None
        end = start + numel
        for p in t["pieces"]:
            ps, pn = p["start"], p["numel"]
            lo, hi = max(start, ps), min(end, ps + pn)
            if lo >= hi:
                continue
            off = p["offsets"][0] + (lo - ps) * isz
            self._pread_into(p["file"], memoryview(raw)[(lo - start) * isz:(hi - start) * isz], off)
        if not direct and out is not None:
            out.copy_(buf.reshape(out.shape))
            return out
        return buf

    def _pread_into(self, fname, mv, offset):
        fd = self._fd(fname)
        done, n = 0, len(mv)
        while done < n:
            got = os.preadv(fd, [mv[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self._file_path(fname)}: unexpected end of file at "
                                      f"{offset + done}; the file is truncated (run verify())")
            done += got

    def tensors(self, prefix=None):
        """Iterate ``(name, tensor)`` one at a time (optionally names starting with prefix)."""
        for name in self.names():
            if prefix is None or name.startswith(prefix):
                yield name, self.read(name)
