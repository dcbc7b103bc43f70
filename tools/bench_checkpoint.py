"""Checkpoint save/load throughput vs peers in the same run (not a test).

usage: .venv/bin/python tools/bench_checkpoint.py [--mb 256] [--dir /tmp/x]
Peers: safetensors.torch.save_file/load_file (whole dict in memory, no fsync) and
torch.save/torch.load(weights_only=True). Ours: save_checkpoint (streamed, SHA-256,
fsync, atomic commit) and load_checkpoint (full verify + read). Prints ratios.
"""
import argparse
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from infinity.checkpoint import load_checkpoint, save_checkpoint


class S:
    def __init__(self, t):
        self.t = t
        self.loaded = {}

    def checkpoint_tensors(self):
        yield from self.t.items()

    def checkpoint_meta(self):
        return {"step": 1}

    def checkpoint_expected(self):
        return {k: (tuple(v.shape), v.dtype) for k, v in self.t.items()}

    def load_checkpoint_tensors(self, r):
        for k in self.t:
            self.loaded[k] = r.read(k)

    def load_checkpoint_meta(self, m):
        pass


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def best(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    root = tempfile.mkdtemp(dir=a.dir)
    try:
        n = a.mb * (1 << 20) // 4 // 32
        t = {f"layer.{i}.weight": torch.randn(n) for i in range(32)}
        gb = 32 * n * 4 / 1e9
        st_path, pt_path, ck = (os.path.join(root, x) for x in ("m.safetensors", "m.pt", "ck"))
        r = {
            "save ours (sha256+fsync+atomic)": best(lambda: save_checkpoint(S(t), ck, tag="a"), a.reps),
            "save safetensors.save_file": best(lambda: save_file(t, st_path), a.reps),
            "save safetensors.save_file+fsync": best(lambda: (save_file(t, st_path), _fsync(st_path)), a.reps),
            "save torch.save": best(lambda: torch.save(t, pt_path), a.reps),
            "load ours (verify+read)": best(lambda: load_checkpoint(S(t), ck), a.reps),
            "load safetensors.load_file+touch": best(lambda: [v.sum() for v in load_file(st_path).values()], a.reps),
            "load torch.load(weights_only)": best(lambda: torch.load(pt_path, weights_only=True), a.reps),
        }
        for k, v in r.items():
            print(f"{k:36s} {v:7.3f} s  {gb / v:6.2f} GB/s")
        print(f"save time ratio ours / (safetensors+fsync): "
              f"{r['save ours (sha256+fsync+atomic)'] / r['save safetensors.save_file+fsync']:.2f}")
        print(f"load time ratio ours / (safetensors mmap+touch): "
              f"{r['load ours (verify+read)'] / r['load safetensors.load_file+touch']:.2f}")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
