#!/usr/bin/env python
"""DeepSpeed ZeRO-3 as the GPU check's peer: the tools/llama_bench.py model and batches.

    python tools/peers/deepspeed_llama.py --size 3b --seq 2048 --micro-batch 8 --steps 5

Single process (it sets the rank environment itself), bf16, ZeRO stage 3 with
``offload_param`` and ``offload_optimizer`` in pinned host memory (``--offload nvme
--nvme-path DIR``: on NVMe), AdamW (DeepSpeedCPUAdam under offload), gradient clipping,
Hugging Face activation checkpointing: the set-up tools/gpu_check.py gives infinity. The
model is built on the device from the same seed as infinity's run (so both start from the
same weights), then handed to ``deepspeed.initialize``. ``--device cpu`` runs the same on
DeepSpeed's CPU accelerator (gloo), for the dry mode.

stdout carries exactly one JSON line (also on failure, with ``error`` and exit code 1):
losses and wall time of every step (the first is the warm-up), median step time over the
others, tokens/s, peak device memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepspeed_e2e import claim_stdout, single_process_env  # noqa: E402  (the MLP peer's)


def log(msg):
    print(f"[deepspeed_llama] {msg}", file=sys.stderr, flush=True)


def ds_config(args):
    off = {"device": args.offload, "pin_memory": True}
    off_opt = dict(off)
    if args.offload == "nvme":
        off.update(nvme_path=args.nvme_path, buffer_count=5, buffer_size=int(4e8))
        off_opt.update(nvme_path=args.nvme_path, buffer_count=4)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": True},
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": off_opt,
                              "overlap_comm": True, "contiguous_gradients": True},
    }


def run(args):
    import torch
    import deepspeed

    import llama_bench as lb
    single_process_env()
    cuda = args.device == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    dev = "cuda" if cuda else "cpu"
    model = lb.build_model(args.size, args.seq, device=dev, seed=0, checkpointing=True)
    data = lb.batches(args.steps * args.grad_accum, args.micro_batch, args.seq, seed=1)
    cfg = ds_config(args)
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    init_s = time.perf_counter() - t0
    log(f"initialize {init_s:.1f} s")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for s in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for a in range(args.grad_accum):
            ids = data[s * args.grad_accum + a].to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / args.grad_accum
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(total)
        log(f"step {s + 1}/{args.steps}: loss {total:.4f}, {times[-1]:.2f} s")
    measured = times[1:] or times
    med = sorted(measured)[len(measured) // 2]
    tokens = args.micro_batch * args.grad_accum * args.seq
    out = {"peer": "deepspeed", "version": deepspeed.__version__, "size": args.size,
           "params": lb.count_params(args.size), "seq": args.seq,
           "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
           "offload": args.offload, "initialize_s": init_s, "losses": losses, "step_s": times,
           "median_step_s": med, "tokens_per_step": tokens, "tokens_per_s": tokens / med,
           "config": cfg}
    if cuda:
        out["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="3b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    if args.offload == "nvme" and not args.nvme_path:
        ap.error("--offload nvme needs --nvme-path DIR")
    real = claim_stdout()   # DeepSpeed's prints (C++ too) to stderr: stdout is the JSON line
    try:
        res = run(args)
        rc = 0
    except BaseException as e:  # noqa: BLE001 -- reported as the JSON line
        traceback.print_exc()
        res = {"peer": "deepspeed", "error": f"{type(e).__name__}: {e}"}
        rc = 1
    real.write(json.dumps(res, default=str) + "\n")
    real.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
