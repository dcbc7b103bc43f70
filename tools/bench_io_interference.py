#!/usr/bin/env python
"""What NVMe traffic costs the compute on this machine: the compute-only training step of
the end-to-end model (plain PyTorch in memory, as bench_e2e.py's (a)) timed quietly and
while fio moves a given number of bytes per step in the background.

This is the floor of *any* offload engine that moves those bytes while computing: fio does
the I/O with no Python, no hooks and no optimizer, with huge-page buffers (the cheapest
O_DIRECT shape, see bench_e2e.HugePages), rate-limited so that each step's worth of bytes
is spread over the step (the perfectly overlapped case). For each ``--traffic R:W`` (GB
read : GB written per step) the rates are set to ``R / step`` and ``W / step`` and
re-adjusted to the step time just measured (``--rounds`` times: a slower step stretches
the same bytes over more time, as an engine's fixed bytes per step would), so the result is
a self-consistent "step time with R + W GB of I/O overlapped".

    .venv/bin/python tools/bench_io_interference.py --nvme-path /work/bench-tmp/intf \\
        --traffic 2.15:2.15 --traffic 5.30:3.22

Printed per traffic: the compute step's median with the I/O, its ratio to the quiet median
measured just before, the bytes fio actually moved per step, and CPU time split
(/proc/stat: user, system, steal, idle) over the window.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import HugePages  # noqa: E402
from e2e_model import build_model, make_batch  # noqa: E402

GB = 10 ** 9


def cpu_times():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return v   # user nice system idle iowait irq softirq steal


def cpu_split(a, b):
    d = [y - x for x, y in zip(a, b)]
    tot = sum(d) or 1
    return {"user": (d[0] + d[1]) / tot, "sys": (d[2] + d[5] + d[6]) / tot,
            "idle": (d[3] + d[4]) / tot, "steal": d[7] / tot}


class Compute:
    def __init__(self, args):
        self.model = build_model(args.layers, args.d, ffn_mult=args.hidden // args.d)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0,
                                     fused=True)
        self.x, self.y = make_batch(args.tokens, args.d)

    def step(self):
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, n):
        c0 = cpu_times()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            ts.append(time.perf_counter() - t0)
        return ts, cpu_split(c0, cpu_times())


def prepare(path, size_mb):
    """Two files fio reads / rewrites (written once here, as infinity's swap files are)."""
    os.makedirs(path, exist_ok=True)
    files = {}
    for k in ("read", "write"):
        fn = os.path.join(path, f"intf-{k}.dat")
        subprocess.run(["fio", "--name=prep", f"--filename={fn}", "--rw=write", "--bs=1M",
                        "--direct=1", "--ioengine=io_uring", "--iodepth=32",
                        f"--size={size_mb}M", "--output=/dev/null"], check=True)
        files[k] = fn
    return files


def start_fio(files, size_mb, read_bps, write_bps, mem, out):
    cmd = ["fio", "--output-format=json", f"--output={out}", "--time_based", "--runtime=3600",
           "--direct=1", "--ioengine=io_uring", "--iodepth=32", "--bs=1M", f"--mem={mem}",
           f"--size={size_mb}M"]
    if read_bps > 0:
        cmd += ["--name=r", f"--filename={files['read']}", "--rw=read", f"--rate={int(read_bps)}"]
    if write_bps > 0:
        cmd += ["--name=w", f"--filename={files['write']}", "--rw=write",
                f"--rate=,{int(write_bps)}"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def stop_fio(p, out):
    p.send_signal(signal.SIGINT)          # fio writes its JSON report on SIGINT
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    try:
        with open(out) as f:
            txt = f.read()
        rep = json.loads(txt[txt.index("{"):])
    except (OSError, ValueError) as e:
        raise SystemExit(f"fio: no report in {out} ({e}); stderr: {p.stderr.read()[-300:]}")
    rd = sum(j["read"]["io_bytes"] for j in rep["jobs"])
    wr = sum(j["write"]["io_bytes"] for j in rep["jobs"])
    return rd, wr


def measure(comp, files, args, r_gb, w_gb, quiet, mem):
    """Step times with R/W GB per step in the background, rates re-fit to the step time."""
    step = quiet
    out = os.path.join(args.nvme_path, "intf-fio.json")
    res = None
    for _ in range(args.rounds):
        p = start_fio(files, args.file_mb, r_gb * GB / step, w_gb * GB / step, mem, out)
        try:
            time.sleep(args.settle)
            t0 = time.perf_counter()
            ts, cpu = comp.timed(args.steps)
            window = time.perf_counter() - t0
        finally:
            rd, wr = stop_fio(p, out)
        total = args.settle + window           # fio ran over the settle time too
        med = statistics.median(ts)
        res = {"steps": ts, "median": med, "cpu": cpu,
               "read_gb_per_step": rd / total * med / GB, "write_gb_per_step": wr / total * med / GB}
        step = med
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-path", required=True, help="directory on the disk under test")
    ap.add_argument("--traffic", action="append", default=None, metavar="R:W",
                    help="GB read : GB written per step (repeatable; default 2.15:2.15, the "
                         "fp32 Adam moments of the 268.6M model, read and written once a step)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per point")
    ap.add_argument("--rounds", type=int, default=2, help="rate re-fits per traffic point")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of I/O before timing")
    ap.add_argument("--file-mb", type=int, default=4096, help="size of each fio file")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    traffic = []
    for t in args.traffic or ["2.15:2.15"]:
        try:
            r, w = (float(x) for x in t.split(":"))
        except ValueError:
            raise SystemExit(f"--traffic {t!r}: expected R:W in GB per step, e.g. 2.15:2.15")
        traffic.append((r, w))
    comp = Compute(args)
    comp.timed(2)                                   # warm-up
    files = prepare(args.nvme_path, args.file_mb)
    rows = []
    try:
        with HugePages(2 * 32 + 8) as huge:
            mem = "shmhuge" if huge else "malloc"
            for r, w in traffic:
                qts, qcpu = comp.timed(args.steps)
                quiet = statistics.median(qts)
                res = measure(comp, files, args, r, w, quiet, mem)
                row = {"traffic_gb": [r, w], "quiet_median": quiet, "quiet_steps": qts,
                       "quiet_cpu": qcpu, **res, "ratio": res["median"] / quiet}
                rows.append(row)
                print(f"{r:.2f} GB read + {w:.2f} GB written per step: compute step "
                      f"{res['median']:.2f} s vs {quiet:.2f} s quiet = {row['ratio']:.2f}x "
                      f"(fio moved {res['read_gb_per_step']:.2f} + {res['write_gb_per_step']:.2f} "
                      f"GB per step; CPU user {res['cpu']['user']:.0%} sys {res['cpu']['sys']:.0%} "
                      f"steal {res['cpu']['steal']:.0%} idle {res['cpu']['idle']:.0%}; quiet: "
                      f"steal {qcpu['steal']:.0%} idle {qcpu['idle']:.0%}; buffers {mem})",
                      flush=True)
    finally:
        for fn in files.values():
            if os.path.exists(fn):
                os.unlink(fn)
    print(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
