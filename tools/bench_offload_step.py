#!/usr/bin/env python
"""Benchmark the pipelined NVMe optimizer step against its peers, in one run.

Measured, interleaved round by round (the machine is shared and noisy):

* ``step``      OptimizerStateStore("nvme").step: read tile i+1 || adam_step on
                tile i || write tile i-1, emitting bf16 params (param_out).
* ``io_pipe``   the same store code with a no-op kernel: the identical I/O
                pattern and bytes, no compute.
* ``io_raw``    the same bytes (master + exp_avg + exp_avg_sq, read then written
                back) moved through the I/O engine directly in large chunks,
                ``depth`` chunks in flight, no optimizer code at all.
* ``compute``   OptimizerStateStore("cpu").step on the same sizes: adam_step
                over host-resident states, no I/O.
* ``io_sleep``  the store with a kernel that *sleeps* as long as adam_step takes
                (calibrated from ``compute`` of the previous round): the pipeline's
                overlap without CPU/memory contention between compute and I/O.
                step/io_sleep > 1 is what contention costs on this machine.

Prints medians and the ratios step / I/O alone (the faster of io_raw and
io_pipe; target <= 1.15), step/(io_raw + compute) (what a non-overlapped step
would cost), io_sleep/io_pipe (overlap of the pipeline itself) and
step/io_sleep (what CPU/memory contention between compute and I/O costs).

    .venv/bin/python tools/bench_offload_step.py --numel 100000000 --rounds 5
"""
import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from infinity.io import AioEngine, SwapSpace, aligned_empty
from infinity.optim.offload_step import OptimizerStateStore, StepItem

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=100e6, help="parameters (default 100M)")
    ap.add_argument("--keys", type=int, default=4, help="partitions the parameters are split into")
    ap.add_argument("--tile-numel", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--depth", type=int, default=3, help="pipeline depth (ring slots)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--path", default=None, help="swap directory (default: a temp dir under /tmp)")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--state-dtype", choices=sorted(DT), default="fp32")
    ap.add_argument("--raw-chunk-mb", type=int, default=16)
    ap.add_argument("--raw-inflight", type=int, default=8, help="io_raw chunks in flight")
    ap.add_argument("--no-param-out", action="store_true", help="do not emit bf16 params in the step")
    ap.add_argument("--adam-threads", type=int, default=0, help="adam_step threads (0: kernel default)")
    return ap.parse_args()


def noop_kernel(*args, **kwargs):
    return None


class SleepKernel:
    """Stands in for adam_step: sleeps for the time adam_step would take on this many elements."""

    def __init__(self):
        self.sec_per_elem = 0.0

    def __call__(self, param, *args, **kwargs):
        time.sleep(param.numel() * self.sec_per_elem)


class Recorder:
    def __init__(self):
        self.links = {}

    def link(self, name, nbytes, seconds):
        b, s = self.links.get(name, (0, 0.0))
        self.links[name] = (b + nbytes, s + seconds)

    def alloc(self, tier, nbytes):
        pass

    def free(self, tier, nbytes):
        pass


def io_raw(swap, extents, bufs):
    """Read every extent chunk by chunk and write it back; len(bufs) chunks in flight."""
    chunk = bufs[0].numel()
    jobs = [(e, off, min(chunk, nb - off)) for e, nb in extents for off in range(0, nb, chunk)]
    depth = len(bufs)
    reads, writes = [None] * depth, [None] * depth

    def issue_read(i):
        e, off, n = jobs[i]
        reads[i % depth] = swap.read(e, bufs[i % depth][:n], offset=off)

    issue_read(0)
    for i, (e, off, n) in enumerate(jobs):
        if i + 1 < len(jobs):
            k = (i + 1) % depth
            if writes[k] is not None:
                writes[k].wait()
                writes[k] = None
            issue_read(i + 1)
        reads[i % depth].wait()
        writes[i % depth] = swap.write(e, bufs[i % depth][:n], offset=off)
    for w in writes:
        if w is not None:
            w.wait()


def main():
    a = parse()
    logging.basicConfig(level=logging.WARNING)
    if a.adam_threads:
        from infinity.optim import set_num_threads
        set_num_threads(a.adam_threads)
    n_total = int(a.numel)
    sizes = [n_total // a.keys + (1 if i < n_total % a.keys else 0) for i in range(a.keys)]
    sdt = DT[a.state_dtype]
    ssz = torch.empty((), dtype=sdt).element_size()
    state_bytes = sum(s * (4 + 2 * ssz) for s in sizes)
    root = a.path or tempfile.mkdtemp(prefix="bench-offload-step-")
    os.makedirs(root, exist_ok=True)

    eng = AioEngine(a.block_size, a.queue_depth, a.threads, a.engine)
    swap = SwapSpace([root], eng)
    stores = {}
    try:
        swap.reserve(4 * state_bytes + 4 * 4096 * 3 * a.keys + (64 << 20))
        grads = [torch.randn(s) * 1e-2 for s in sizes]
        outs = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
        rec = Recorder()
        stores["step"] = OptimizerStateStore("nvme", swap=swap, tile_numel=a.tile_numel, state_dtype=sdt,
                                             pipeline_depth=a.depth, accounting=rec)
        stores["io_pipe"] = OptimizerStateStore("nvme", swap=swap, tile_numel=a.tile_numel, state_dtype=sdt,
                                                pipeline_depth=a.depth, kernel=noop_kernel)
        stores["compute"] = OptimizerStateStore("cpu", tile_numel=a.tile_numel, state_dtype=sdt,
                                                pipeline_depth=a.depth)
        sleeper = SleepKernel()
        stores["io_sleep"] = OptimizerStateStore("nvme", swap=swap, tile_numel=a.tile_numel, state_dtype=sdt,
                                                 pipeline_depth=a.depth, kernel=sleeper)
        for name, st in stores.items():
            for i, s in enumerate(sizes):
                st.add(f"k{i}", s, init=torch.randn(s) if name in ("step", "compute") else None)
        raw_exts = []
        for s in sizes:
            for b in (4, ssz, ssz):
                nb = (s * b + 4095) // 4096 * 4096
                raw_exts.append((swap.allocate(nb), nb))
        chunk = a.raw_chunk_mb << 20
        raw_bufs = [aligned_empty(chunk, torch.uint8) for _ in range(a.raw_inflight)]
        for e, nb in raw_exts:                       # make the raw extents really written once
            for off in range(0, nb, chunk):
                swap.write(e, raw_bufs[0][:min(chunk, nb - off)], offset=off).wait()

        step_no = {k: 0 for k in stores}

        def run(name):
            if name == "io_raw":
                io_raw(swap, raw_exts, raw_bufs)
                return
            st = stores[name]
            step_no[name] += 1
            items = [StepItem(f"k{i}", grads[i], [(0, s, 1e-4, 0.01)],
                              param_out=None if a.no_param_out else outs[i])
                     for i, s in enumerate(sizes)]
            st.step(items, step=step_no[name], beta1=0.9, beta2=0.999, eps=1e-8)

        names = ["step", "io_pipe", "io_raw", "compute", "io_sleep"]
        for nm in names:                              # warm-up: moments written, pages touched
            t0 = time.perf_counter()
            run(nm)
            if nm == "compute":
                sleeper.sec_per_elem = (time.perf_counter() - t0) / n_total
        rec.links.clear()
        times = {nm: [] for nm in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for nm in order:
                t0 = time.perf_counter()
                run(nm)
                times[nm].append(time.perf_counter() - t0)
                if nm == "compute":
                    sleeper.sec_per_elem = times[nm][-1] / n_total
            print(f"round {r}: " + "  ".join(f"{nm} {times[nm][-1]:.3f}s" for nm in names), flush=True)
        med = {nm: statistics.median(v) for nm, v in times.items()}
        io_bytes = 2 * state_bytes
        print(f"\n{n_total / 1e6:.0f}M params in {a.keys} keys, states {a.state_dtype}, tile {a.tile_numel}, "
              f"depth {a.depth}, engine {getattr(eng, 'kind', a.engine)}, "
              f"param_out {'none' if a.no_param_out else 'bf16'}, {a.rounds} rounds (medians):")
        for nm in names:
            extra = f"  ({io_bytes / med[nm] / 1e9:.2f} GB/s of NVMe traffic)" if nm != "compute" else ""
            if nm == "io_sleep":
                extra += "  (no compute, sleeps as long as it)"
            print(f"  {nm:8s} {med[nm]:.3f} s{extra}")
        rb, rs = rec.links.get("nvme_read", (0, 0.0))
        wb, ws = rec.links.get("nvme_write", (0, 0.0))
        if rs and ws:
            print(f"  step accounting: read {rb / 1e9:.2f} GB at {rb / rs / 1e9:.2f} GB/s busy, "
                  f"write {wb / 1e9:.2f} GB at {wb / ws / 1e9:.2f} GB/s busy")
        io_alone = min(med["io_raw"], med["io_pipe"])
        print(f"  ratio step / I/O alone         = {med['step'] / io_alone:.3f}   (target <= 1.15; "
              f"I/O alone = the faster of io_raw and io_pipe)")
        print(f"  ratio step / io_raw            = {med['step'] / med['io_raw']:.3f}")
        print(f"  ratio step / io_pipe           = {med['step'] / med['io_pipe']:.3f}")
        print(f"  ratio step / (io_raw+compute)  = {med['step'] / (med['io_raw'] + med['compute']):.3f}"
              f"   (1.0 = no overlap)")
        print(f"  ratio io_sleep / io_pipe       = {med['io_sleep'] / med['io_pipe']:.3f}"
              f"   (pipeline overlap without contention; 1.0 = compute fully hidden)")
        print(f"  ratio step / io_sleep          = {med['step'] / med['io_sleep']:.3f}"
              f"   (cost of compute/I-O contention for CPU and memory)")
        try:
            load = os.getloadavg()
            print(f"  load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
        except OSError:
            pass
    finally:
        for st in stores.values():
            st.close()
        swap.close()
        eng.close()
        if a.path is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
