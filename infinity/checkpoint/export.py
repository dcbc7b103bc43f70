"""Export the model weights of a checkpoint as consolidated safetensors.

Output (Hugging Face layout): ``OUT/model.safetensors``, or when larger than
``max_shard_bytes`` ``OUT/model-00001-of-0000N.safetensors`` ... plus
``OUT/model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``).
Model tensors are every checkpoint name that does not start with ``optim.``
(the optimizer-state namespace), unless ``meta["model_names"]`` lists them.
Partitioned tensors (saved by several ranks) are reassembled. Tensors stream one
at a time; each output file is written under a temp name, fsynced and renamed.
"""
import json
import logging
import os

from . import dtypes
from .errors import CheckpointError
from .fsutil import atomic_write_text, fsync_dir, remove_tree
from .reader import CheckpointReader
from .safetensors_stream import SafetensorsStreamWriter, header_reserve_for

log = logging.getLogger("infinity.checkpoint")

OPTIM_PREFIX = "optim."
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
INDEX_NAME = "model.safetensors.index.json"


def model_names(reader):
    listed = reader.meta.get("model_names")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise CheckpointError(f"{reader.path}: meta['model_names'] must be a list of strings")
        missing = [n for n in listed if n not in reader]
        if missing:
            raise CheckpointError(f"{reader.path}: meta['model_names'] lists tensors that are not "
                                  f"in the checkpoint: {missing[:20]}")
        return list(listed)
    return [n for n in reader.names() if not n.startswith(OPTIM_PREFIX)]


def export_model(ckpt_dir, out_dir, tag=None, *, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES,
                 dtype=None, verify=True):
    """Write the checkpoint's model weights to ``out_dir``; returns the list of files."""
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    with CheckpointReader(ckpt_dir, tag) as r:
        if verify:
            r.verify()
        names = model_names(r)
        if not names:
            raise CheckpointError(f"{r.path} contains no model tensors to export")
        plan, cur, cur_bytes = [], [], 0
        for n in names:
            shape, dt = r.info(n)
            odt = dtype if (dtype is not None and dt.is_floating_point) else dt
            nb = r.numel(n) * dtypes.itemsize(odt)
            if cur and cur_bytes + nb > max_shard_bytes:
                plan.append(cur)
                cur, cur_bytes = [], 0
            cur.append((n, shape, odt))
            cur_bytes += nb
        plan.append(cur)
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise CheckpointError(f"export target {out_dir} exists and is not a directory")
        os.makedirs(out_dir, exist_ok=True)
        k = len(plan)
        fnames = (["model.safetensors"] if k == 1 else
                  [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)])
        weight_map, total, written = {}, 0, []
        for fname, group in zip(fnames, plan):
            final = os.path.join(out_dir, fname)
            tmp = os.path.join(out_dir, f".{fname}.tmp-{os.getpid()}")
            remove_tree(tmp)
            reserve = header_reserve_for([(n, dtypes.to_st(d), s) for n, s, d in group])
            w = SafetensorsStreamWriter(tmp, header_reserve=reserve, metadata={"format": "pt"})
            try:
                for n, shape, odt in group:
                    t = r.read(n)
                    if t.dtype != odt:
                        t = t.to(odt)
                    w.add(n, t)
                    total += t.numel() * t.element_size()
                    weight_map[n] = fname
                    del t
                w.close()
                os.rename(tmp, final)
            except BaseException:
                w.abort()
                remove_tree(tmp)
                raise
            written.append(final)
        fsync_dir(out_dir)
        index = os.path.join(out_dir, INDEX_NAME)
        if k > 1:
            atomic_write_text(index, json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
            written.append(index)
        elif os.path.exists(index):
            os.unlink(index)  # a stale index from an earlier sharded export would mislead loaders
        log.info("exported %d tensors (%d bytes) from %s to %s", len(weight_map), total, r.path, out_dir)
        return written


def load_exported(out_dir):
    """Helper for tests/tools: read an export back as a dict of tensors (via safetensors)."""
    from safetensors import safe_open
    index = os.path.join(out_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        with safe_open(os.path.join(out_dir, fn), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out

