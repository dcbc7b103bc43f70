#!/usr/bin/env python
"""End-to-end step time: plain PyTorch in memory vs infinity with params and optimizer on
NVMe (host cap <= 40 % of the model states), against the bandwidth bound
``max(compute-only step, NVMe read bytes / fio read bw + NVMe write bytes / fio write bw)``.

    .venv/bin/python tools/bench_e2e.py                       # 268M-param fp32 MLP stack
    .venv/bin/python tools/bench_e2e.py --layers 2 --d 512    # quick smoke run

(c) DeepSpeed ZeRO-3 with params and optimizer on NVMe runs in its own venv (never in
.venv): create it once with ``bash tools/setup_deepspeed_venv.sh`` (default
/tmp/infinity-dsvenv); the script then calls tools/peers/deepspeed_e2e.py with the same
model (tools/e2e_model.py: same seeds, same weights and batch). ``--deepspeed-python ''``
skips it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_model import build_model, make_batch  # noqa: E402  (shared with the DeepSpeed peer)

DEFAULT_DS_PYTHON = "/tmp/infinity-dsvenv/bin/python"  # tools/setup_deepspeed_venv.sh


def build(layers, d, hidden):
    if hidden % d:
        raise SystemExit(f"--hidden ({hidden}) must be a multiple of --d ({d})")
    return build_model(layers, d, ffn_mult=hidden // d)


def batch(d, tokens):
    return make_batch(tokens, d)


def run_torch(args):
    model = build(args.layers, args.d, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    x, y = batch(args.d, args.tokens)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    del model, opt
    return times[args.warmup:]


def run_infinity(args, swap_dir, host_gb):
    import infinity
    model = build(args.layers, args.d, args.hidden)
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir],
                       "host_memory_gb": host_gb},
           "prefetch": {"depth": args.depth},
           "aio": {"queue_depth": 32, "threads": args.aio_threads},
           "optimizer": {"lr": 1e-4, "weight_decay": 0.0}}
    x, y = batch(args.d, args.tokens)
    times, moved = [], []
    with infinity.initialize(model, cfg) as eng:
        for i in range(args.warmup + args.steps):
            s0 = eng.stats()
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(eng(x), y)
            eng.backward(loss)
            t1 = time.perf_counter()
            eng.step()
            t2 = time.perf_counter()
            s1 = eng.stats()
            times.append((t2 - t0, t1 - t0, t2 - t1))
            moved.append({k: s1[k] - s0[k] for k in ("nvme_read_bytes", "nvme_write_bytes",
                                                     "nvme_read_seconds", "nvme_write_seconds",
                                                     "on_demand_fetches")})
        final = eng.stats()
    return times[args.warmup:], moved[args.warmup:], final


def run_deepspeed(args, swap_dir):
    """Median step time of DeepSpeed ZeRO-3 (params + optimizer on NVMe), or None if skipped."""
    py = args.deepspeed_python
    if not py:
        print("(c) DeepSpeed: skipped (--deepspeed-python '')")
        return None
    if not os.path.exists(py):
        print(f"(c) DeepSpeed: skipped: {py} not found (create it: bash tools/setup_deepspeed_venv.sh)")
        return None
    if args.hidden % args.d:
        raise SystemExit("--hidden must be a multiple of --d")
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "deepspeed_e2e.py")
    cmd = [py, peer, "--layers", str(args.layers), "--hidden", str(args.d),
           "--ffn-mult", str(args.hidden // args.d), "--tokens", str(args.tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-path", swap_dir, "--json"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    try:
        res = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(f"(c) DeepSpeed: failed (exit {r.returncode}); command: {' '.join(cmd)}")
        return None
    if "error" in res or r.returncode:
        print(f"(c) DeepSpeed: failed: {res.get('error')}")
        return None
    t = res["median_step_s"]
    print(f"(c) DeepSpeed ZeRO-3 params+optimizer on NVMe: median step {t:.2f} s  "
          f"{[round(x, 2) for x in res.get('step_s', [])]}; peak RSS "
          f"{res.get('peak_rss_bytes', 0) / 1e9:.2f} GB")
    return t


def fio_bw(path, size_mb, seconds):
    """Sequential O_DIRECT read and write bandwidth (bytes/s) of ``path`` measured by fio."""
    if shutil.which("fio") is None:
        return None
    os.makedirs(path, exist_ok=True)
    out = {}
    fname = os.path.join(path, "fio-bench.dat")
    try:
        for rw in ("write", "read"):
            r = subprocess.run(["fio", "--name=bw", f"--filename={fname}", f"--rw={rw}",
                                "--bs=1M", "--direct=1", "--ioengine=io_uring",
                                "--iodepth=32", f"--size={size_mb}M", f"--runtime={seconds}",
                                "--time_based=0", "--output-format=json"],
                               capture_output=True, text=True)
            if r.returncode:
                return None
            job = json.loads(r.stdout)["jobs"][0][rw]
            out[rw] = job["bw_bytes"]
    finally:
        if os.path.exists(fname):
            os.unlink(fname)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--aio-threads", type=int, default=1)
    ap.add_argument("--host-frac", type=float, default=0.4,
                    help="host_memory_gb as a fraction of the model states (params+grads+m+v)")
    ap.add_argument("--nvme-path", default=None, help="default: a temp dir under ./")
    ap.add_argument("--fio-mb", type=int, default=2048)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                    help="python of the DeepSpeed venv ('' to skip; default %(default)s)")
    args = ap.parse_args(argv)

    n_params = sum(p.numel() for p in build(1, args.d, args.hidden).parameters()) * args.layers
    states = 16 * n_params
    host_gb = args.host_frac * states / 1e9
    root = args.nvme_path or tempfile.mkdtemp(prefix="bench-e2e-", dir=".")
    print(f"model: {args.layers} blocks d={args.d} hidden={args.hidden}: {n_params / 1e6:.1f}M "
          f"params fp32, {args.tokens} tokens; model states {states / 1e9:.2f} GB; "
          f"infinity host cap {host_gb:.2f} GB ({args.host_frac:.0%}); torch threads "
          f"{torch.get_num_threads()}")
    bw = fio_bw(os.path.join(root, "fio"), args.fio_mb, 10)
    if bw:
        print(f"fio: read {bw['read'] / 1e9:.2f} GB/s, write {bw['write'] / 1e9:.2f} GB/s "
              f"(1 MiB, O_DIRECT, io_uring, iodepth 32)")
    t_torch = None
    if not args.skip_torch:
        tt = run_torch(args)
        t_torch = statistics.median(tt)
        print(f"(a) plain PyTorch in memory: median step {t_torch:.2f} s  {[round(t, 2) for t in tt]}")
    ti, moved, final = run_infinity(args, os.path.join(root, "swap"), host_gb)
    t_inf = statistics.median(t[0] for t in ti)
    fb = statistics.median(t[1] for t in ti)
    st = statistics.median(t[2] for t in ti)
    rd = statistics.median(m["nvme_read_bytes"] for m in moved)
    wr = statistics.median(m["nvme_write_bytes"] for m in moved)
    print(f"(b) infinity params+optimizer on NVMe: median step {t_inf:.2f} s "
          f"(forward+backward {fb:.2f} s, optimizer step {st:.2f} s)  "
          f"{[round(t[0], 2) for t in ti]}")
    print(f"    per step: NVMe read {rd / 1e9:.2f} GB, NVMe write {wr / 1e9:.2f} GB, "
          f"on-demand fetches {[m['on_demand_fetches'] for m in moved]}; peaks host "
          f"{final['host_peak_bytes'] / 1e9:.2f} GB, device tier "
          f"{final['device_peak_bytes'] / 1e9:.2f} GB")
    if bw and t_torch is not None:
        io_time = rd / bw["read"] + wr / bw["write"]
        bound = max(t_torch, io_time)
        print(f"bound = max(compute-only {t_torch:.2f} s, NVMe bytes / fio bw {io_time:.2f} s) "
              f"= {bound:.2f} s;  infinity / bound = {t_inf / bound:.2f}  "
              f"(target <= 1.25);  infinity / torch = {t_inf / t_torch:.2f}")
    t_ds = run_deepspeed(args, os.path.join(root, "ds-swap"))
    if t_ds is not None:
        print(f"    infinity / DeepSpeed = {t_inf / t_ds:.2f}  (target <= 0.5)")
    if args.nvme_path is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
