#!/usr/bin/env python
"""DeepSpeed ZeRO-Infinity as a measured peer: training steps of the tools/e2e_model.py MLP stack.

Run with the python of the separate DeepSpeed venv (tools/setup_deepspeed_venv.sh), never the
project's .venv. Single process, CPU only (gloo); it sets MASTER_ADDR/MASTER_PORT, RANK=0,
WORLD_SIZE=1 and LOCAL_RANK=0 itself:

    /tmp/infinity-dsvenv/bin/python tools/peers/deepspeed_e2e.py \
        --layers 2 --hidden 2048 --tokens 128 --steps 3 --warmup 1 --nvme-path ./swap --json

``--distributed``: one rank of a torchrun-style launch (the launcher sets the rank
environment; tools/bench_zero_vs_deepspeed.py does), each rank on its own ``--tokens``
micro-batch.

Set-up (what BASELINE.md measured): fp32, ZeRO stage 3, ``offload_param`` and
``offload_optimizer`` on NVMe (``--offload cpu``: in host memory instead), ``aio`` block 1 MiB,
queue depth 32, ``optimizer: {type: AdamW}`` (DeepSpeedCPUAdam under offload), the model and
batch from tools/e2e_model.py with the same seeds as the project's benchmarks, MSE loss.
DeepSpeed's ops JIT-compile on first use (minutes, cached in ~/.cache/torch_extensions).

stdout carries exactly ONE JSON line (also on failure, with an ``error`` field and exit code
1); everything else, DeepSpeed's C++ prints included, goes to stderr. The fields: median step
time over the post-warmup steps, every step's time (split into forward+backward and optimizer
step), each step's loss, each measured step's storage bytes read and written by this process
(``/proc/self/io``: ``io_read_bytes``/``io_write_bytes``), peak RSS (``ru_maxrss``), parameter
count, the DeepSpeed config used.
The swap directory is a private 0700 directory made under ``--nvme-path`` and removed at the
end (DeepSpeed itself leaves its swap files behind).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time

TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def claim_stdout():
    """Route fd 1 (C++ ``std::cout`` and Python prints alike) to stderr; return the real stdout."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return real


def log(msg):
    print(f"[deepspeed_e2e] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn-mult", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--nvme-path", default=None,
                    help="directory for DeepSpeed's swap files (required with --offload nvme)")
    ap.add_argument("--offload", choices=("nvme", "cpu"), default="nvme")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: DeepSpeed's own accelerator on cuda:0 (NCCL); cpu: gloo")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--aio-block-size", type=int, default=1 << 20)
    ap.add_argument("--aio-queue-depth", type=int, default=32)
    ap.add_argument("--aio-threads", type=int, default=1, help="aio intra_op_parallelism")
    ap.add_argument("--max-in-cpu", type=int, default=int(1e9),
                    help="offload_param.max_in_cpu: parameter elements DeepSpeed keeps resident in "
                         "host memory with NVMe offload (DeepSpeed's default 1e9 keeps every "
                         "param of a < 1e9-param model in RAM; 0 puts them all on NVMe)")
    ap.add_argument("--sub-group-size", type=int, default=None,
                    help="zero_optimization.sub_group_size (DeepSpeed default 1e9)")
    ap.add_argument("--zero-init", action="store_true",
                    help="build the model under deepspeed.zero.Init (partitioned as constructed)")
    ap.add_argument("--distributed", action="store_true",
                    help="one rank of several, launched torchrun-style (RANK, WORLD_SIZE, "
                         "LOCAL_RANK, MASTER_ADDR, MASTER_PORT set by the launcher): each rank "
                         "trains on its own --tokens micro-batch (seed 1 + rank)")
    ap.add_argument("--json", action="store_true",
                    help="accepted for symmetry: stdout always carries the one JSON line")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "ffn_mult", "tokens", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.offload == "nvme" and not args.nvme_path:
        ap.error("--offload nvme needs --nvme-path DIR")
    return args


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    os.environ.setdefault("LOCAL_SIZE", "1")
    os.environ.setdefault("CROSS_RANK", "0")
    os.environ.setdefault("CROSS_SIZE", "1")


def ds_config(args, swap_dir, largest_param):
    offload_param = {"device": args.offload, "pin_memory": True}
    offload_opt = {"device": args.offload, "pin_memory": True}
    if args.offload == "nvme":
        # buffer_size must hold the largest parameter (elements); DeepSpeed's default is 1e8.
        offload_param.update(nvme_path=swap_dir, buffer_count=5,
                             buffer_size=max(int(1e8), largest_param), max_in_cpu=args.max_in_cpu)
        offload_opt.update(nvme_path=swap_dir, buffer_count=4, fast_init=False)
    zero = {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_opt,
            "overlap_comm": False, "contiguous_gradients": True}
    if args.sub_group_size:
        zero["sub_group_size"] = args.sub_group_size
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                 "weight_decay": args.weight_decay}},
        "zero_optimization": zero,
        "aio": {"block_size": args.aio_block_size, "queue_depth": args.aio_queue_depth,
                "intra_op_parallelism": args.aio_threads, "single_submit": False,
                "overlap_events": True, "use_gds": False},
    }


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(args, swap_dir, res):
    if not args.distributed:
        single_process_env()
    import torch
    import deepspeed
    sys.path.insert(0, TOOLS_DIR)
    import e2e_model

    res.update(deepspeed_version=deepspeed.__version__, torch_version=torch.__version__,
               torch_threads=torch.get_num_threads())
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")

    ffn = args.ffn_mult * args.hidden
    cfg = ds_config(args, swap_dir, largest_param=args.hidden * ffn)
    res["config"] = cfg
    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=cfg,
                                 remote_device=args.offload, pin_memory=True):
            model = e2e_model.build_model(args.layers, args.hidden, args.ffn_mult)
    else:
        model = e2e_model.build_model(args.layers, args.hidden, args.ffn_mult)
    res["params"] = e2e_model.count_params(args.layers, args.hidden, args.ffn_mult)
    log(f"model: {args.layers} blocks, hidden {args.hidden}, ffn {ffn}: {res['params']:,} params "
        f"fp32; offload {args.offload}; swap {swap_dir}")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    res["init_seconds"] = time.perf_counter() - t0
    res["rss_after_init_bytes"] = peak_rss_bytes()
    res["optimizer_class"] = type(engine.optimizer.optimizer).__name__ \
        if hasattr(engine.optimizer, "optimizer") else type(engine.optimizer).__name__
    log(f"initialised in {res['init_seconds']:.1f} s, peak RSS so far "
        f"{res['rss_after_init_bytes'] / 1e9:.2f} GB, optimizer {res['optimizer_class']}")

    rank = int(os.environ.get("RANK", "0"))
    res.update(rank=rank, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    x, y = e2e_model.make_batch(args.tokens, args.hidden, seed=1 + rank if args.distributed else 1)
    if args.device == "cuda":
        x, y = x.to(engine.device), y.to(engine.device)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()
    steps, fwd_bwd, opt_step, losses, io_rd, io_wr = [], [], [], [], [], []
    cpu0 = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu0 = os.times()
        io0 = e2e_model.proc_io()
        sync()
        ta = time.perf_counter()
        loss = e2e_model.loss_fn(engine(x), y)
        engine.backward(loss)
        sync()
        tb = time.perf_counter()
        engine.step()
        sync()
        tc = time.perf_counter()
        io1 = e2e_model.proc_io()
        if io0 and io1:
            io_rd.append(io1["read_bytes"] - io0["read_bytes"])
            io_wr.append(io1["write_bytes"] - io0["write_bytes"])
        steps.append(tc - ta)
        fwd_bwd.append(tb - ta)
        opt_step.append(tc - tb)
        losses.append(loss.item())
        log(f"step {i}{' (warm-up)' if i < args.warmup else ''}: {tc - ta:.2f} s "
            f"(fwd+bwd {tb - ta:.2f} s, step {tc - tb:.2f} s), loss {losses[-1]:.6f}")
    cpu1 = os.times()
    w = args.warmup
    res.update(
        median_step_s=statistics.median(steps[w:]),
        step_s=steps[w:],
        fwd_bwd_s=fwd_bwd[w:],
        optimizer_step_s=opt_step[w:],
        warmup_step_s=steps[:w],
        losses=losses,
        measured_user_s=cpu1.user - cpu0.user,
        measured_sys_s=cpu1.system - cpu0.system,
        io_read_bytes=io_rd[w:],
        io_write_bytes=io_wr[w:],
    )
    if args.offload == "nvme":
        res["swap_bytes_on_disk"] = dir_bytes(swap_dir)
    try:
        engine.destroy()
    except Exception as e:  # best effort: the process ends right after
        log(f"engine.destroy() failed: {e!r}")


def main(argv=None):
    args = parse_args(argv)
    out = claim_stdout()
    # SIGTERM (e.g. a benchmark's timeout) unwinds through the finally below: swap files go.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt("SIGTERM")))
    swap_dir = None
    res = {"peer": "deepspeed-zero3", "layers": args.layers, "hidden": args.hidden,
           "ffn_mult": args.ffn_mult, "tokens": args.tokens, "steps": args.steps,
           "warmup": args.warmup, "offload": args.offload, "dtype": "float32",
           "zero_init": args.zero_init, "host": platform.node(),
           "loadavg_start": os.getloadavg()}
    rc = 0
    try:
        if args.offload == "nvme":
            swap_root = os.path.abspath(args.nvme_path)
            os.makedirs(swap_root, exist_ok=True)
            swap_dir = tempfile.mkdtemp(prefix="ds-e2e-", dir=swap_root)  # 0700
        run(args, swap_dir, res)
    except BaseException as e:  # report, in the one JSON line, whatever stopped the run
        import traceback
        traceback.print_exc(file=sys.stderr)
        res["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    finally:
        if swap_dir is not None:
            shutil.rmtree(swap_dir, ignore_errors=True)
            res["swap_dir_removed"] = not os.path.exists(swap_dir)
    res["peak_rss_bytes"] = peak_rss_bytes()
    res["loadavg_end"] = os.getloadavg()
    out.write(json.dumps(res) + "\n")
    out.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
