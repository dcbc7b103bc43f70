"""The checkpoint manifest: schema, canonical JSON, self-checksum and validation.

``manifest.json`` (format "infinity-checkpoint", version 1)::

    {"format": "infinity-checkpoint", "version": 1, "tag": "step-3",
     "world_size": 2, "created_unix": 1700000000.0,
     "ranks": [{"rank": 0, "files": ["rank0-00000.safetensors"]}, ...],
     "files": {"rank0-00000.safetensors": {"rank": 0, "size": 266240, "data_start": 262144,
               "header_sha256": "...", "hash_block_bytes": 67108864,
               "data_sha256_blocks": ["...", ...]}},   # SHA-256 per data block
     "tensors": {"w": {"dtype": "F32", "shape": [8, 3],
                       "pieces": [{"rank": 0, "file": "rank0-00000.safetensors", "key": "w",
                                   "start": 0, "numel": 12, "offsets": [262144, 262192]},
                                  {"rank": 1, ...,  "start": 12, "numel": 12, ...}]}},
     "meta": {...},                  # free-form JSON (step, scaler, scheduler, rng, config)
     "checksum": "<sha256 of the canonical JSON of every other field>"}

A tensor is the row-major flattening of ``shape`` split into ``pieces`` that cover
``[0, numel)`` exactly, in order; piece ``i`` holds flat elements
``[start, start + numel)`` at absolute byte range ``offsets`` of ``file`` (under the
safetensors key ``key``). At world size 1 a tensor is one piece. ``rank`` says which
rank wrote it; a reader at another world size picks any flat range it wants
(``CheckpointReader.read_slice``).

Everything read back is treated as untrusted: :func:`validate` rejects absolute
paths, ``..``, path separators, unknown dtypes, negative/non-int shapes, ranges that
are inconsistent with shape/dtype or outside the file, overlapping/gapped pieces, a
``ranks`` list that does not hold exactly the ranks ``0 .. world_size - 1`` with the files
each wrote, and JSON nested deeper than :data:`MAX_DEPTH` levels (the free-form ``meta``
included; :func:`parse` also turns a document too deep for the JSON parser into a
:class:`CheckpointError`).
"""
import hashlib
import json
import re

from . import dtypes
from .errors import CheckpointError

FORMAT = "infinity-checkpoint"
VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"

_FILE_RE = re.compile(r"^rank[0-9]{1,6}-[0-9]{5,9}\.safetensors$")
_FILE_RE_RANK = re.compile(r"^rank([0-9]+)-")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}$")
_MAX_DIMS = 64
#: deepest nesting of JSON containers a manifest may hold (the engine's own meta: < 10)
MAX_DEPTH = 64


def check_tag(tag, where=""):
    """Tags are plain directory names: no separators, no leading dot, no ``..``."""
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or ".." in tag:
        raise CheckpointError(f"{where}invalid checkpoint tag {tag!r}: use letters, digits and "
                              f"'._+=-' (not starting with '.' or '-', no '..', at most 200 chars)")
    return tag


def shard_file_name(rank, index):
    return f"rank{rank}-{index:05d}.safetensors"


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def seal(manifest):
    """Add the self-checksum and return the JSON text to write."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    body["checksum"] = hashlib.sha256(canonical(body)).hexdigest()
    return json.dumps(body, sort_keys=True, separators=(",", ":")) + "\n"


def parse(text, path):
    """Parse manifest text, check the self-checksum and validate everything."""
    try:
        m = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: manifest is not valid JSON ({e}); the checkpoint is "
                              f"corrupt, load another tag") from None
    except RecursionError:
        raise CheckpointError(f"{path}: manifest nests JSON too deeply to parse (at most "
                              f"{MAX_DEPTH} levels are allowed); the checkpoint is corrupt or "
                              f"was not written by infinity, load another tag") from None
    if not isinstance(m, dict):
        raise CheckpointError(f"{path}: manifest is not a JSON object")
    # extra top-level keys are walked here; 'meta' by validate(), 'files' and 'tensors' field
    # by field by validate() (a deep extra key inside them is never read)
    for k, v in m.items():
        if k not in ("files", "tensors", "meta"):
            check_depth(v, path, repr(k))
    want = m.get("checksum")
    body = {k: v for k, v in m.items() if k != "checksum"}
    try:
        digest = hashlib.sha256(canonical(body)).hexdigest()
    except RecursionError:
        raise CheckpointError(f"{path}: manifest nests JSON too deeply (at most {MAX_DEPTH} "
                              f"levels are allowed); the checkpoint is corrupt or was not "
                              f"written by infinity, load another tag") from None
    if want != digest:
        raise CheckpointError(f"{path}: manifest checksum mismatch; the manifest is corrupt or "
                              f"was edited, load another tag")
    validate(m, path)
    return m


def check_depth(obj, path, what="manifest", limit=MAX_DEPTH):
    """Refuse JSON containers nested deeper than ``limit`` (walked without recursion, so a
    hostile document cannot exhaust the stack here or in whatever reads it later)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            children = o.values()
        elif isinstance(o, list):
            children = o
        else:
            continue
        if d > limit:
            raise CheckpointError(f"{path}: {what} nests JSON objects/lists more than {limit} "
                                  f"levels deep; the checkpoint is corrupt or was not written "
                                  f"by infinity (a meta passed to save_checkpoint must stay "
                                  f"within {limit} levels)")
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))


def _int(v, what, path, lo=0):
    if type(v) is not int or v < lo:
        raise CheckpointError(f"{path}: {what} must be an integer >= {lo}, got {v!r}")
    return v


def check_file_name(name, path):
    if (not isinstance(name, str) or "/" in name or "\\" in name or "\x00" in name
            or name.startswith(".") or ".." in name or not _FILE_RE.match(name)):
        raise CheckpointError(f"{path}: manifest names an invalid file {name!r} (only "
                              f"'rank<r>-<n>.safetensors' inside the tag directory are allowed)")
    return name


def validate(m, path):
    """Structural validation of a parsed manifest (untrusted)."""
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an infinity checkpoint manifest (format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{path}: manifest version {m.get('version')!r} is not supported "
                              f"(this build reads version {VERSION})")
    world = _int(m.get("world_size"), "world_size", path, 1)
    if not isinstance(m.get("meta"), dict):
        raise CheckpointError(f"{path}: 'meta' must be a JSON object")
    check_depth(m["meta"], path, "'meta'")
    files = m.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' must be an object")
    for fname, fi in files.items():
        check_file_name(fname, path)
        if not isinstance(fi, dict):
            raise CheckpointError(f"{path}: file entry {fname!r} must be an object")
        r = _int(fi.get("rank"), f"files[{fname!r}].rank", path)
        if r >= world:
            raise CheckpointError(f"{path}: file {fname!r} has rank {r} >= world_size {world}; "
                                  f"the manifest's world_size does not match its shard files")
        if r != int(_FILE_RE_RANK.match(fname).group(1)):
            raise CheckpointError(f"{path}: file {fname!r} is recorded as written by rank {r}, "
                                  f"its name says another rank")
        size = _int(fi.get("size"), f"files[{fname!r}].size", path)
        ds = _int(fi.get("data_start"), f"files[{fname!r}].data_start", path, 8)
        if ds > size:
            raise CheckpointError(f"{path}: file {fname!r}: data_start {ds} > size {size}")
        hb = _int(fi.get("hash_block_bytes"), f"files[{fname!r}].hash_block_bytes", path, 4096)
        blocks = fi.get("data_sha256_blocks")
        nblocks = -(-(size - ds) // hb)
        if not isinstance(blocks, list) or len(blocks) != nblocks:
            raise CheckpointError(f"{path}: file {fname!r}: data_sha256_blocks must list "
                                  f"{nblocks} digests")
        for v in [fi.get("header_sha256")] + blocks:
            if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
                raise CheckpointError(f"{path}: file {fname!r}: {v!r} is not a sha256 hex digest")
    _validate_ranks(m.get("ranks"), files, world, path)
    tensors = m.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{path}: 'tensors' must be an object")
    used = {}  # file -> list of (begin, end, name)
    for name, t in tensors.items():
        if not isinstance(t, dict):
            raise CheckpointError(f"{path}: tensor {name!r} entry must be an object")
        dt = dtypes.to_torch(t.get("dtype"), where=f"{path}: tensor {name!r}: ")
        isz = dtypes.itemsize(dt)
        shape = t.get("shape")
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
            raise CheckpointError(f"{path}: tensor {name!r}: shape must be a list of at most "
                                  f"{_MAX_DIMS} non-negative integers, got {shape!r}")
        numel = 1
        for s in shape:
            numel *= _int(s, f"tensor {name!r} shape entry", path)
        pieces = t.get("pieces")
        if not isinstance(pieces, list):
            raise CheckpointError(f"{path}: tensor {name!r}: 'pieces' must be a list")
        pos = 0
        for i, p in enumerate(pieces):
            if not isinstance(p, dict):
                raise CheckpointError(f"{path}: tensor {name!r} piece {i} must be an object")
            f = check_file_name(p.get("file"), path)
            if f not in files:
                raise CheckpointError(f"{path}: tensor {name!r} refers to file {f!r} that is not "
                                      f"listed in 'files'")
            start = _int(p.get("start"), f"tensor {name!r} piece {i} start", path)
            n = _int(p.get("numel"), f"tensor {name!r} piece {i} numel", path)
            if start != pos:
                raise CheckpointError(f"{path}: tensor {name!r}: pieces overlap or leave a gap at "
                                      f"element {pos} (piece {i} starts at {start})")
            pos += n
            offs = p.get("offsets")
            if not isinstance(offs, list) or len(offs) != 2:
                raise CheckpointError(f"{path}: tensor {name!r} piece {i}: bad offsets {offs!r}")
            b = _int(offs[0], "offset", path)
            e = _int(offs[1], "offset", path)
            fi = files[f]
            if e - b != n * isz or b < fi["data_start"] or e > fi["size"]:
                raise CheckpointError(f"{path}: tensor {name!r} piece {i}: byte range [{b}, {e}) "
                                      f"is inconsistent with {n} x {t['dtype']} or file {f!r} "
                                      f"(data {fi['data_start']}..{fi['size']})")
            if not isinstance(p.get("key"), str):
                raise CheckpointError(f"{path}: tensor {name!r} piece {i}: missing 'key'")
            used.setdefault(f, []).append((b, e, name))
        if pos != numel:
            raise CheckpointError(f"{path}: tensor {name!r}: pieces cover {pos} elements, shape "
                                  f"{shape} has {numel}")
    for f, ranges in used.items():
        ranges.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap in file {f!r}")
    return m


def _validate_ranks(ranks, files, world, path):
    """``ranks``: one entry per rank ``0 .. world_size - 1`` in order, each listing exactly
    the files that rank wrote (a rank may have written none); every file once."""
    if not isinstance(ranks, list) or len(ranks) != world:
        n = len(ranks) if isinstance(ranks, list) else type(ranks).__name__
        raise CheckpointError(f"{path}: 'ranks' must list the {world} ranks of world_size {world}, "
                              f"got {n}; the manifest's world_size does not match the ranks that "
                              f"wrote it: the checkpoint is corrupt, load another tag")
    listed = set()
    for i, ent in enumerate(ranks):
        if not isinstance(ent, dict) or ent.get("rank") != i or type(ent.get("rank")) is not int \
                or not isinstance(ent.get("files"), list):
            raise CheckpointError(f"{path}: 'ranks'[{i}] must be {{\"rank\": {i}, \"files\": "
                                  f"[...]}}, got {str(ent)[:200]}")
        for f in ent["files"]:
            if not isinstance(f, str) or f not in files or files[f].get("rank") != i or f in listed:
                raise CheckpointError(f"{path}: 'ranks'[{i}] lists {f!r}, which is not a file of "
                                      f"rank {i} in 'files' (or is listed twice)")
            listed.add(f)
    unlisted = sorted(set(files) - listed)
    if unlisted:
        raise CheckpointError(f"{path}: files {unlisted[:5]} are not listed under 'ranks'; the "
                              f"checkpoint is corrupt, load another tag")
