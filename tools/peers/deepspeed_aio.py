#!/usr/bin/env python
"""DeepSpeed's async I/O handle as a measured peer: O_DIRECT write-then-read of N MiB.

Run with the python of the separate DeepSpeed venv (tools/setup_deepspeed_venv.sh), never the
project's .venv:

    /tmp/infinity-dsvenv/bin/python tools/peers/deepspeed_aio.py \
        --path ./swap --size-mb 1024 --block-kb 1024 --queue-depth 32 --json

``AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit=False,
overlap_events=True, intra_op_parallelism=threads)``; the buffer is one page-locked tensor from
``handle.new_cpu_locked_tensor``; each pass is one ``sync_pwrite`` / ``sync_pread`` of the
whole buffer (DeepSpeed splits it into blocks and keeps up to ``queue_depth`` in flight per
thread, libaio underneath). Pass 1 writes a new file (allocating blocks), later passes rewrite
it; every read pass is checked against the written pattern (a mismatch is an error, not a
figure). GB/s are 10^9 bytes per second.

stdout carries exactly one JSON line (with or without ``--json``; without it a readable
summary also goes to stderr); DeepSpeed's own prints (C++ included) are sent to stderr. The
test file lives in a private 0700 directory under ``--path`` and is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

CHECK_CHUNK = 64 << 20  # bytes compared per slice when verifying a read


def claim_stdout():
    """Route fd 1 (C++ ``std::cout`` and Python prints alike) to stderr; return the real stdout."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return real


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True, help="directory on the device to measure")
    ap.add_argument("--size-mb", type=int, required=True, help="MiB written then read")
    ap.add_argument("--block-kb", type=int, default=1024, help="aio block size in KiB")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="DeepSpeed intra_op_parallelism")
    ap.add_argument("--passes", type=int, default=3,
                    help="write passes then read passes (pass 1 writes a new file)")
    ap.add_argument("--json", action="store_true",
                    help="only the JSON line (stdout always carries it; this silences the summary)")
    args = ap.parse_args(argv)
    for name in ("size_mb", "block_kb", "queue_depth", "threads", "passes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def fill_pattern(buf_i64, torch):
    """Element i holds i (int64): every 8-byte word differs, so a misplaced block is caught."""
    n = buf_i64.numel()
    step = CHECK_CHUNK // 8
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        torch.arange(lo, hi, dtype=torch.int64, out=buf_i64[lo:hi])


def check_pattern(buf_i64, torch, fname):
    n = buf_i64.numel()
    step = CHECK_CHUNK // 8
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if not torch.equal(buf_i64[lo:hi], torch.arange(lo, hi, dtype=torch.int64)):
            bad = (buf_i64[lo:hi] != torch.arange(lo, hi, dtype=torch.int64)).nonzero()[0].item()
            raise RuntimeError(f"deepspeed_aio: read-back mismatch in {fname} at byte offset "
                               f"{(lo + bad) * 8}: the data read is not the data written")


def run(args):
    import torch
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder

    nbytes = args.size_mb << 20
    block = args.block_kb << 10
    t0 = time.perf_counter()
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=True):
        raise RuntimeError("deepspeed_aio: DeepSpeed's AsyncIOBuilder is not compatible with this "
                           "machine (libaio-dev missing?); run tools/setup_deepspeed_venv.sh")
    aio = builder.load()
    load_s = time.perf_counter() - t0
    handle = aio.aio_handle(block, args.queue_depth, False, True, args.threads)

    os.makedirs(args.path, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="ds-aio-", dir=args.path)  # 0700
    fname = os.path.join(workdir, "ds-aio.bin")
    buf = None
    try:
        buf = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        if buf.numel() != nbytes:
            raise RuntimeError(f"deepspeed_aio: new_cpu_locked_tensor gave {buf.numel()} bytes, "
                               f"asked {nbytes}")
        words = buf.view(torch.int64)
        writes, reads = [], []
        for _ in range(args.passes):
            fill_pattern(words, torch)
            t = time.perf_counter()
            n = handle.sync_pwrite(buf, fname)
            writes.append(time.perf_counter() - t)
            if n < 0:
                raise OSError(f"deepspeed_aio: sync_pwrite of {nbytes} bytes to {fname} failed "
                              f"(returned {n})")
        size = os.path.getsize(fname)
        if size != nbytes:
            raise RuntimeError(f"deepspeed_aio: {fname} has {size} bytes after writing {nbytes}")
        for _ in range(args.passes):
            buf.zero_()
            t = time.perf_counter()
            n = handle.sync_pread(buf, fname)
            reads.append(time.perf_counter() - t)
            if n < 0:
                raise OSError(f"deepspeed_aio: sync_pread of {nbytes} bytes from {fname} failed "
                              f"(returned {n})")
            check_pattern(words, torch, fname)
    finally:
        if buf is not None:
            handle.free_cpu_locked_tensor(buf)
        shutil.rmtree(workdir, ignore_errors=True)

    gbps = [nbytes / s / 1e9 for s in writes], [nbytes / s / 1e9 for s in reads]
    return {
        "peer": "deepspeed-aio",
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "path": os.path.abspath(args.path),
        "bytes": nbytes,
        "block_size": block,
        "queue_depth": args.queue_depth,
        "threads": args.threads,
        "passes": args.passes,
        "o_direct": True,
        # rewrite passes only when there are any: the first write also allocates the file
        "write_gbps": statistics.median(gbps[0][1:] or gbps[0]),
        "read_gbps": statistics.median(gbps[1]),
        "write_gbps_passes": [round(g, 4) for g in gbps[0]],
        "read_gbps_passes": [round(g, 4) for g in gbps[1]],
        "first_write_gbps": gbps[0][0],
        "op_load_seconds": load_s,
        "verified": True,
        "loadavg": os.getloadavg(),
        "host": platform.node(),
    }


def main(argv=None):
    args = parse_args(argv)
    out = claim_stdout()
    res = run(args)
    if not args.json:
        print(f"DeepSpeed aio_handle, {args.size_mb} MiB, {args.block_kb} KiB blocks, "
              f"QD {args.queue_depth}, {args.threads} thread(s): write "
              f"{res['write_gbps']:.2f} GB/s (passes {res['write_gbps_passes']}), read "
              f"{res['read_gbps']:.2f} GB/s (passes {res['read_gbps_passes']})", file=sys.stderr)
    out.write(json.dumps(res) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
