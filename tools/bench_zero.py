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

``--compare device`` alternates the device tier instead, at ``--depth``: the CPU tier
(host memory, zero-copy) against the simulated device (``INFINITY_SIMULATE_DEVICE=1``:
the GPU protocol's leases, H2D/D2H copies and events, all-gathers into device buffers,
reduce-scatters on the device) and prints both step times, their ratio and the simulated
run's bytes per step on each link:

    .venv/bin/python tools/bench_zero.py --compare device --params cpu --rounds 2
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
    # variants: prefetch depth (0 vs --depth), or the device tier ("cpu" vs "simulated")
    variants = [0, a.depth] if a.compare == "prefetch" else ["cpu", "simulated"]
    times = {v: [] for v in variants}
    steps_s = {v: [] for v in variants}
    links = {}
    x = torch.randn(a.tokens // ws, a.hidden)
    for rnd in range(a.rounds):
        for v in variants if rnd % 2 == 0 else variants[::-1]:
            depth = v if a.compare == "prefetch" else a.depth
            os.environ["INFINITY_SIMULATE_DEVICE"] = "1" if v == "simulated" else "0"
            cfg = {"zero_stage": 3, "dist_timeout_s": 300, "prefetch": {"depth": depth},
                   "offload": {"params": a.params, "optimizer": "nvme",
                               "nvme_paths": [os.path.join(a.swap, f"d{v}")]}}
            eng = infinity.initialize(build(), cfg)
            try:
                for step in range(a.steps + 1):
                    dist.barrier()
                    if step == 1:
                        s0 = eng.stats()
                    t0 = time.perf_counter()
                    loss = eng(x).pow(2).mean()
                    eng.backward(loss)
                    t1 = time.perf_counter()
                    eng.step()
                    t2 = time.perf_counter()
                    if step > 0:           # step 0 records the trace
                        times[v].append(t1 - t0)
                        steps_s[v].append(t2 - t0)
                st = eng.stats()
                links[str(v)] = {k: (st[f"{k}_bytes"] - s0[f"{k}_bytes"]) / a.steps
                                 for k in ("h2d", "d2h", "allgather", "reduce_scatter",
                                           "nvme_read", "nvme_write")}
                links[str(v)]["device_peak_bytes"] = st["device_peak_bytes"]
            finally:
                eng.close()
    if rank == 0:
        print(json.dumps({"times": {str(k): v for k, v in times.items()},
                          "steps": {str(k): v for k, v in steps_s.items()}, "links": links,
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
    ap.add_argument("--compare", choices=("prefetch", "device"), default="prefetch")
    ap.add_argument("--params", choices=("cpu", "nvme"), default="nvme",
                    help="offload.params (the optimizer is on NVMe)")
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
                                   ("steps", a.steps), ("rounds", a.rounds), ("depth", a.depth),
                                   ("compare", a.compare), ("params", a.params))]
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
    n = a.layers * (8 * a.hidden * a.hidden + 7 * a.hidden)
    if a.compare == "device":
        fc, fs = (statistics.median(res["times"][k]) for k in ("cpu", "simulated"))
        sc, ss = (statistics.median(res["steps"][k]) for k in ("cpu", "simulated"))
        print(f"stage 3, {a.ranks} ranks, {n / 1e6:.1f}M params (params {a.params}, optimizer "
              f"nvme), {a.tokens} tokens, depth {a.depth}: forward+backward median "
              f"{fc:.3f} s CPU tier vs {fs:.3f} s simulated device ({fs / fc:.2f}x); whole "
              f"step {sc:.3f} s vs {ss:.3f} s ({ss / sc:.2f}x)")
        for k in ("cpu", "simulated"):
            ln = res["links"][k]
            print(f"  {k:>9} per step: " + ", ".join(
                f"{name} {ln[name] / 1e6:.1f} MB" for name in ("h2d", "d2h", "allgather",
                                                               "reduce_scatter", "nvme_read"))
                  + f"; device peak {ln['device_peak_bytes'] / 1e6:.1f} MB")
        return 0
    t0 = statistics.median(res["times"]["0"])
    td = statistics.median(res["times"][str(a.depth)])
    print(f"stage 3, {a.ranks} ranks, {n / 1e6:.1f}M params on NVMe, {a.tokens} tokens: "
          f"forward+backward median {t0:.3f} s on demand vs {td:.3f} s with prefetch depth "
          f"{a.depth}: ratio {t0 / td:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
