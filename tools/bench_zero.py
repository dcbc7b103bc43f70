#!/usr/bin/env python
"""ZeRO stage 3 across 2 local gloo ranks: does prefetch overlap the NVMe read +
all-gather of the next groups with compute?

Spawns ``--ranks`` processes (as torchrun would) that train the same MLP stack with
params and optimizer on NVMe, alternating ``prefetch.depth`` 0 (fetch on demand) and
``--depth`` (prefetch) round by round in the same processes, and prints the median
forward+backward time of each and their ratio (the optimizer step is the same in both
and excluded).  A benchmark, not a test: on a shared 2-core machine the two ranks also
compete for the cores.

    .venv/bin/python tools/bench_zero.py --layers 8 --hidden 1024 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def child(a) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    import infinity
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.LayerNorm(a.hidden), nn.Linear(a.hidden, 4 * a.hidden),
                                             nn.GELU(), nn.Linear(4 * a.hidden, a.hidden))
                               for _ in range(a.layers)])
    times = {0: [], a.depth: []}
    x = torch.randn(a.tokens // ws, a.hidden)
    for rnd in range(a.rounds):
        for depth in (0, a.depth) if rnd % 2 == 0 else (a.depth, 0):
            cfg = {"zero_stage": 3, "dist_timeout_s": 300, "prefetch": {"depth": depth},
                   "offload": {"params": "nvme", "optimizer": "nvme",
                               "nvme_paths": [os.path.join(a.swap, f"d{depth}")]}}
            eng = infinity.initialize(build(), cfg)
            try:
                for step in range(a.steps + 1):
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = eng(x).pow(2).mean()
                    eng.backward(loss)
                    t1 = time.perf_counter()
                    eng.step()
                    if step > 0:           # step 0 records the trace
                        times[depth].append(t1 - t0)
                st = eng.stats()
            finally:
                eng.close()
    if rank == 0:
        print(json.dumps({"times": {str(k): v for k, v in times.items()},
                          "prefetched_fetches": st.get("prefetched_fetches", 0)}), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--swap", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return 0
    swap = a.swap or tempfile.mkdtemp(prefix="bench-zero-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, os.path.abspath(__file__), "--child", "--swap", swap] + \
        [f"--{k}={v}" for k, v in (("layers", a.layers), ("hidden", a.hidden), ("tokens", a.tokens),
                                   ("steps", a.steps), ("rounds", a.rounds), ("depth", a.depth))]
    procs = []
    for r in range(a.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(a.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    res = json.loads(outs[0].strip().splitlines()[-1])
    t0 = statistics.median(res["times"]["0"])
    td = statistics.median(res["times"][str(a.depth)])
    n = a.layers * (8 * a.hidden * a.hidden + 7 * a.hidden)
    print(f"stage 3, {a.ranks} ranks, {n / 1e6:.1f}M params on NVMe, {a.tokens} tokens: "
          f"forward+backward median {t0:.3f} s on demand vs {td:.3f} s with prefetch depth "
          f"{a.depth}: ratio {t0 / td:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
