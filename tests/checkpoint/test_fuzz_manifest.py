"""Structural mutations of a (re-sealed) manifest and random bytes in shard headers:
loading either raises CheckpointError or returns exactly the saved data — never
another exception, never wrong data."""
import json
import os
import random

import pytest
import torch

from infinity.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from infinity.checkpoint import manifest as mf

_VALUES = [None, -1, 0, 1, 2**70, 1.5, "x", "../x", "F32", "BF16", [], [1], [-1, 2], {}, {"a": 1}, True]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def _load_ok_or_checkpoint_error(root, dict_state, tensors):
    dst = dict_state({k: torch.zeros_like(v) for k, v in tensors.items()})
    try:
        load_checkpoint(dst, root)
    except CheckpointError:
        assert dst.load_calls == 0
        return False
    for k, v in tensors.items():
        assert torch.equal(dst.loaded[k], v), k
    return True


@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(k, marks=pytest.mark.slow) for k in range(2, 10)])
def test_manifest_mutations(tmp_path, dict_state, seed):
    rng = random.Random(seed)
    t = {"a": torch.randn(7, 3), "b": torch.arange(10), "c": torch.randn(5).bfloat16()}
    save_checkpoint(dict_state(t, {"step": 1}), tmp_path, shard_bytes=60)
    mpath = tmp_path / "step-1" / "manifest.json"
    orig = json.loads(mpath.read_text())
    paths = [p for p in _paths(orig) if p and p[0] not in ("checksum", "created_unix")]
    rejected = 0
    for _ in range(60):
        m = json.loads(json.dumps(orig))
        path = rng.choice(paths)
        if path[0] == "meta":  # meta is free-form by design
            continue
        _set(m, path, rng.choice(_VALUES))
        mpath.write_text(mf.seal(m))
        rejected += not _load_ok_or_checkpoint_error(tmp_path, dict_state, t)
    mpath.write_text(mf.seal(orig))
    assert _load_ok_or_checkpoint_error(tmp_path, dict_state, t)
    assert rejected > 20


def test_random_header_bytes(tmp_path, dict_state):
    rng = random.Random(7)
    t = {"a": torch.randn(7, 3), "b": torch.arange(10)}
    save_checkpoint(dict_state(t, {"step": 1}), tmp_path)
    f = tmp_path / "step-1" / "rank0-00000.safetensors"
    orig = f.read_bytes()
    for _ in range(30):
        b = bytearray(orig)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(0, 400)] = rng.randrange(256)
        f.write_bytes(bytes(b))
        os.chmod(f, 0o600)
        ok = _load_ok_or_checkpoint_error(tmp_path, dict_state, t)
        assert ok == (bytes(b) == orig)
