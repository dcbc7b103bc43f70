"""Checkpoints written by several ranks (each its own partition), read at other world sizes."""
import os
import subprocess
import sys

import pytest
import torch

from infinity.checkpoint import CheckpointReader, Piece, load_checkpoint
from infinity.checkpoint import writer as w

HERE = os.path.dirname(__file__)


def _partition(numel, rank, world):
    per = -(-numel // world)
    lo = min(numel, rank * per)
    return lo, min(numel, lo + per)


def _full():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(10, 7, generator=g), "b": torch.randn(5, generator=g).bfloat16(),
            "e": torch.empty(0, 3), "s": torch.tensor(1.5),
            "optim.w.exp_avg": torch.randn(10, 7, generator=g)}


def _write_simulated(root, world, tag="step-1"):
    """What each rank of save_checkpoint does, run here rank by rank."""
    tmp = w.begin(str(root), tag)
    for r in range(world):
        rw = w.RankShardWriter(tmp, r, shard_bytes=64)
        for name, t in _full().items():
            lo, hi = _partition(t.numel(), r, world)
            rw.add(name, t.reshape(-1)[lo:hi], Piece(t.shape, lo))
        rw.finish()
    w.finalize(str(root), tag, tmp, world, {"step": 1})


@pytest.mark.parametrize("save_world", [2, 3])
@pytest.mark.parametrize("load_world", [1, 2, 4])
def test_simulated_ranks_load_at_other_world_size(tmp_path, save_world, load_world):
    _write_simulated(tmp_path, save_world)
    full = _full()
    with CheckpointReader(tmp_path) as r:
        r.verify()
        assert r.world_size == save_world
        assert r.manifest["ranks"][save_world - 1]["rank"] == save_world - 1
        for name, t in full.items():
            assert r.info(name) == (tuple(t.shape), t.dtype)
            assert torch.equal(r.read(name), t)  # consolidated (world size 1)
            parts = []
            for rank in range(load_world):  # each new rank reads its own partition
                lo, hi = _partition(t.numel(), rank, load_world)
                out = torch.empty(hi - lo, dtype=t.dtype)
                r.read_slice(name, lo, hi - lo, out=out)
                parts.append(out)
            assert torch.equal(torch.cat(parts), t.reshape(-1))


def test_simulated_ranks_through_load_checkpoint(tmp_path, dict_state):
    _write_simulated(tmp_path, 2)
    full = _full()
    dst = dict_state({k: torch.zeros_like(v) for k, v in full.items()})
    load_checkpoint(dst, tmp_path)
    for k, v in full.items():
        assert torch.equal(dst.loaded[k], v)


def test_gloo_two_ranks_save(tmp_path):
    root, init = tmp_path / "ck", tmp_path / "init"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "rank_child.py"), str(r), "2",
                               str(init), str(root)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e.decode()[-3000:]
    sys.path.insert(0, HERE)
    try:
        import rank_child
    finally:
        sys.path.remove(HERE)
    with CheckpointReader(root) as r:
        r.verify()
        assert r.world_size == 2 and r.meta == {"step": 4, "world_size": 2}
        files = sorted(f for f in os.listdir(r.path) if f.endswith(".safetensors"))
        assert any(f.startswith("rank0-") for f in files) and any(f.startswith("rank1-") for f in files)
        for name, t in rank_child.full_tensors().items():
            assert torch.equal(r.read(name), t), name
    assert sorted(os.listdir(root)) == ["latest", "step-4"]
