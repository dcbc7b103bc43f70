import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from infinity.checkpoint import (CheckpointError, CheckpointReader, load_checkpoint,
                                 rng_state_from_json, rng_state_to_json, save_checkpoint)


def _assert_same(a, b, name=""):
    assert a.dtype == b.dtype, name
    assert tuple(a.shape) == tuple(b.shape), name
    # bitwise: compare raw bytes (NaN-safe, -0.0-safe)
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8) if a.numel() else a,
                       b.contiguous().reshape(-1).view(torch.uint8) if b.numel() else b), name


@pytest.mark.parametrize("shard_bytes", [64, 5000, 1 << 30])
@pytest.mark.parametrize("reuse_buffer", [False, True])
def test_roundtrip_bit_exact(tmp_path, dict_state, tensors, shard_bytes, reuse_buffer):
    tensors["nan"] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    src = dict_state(tensors, {"step": 7, "scaler": {"scale": 65536.0}}, reuse_buffer=reuse_buffer)
    h = save_checkpoint(src, tmp_path / "ck", shard_bytes=shard_bytes)
    assert h.wait() == str(tmp_path / "ck" / "step-7")
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-7"
    files = [f for f in os.listdir(h.path) if f.endswith(".safetensors")]
    if shard_bytes == 64:
        assert len(files) >= 8  # one tensor per shard for everything over 64 bytes
    if shard_bytes == 1 << 30:
        assert files == ["rank0-00000.safetensors"]
    dst = dict_state({k: torch.zeros_like(v) for k, v in tensors.items()})
    meta = load_checkpoint(dst, tmp_path / "ck")
    assert meta == {"step": 7, "scaler": {"scale": 65536.0}}
    assert dst.loaded_meta == meta
    for k, v in tensors.items():
        _assert_same(dst.loaded[k], v, k)


def test_safe_open_reads_every_file(tmp_path, dict_state, tensors):
    save_checkpoint(dict_state(tensors, {"step": 1}), tmp_path, shard_bytes=3000)
    seen = {}
    d = tmp_path / "step-1"
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(str(d / f), framework="pt") as st:
                assert st.metadata()["format"] == "pt"
                for k in st.keys():
                    seen[k] = st.get_tensor(k)
    assert set(seen) == set(tensors)
    for k, v in tensors.items():
        _assert_same(seen[k], v, k)


def test_many_tensors_roll_over_header_space(tmp_path, dict_state):
    # 4 KiB header reserve: long names force new shards even though data is tiny
    t = {f"module.with.a.rather.long.name.{i:04d}.weight": torch.full((3,), float(i)) for i in range(200)}
    h = save_checkpoint(dict_state(t, {"step": 2}), tmp_path, header_reserve=4096)
    files = [f for f in os.listdir(h.path) if f.endswith(".safetensors")]
    assert len(files) > 3
    with CheckpointReader(tmp_path) as r:
        r.verify()
        for k, v in t.items():
            assert torch.equal(r.read(k), v)


def test_read_into_out_cast_and_slices(tmp_path, dict_state):
    w = torch.randn(10, 10)
    save_checkpoint(dict_state({"w": w}, {"step": 1}), tmp_path)
    with CheckpointReader(tmp_path) as r:
        assert r.info("w") == ((10, 10), torch.float32)
        out = torch.empty(10, 10)
        assert r.read("w", out=out) is out and torch.equal(out, w)
        bf = torch.empty(100, dtype=torch.bfloat16)
        r.read("w", out=bf)
        assert torch.equal(bf, w.reshape(-1).to(torch.bfloat16))
        nc = torch.empty(10, 10).t()  # non-contiguous
        r.read("w", out=nc)
        assert torch.equal(nc, w)
        s = r.read_slice("w", 13, 29)
        assert torch.equal(s, w.reshape(-1)[13:42])
        with pytest.raises(CheckpointError, match="outside"):
            r.read_slice("w", 90, 11)
        with pytest.raises(CheckpointError, match="'nope' is not in checkpoint"):
            r.read("nope")


def test_default_tag_and_explicit_step(tmp_path, dict_state):
    with pytest.raises(CheckpointError, match="no tag given"):
        save_checkpoint(dict_state({"a": torch.ones(1)}), tmp_path)
    h = save_checkpoint(dict_state({"a": torch.ones(1)}), tmp_path, step=12)
    assert h.tag == "step-12"
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        save_checkpoint(dict_state({"a": torch.ones(1)}), tmp_path, tag="../x")
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        save_checkpoint(dict_state({"a": torch.ones(1)}, {"step": 1, "bad": object()}), tmp_path)


def test_rng_state_json_roundtrip():
    st = rng_state_to_json()
    json.dumps(st)  # JSON-safe
    st = json.loads(json.dumps(st))
    a = (torch.rand(5), np.random.rand(3), random.random())
    torch.rand(100), np.random.rand(100), random.random()
    rng_state_from_json(st)
    b = (torch.rand(5), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    with pytest.raises(CheckpointError):
        rng_state_from_json({"torch": [1, 2, 999]})


def test_async_save_snapshots_and_bounds_memory(tmp_path, dict_state):
    t = {f"p{i}": torch.randn(1000) for i in range(20)}  # 4000 bytes each
    ref = {k: v.clone() for k, v in t.items()}
    h = save_checkpoint(dict_state(t, {"step": 1}), tmp_path, async_=True, max_host_bytes=8000)
    for v in t.values():  # training continues and changes the params
        v.add_(1.0)
    assert h.wait() == str(tmp_path / "step-1")
    assert h.peak_queued_bytes <= 8000
    # a second save waits for the first; both complete
    h2 = save_checkpoint(dict_state(t, {"step": 2}), tmp_path, async_=True, max_host_bytes=8000)
    dst = dict_state({k: torch.empty(1000) for k in t})
    load_checkpoint(dst, tmp_path, "step-1")  # load waits for the pending save too
    assert h2.done()
    for k in t:
        assert torch.equal(dst.loaded[k], ref[k])
    load_checkpoint(dst, tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    for k in t:
        assert torch.equal(dst.loaded[k], ref[k] + 1.0)


def test_async_save_error_reaches_wait_and_cleans_up(tmp_path, dict_state):
    save_checkpoint(dict_state({"a": torch.ones(2)}, {"step": 1}), tmp_path)
    bad = dict_state({"a": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)}, {"step": 2})
    try:
        h = save_checkpoint(bad, tmp_path, async_=True)
        with pytest.raises(CheckpointError, match="complex64"):
            h.wait()
    except CheckpointError as e:  # the producer may see the worker's error first
        assert "complex64" in str(e)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1"]
    assert (tmp_path / "latest").read_text().strip() == "step-1"
