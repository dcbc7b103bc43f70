#!/usr/bin/env python
"""infinity's I/O engine vs fio (io_uring, O_DIRECT) and, optionally, DeepSpeed's aio_handle.

Same block size, queue depth, size and directory for all; the peers are run
interleaved (the order alternates every round) for `--rounds` rounds; each
round gives a ratio infinity/peer for read and for write, and the median of
those per-round ratios is reported. The machine is shared and noisy: ratios
measured back to back are what we compare, not absolute GB/s.

    .venv/bin/python tools/bench_io_vs_fio.py --path ./infinity-swap --size-mb 2048 \
        --block-kb 1024 --queue-depth 32 --rounds 5 [--deepspeed-python /path/to/venv/bin/python]

Output: progress on stderr, a table and the medians on stdout (`--json`: one JSON line).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_infinity(a):
    cmd = [sys.executable, "-m", "infinity", "bench-io", "--nvme-path", a.path, "--size-mb", str(a.size_mb),
           "--block-kb", str(a.block_kb), "--queue-depth", str(a.queue_depth), "--threads", str(a.threads),
           "--engine", a.engine, "--repeats", "1", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"infinity bench-io failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return {"read_gbps": d["read_gbps"], "write_gbps": d["write_gbps"], "engine": d["engine"],
            "direct": d["direct"]}


def run_fio(a):
    d = tempfile.mkdtemp(prefix="fio-", dir=a.path)
    try:
        out = {}
        for rw in ("write", "read"):
            cmd = ["fio", "--name=infinity-peer", f"--directory={d}", "--filename=fio.bin",
                   f"--size={a.size_mb}m", f"--bs={a.block_kb}k", f"--iodepth={a.queue_depth}",
                   f"--rw={rw}", "--ioengine=io_uring", "--direct=1", "--numjobs=1",
                   "--output-format=json"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"fio failed: {r.stderr.strip()[-2000:]}")
            j = json.loads(r.stdout[r.stdout.index("{"):])
            out[f"{rw}_gbps"] = j["jobs"][0][rw]["bw_bytes"] / 1e9
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_deepspeed(a):
    """DeepSpeed's aio_handle through tools/peers/deepspeed_aio.py: the first pass creates the
    file, the reported write figure is the median of the *rewrites* (infinity and fio write
    into preallocated space too; a new file costs ext4 block allocation under O_DIRECT)."""
    d = tempfile.mkdtemp(prefix="ds-", dir=a.path)
    try:
        cmd = [a.deepspeed_python, os.path.join(REPO, "tools", "peers", "deepspeed_aio.py"),
               "--path", d, "--size-mb", str(a.size_mb), "--block-kb", str(a.block_kb),
               "--queue-depth", str(a.queue_depth), "--threads", str(a.threads), "--passes", "3",
               "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=d)
        if r.returncode != 0:
            raise RuntimeError(f"DeepSpeed aio_handle run failed: {r.stderr.strip()[-2000:]}")
        j = json.loads(r.stdout.strip().splitlines()[-1])
        return {"read_gbps": j["read_gbps"], "write_gbps": j["write_gbps"],
                "first_write_gbps": j.get("first_write_gbps")}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default="./infinity-swap")
    p.add_argument("--size-mb", type=int, default=2048)
    p.add_argument("--block-kb", type=int, default=1024)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", default="auto", choices=["auto", "uring", "posix"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--deepspeed-python", default=None,
                   help="python of a SEPARATE venv with deepspeed installed (adds DeepSpeed aio_handle)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not shutil.which("fio"):
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    a.path = os.path.abspath(a.path)
    created = not os.path.exists(a.path)
    os.makedirs(a.path, exist_ok=True)
    peers = {"infinity": run_infinity, "fio": run_fio}
    if a.deepspeed_python:
        peers["deepspeed"] = run_deepspeed
    rounds = []
    try:
        for i in range(a.rounds):
            names = list(peers)
            if i % 2:
                names.reverse()
            res = {}
            for n in names:
                res[n] = peers[n](a)
                log(f"round {i + 1}/{a.rounds} {n:9s}: write {res[n]['write_gbps']:.3f} GB/s, "
                    f"read {res[n]['read_gbps']:.3f} GB/s")
            rounds.append(res)
    finally:
        if created:
            shutil.rmtree(a.path, ignore_errors=True)
    summary = {"size_bytes": a.size_mb << 20, "block_size": a.block_kb << 10, "queue_depth": a.queue_depth,
               "threads": a.threads, "rounds": len(rounds), "engine": rounds[0]["infinity"]["engine"],
               "direct": rounds[0]["infinity"]["direct"]}
    for peer in [n for n in peers if n != "infinity"]:
        for op in ("read", "write"):
            ratios = [r["infinity"][f"{op}_gbps"] / r[peer][f"{op}_gbps"] for r in rounds]
            summary[f"{op}_ratio_vs_{peer}"] = round(statistics.median(ratios), 3)
            summary[f"{op}_ratios_vs_{peer}"] = [round(x, 3) for x in ratios]
    for n in peers:
        for op in ("read", "write"):
            summary[f"{n}_{op}_gbps_median"] = round(statistics.median(r[n][f"{op}_gbps"] for r in rounds), 3)
    if a.json:
        print(json.dumps(summary))
    else:
        print(f"{a.size_mb} MiB, block {a.block_kb} KiB, QD {a.queue_depth}, {a.rounds} interleaved rounds "
              f"(infinity engine: {summary['engine']}, {'O_DIRECT' if summary['direct'] else 'buffered'})")
        for n in peers:
            print(f"  {n:10s} median write {summary[f'{n}_write_gbps_median']:.3f} GB/s, "
                  f"read {summary[f'{n}_read_gbps_median']:.3f} GB/s")
        for peer in [n for n in peers if n != "infinity"]:
            print(f"  infinity / {peer}: median per-round ratio write "
                  f"{summary[f'write_ratio_vs_{peer}']:.3f}x, read {summary[f'read_ratio_vs_{peer}']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
