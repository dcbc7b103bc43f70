"""`infinity bench-io`: measure (and with --sweep, tune) NVMe swap throughput.

Writes then reads N MiB through the engine R times on the swap path and
reports the median read and write GB/s (10^9 bytes/s). `--json` prints one
JSON line on stdout; progress goes to stderr. `--sweep` tries block sizes x
queue depths x threads and prints the best `aio` config block; `--save FILE`
stores the sweep as JSON (`<path>/bench-io.json` is picked up by `finetune`).
"""
import itertools
import json
import logging
import os
import sys
import time
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.cli")

SWEEP_BLOCK_KB = [256, 512, 1024, 2048, 4096]
SWEEP_QD = [8, 16, 32, 64]
SWEEP_THREADS = [1, 2]
SAVE_NAME = "bench-io.json"


def _int_list(s):
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of integers, got {s!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"expected positive integers, got {s!r}")
    return vals


def register(sub):
    p = sub.add_parser("bench-io", help="measure NVMe swap read/write throughput (and tune it with --sweep)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--nvme-path", "--path", dest="path", default="./infinity-swap", metavar="DIR",
                   help="swap directory (default ./infinity-swap; --path is an alias)")
    p.add_argument("--size-mb", type=int, default=None,
                   help="MiB written then read per round (default 1024; 256 per config with --sweep)")
    p.add_argument("--block-kb", type=int, default=1024, help="engine block size in KiB (default 1024)")
    p.add_argument("--queue-depth", type=int, default=32, help="requests in flight per thread (default 32)")
    p.add_argument("--threads", type=int, default=1, help="I/O worker threads (default 1)")
    p.add_argument("--engine", choices=["auto", "uring", "posix"], default="auto")
    p.add_argument("--repeats", type=int, default=None, help="rounds; the median is reported (default 3; 2 with --sweep)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON line on stdout")
    p.add_argument("--sweep", action="store_true", help="try block sizes x queue depths x threads, print the best")
    p.add_argument("--sweep-block-kb", default=",".join(map(str, SWEEP_BLOCK_KB)),
                   help="block sizes (KiB) tried by --sweep")
    p.add_argument("--sweep-queue-depths", default=",".join(map(str, SWEEP_QD)),
                   help="queue depths tried by --sweep")
    p.add_argument("--sweep-threads", default=",".join(map(str, SWEEP_THREADS)),
                   help="thread counts tried by --sweep")
    p.add_argument("--save", nargs="?", const="", default=None, metavar="FILE",
                   help=f"with --sweep: save results as JSON to FILE (default <path>/{SAVE_NAME}, which "
                        "`infinity finetune` picks up)")
    p.set_defaults(func=run)


def _err(msg):
    from infinity.cli.main import CLIError
    return CLIError(msg)


def _progress(msg):
    print(msg, file=sys.stderr, flush=True)


def _run_one(args, path, size, bs, qd, th, repeats, label=""):
    from infinity.io import AioError
    from infinity.io.bench import measure

    def prog(r, n, rd, wr):
        _progress(f"bench-io{label}: round {r}/{n}: write {wr:.3f} GB/s, read {rd:.3f} GB/s")

    try:
        return measure(path, size, block_size=bs, queue_depth=qd, threads=th, engine=args.engine,
                       repeats=repeats, progress=prog)
    except (AioError, ValueError) as e:
        raise _err(str(e)) from None


def run(args):
    path = os.path.abspath(os.path.expanduser(args.path))
    sweep = args.sweep
    size_mb = args.size_mb if args.size_mb is not None else (256 if sweep else 1024)
    repeats = args.repeats if args.repeats is not None else (2 if sweep else 3)
    if size_mb <= 0 or repeats <= 0:
        raise _err("--size-mb and --repeats must be positive")
    for name in ("block_kb", "queue_depth", "threads"):
        if getattr(args, name) <= 0:
            raise _err(f"--{name.replace('_', '-')} must be positive")
    if args.block_kb % 4:
        raise _err("--block-kb must be a multiple of 4 (4096-byte alignment)")
    if args.save is not None and not sweep:
        raise _err("--save goes with --sweep")
    size = size_mb << 20
    if not sweep:
        res = _run_one(args, path, size, args.block_kb << 10, args.queue_depth, args.threads, repeats)
        if args.json:
            print(json.dumps(res))
        else:
            print(f"{res['engine']} engine, {'O_DIRECT' if res['direct'] else 'buffered'}, {size_mb} MiB, "
                  f"block {args.block_kb} KiB, queue depth {args.queue_depth}, {args.threads} thread(s), "
                  f"median of {repeats}:")
            print(f"  write {res['write_gbps']:.3f} GB/s   read {res['read_gbps']:.3f} GB/s"
                  + ("" if res["verified"] else "   (DATA MISMATCH!)"))
        return 0 if res["verified"] else 1

    try:
        grid = list(itertools.product(_int_list(args.sweep_block_kb), _int_list(args.sweep_queue_depths),
                                      _int_list(args.sweep_threads)))
    except ValueError as e:
        raise _err(str(e)) from None
    results = []
    t0 = time.perf_counter()
    for i, (bkb, qd, th) in enumerate(grid):
        if bkb % 4:
            raise _err(f"sweep block size {bkb} KiB is not a multiple of 4")
        res = _run_one(args, path, size, bkb << 10, qd, th, repeats, label=f" [{i + 1}/{len(grid)}]")
        results.append(res)
        el = time.perf_counter() - t0
        eta = el / (i + 1) * (len(grid) - i - 1)
        _progress(f"bench-io sweep [{i + 1}/{len(grid)}] block {bkb} KiB, qd {qd}, threads {th}: "
                  f"write {res['write_gbps']:.3f} GB/s, read {res['read_gbps']:.3f} GB/s (ETA {eta:.0f} s)")

    def score(r):  # harmonic mean: throughput of equal read and write volumes
        return 2.0 / (1.0 / max(r["read_gbps"], 1e-9) + 1.0 / max(r["write_gbps"], 1e-9))

    best = max(results, key=score)
    aio = {"engine": best["engine"], "block_size": best["block_size"],
           "queue_depth": best["queue_depth"], "threads": best["threads"]}
    out = {"aio": aio, "best": best, "results": results}
    if args.save is not None:
        save = args.save or os.path.join(path, SAVE_NAME)
        try:
            makedirs(os.path.dirname(os.path.abspath(save)))
            tmp = save + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, save)
        except OSError as e:
            raise _err(f"cannot save the sweep to {save}: {e.strerror}") from None
        _progress(f"bench-io: sweep saved to {save}")
    if args.json:
        print(json.dumps(out))
    else:
        print(f"best of {len(results)} configurations: write {best['write_gbps']:.3f} GB/s, "
              f"read {best['read_gbps']:.3f} GB/s ({best['engine']}, "
              f"{'O_DIRECT' if best['direct'] else 'buffered'})")
        print("paste into your infinity config:")
        print(json.dumps({"aio": aio}, indent=2))
    return 0
