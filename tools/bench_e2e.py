#!/usr/bin/env python
"""End-to-end step time: plain PyTorch in memory vs infinity with params and optimizer on
NVMe (host cap <= 40 % of the model states) vs DeepSpeed ZeRO-3 with params and optimizer on
NVMe, in one run, against the bandwidth bound
``max(compute-only step, NVMe read bytes / fio read bw + NVMe write bytes / fio write bw)``.

Order: fio, (a) torch, (b) infinity, fio again, (c) DeepSpeed. The bound takes the faster of
the two fio measurements (read; write = rewrite of an already written file, as infinity's
preallocated swap files are; buffers in hugetlb pages when root can reserve them, see
HugePages) and infinity's NVMe bytes per step from ``engine.stats()``.
Printed per step: bytes and busy seconds per link (engine.stats()), the bytes the kernel saw
the process read/write (/proc/self/io), and the same kernel counters for the DeepSpeed process.

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
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_model import build_model, make_batch, proc_io  # noqa: E402  (shared with the DeepSpeed peer)

DEFAULT_DS_PYTHON = "/tmp/infinity-dsvenv/bin/python"  # tools/setup_deepspeed_venv.sh


def build(layers, d, hidden):
    if hidden % d:
        raise SystemExit(f"--hidden ({hidden}) must be a multiple of --d ({d})")
    return build_model(layers, d, ffn_mult=hidden // d)


def batch(d, tokens):
    return make_batch(tokens, d)


def sync(device):
    """Wait for queued device work before reading the clock (CUDA)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_torch(args):
    model = build(args.layers, args.d, args.hidden).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    x, y = (t.to(args.device) for t in batch(args.d, args.tokens))
    times = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu0 = os.times()
        sync(args.device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    cpu1 = os.times()
    del model, opt
    return times[args.warmup:], (cpu1.user - cpu0.user, cpu1.system - cpu0.system)


LINKS = ("nvme_read", "nvme_write", "h2d", "d2h")
DELTA_KEYS = tuple(f"{k}_{u}" for k in LINKS for u in ("bytes", "seconds")) + (
    "on_demand_fetches", "optimizer_groups_overlapped", "optimizer_clip_redos",
    "optimizer_speculation_skipped", "optimizer_speculation_stopped")


def run_infinity(args, swap_dir, host_gb):
    import infinity
    # --device cuda: the model on the GPU, params + optimizer on NVMe (the CUDA tier)
    model = build(args.layers, args.d, args.hidden).to(args.device)
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir],
                       "host_memory_gb": host_gb},
           "prefetch": {"depth": args.depth},
           "aio": {"queue_depth": 32, "threads": args.aio_threads},
           "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
           "gradient_clipping": args.ab_clip or args.clip}
    x, y = (t.to(args.device) for t in batch(args.d, args.tokens))
    times, moved = [], []
    with infinity.initialize(model, cfg) as eng:
        if args.no_commit_point:
            eng.commit_point = False             # A/B: updates in place (not all-or-nothing)
        if args.no_overlap:
            eng.overlap_optimizer_step = False   # A/B: every group stepped after backward
        if args.no_master_handoff and eng.overlap is not None:
            eng.overlap.handoff = False          # A/B: the overlapped step reads its master
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                cpu0 = os.times()
            if args.ab_clip:     # A/B in one process: odd steps clip, even steps do not
                c = args.ab_clip if i % 2 else 0.0
                eng.opt.clip = c
                if eng.overlap is not None:
                    eng.overlap.clip = c
            s0 = eng.stats()
            k0 = proc_io()
            sync(args.device)
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(eng(x), y)
            eng.backward(loss)
            sync(args.device)
            t1 = time.perf_counter()
            eng.step()
            sync(args.device)
            t2 = time.perf_counter()
            s1 = eng.stats()
            k1 = proc_io()
            times.append((t2 - t0, t1 - t0, t2 - t1))
            moved.append({k: s1.get(k, 0) - s0.get(k, 0) for k in DELTA_KEYS})
            moved[-1]["grad_norm"] = s1["grad_norm"]
            moved[-1]["clip"] = eng.opt.clip
            if k0 and k1:  # what the kernel saw this process read/write from storage
                moved[-1].update(kernel_read_bytes=k1["read_bytes"] - k0["read_bytes"],
                                 kernel_write_bytes=k1["write_bytes"] - k0["write_bytes"])
        cpu1 = os.times()
        final = eng.stats()
    final["measured_user_s"] = cpu1.user - cpu0.user
    final["measured_sys_s"] = cpu1.system - cpu0.system
    return times[args.warmup:], moved[args.warmup:], final


def run_deepspeed(args, swap_dir, max_in_cpu):
    """The peer's JSON result for DeepSpeed ZeRO-3 (params + optimizer on NVMe), or None."""
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
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nvme-path", swap_dir,
           "--max-in-cpu", str(max_in_cpu), "--device", args.device, "--json"]
    print(f"(c) DeepSpeed: running {' '.join(cmd)}", flush=True)
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
    print(f"(c) DeepSpeed ZeRO-3 params+optimizer on NVMe, max_in_cpu {max_in_cpu:.0e}: median step {t:.2f} s "
          f"(forward+backward {statistics.median(res['fwd_bwd_s']):.2f} s, optimizer step "
          f"{statistics.median(res['optimizer_step_s']):.2f} s)  "
          f"{[round(x, 2) for x in res.get('step_s', [])]}; init {res.get('init_seconds', 0):.1f} s; "
          f"peak RSS {res.get('peak_rss_bytes', 0) / 1e9:.2f} GB")
    if res.get("io_read_bytes"):
        print(f"    per step (median), kernel (/proc/self/io) of the DeepSpeed process: read "
              f"{statistics.median(res['io_read_bytes']) / 1e9:.2f} GB, write "
              f"{statistics.median(res['io_write_bytes']) / 1e9:.2f} GB; CPU over the measured "
              f"steps {res.get('measured_user_s', 0):.1f} s user + "
              f"{res.get('measured_sys_s', 0):.1f} s sys")
    return res


def fmt(t):
    return "-" if t is None else f"{t:.2f} s"


def ratio(a, b):
    return "-" if not b else f"{a / b:.2f}"


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


FIO_SHAPES = ((1, 1), (4, 2))  # (block MiB, jobs): infinity's 1 MiB blocks, and 4 MiB x 2 jobs


def fio_bw(path, size_mb, seconds):
    """Sequential O_DIRECT bandwidth (bytes/s) of ``path`` measured by fio (io_uring, iodepth
    32), the best over FIO_SHAPES (the faster the device looks, the stricter the bound).
    ``write`` is the REwrite of a file fio has already written once (infinity's swap files are
    preallocated and rewritten every step; writing fresh blocks is slower on ext4, which would
    loosen the bound), ``first_write`` that first pass, ``read`` a read of the file."""
    if shutil.which("fio") is None:
        print("fio: not installed (apt-get install fio); no bound")
        return None
    os.makedirs(path, exist_ok=True)
    with HugePages(max(bs * nj for bs, nj in FIO_SHAPES) * 32 // 2 + 8) as huge:
        return _fio_runs(path, size_mb, seconds, "shmhuge" if huge else "malloc")


class HugePages:
    """Reserve ``pages`` 2 MiB hugetlb pages (``/proc/sys/vm/nr_hugepages``, root) for fio's
    buffers while inside, and restore the old count after. fio has no transparent-huge-page
    option; with its 4 KiB-page ``malloc`` buffers every 1 MiB O_DIRECT request is ~256 physical
    segments and this virtio disk ran 2-4x slower than with huge pages (infinity's own buffers
    are MADV_HUGEPAGE), which would make the fio bound far too loose. True if reserved."""
    PATH = "/proc/sys/vm/nr_hugepages"

    def __init__(self, pages):
        self.pages, self.old = pages, None

    def __enter__(self):
        try:
            with open(self.PATH) as f:
                self.old = int(f.read())
            with open(self.PATH, "w") as f:
                f.write(str(self.old + self.pages))
            with open("/proc/meminfo") as f:
                free = int(next(l for l in f if l.startswith("HugePages_Free")).split()[1])
            if free < self.pages:
                print(f"fio: only {free} of {self.pages} huge pages reserved; 4 KiB-page buffers "
                      f"(fio will understate the disk)")
                self.__exit__()
                return False
            return True
        except (OSError, ValueError, StopIteration) as e:
            print(f"fio: cannot reserve huge pages ({e}); 4 KiB-page buffers (fio will "
                  f"understate the disk; run as root)")
            self.old = None
            return False

    def __exit__(self, *exc):
        if self.old is not None:
            with open(self.PATH, "w") as f:
                f.write(str(self.old))
            self.old = None


def _fio_runs(path, size_mb, seconds, mem):
    out = {"first_write": 0, "write": 0, "read": 0, "mem": mem}
    fname = os.path.join(path, "fio-bench.dat")
    runs = [("first_write", "write", 1, 1)] + [(k, rw, bs, nj) for bs, nj in FIO_SHAPES
                                                 for k, rw in (("write", "write"), ("read", "read"))]
    try:
        for key, rw, bs, nj in runs:
            r = subprocess.run(["fio", "--name=bw", f"--filename={fname}", f"--rw={rw}",
                                f"--bs={bs}M", "--direct=1", "--ioengine=io_uring",
                                "--iodepth=32", f"--numjobs={nj}", f"--mem={mem}", f"--size={size_mb // nj}M",
                                f"--offset_increment={size_mb // nj}M", "--group_reporting",
                                f"--runtime={seconds}", "--time_based=0",
                                "--output-format=json"],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"fio: {rw} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}; no bound")
                return None
            txt = r.stdout[r.stdout.index("{"):]  # fio may print notes before the JSON
            out[key] = max(out[key], json.loads(txt)["jobs"][0][rw]["bw_bytes"])
    finally:
        if os.path.exists(fname):
            os.unlink(fname)
    return out


def print_fio(when, bw, args):
    if bw:
        print(f"fio ({when}): read {bw['read'] / 1e9:.2f} GB/s, write {bw['write'] / 1e9:.2f} GB/s "
              f"(rewrite; first write of the file {bw['first_write'] / 1e9:.2f} GB/s) "
              f"(best of 1 MiB x 1 job and 4 MiB x 2 jobs, {args.fio_mb} MiB, O_DIRECT, io_uring, "
              f"iodepth 32, buffers --mem={bw['mem']})")


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
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where plain PyTorch and infinity compute (cuda: cuda:0; DeepSpeed "
                         "runs on the GPU there too). The GPU path has not yet run on a GPU")
    ap.add_argument("--skip-fio", action="store_true", help="no fio runs (and so no bound)")
    ap.add_argument("--no-commit-point", action="store_true",
                    help="A/B only: updates in place instead of all-or-nothing (Note [commit point])")
    ap.add_argument("--no-master-handoff", action="store_true",
                    help="A/B: the overlapped optimizer step reads each fp32 master from NVMe "
                         "instead of reusing the parameter buffer backward fetched")
    ap.add_argument("--no-overlap", action="store_true",
                    help="A/B: the optimizer step after backward (engine.overlap_optimizer_step "
                         "= False), as with clipping before speculative clipping")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="infinity's gradient_clipping (0: none); prints how often it triggered")
    ap.add_argument("--ab-clip", type=float, default=0.0,
                    help="A/B in one process: steps alternate gradient_clipping AB_CLIP (odd "
                         "steps) and none (even steps); prints both medians, their pairwise "
                         "ratios and how often the clip triggered")
    ap.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                    help="python of the DeepSpeed venv ('' to skip; default %(default)s)")
    ap.add_argument("--ds-max-in-cpu", default=str(int(1e9)),
                    type=lambda v: [int(float(x)) for x in v.split(",")],
                    help="DeepSpeed offload_param.max_in_cpu, comma-separated for one DeepSpeed "
                         "run each (its default 1e9: all params of this model stay resident in "
                         "host memory; 0: params really on NVMe). Default %(default)s")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_e2e: --device cuda but torch.cuda.is_available() is False")

    n_params = sum(p.numel() for p in build(1, args.d, args.hidden).parameters()) * args.layers
    states = 16 * n_params
    host_gb = args.host_frac * states / 1e9
    root = args.nvme_path or tempfile.mkdtemp(prefix="bench-e2e-", dir=".")
    print(f"model: {args.layers} blocks d={args.d} hidden={args.hidden}: {n_params / 1e6:.1f}M "
          f"params fp32, {args.tokens} tokens; model states {states / 1e9:.2f} GB; "
          f"infinity host cap {host_gb:.2f} GB ({args.host_frac:.0%}); torch threads "
          f"{torch.get_num_threads()}")
    bw = None if args.skip_fio else fio_bw(os.path.join(root, "fio"), args.fio_mb, 10)
    print_fio("before", bw, args)
    t_torch = None
    if not args.skip_torch:
        tt, (tu, ts) = run_torch(args)
        t_torch = statistics.median(tt)
        print(f"(a) plain PyTorch in memory: median step {t_torch:.2f} s  {[round(t, 2) for t in tt]}; "
              f"CPU over the measured steps {tu:.1f} s user + {ts:.1f} s sys")
    ti, moved, final = run_infinity(args, os.path.join(root, "swap"), host_gb)
    t_inf = statistics.median(t[0] for t in ti)
    fb = statistics.median(t[1] for t in ti)
    st = statistics.median(t[2] for t in ti)
    rd = statistics.median(m["nvme_read_bytes"] for m in moved)
    wr = statistics.median(m["nvme_write_bytes"] for m in moved)
    print(f"(b) infinity params+optimizer on NVMe: median step {t_inf:.2f} s "
          f"(forward+backward {fb:.2f} s, optimizer step {st:.2f} s)  "
          f"{[round(t[0], 2) for t in ti]}")
    if args.clip:
        clipped = sum(1 for m in moved if m["grad_norm"] + 1e-6 > args.clip)
        print(f"    gradient_clipping {args.clip}: the norm was above it in {clipped} of "
              f"{len(moved)} measured steps (norms {[round(m['grad_norm'], 3) for m in moved]}); "
              f"per step: groups stepped during backward "
              f"{[m['optimizer_groups_overlapped'] for m in moved]}, redone "
              f"{[m['optimizer_clip_redos'] for m in moved]}, speculation skipped "
              f"{[m['optimizer_speculation_skipped'] for m in moved]} / stopped "
              f"{[m['optimizer_speculation_stopped'] for m in moved]}")
    if args.ab_clip:
        first = args.warmup
        pairs = [(ti[j][0], ti[j + 1][0]) for j in range(len(ti) - 1)
                 if moved[j]["clip"] == 0.0 and moved[j + 1]["clip"] > 0]
        on = [t[0] for t, m in zip(ti, moved) if m["clip"] > 0]
        off = [t[0] for t, m in zip(ti, moved) if m["clip"] == 0.0]
        trig = [m for m in moved if m["clip"] > 0]
        ratios = [b / a for a, b in pairs]
        print(f"    A/B clip {args.ab_clip} (odd steps) vs none (even steps) from step {first}: "
              f"median {statistics.median(on):.2f} vs {statistics.median(off):.2f} s; pairwise "
              f"ratios {[round(r, 3) for r in ratios]} (median "
              f"{statistics.median(ratios):.3f}); clip triggered in "
              f"{sum(1 for m in trig if m['grad_norm'] + 1e-6 > args.ab_clip)} of {len(trig)} "
              f"clipped steps (norms {[round(m['grad_norm'], 3) for m in trig]}), redone "
              f"{[m['optimizer_clip_redos'] for m in trig]}; NVMe read per step clip/none "
              f"{statistics.median(m['nvme_read_bytes'] for m in trig) / 1e9:.2f} / "
              f"{statistics.median(m['nvme_read_bytes'] for m in moved if m['clip'] == 0) / 1e9:.2f} GB")
    print("    per step (median), engine.stats() deltas: link, bytes, busy seconds, bytes/busy s")
    for k in LINKS:
        b = statistics.median(m[f"{k}_bytes"] for m in moved)
        sec = statistics.median(m[f"{k}_seconds"] for m in moved)
        rate = f"{b / sec / 1e9:.2f} GB/s" if sec > 0 else "-"
        print(f"      {k:<10} {b / 1e9:7.2f} GB  {sec:7.2f} s  {rate}")
    if "kernel_read_bytes" in moved[0]:
        print(f"    kernel (/proc/self/io) per step: read "
              f"{statistics.median(m['kernel_read_bytes'] for m in moved) / 1e9:.2f} GB, write "
              f"{statistics.median(m['kernel_write_bytes'] for m in moved) / 1e9:.2f} GB")
    print(f"    on-demand fetches {[m['on_demand_fetches'] for m in moved]}; peaks host "
          f"{final['host_peak_bytes'] / 1e9:.2f} GB (cap {host_gb:.2f} GB), device tier "
          f"{final['device_peak_bytes'] / 1e9:.2f} GB, NVMe {final.get('nvme_peak_bytes', 0) / 1e9:.2f} GB; "
          f"peak RSS {peak_rss_bytes() / 1e9:.2f} GB (process so far); CPU over the measured "
          f"steps {final['measured_user_s']:.1f} s user + {final['measured_sys_s']:.1f} s sys")
    bound = None
    bw2 = fio_bw(os.path.join(root, "fio"), args.fio_mb, 10) if bw else None
    print_fio("after infinity", bw2, args)
    if bw and bw2:  # the faster of the two measurements: the stricter bound
        bw = {k: max(bw[k], bw2[k]) if k != "mem" else bw[k] for k in bw}
    if bw and t_torch is not None:
        io_time = rd / bw["read"] + wr / bw["write"]
        bound = max(t_torch, io_time)
        print(f"bound = max(compute-only {t_torch:.2f} s, NVMe bytes / fio bw "
              f"{rd / 1e9:.2f} GB / {bw['read'] / 1e9:.2f} + {wr / 1e9:.2f} GB / "
              f"{bw['write'] / 1e9:.2f} = {io_time:.2f} s) = {bound:.2f} s;  infinity / bound = "
              f"{t_inf / bound:.2f}  (target <= 1.25);  infinity / torch = {t_inf / t_torch:.2f}")
    elif not bw:
        print("bound: not computed (fio missing or failed: apt-get install fio)")
    t_ds = []
    for mic in args.ds_max_in_cpu:
        ds = run_deepspeed(args, os.path.join(root, "ds-swap"), mic)
        t_ds.append(ds["median_step_s"] if ds else None)
        if t_ds[-1] is not None:
            print(f"    infinity / DeepSpeed (max_in_cpu {mic:.0e}) = {t_inf / t_ds[-1]:.2f}  "
                  f"(target <= 0.5)")
    ds_s = ", ".join(f"{fmt(t)} (max_in_cpu {m:.0e})" for t, m in zip(t_ds, args.ds_max_in_cpu))
    ds_r = ", ".join(ratio(t_inf, t) for t in t_ds)
    print(f"summary: torch {fmt(t_torch)} | infinity {t_inf:.2f} s | DeepSpeed {ds_s or '-'} | "
          f"bound {fmt(bound)} | infinity/bound {ratio(t_inf, bound)} (<= 1.25) | "
          f"infinity/DeepSpeed {ds_r or '-'} (<= 0.5) | load {os.getloadavg()}")
    if args.nvme_path is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
