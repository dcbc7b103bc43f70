#!/usr/bin/env python
"""The optimizer step with and without the undo copies past the commit decision (Note
[finish only] in infinity/optim/offload_step.py), in one run, interleaved.

One process, params and optimizer in host memory, bf16, every update clipped (so nothing is
stepped speculatively and the whole update comes after the decision): the engine's
``optimizer_step_seconds`` with finish-only (the default) against the same engine forced to
take undo copies as before (``StepTxn.finish_only`` a no-op).  Prints the medians over the
steps after the first, the first step of each, and their ratio.

    .venv/bin/python tools/bench_finish_only.py --layers 36 --hidden 2048 --steps 6
"""
import argparse
import statistics
import time

import torch
from torch import nn

import infinity
from infinity.optim.offload_step import StepTxn


def run(layers, hidden, steps, undo):
    real = StepTxn.finish_only
    if undo:
        StepTxn.finish_only = lambda self: None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
        cfg = {"precision": "bf16", "gradient_clipping": 1.0,
               "offload": {"params": "cpu", "optimizer": "cpu"}}
        x = torch.randn(16, hidden)
        out = []
        with infinity.initialize(model, cfg) as e:
            for _ in range(steps):
                t0 = time.perf_counter()
                e.backward(e(x).float().pow(2).mean() * 1e4)    # far above the clip
                e.step()
                out.append((e.stats()["optimizer_step_seconds"], time.perf_counter() - t0))
        return out
    finally:
        StepTxn.finish_only = real


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    res = {"finish_only": [], "undo": []}
    for _ in range(a.rounds):
        for name in ("finish_only", "undo"):
            res[name].append(run(a.layers, a.hidden, a.steps, name == "undo"))
    n = a.layers * (a.hidden * a.hidden + a.hidden)
    print(f"{n / 1e6:.1f} M params, bf16, params + optimizer in host memory, every update clipped")
    med = {}
    for name, runs in res.items():
        later = [s for r in runs for s, _ in r[1:]]
        first = [r[0][0] for r in runs]
        med[name] = statistics.median(later)
        print(f"  {name:<12} optimizer step: median {med[name]:.3f} s (steps 2+), "
              f"first {statistics.median(first):.3f} s")
    print(f"  finish_only / undo: {med['finish_only'] / med['undo']:.2f}")


if __name__ == "__main__":
    main()
