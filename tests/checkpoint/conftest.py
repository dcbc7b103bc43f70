"""Fixtures for checkpoint tests: a plain Checkpointable producer over real tensors."""
import pytest
import torch


class DictState:
    """Checkpointable over a dict of tensors (+ meta); records what was loaded.

    ``reuse_buffer=True`` yields every tensor through one staging buffer that is
    overwritten after the writer consumed it (as an NVMe-backed engine would do).
    """

    def __init__(self, tensors, meta=None, *, reuse_buffer=False, fail_after=None):
        self.tensors = dict(tensors)
        self.meta = dict(meta or {})
        self.reuse_buffer = reuse_buffer
        self.fail_after = fail_after
        self.loaded = None
        self.loaded_meta = None
        self.load_calls = 0

    def checkpoint_tensors(self):
        stage = None
        for i, (k, v) in enumerate(self.tensors.items()):
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError(f"producer failed at tensor {i}")
            if self.reuse_buffer:
                nbytes = v.numel() * v.element_size()
                if stage is None or stage.numel() < nbytes:
                    stage = torch.empty(max(nbytes, 1), dtype=torch.uint8)
                view = stage[:nbytes].view(v.dtype).reshape(v.shape) if nbytes else v.clone()
                view.copy_(v)
                yield k, view
                if nbytes:
                    stage.fill_(0xAB)  # clobber: the writer must have consumed it
            else:
                yield k, v

    def checkpoint_meta(self):
        return self.meta

    def checkpoint_expected(self):
        return {k: (tuple(v.shape), v.dtype) for k, v in self.tensors.items()}

    def load_checkpoint_tensors(self, reader):
        self.load_calls += 1
        self.loaded = {k: reader.read(k) for k in self.tensors}

    def load_checkpoint_meta(self, meta):
        self.loaded_meta = meta


def make_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {
        "layer.0.weight": torch.randn(7, 3, generator=g),
        "layer.0.bias": torch.randn(1, generator=g),
        "big": torch.randn(4097, generator=g),
        "bf": torch.randn(4095, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, 5, 7, generator=g).to(torch.float16),
        "ids": torch.randint(-2**40, 2**40, (13,), generator=g, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "mask": torch.rand(9, generator=g) > 0.5,
        "optim.layer.0.weight.exp_avg": torch.randn(7, 3, generator=g),
        "optim.layer.0.weight.exp_avg_sq": torch.rand(7, 3, generator=g),
    }
    return t


@pytest.fixture
def dict_state():
    return DictState


@pytest.fixture
def tensors():
    return make_tensors()


def rewrite_tensor(tag_dir, name, values):
    """Overwrite tensor ``name`` of checkpoint ``tag_dir`` in place with ``values`` (a
    tensor of its numel, or a function of its current values), then **re-seal** it: new
    data-block digests and manifest checksum, so only a semantic check can catch it."""
    import hashlib
    import json
    from pathlib import Path

    from infinity.checkpoint import CheckpointReader
    from infinity.checkpoint import manifest as mf
    tag_dir = Path(tag_dir)
    mpath = tag_dir / "manifest.json"
    m = json.loads(mpath.read_text())
    with CheckpointReader(tag_dir.parent, tag_dir.name) as r:
        old = r.read(name)
    new = values(old.clone()) if callable(values) else values
    new = new.to(old.dtype).contiguous().reshape(-1)
    raw = new.view(torch.uint8).numpy().tobytes()
    isz = new.element_size()
    touched = set()
    for p in m["tensors"][name]["pieces"]:
        with open(tag_dir / p["file"], "r+b") as f:
            f.seek(p["offsets"][0])
            f.write(raw[p["start"] * isz:(p["start"] + p["numel"]) * isz])
        touched.add(p["file"])
    for fname in touched:
        fi = m["files"][fname]
        data = (tag_dir / fname).read_bytes()
        ds, hb, size = fi["data_start"], fi["hash_block_bytes"], fi["size"]
        fi["data_sha256_blocks"] = [hashlib.sha256(data[lo:min(size, lo + hb)]).hexdigest()
                                    for lo in range(ds, size, hb)]
    mpath.write_text(mf.seal(m))


def edit_manifest(tag_dir, fn):
    """Apply ``fn(manifest dict)`` and re-seal the manifest (its checksum passes)."""
    import json
    from pathlib import Path

    from infinity.checkpoint import manifest as mf
    mpath = Path(tag_dir) / "manifest.json"
    m = json.loads(mpath.read_text())
    fn(m)
    mpath.write_text(mf.seal(m))


@pytest.fixture
def reseal():
    """``reseal.tensor(tag_dir, name, values)`` / ``reseal.manifest(tag_dir, fn)``."""
    class _R:
        tensor = staticmethod(rewrite_tensor)
        manifest = staticmethod(edit_manifest)
    return _R
