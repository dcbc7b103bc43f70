"""NVMe bytes per micro-batch of each gradient-accumulation scheme, in one run.

A stack of Linear layers (params on the host, Adam states on NVMe, accumulation A) is
trained under host caps that put the fp32 gradient accumulators (a) all in host memory,
(b) partly in host memory (the groups that fit; the rest on NVMe), (c) all on NVMe, and
(d) as (c) with ``gradient_accumulation_dtype: "bf16"``.  For each: the NVMe bytes of a
middle micro-batch of a window (only gradient traffic: params are on the host), what the
placement plan predicts, the median step time and the final loss against (a).

    .venv/bin/python tools/bench_grad_accumulation.py
    .venv/bin/python tools/bench_grad_accumulation.py --width 1024 --layers 8 --accum 8
"""
import argparse
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
import torch.nn.functional as F

import infinity


def run(width, layers, accum, steps, cap_gb, dtype, swap):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    cfg = {"offload": {"params": "cpu", "optimizer": "nvme", "nvme_paths": [swap],
                       "host_memory_gb": cap_gb},
           "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
           "gradient_accumulation_steps": accum, "gradient_accumulation_dtype": dtype}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g))
            for _ in range(accum)]
    with infinity.initialize(model, cfg) as eng:
        plan = eng.placement
        times, micro, loss = [], [], 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            for i, (x, y) in enumerate(data):
                s0 = eng.stats()
                loss_t = F.mse_loss(eng(x), y)
                eng.backward(loss_t)
                eng.step()
                s1 = eng.stats()
                if 0 < i < accum - 1:
                    micro.append(sum(s1[k] - s0[k] for k in ("nvme_read_bytes", "nvme_write_bytes")))
                loss = float(loss_t.detach())
            times.append(time.perf_counter() - t0)
        nvme_numel = sum(gr.padded_numel for gr in eng.opt.groups
                         if plan.grad_home == "nvme" and gr.gid not in plan.grad_host_gids)
        b = 2 if dtype == "bf16" else 4
        pred = 2 * b * nvme_numel if accum > 2 else 0
        host = sum(gr.padded_numel for gr in eng.opt.groups) * 4 - nvme_numel * 4
    return {"micro": statistics.median(micro) if micro else 0, "pred": pred,
            "step_s": statistics.median(times[1:]), "loss": loss, "grads_host": host,
            "grads_nvme": nvme_numel * 4}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    w, L = args.width, args.layers
    grads = 4 * L * (w * w + w)
    params_host = grads                         # fp32 params homed on the host
    group = 4 * (w * w + w)
    # the engine's tile ring takes up to 15 % of the cap: solve params + staging + ring <= cap
    nvme_cap = (params_host + 2 * group + group // 2) / 0.85 * 1.02
    half_cap = nvme_cap + grads / 2 / 0.85
    schemes = [("fp32, all in host memory", None, "fp32"),
               ("fp32, half in host memory", half_cap / 1e9, "fp32"),
               ("fp32, all on NVMe", nvme_cap / 1e9, "fp32"),
               ("bf16 partial sums, all on NVMe", nvme_cap / 1e9, "bf16")]
    print(f"{L} x Linear({w}, {w}): {grads / 1e6:.1f} MB of fp32 gradients, accumulation "
          f"{args.accum}; params on the host, Adam states on NVMe")
    print(f"{'scheme':<34}{'grads host MB':>14}{'on NVMe MB':>11}{'NVMe MB/micro':>14}"
          f"{'plan':>8}{'step s':>8}{'loss':>12}")
    ref = None
    for name, cap, dtype in schemes:
        with tempfile.TemporaryDirectory(prefix="bench-accum-", dir=".") as swap:
            r = run(w, L, args.accum, args.steps, cap, dtype, swap)
        ref = ref or r
        print(f"{name:<34}{r['grads_host'] / 1e6:>14.1f}{r['grads_nvme'] / 1e6:>11.1f}"
              f"{r['micro'] / 1e6:>14.2f}{r['pred'] / 1e6:>8.2f}{r['step_s']:>8.2f}"
              f"{r['loss']:>12.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
